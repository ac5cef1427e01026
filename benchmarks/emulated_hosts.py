#!/usr/bin/env python3
"""Several hosts on one Linux machine: hierarchical all-reduce across emulated nodes.

    sudo python benchmarks/emulated_hosts.py                 # verify + bench, all settings
    sudo python benchmarks/emulated_hosts.py verify --layout 2,3,2
    sudo python benchmarks/emulated_hosts.py model                # the cost model's check
    sudo python benchmarks/emulated_hosts.py run --layout 2,2 -- python -m mpi_allreduce info

Each emulated host is a network namespace plus a UTS namespace (its own
hostname ``hN`` and address 10.213.0.N+1/24), joined to the others by a veth
pair on a bridge.  Links can be shaped with ``tc tbf`` (bandwidth).  Open MPI
is launched from host 0 with a hostfile and a remote-shell agent that enters
the target host's namespaces (no sshd), so ranks on one host talk through
shared memory and ranks on different hosts through TCP over the veths, and
``MPI_COMM_TYPE_SHARED`` groups ranks by emulated host for real.

Everything is removed afterwards, also on failure.  Needs root, iproute2
(ip, tc) and util-linux (unshare).  The root namespace gets no address: the
bridge carries only the namespaces' own 10.213.0.0/24.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
_INSTANCES = itertools.count()
SUBNET = "10.213.0"


def missing() -> list[str]:
    lacks = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        lacks.append("root")
    return lacks


def sh(*cmd, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, timeout=60)


class EmulatedHosts:
    """Context manager: ``layout`` = ranks per host, e.g. (2, 3, 2)."""

    def __init__(self, layout, rate: Optional[str] = None):
        self.layout = list(layout)
        self.rate = rate
        # unique per instance: a namespace just deleted may linger for a moment
        tag = f"m{os.getpid() % 1000}{next(_INSTANCES) % 100}x"
        self.ns = [f"{tag}h{i}" for i in range(len(self.layout))]
        self.veth = [f"{tag}v{i}" for i in range(len(self.layout))]
        self.bridge = f"{tag}br"
        self.dir: Optional[Path] = None

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> "EmulatedHosts":
        try:
            self._build()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._teardown()

    def _build(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mar-hosts-"))
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "up")
        for i, (ns, veth) in enumerate(zip(self.ns, self.veth)):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", veth, "master", self.bridge, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            if self.rate:
                # shape both directions of the host's link
                tbf = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf)
                sh("tc", "qdisc", "add", "dev", veth, "root", *tbf)
        hostfile = self.dir / "hostfile"
        hostfile.write_text("".join(f"{self.address(i)} slots={n}\n"
                                    for i, n in enumerate(self.layout)))
        agent = self.dir / "agent.sh"
        cases = "\n".join(f"  {self.address(i)}) ns={ns}; name=h{i} ;;"
                          for i, ns in enumerate(self.ns))
        agent.write_text(f"""#!/bin/sh
# remote-shell agent for mpiexec: enter the emulated host's namespaces and run the command
host=$1; shift
case "$host" in
{cases}
  *) echo "unknown emulated host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $name; $*"
