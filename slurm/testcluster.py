#!/usr/bin/env python3
"""A real, throw-away Slurm cluster on this one machine, for tests.

Starts munged, slurmctld and N slurmd daemons (``slurmd -N nodeK``, each on
its own port, all on this host) from a temporary folder, with
``SlurmdParameters=config_overrides`` so a node may declare more CPUs than
the machine has, and ``MpiDefault=pmix`` for ``srun --mpi=pmix``.  Needs
root and Debian's ``slurmctld slurmd slurm-client munge libpmix-dev``.

    python slurm/testcluster.py run [--nodes 2] -- sbatch --wait slurm/verify.sbatch
    with TestCluster(nodes=2) as cluster: cluster.sbatch(...)

Everything is stopped and removed afterwards, also on failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")


def missing() -> list[str]:
    """What this machine lacks to run the test cluster (empty when ready)."""
    lacks = [d for d in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
             if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        lacks.append("root")
    if not any(Path(p).exists() for p in ("/usr/lib/x86_64-linux-gnu/slurm-wlm/mpi_pmix.so",
                                          "/usr/lib/aarch64-linux-gnu/slurm-wlm/mpi_pmix.so",
                                          "/usr/lib64/slurm/mpi_pmix.so")):
        lacks.append("slurm's pmix plugin (libpmix-dev)")
    return lacks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class TestCluster:
    """Context manager: a running cluster with ``nodes`` nodes of ``cpus`` CPUs each."""

    def __init__(self, nodes: int = 2, cpus: int = 4, gpu_node: bool = False):
        self.nodes, self.cpus, self.gpu_node = nodes, cpus, gpu_node
        self.dir: Optional[Path] = None
        self.procs: list[subprocess.Popen] = []
        self.env: dict = {}

    # --- set-up -----------------------------------------------------------
    def __enter__(self) -> "TestCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mar-slurm-"))
        os.chmod(self.dir, 0o700)
        d = self.dir
        subdirs = ["state", "munge", "log"]
        for i in range(self.nodes):
            # each emulated node gets its own spool and temporary folder, or the
            # pmix plugins of two nodes on one machine collide in one /tmp
            subdirs += [f"spool-node{i + 1}", f"tmp-node{i + 1}"]
        for sub in subdirs:
            (d / sub).mkdir(mode=0o700)
        host = socket.gethostname()
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = d / "munge" / "munge.socket"
        subprocess.run([_binary("munged"), "--key-file", str(key), "--socket", str(sock),
                        "--pid-file", str(d / "munge" / "munged.pid"),
                        "--log-file", str(d / "log" / "munged.log"),
                        "--seed-file", str(d / "munge" / "seed"), "--force"],
                       check=True, timeout=30)
        ctl_port = _free_port()
        node_ports = [_free_port() for _ in range(self.nodes)]
        gres = ""
        if self.gpu_node:
            # a node that declares a GPU (no device file needed for --test-only)
            (d / "gres.conf").write_text("NodeName=node1 Name=gpu Count=1 File=/dev/null\n")
            gres = " Gres=gpu:1"
        node_lines = "\n".join(
            f"NodeName=node{i + 1} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN{gres if i == 0 else ''}"
            for i, port in enumerate(node_ports))
        # every task sees its own node's temporary folder: Open MPI names its
        # shared-memory segments by host name and job, and all emulated nodes
        # share one host name, so without this two nodes' segments collide
        prolog = d / "task_prolog.sh"
        prolog.write_text("#!/bin/sh\n"
                          f'echo "export TMPDIR={d}/tmp-$SLURMD_NODENAME"\n'
                          f'echo "export OMPI_MCA_btl_sm_backing_directory={d}/tmp-$SLURMD_NODENAME"\n')
        prolog.chmod(0o755)
        conf = d / "slurm.conf"
        conf.write_text(f"""\
ClusterName=martest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
TmpFS={d}/tmp-%n
TaskProlog={prolog}
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=pmix
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
{"GresTypes=gpu" if self.gpu_node else ""}
InactiveLimit=0
KillWait=5
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=30 State=UP
""")
        self.env = dict(os.environ, SLURM_CONF=str(conf))
        self.procs.append(self._daemon([_binary("slurmctld"), "-D", "-i", "-f", str(conf)]))
        for i in range(self.nodes):
            self.procs.append(self._daemon([_binary("slurmd"), "-D", "-f", str(conf),
                                            "-N", f"node{i + 1}"]))
        self._wait_idle()

    def _daemon(self, cmd) -> subprocess.Popen:
        log = open(self.dir / "log" / (Path(cmd[0]).name + f"-{len(self.procs)}.out"), "w")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)

    def _wait_idle(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        out = ""
        while time.time() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited ({p.returncode}):\n{self.logs()}")
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env,
                               capture_output=True, text=True, timeout=30)
            out = r.stdout
            states = [line.split()[1] for line in out.splitlines() if line.split()]
            if len(states) == self.nodes and all(s.startswith("idle") for s in states):
                return
            time.sleep(1)
        raise RuntimeError(f"nodes not idle after {timeout:.0f} s: {out!r}\n{self.logs()}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.procs.clear()
        if self.dir is not None:
            pidfile = self.dir / "munge" / "munged.pid"
            if pidfile.exists():
                try:
                    os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
                except (ValueError, ProcessLookupError):
                    pass
            if os.environ.get("MAR_SLURM_KEEP"):
                print(f"keeping {self.dir}", file=sys.stderr)
            else:
                shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # --- use --------------------------------------------------------------
    def run(self, cmd, timeout: float = 120, cwd=None, env=None) -> subprocess.CompletedProcess:
        merged = dict(self.env, **(env or {}))
        return subprocess.run(cmd, env=merged, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)

    #: a job's states once it has ended (``scontrol show job``)
    ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
             "PREEMPTED", "BOOT_FAIL", "DEADLINE")

    def sbatch(self, script, args=(), timeout: float = 600, cwd=None, env=None) -> str:
        """Submit, wait for the job to end and return its id.  The wait asks
        the job's state twice a second: ``sbatch --wait`` asks at growing
        intervals, and a job of about 15 s came back after 42 s here."""
        r = self.run(["sbatch", "--parsable", *args, str(script)], timeout=60, cwd=cwd, env=env)
        job = r.stdout.strip().split(";")[0]
        if r.returncode != 0 or not job:
            raise RuntimeError(f"sbatch failed ({r.returncode}): {r.stderr}\n{self.logs()}")
        deadline = time.time() + timeout
        while self.job_state(job) not in self.ENDED:
            if time.time() > deadline:
                self.run(["scancel", job])
                raise TimeoutError(f"job {job} not done after {timeout:.0f} s\n{self.logs()}")
            time.sleep(0.5)
        return job

    def job_state(self, job: str) -> str:
        r = self.run(["scontrol", "show", "job", job])
        for word in r.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"

    def logs(self) -> str:
        if self.dir is None:
            return ""
        parts = []
        for f in sorted((self.dir / "log").glob("*")):
            text = f.read_text(errors="replace")[-3000:]
            parts.append(f"--- {f.name}\n{text}")
        return "\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["run", "check"])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=4)
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    lacks = missing()
    if args.action == "check" or lacks:
        print("ready" if not lacks else f"missing: {', '.join(lacks)}")
        return 0 if not lacks else 1
    with TestCluster(args.nodes, args.cpus) as cluster:
        print(f"cluster up: SLURM_CONF={cluster.env['SLURM_CONF']}", file=sys.stderr)
        return subprocess.run(cmd, env=cluster.env).returncode


if __name__ == "__main__":
    sys.exit(main())
