"""The batch scripts in slurm/, submitted to a real one-machine Slurm cluster.

``slurm/testcluster.py`` starts munged, slurmctld and two slurmd daemons
(``slurmd -N``), so jobs span two (emulated) nodes.  Skipped unless Slurm,
munge and Slurm's pmix plugin are installed and we are root:
    apt-get install slurmctld slurmd slurm-client munge libpmix-dev
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "slurm"))
from testcluster import TestCluster, missing  # noqa: E402

TestCluster.__test__ = False  # a helper, not a test class

LACKS = missing()
pytestmark = pytest.mark.skipif(
    bool(LACKS),
    reason=f"needs a local Slurm ({', '.join(LACKS)} missing): as root run "
           "'apt-get install slurmctld slurmd slurm-client munge libpmix-dev'",
)

SCRIPTS = ROOT / "slurm"


@pytest.fixture(scope="module")
def cluster():
    with TestCluster(nodes=2, cpus=4) as c:
        yield c


def submit(cluster, script, tmp_path, env, args=()):
    job = cluster.sbatch(SCRIPTS / script, args=args, cwd=tmp_path, env=env, timeout=900)
    state = cluster.job_state(job)
    outputs = list(tmp_path.glob(f"*-{job}.out"))
    text = outputs[0].read_text() if outputs else "(no output file)"
    assert state == "COMPLETED", f"job {job} ended {state}:\n{text[-4000:]}\n{cluster.logs()}"
    return job, text


def test_verify_job_spans_two_nodes(cluster, tmp_path):
    job, text = submit(cluster, "verify.sbatch", tmp_path,
                       {"MAR_VERIFY_ARGS": "--no-large -d int32,float32 --counts 0,1,5,97"})
    assert "# OK:" in text and " 0 wrong elements" in text, text[-3000:]
    # the bundled Open MPI finds its help files under srun too (OPAL_PREFIX)
    assert "Sorry!" not in text and "No such file or directory" not in text, text[:3000]
    assert "slurm nodes : node1, node2" in text
    assert "ranks       : 4" in text
    # (Open MPI under this Slurm's pmix reports no shared-memory peers, so
    # MPI_COMM_TYPE_SHARED groups of 1: the line is checked, not its value)
    assert "ranks/node  : [" in text
    assert "hierarchical" in text


def test_bench_job_writes_json_csv_png(cluster, tmp_path):
    job, text = submit(cluster, "bench.sbatch", tmp_path,
                       {"MAR_MAXBYTES": "64K", "MAR_STEPFACTOR": "16",
                        "MAR_BENCH_ARGS": "-n 5 -w 1 -c", "MAR_RESULTS": str(tmp_path / "res")})
    out = tmp_path / "res" / f"bench-{job}"
    doc = json.loads((out / "bench.json").read_text())
    from mpi_allreduce import ALGORITHMS

    algorithms = {r["algorithm"] for r in doc["results"]}
    assert algorithms >= set(ALGORITHMS) | {"mpi", "auto"}
    assert all(r["wrong"] == 0 for r in doc["results"])
    meta = doc["meta"]
    assert meta["ranks"] == 4 and all(isinstance(n, int) for n in meta["ranks_per_node"])
    assert meta["slurm_nodes"] == ["node1", "node2"]
    assert meta["env"]["SLURM_JOB_ID"] == job and "Open MPI" in meta["mpi_library"]
    assert (out / "bench.csv").read_text().count("\n") == len(doc["results"]) + 2
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_vendor_job_times_the_vendors_algorithms_and_checks_its_tuning_file(cluster, tmp_path):
    """slurm/vendor.sbatch under srun on two nodes: every algorithm of the
    vendor's own has a checked row, tune --export wrote the vendor's file,
    and the launch with it names its vendor row mpi:tuned."""
    job, text = submit(cluster, "vendor.sbatch", tmp_path,
                       {"MAR_MAXBYTES": "4K", "MAR_STEPFACTOR": "64",
                        "MAR_BENCH_ARGS": "-n 3 -w 1 -c", "MAR_RESULTS": str(tmp_path / "res")})
    out = tmp_path / "res" / f"vendor-{job}"
    rows = json.loads((out / "algorithms.json").read_text())["results"]
    assert {"mpi:ring", "mpi:recursive_doubling"} <= {r["algorithm"] for r in rows}, text[-3000:]
    assert all(r["wrong"] == 0 for r in rows)
    assert "export OMPI_MCA_coll_tuned_dynamic_rules_filename=" in text
    assert (out / "tuned.openmpi").read_text().splitlines()[1].startswith("2 ")
    tuned = json.loads((out / "tuned.json").read_text())["results"]
    assert {r["algorithm"] for r in tuned} == {"mpi:tuned", "auto"}
    assert all(r["wrong"] == 0 for r in tuned)
    assert (out / "vendor.png").read_bytes()[:4] == b"\x89PNG"


def test_launchers_job_runs_srun_and_mpiexec_side_by_side(cluster, tmp_path):
    """srun and mpiexec in one allocation, each verify with 0 wrong; times printed."""
    job, text = submit(cluster, "launchers.sbatch", tmp_path,
                       {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    assert text.count(" 0 wrong elements") == 3, text[-3000:]
    for launcher in ("srun-busy", "srun", "mpiexec"):
        assert re.search(rf"# +{launcher}: verify [\d.]+ s, bench [\d.]+ s", text), text[-3000:]
    # this cluster's nodes declare more CPUs than the machine has: the scripts let ranks yield
    assert "OMPI_MCA_mpi_yield_when_idle=1" in text


def test_scripts_are_valid_bash():
    for script in SCRIPTS.glob("*.sbatch"):
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_gpu_script_is_accepted_by_a_cluster_with_a_gpu_node(tmp_path):
    """Only ``sbatch --test-only``: the GPU job cannot run without a GPU."""
    with TestCluster(nodes=1, cpus=4, gpu_node=True) as gpu_cluster:
        r = gpu_cluster.run(["sbatch", "--test-only", "--gpus-per-node=1",
                             "--ntasks-per-node=1", str(SCRIPTS / "gpu.sbatch")],
                            cwd=tmp_path)
    assert "to start at" in (r.stdout + r.stderr), r.stdout + r.stderr