""")
        agent.chmod(0o755)

    def _teardown(self) -> None:
        for ns in self.ns:
            sh("ip", "netns", "del", ns, check=False)  # also removes the veth pair
        sh("ip", "link", "del", self.bridge, check=False)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def mpiexec(self, args, timeout: int = 900, env_extra: Optional[dict] = None):
        """``mpiexec`` across the hosts, started from host 0; output captured."""
        bindir = os.path.dirname(sys.executable)
        mpiexec = os.path.join(bindir, "mpiexec") if os.path.exists(
            os.path.join(bindir, "mpiexec")) else "mpiexec"
        inner = [mpiexec, "--hostfile", str(self.dir / "hostfile"), "--map-by", "slot",
                 "--prtemca", "plm_ssh_agent", str(self.dir / "agent.sh"),
                 "--prtemca", "oob_tcp_if_include", f"{SUBNET}.0/24",
                 "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24",
                 # the hosts share 2 cores: busy-polling ranks would starve each other
                 "--mca", "mpi_yield_when_idle", "1",
                 "-n", str(sum(self.layout))] + list(args)
        env = dict(os.environ, MPIEXEC_TIMEOUT=str(timeout), OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PRTE_ALLOW_RUN_AS_ROOT="1",
                   PRTE_ALLOW_RUN_AS_ROOT_CONFIRM="1", **(env_extra or {}))
        quoted = " ".join(_quote(a) for a in inner)
        cmd = ["ip", "netns", "exec", self.ns[0], "unshare", "--uts", "sh", "-c",
               f"hostname h0; exec {quoted}"]
        return subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=timeout + 60, cwd=str(HERE.parent))


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def layout_of(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


#: a reduced matrix: TCP between namespaces on 2 cores is slow (~0.1 s a case)
VERIFY_ARGS = ["-m", "mpi_allreduce", "verify", "--no-large", "-d", "int32,float32",
               "-o", "sum,max,band,avg", "--counts", "0,1,5,97"]


def cmd_verify(layout, rate=None) -> tuple[int, str]:
    with EmulatedHosts(layout, rate) as hosts:
        info = hosts.mpiexec([sys.executable, "-m", "mpi_allreduce", "info"], timeout=120)
        result = hosts.mpiexec([sys.executable] + VERIFY_ARGS)
    return result.returncode, info.stdout + info.stderr + result.stdout + result.stderr[-3000:]


SETTINGS = [("unshaped", None), ("10gbit", "10gbit"), ("1gbit", "1gbit")]


#: the model's check on emulated hosts: (layout, tbf rate)
MODEL_CHECKS = [([2, 2], "1gbit"), ([2, 2, 2, 2], "1gbit")]


def model_check(out: Path) -> list[str]:
    """``model --two-level`` on each of ``MODEL_CHECKS``: the machine's
    parameters fitted on the emulated hosts, every algorithm's predicted
    time against its measured time (``model-check-<hosts>x<ranks>-<rate>.txt/json``)."""
    report = []
    for layout, rate in MODEL_CHECKS:
        name = f"check-{len(layout)}x{layout[0]}-{rate}"
        with EmulatedHosts(layout, rate) as hosts:
            m = hosts.mpiexec([sys.executable, "-m", "mpi_allreduce", "model", "--two-level",
                               "-e", "16M", "-f", "8", "-n", "50", "--json",
                               str(out / f"model-{name}.json")], timeout=1500)
        (out / f"model-{name}.txt").write_text(m.stdout + m.stderr[-2000:])
        print(m.stdout, flush=True)
        within = next((line for line in m.stdout.splitlines() if "within" in line), "")
        report.append(f"model {name}: exit {m.returncode} {within.lstrip('# ')}")
    return report


def cmd_all(out: Path, layouts) -> int:
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    report = []
    for layout in layouts:
        rc, text = cmd_verify(layout)
        name = "x".join(map(str, layout))
        (out / f"verify-{name}.txt").write_text(text)
        report.append(f"verify {name}: exit {rc}")
        print(text, flush=True)
        status |= rc
    bench_inputs = []
    for label, rate in SETTINGS:
        layout = [2, 2]
        with EmulatedHosts(layout, rate) as hosts:
            path = out / f"bench-2x2-{label}.json"
            r = hosts.mpiexec([sys.executable, "-m", "mpi_allreduce", "bench", "-b", "8",
                               "-e", "8M", "-f", "16", "-n", "10", "-w", "2", "-r", "3", "-c",
                               "--quiet", "--json", str(path)])
            (out / f"bench-2x2-{label}.txt").write_text(r.stdout + r.stderr[-2000:])
            m = hosts.mpiexec([sys.executable, "-m", "mpi_allreduce", "model", "--two-level",
                               "-e", "8M", "-f", "16", "-n", "5", "--json",
                               str(out / f"model-2x2-{label}.json")])
            (out / f"model-2x2-{label}.txt").write_text(m.stdout + m.stderr[-2000:])
            print(r.stdout, m.stdout, flush=True)
            report.append(f"bench 2x2 {label}: exit {r.returncode}; model exit {m.returncode}")
            status |= r.returncode
            if path.exists():
                bench_inputs.append((label, path))
    if bench_inputs:
        plot_settings(bench_inputs, out / "hierarchical.png")
    report += model_check(out)
    (out / "README.md").write_text(
        "# Emulated hosts\n\nProduced by `sudo python benchmarks/emulated_hosts.py` "
        "(see its docstring).\n\n" + "\n".join(f"- {line}" for line in report) + "\n")
    print("\n".join(report))
    return status


def plot_settings(inputs, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(inputs), figsize=(5 * len(inputs), 4.5), sharey=True)
    for ax, (label, path) in zip(axes, inputs):
        rows = json.loads(path.read_text())["results"]
        for name in ("mpi", "driver", "ring", "ring_pipelined", "rabenseifner",
                     "recursive_doubling", "hierarchical", "auto"):
            pts = sorted((r["size"], r["time_avg_us"]) for r in rows if r["algorithm"] == name)
            style = {"linestyle": "--", "color": "black"} if name == "mpi" else {}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                    label=name, **style)
        ax.set(xscale="log", yscale="log", title=f"2 hosts x 2 ranks, links {label}",
               xlabel="message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time per all-reduce (us)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", default="all",
                        choices=["all", "verify", "run", "check", "model"])
    parser.add_argument("--layout", default="2,2", help="ranks per host, e.g. 2,3,2")
    parser.add_argument("--rate", default=None, help="tbf rate of every link, e.g. 1gbit")
    parser.add_argument("--out", default=str(HERE / "results" / "emulated"))
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    lacks = missing()
    if args.action == "check" or lacks:
        print("ready" if not lacks else f"missing: {', '.join(lacks)}")
        return 0 if not lacks else 1
    if args.action == "verify":
        rc, text = cmd_verify(layout_of(args.layout), args.rate)
        print(text)
        return rc
    if args.action == "run":
        with EmulatedHosts(layout_of(args.layout), args.rate) as hosts:
            r = hosts.mpiexec(cmd)
            print(r.stdout, r.stderr, sep="")
            return r.returncode
    if args.action == "model":
        Path(args.out).mkdir(parents=True, exist_ok=True)
        report = model_check(Path(args.out))
        print("\n".join(report))
        return 0 if all(": exit 0" in line for line in report) else 1
    return cmd_all(Path(args.out), [[2, 2], [2, 3, 2], [2, 2, 2, 2]])


if __name__ == "__main__":
    sys.exit(main())
