"""Traces of jobs that end in ``MPI_Abort``: the rank files hold the calls
that ran (written as they went, and by :func:`mpi_allreduce.trace.flush`
just before the abort), lack only their closing ``]``, and ``python -m
mpi_allreduce trace DIR`` merges them.  A rank file cut in the middle of a
line reads up to its last whole line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mpi_allreduce import trace
from mpi_allreduce.launch import find_mpiexec, run_mpi
from mpi_allreduce.tools.traces import load, merge, validate

ROOT = Path(__file__).resolve().parent.parent

#: a job of traced calls that ends in an abort: ``watchdog`` (rank 1 skips the
#: last call; the others stall and the watchdog aborts) or ``flush`` (rank 0 calls
#: trace.flush() and MPI_Abort itself, with no write before: the abort path by hand)
SCRIPT = """\
import os
import sys

os.environ["MPI_ALLREDUCE_TRACE"] = sys.argv[1]
os.environ["MPI_ALLREDUCE_WATCHDOG"] = "2"
os.environ["MPI_ALLREDUCE_WATCHDOG_ACTION"] = "abort"

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import trace

how = sys.argv[2]
trace.FLUSH_SECONDS = 0.25 if how == "watchdog" else 3600.0
world = MPI.COMM_WORLD
x = np.ones(1000, dtype=np.float32)
y = np.empty_like(x)
for _ in range(5):
    mar.allreduce(x, y, algorithm="ring")
assert (y == world.Get_size()).all()
world.Barrier()
print(f"rank {world.Get_rank()}: 5 calls made", flush=True)
if how == "watchdog":
    if world.Get_rank() != 1:
        mar.allreduce(x, y, algorithm="ring")  # rank 1 never comes: a stall
elif world.Get_rank() == 0:
    trace.flush()
    world.Abort(3)
world.Barrier()  # (never passed: the job is aborted)
"""

pytestmark = pytest.mark.skipif(
    find_mpiexec() is None,
    reason="no mpiexec found: pip install 'mpi_allreduce[mpi]' (bundled Open MPI) "
           "or load your site's MPI module",
)


def _abort(tmp_path: Path, size: int, how: str) -> Path:
    script = tmp_path / "abort.py"
    script.write_text(SCRIPT)
    directory = tmp_path / "traces"
    result = run_mpi(size, [sys.executable, str(script), str(directory), how], timeout=60,
                     cwd=str(ROOT))
    assert result.returncode not in (0, 124), result.stdout[-3000:]
    assert result.stdout.count("5 calls made") == size, result.stdout[-3000:]
    return directory


def _merge_command(directory: Path) -> dict:
    """``python -m mpi_allreduce trace DIR``; the merged trace."""
    result = subprocess.run([sys.executable, "-m", "mpi_allreduce", "trace", str(directory)],
                            capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"wrote {directory / 'trace.json'}" in result.stdout
    return load(str(directory / "trace.json"))


def _calls(doc: dict) -> Counter:
    return Counter(e["pid"] for e in doc["traceEvents"]
                   if e.get("cat") == "call" and e["ph"] == "X")


@pytest.mark.parametrize("size", [2, 3])
def test_a_watchdog_abort_leaves_rank_files_with_the_calls_that_ran(tmp_path, size):
    directory = _abort(tmp_path, size, "watchdog")
    files = sorted(directory.glob("rank-*.json"))
    assert sorted(int(f.name.split("-")[1]) for f in files) == list(range(size))
    for f in files:
        text = f.read_text()
        assert not text.rstrip().endswith("]")  # cut short by the abort
        json.loads(text + "]")  # a JSON array without its ']', as the format allows
    doc = _merge_command(directory)
    # the five calls every rank finished; the stalled one never finished anywhere
    assert _calls(doc) == {rank: 5 for rank in range(size)}
    assert sorted(doc["otherData"]["unfinished"]) == [str(f) for f in files]
    counts = validate(doc)
    assert counts["round"] >= 5 * size and counts["messages"] >= 5 * size


def test_flush_before_an_abort_writes_what_the_rank_held(tmp_path):
    """No write comes before the abort but :func:`trace.flush` on rank 0:
    its file has its five calls; rank 1, killed by the abort with its
    events held, has none (which is why the library flushes before an
    abort, and why a rank writes what it holds after FLUSH_SECONDS)."""
    directory = _abort(tmp_path, 2, "flush")
    files = sorted(directory.glob("rank-*.json"))
    assert [f.name.split("-")[1] for f in files] == ["0"]
    doc = _merge_command(directory)
    assert _calls(doc) == {0: 5}
    # rank 0's messages lost their other side with rank 1's events: counted, not refused
    assert validate(doc)["unpaired"] > 0


def test_a_line_cut_short_is_left_out(tmp_path):
    """A rank file whose last write was cut in the middle of a line (its
    process killed while writing) reads up to the line before."""
    t = trace.Tracer(str(tmp_path), 7, chunk=4)
    for k in range(10):
        t.add({"ev": "call", "name": "ring", "lane": 0, "t0": t.origin + 1000 * k,
               "t1": t.origin + 1000 * k + 500, "args": {"call": k + 1}})
    t.flush()
    assert t.written == 10 and t.peak <= 4
    path = Path(t.path)
    text = path.read_text()
    path.write_text(text[:-20])  # the last event, in part
    doc = load(str(path))
    assert [e["args"]["call"] for e in doc["traceEvents"] if e["ph"] == "X"] == list(range(1, 10))
    assert doc["otherData"]["unfinished"] == [str(path)]
    out = merge([str(tmp_path)], str(tmp_path / "merged.json"))
    assert validate(load(out))["call"] == 9


def test_a_rank_file_holds_the_chrome_events_of_what_was_recorded(tmp_path):
    """The lines a rank's file is written with (made without json.dumps,
    for speed) are the Chrome events of the raw ones, lanes named."""
    t = trace.Tracer(str(tmp_path), 2)
    o = t.origin
    raw = [{"ev": "send", "name": "send", "peer": 3, "t0": o + 5, "t1": o + 10005,
            "args": {"peer": 3, "bytes": 8, "round": 0, "key": "(2, 3)/1/2>3/1"}},
           {"ev": "local", "name": "reduce", "lane": 1, "t0": o + 7, "t1": o + 6,
            "args": {"bytes": 8, "round": 1}},
           {"ev": "call", "name": 'a "quoted" name\u00e9', "lane": 0, "t0": o,
            "t1": o + 123456789, "args": {"algorithm": "ring", "elements": 5}}]
    for e in raw:
        t.add(dict(e))
    t.close()
    doc = load(t.files[0])
    assert [e for e in doc["traceEvents"] if e["ph"] == "X"] == \
        [trace._chrome(2, e, 0, o) for e in raw]
    lanes = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["name"] == "thread_name"}
    assert lanes == {trace.SEND_LANE + 3: "send to 3", 1: "calls in flight 1",
                     0: "blocking calls"}
    assert doc["otherData"] == {"ranks": [2], "origin_ns": o, "unfinished": []}
