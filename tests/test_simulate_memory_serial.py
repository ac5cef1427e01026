"""What ``simulate`` knows of its memory before it starts: the estimate
(:func:`~mpi_allreduce.simulate.footprint`) against what a run really
holds, the refusal of a run above what the machine has available (one
``error:`` line, exit status 2, naming the estimate and the option that
lowers it), and the default that leaves the algorithms whose memory grows
as p^2 out above their number of ranks."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from mpi_allreduce import registry
from mpi_allreduce import simulate as sim
from mpi_allreduce.__main__ import main, parse_args

ROOT = Path(__file__).resolve().parent.parent

#: the estimate over what a run holds (tracemalloc's peak, every Python
#: object and numpy buffer): at least 1, at most this
FACTOR = 1.6


def options_for(algorithm: str) -> dict:
    return {"ranks_per_node": 8, "inner": "rabenseifner"} if algorithm == "hierarchical" else {}


@pytest.mark.parametrize("algorithm", registry.ALGORITHMS)
def test_the_estimate_holds_what_a_run_holds(algorithm):
    """At p = 64 (every rank counted: exact) the estimate is at least what
    a run holds at its peak, and within :data:`FACTOR` of it."""
    size, count, segment = 64, 4099, 1 << 18
    options = options_for(algorithm)
    estimate = sim.footprint(algorithm, size, count, segment, options)
    assert estimate.exact
    need = estimate.bytes(count, "float32")
    tracemalloc.start()
    try:
        out = sim.simulate(algorithm, size, count, "float32", segment_size=segment,
                           options=options)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.wrong == 0
    assert peak <= need <= FACTOR * peak, (need, peak)


@pytest.mark.parametrize("algorithm", registry.ALGORITHMS)
def test_counting_a_few_ranks_bounds_counting_all(algorithm):
    """With a budget that counts only some ranks (p = 48, not a power of
    two: the folds' ranks differ from the others), the estimate is no less
    than counting every rank, and at most twice it."""
    size, count, segment = 48, 300, 128
    options = options_for(algorithm)
    exact = sim.tally(sim.schedules(algorithm, size, count, segment, options))
    sampled = sim.footprint(algorithm, size, count, segment, options, budget=(10**6, 1000))
    assert exact.schedule_bytes <= sampled.schedule_bytes <= 2 * exact.schedule_bytes
    assert exact.scratch <= sampled.scratch <= 2 * exact.scratch
    assert (sampled.in_flight, sampled.queues) >= (exact.in_flight, exact.queues)
    if algorithm in ("ring", "naive", "swing_bandwidth"):
        assert not sampled.exact


def test_counting_at_fewer_elements_bounds_the_whole():
    """allgather_reduce, whose rank 0 past the budget is counted at fewer
    elements (its pieces of segment / p elements: p actions each): the
    schedules' estimate at most 1.5 times counting them all, and no less."""
    size, count, segment = 24, 3000, 16
    exact = sim.tally(sim.schedules("allgather_reduce", size, count, segment))
    probed = sim.footprint("allgather_reduce", size, count, segment, budget=(2000, 10**6))
    assert not probed.exact
    assert exact.schedule_bytes <= probed.schedule_bytes <= 1.5 * exact.schedule_bytes
    assert exact.scratch <= probed.scratch


def refused(argv: list, capsys) -> str:
    """The one ``error:`` line ``main(argv)`` refuses with (exit status 2,
    nothing on stdout: nothing ran)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert out == ""
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    return errors[0]


def test_a_run_above_what_is_available_is_refused(monkeypatch, capsys):
    """The estimate and what is available, in GB, and what lowers it:
    leaving out the algorithm that does not fit (-a naming the others), or
    fewer ranks or elements where one algorithm alone is too big."""
    have = 200_000_000
    monkeypatch.setattr(sim, "available_memory", lambda: have)
    naive = sim.memory_needed("naive", 200, 4099)
    assert naive > have > sim.memory_needed("ring", 200, 4099)
    line = refused(["simulate", "-p", "200", "-a", "ring,naive", "--count", "4099"], capsys)
    assert line.startswith("python -m mpi_allreduce simulate: error: -a/--algorithms")
    assert f"about {sim.memory_text(naive)}" in line and "(naive;" in line
    assert f"and {sim.memory_text(have)} is available" in line
    assert "leave out naive (-a ring)" in line
    line = refused(["simulate", "-p", "200", "-a", "naive"], capsys)
    assert "-p/--size" in line and "--count" in line and f"about {sim.memory_text(naive)}" in line
    # within what is available it runs, and says its estimate first
    assert main(["simulate", "-p", "20", "-a", "naive", "--count", "99"]) == 0
    out = capsys.readouterr().out
    need = sim.memory_needed("naive", 20, 99)
    assert (f"# memory: about {sim.memory_text(need)} estimated, for naive "
            "(0.2 GB available)") in out


def test_the_refusal_as_a_process():
    """As ``python -m mpi_allreduce`` (where mpiexec starts every rank):
    exit status 2, the usage and one error line on stderr, no traceback.
    naive on 4096 ranks keeps 4096^2 vectors: 275 GB, more than here."""
    result = subprocess.run([sys.executable, "-m", "mpi_allreduce", "simulate", "-p", "4096",
                             "-a", "naive"], capture_output=True, text=True, timeout=120,
                            cwd=str(ROOT))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "GB is available" in errors[0] and "-p/--size" in errors[0]
    assert result.stderr.startswith("usage:")


def test_the_quadratic_algorithms_run_by_default_up_to_their_ranks(monkeypatch):
    """naive and allgather_reduce are in the default up to 256 ranks, out
    above; named, they run on any number."""
    monkeypatch.setattr(sim, "available_memory", lambda: 1 << 50)
    for name in ("naive", "allgather_reduce"):
        limit = sim.BY_NAME_ABOVE[name]
        assert name in parse_args(["simulate", "-p", str(limit), "--count", "1"]).run
        args = parse_args(["simulate", "-p", str(limit + 1), "--count", "1"])
        assert name not in args.run and name in args.left_out
        assert parse_args(["simulate", "-p", "1024", "--count", "1", "-a", name]).run == [name]
    assert sim.default_algorithms(1024) == (
        tuple(a for a in registry.ALGORITHMS if a not in ("naive", "allgather_reduce")),
        ("naive", "allgather_reduce"))


def test_the_limit_is_where_naive_passes_a_gigabyte():
    """BY_NAME_ABOVE's 256 ranks, from the estimate at the default count:
    naive on 256 ranks about 1 GB, on twice as many several."""
    assert 0.9e9 < sim.memory_needed("naive", 256, 4099) < 1.3e9
    assert sim.memory_needed("naive", 512, 4099) > 4e9
    assert sim.memory_needed("allgather_reduce", 256, 4099) < 1e9 < \
        sim.memory_needed("allgather_reduce", 512, 4099)


def test_the_left_out_line(monkeypatch, capsys):
    """Above the limit the output says what it left out and how to run it
    (the algorithms' runs stubbed: only the lines before them are read)."""
    monkeypatch.setattr(sim, "simulate", lambda name, size, count, *a, **k: sim.Outcome(
        name, size, count, "float32", "sum", False, 0, 0, [0], [0], [0], [0], [0]))
    assert main(["simulate", "-p", "300", "--count", "1"]) == 0
    out = capsys.readouterr().out
    left = [line for line in out.splitlines() if line.startswith("# left out:")]
    assert left == ["# left out: naive (above 256 ranks), allgather_reduce (above 256 ranks), "
                    "whose memory grows as p^2; named they run: -a "
                    + ",".join(sim.default_algorithms(300)[0] + ("naive", "allgather_reduce"))]
    assert "naive " not in out.split("# left out:")[1].split("\n", 1)[1]  # (not run)


# draw

#: a drawing's peak (the process's, over its own after the imports) as a
#: child process measures it, and the estimate
DRAWN = """
import sys
import mpi_allreduce.__main__
from mpi_allreduce.tools.draw import contributions, draw, memory_needed

def peak():  # (this process's own: getrusage's would start at the parent's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

algorithm, size, output = sys.argv[1], int(sys.argv[2]), sys.argv[3]
need = memory_needed(algorithm, size, output=output)
before = peak()
draw(contributions(algorithm, size), output)
print(need, peak() - before)
"""


@pytest.mark.parametrize("output", ["rd.png", "rd.gif"])
def test_the_drawing_estimate_holds_what_it_holds(tmp_path, output):
    """recursive doubling on 32 ranks, panels and frames: the estimate
    within 25% below and 50% above what the drawing adds to the process's
    peak (matplotlib's canvas and images are no Python objects:
    tracemalloc would not see them)."""
    result = subprocess.run([sys.executable, "-c", DRAWN, "recursive_doubling", "32",
                             str(tmp_path / output)], capture_output=True, text=True,
                            timeout=120, cwd=str(ROOT))
    assert result.returncode == 0, result.stderr
    need, used = map(int, result.stdout.split())
    assert used / 1.25 <= need <= 1.5 * used, (need, used)


def test_a_drawing_above_what_is_available_is_refused(monkeypatch, capsys, tmp_path):
    """The ring on 4096 ranks keeps a frame of 4096 x 4096 sets for each
    of its 8190 rounds: refused before anything is drawn or written."""
    from mpi_allreduce.tools.draw import memory_needed

    need = memory_needed("ring", 4096)
    line = refused(["draw", "-a", "ring", "-p", "4096", "-o", str(tmp_path / "r.png")], capsys)
    assert line.startswith("python -m mpi_allreduce draw: error: -p/--size and --count")
    assert f"about {sim.memory_text(need)}" in line and "is available" in line
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(sim, "available_memory", lambda: 10_000_000)
    line = refused(["draw", "-a", "ring", "-p", "8", "-o", str(tmp_path / "r.png")], capsys)
    assert "and 10 MB is available" in line
    monkeypatch.setattr(sim, "available_memory", lambda: 1 << 40)
    assert main(["draw", "-a", "ring", "-p", "8", "-o", str(tmp_path / "r.png")]) == 0
    need = memory_needed("ring", 8, output=str(tmp_path / "r.png"))
    assert capsys.readouterr().out.startswith(
        f"# memory: about {sim.memory_text(need)} estimated "
        f"({sim.memory_text(1 << 40)} available)")


# simulate --predict (tools/scale.py)

def test_the_prediction_estimate_holds_what_it_holds():
    """The table's simulations on 32 ranks (those without a closed form,
    the double binary tree): the estimate at least what they hold at their
    peak, at most twice it."""
    from mpi_allreduce.tools import scale

    machine = sim.Machine(alpha=1e-6, beta=2e-10, gamma=3e-11, overhead=1e-7)
    need = scale.memory_needed([32], [8, 8192], 8, 4096)
    assert need == max(scale._footprint_bytes(*run, 4) for size in (8, 8192)
                       for a in scale.ALGORITHMS
                       for run in scale.simulations(a, size, 32, 8, 4096))
    tracemalloc.start()
    try:
        scale.table(machine, [32], [8, 8192], 8, 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= need <= 2 * peak, (need, peak)


def test_a_simulation_past_the_limit_is_no_prediction(monkeypatch):
    """An algorithm without a closed form is simulated only within
    SIMULATE_FORMLESS_BYTES: past it (and at every larger size), no
    prediction, and nothing simulated."""
    from mpi_allreduce.tools import scale

    small = scale._footprint_bytes("allgather_reduce", 16, 64, 256, 4)
    large = scale._footprint_bytes("allgather_reduce", 16, 4096, 256, 4)
    assert small < large
    monkeypatch.setattr(scale, "SIMULATE_FORMLESS_BYTES", (small + large) // 2)
    monkeypatch.setattr(scale, "_TOO_LONG", {})
    machine = sim.Machine(alpha=1e-6, beta=2e-10)
    assert scale.seconds("allgather_reduce", 64 * 4, 16, machine, None, 1024) > 0
    assert scale.simulations("allgather_reduce", 4096 * 4, 16, None, 1024) == []
    assert scale.seconds("allgather_reduce", 4096 * 4, 16, machine, None, 1024) != \
        scale.seconds("allgather_reduce", 4096 * 4, 16, machine, None, 1024)  # NaN
    assert scale.simulations("allgather_reduce", 64 * 4, 16, None, 1024) == [
        ("allgather_reduce", 16, 64, 256)]


def test_a_prediction_above_what_is_available_is_refused(monkeypatch, capsys, tmp_path):
    import json

    params = tmp_path / "machine.json"
    params.write_text(json.dumps({"params": sim.Machine(alpha=1e-6).parameters()}))
    monkeypatch.setattr(sim, "available_memory", lambda: 1_000_000)
    line = refused(["simulate", "--predict", "--params", str(params), "--ranks", "2,64",
                    "-e", "64K"], capsys)
    assert "--ranks" in line and "-e/--maxbytes" in line
    assert f"and {sim.memory_text(1_000_000)} is available" in line
