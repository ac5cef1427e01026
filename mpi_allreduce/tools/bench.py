"""Benchmark harness in the style of nccl-tests and the OSU micro-benchmarks.

For every message size and algorithm (ours, plus ``mpi`` = ``MPI.Allreduce``
of the running MPI as the baseline): ``warmup`` untimed calls, a Barrier,
then ``iters`` calls each timed with ``MPI.Wtime``; the time of an
iteration is the maximum over ranks.  Reported: avg/min/max over
iterations (microseconds), algbw = bytes / avg time, and
busbw = algbw * 2(p-1)/p (decimal GB/s) -- the nccl-tests convention, which
makes busbw comparable across rank counts.  With ``repeats`` > 1 the whole
set of algorithms runs that many times interleaved, in a shuffled order
each time (:func:`repeat_order`), and the median of the per-repeat averages
is reported (ratios are taken side by side in one run).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tracemalloc
from statistics import median, quantiles
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
from mpi4py import MPI

from .. import ALGORITHMS, allreduce
from ..backend import backend_for, to_device, to_host
from ..ops import dtype_label, resolve_op
from ..options import keywords_for
from ..context import context_for
from ..executor import wire_type
from ..selection import choose
from ..topology import on_node
from ..vendor import VENDOR
from .verify import make_data, mpi_library, reference

BUSBW_NOTE = "busbw = algbw * 2(p-1)/p; GB/s are decimal (1e9 bytes/s); times are microseconds, max over ranks"


def parse_size(text: str) -> int:
    """'8', '64K', '16M', '1G' -> bytes (binary multiples, as nccl-tests)."""
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    return int(float(number) * mult)


def sizes_between(lo: int, hi: int, factor: float) -> list[int]:
    """``lo``, ``lo * factor``, ... up to ``hi`` bytes, each size once (a
    factor close to 1 gives some whole sizes twice)."""
    if lo <= 0 or hi < lo or factor <= 1:
        raise ValueError(f"need 0 < min <= max and factor > 1, got {lo}, {hi}, {factor}")
    out, s = [], lo
    while s <= hi:
        if not out or int(s) != out[-1]:
            out.append(int(s))
        s *= factor
    return out


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def iterations_for(nbytes: int, iters: int, warmup: int) -> tuple[int, int]:
    """Fewer iterations for large messages (as OSU does): scaled so one size
    moves about ``iters`` MiB, but never fewer than 10 timed and 2 warm-up."""
    if nbytes <= 1 << 20:
        return iters, warmup
    scale = (1 << 20) / nbytes
    return max(10, int(iters * scale)), max(2, int(warmup * scale))


@dataclass
class Result:
    size: int
    count: int
    dtype: str
    op: str
    algorithm: str
    in_place: bool
    time_avg_us: float
    time_min_us: float
    time_max_us: float
    algbw_GBs: float
    busbw_GBs: float
    ratio_to_vendor: Optional[float] = None
    wrong: Optional[int] = None
    iters: int = 0
    repeats_avg_us: list = field(default_factory=list)
    scratch_bytes: Optional[int] = None
    steady_alloc_bytes: Optional[int] = None
    runs: Optional[str] = None  # the algorithm "auto" ran at this size (at the end)
    moves: Optional[int] = None  # how often "auto"'s watch moved to another algorithm


def is_vendor(algorithm: str) -> bool:
    """``mpi`` or ``mpi:<one of the vendor's own algorithms>``."""
    return algorithm == VENDOR or algorithm.startswith(VENDOR + ":")


class Runner:
    """Runs one algorithm on fixed buffers; ``mpi`` is the vendor's Allreduce,
    ``mpi:<name>`` the vendor's with one of its own algorithms forced
    (``forcing``: :meth:`~mpi_allreduce.vendor.Library.forcing`'s
    communicator and the functions that put the control in force around a
    batch of calls, :meth:`forced`).

    On a device without a CUDA-aware MPI the vendor runs on host copies of
    the buffers (it cannot read device memory)."""

    def __init__(self, comm, algorithm, send, recv, op, in_place, options, forcing=None):
        self.comm, self.algorithm = comm, algorithm
        self.send, self.recv, self.in_place = send, recv, in_place
        self.op = resolve_op(op)
        self.enter = self.leave = None
        if forcing is not None:
            self.comm, self.enter, self.leave = forcing
        self.vendor = is_vendor(algorithm)
        self.options = {} if self.vendor else keywords_for(options, "allreduce", algorithm)
        if self.vendor:
            self.mpitype = wire_type(send.dtype)
            if backend_for(send).device and not backend_for(send).direct:
                self.send, self.recv = to_host(send), to_host(recv)
            self.finalize = backend_for(self.recv).ufunc(self.op.finalize) \
                if self.op.finalize is not None else None
            backend_for(self.recv).synchronize()

    @contextlib.contextmanager
    def forced(self):
        """A context in which the vendor's forced algorithm is in force."""
        if self.enter is not None:
            self.enter()
        try:
            yield
        finally:
            if self.leave is not None:
                self.leave()

    def __call__(self):
        if self.vendor:
            sbuf = MPI.IN_PLACE if self.in_place else [self.send, self.mpitype]
            self.comm.Allreduce(sbuf, [self.recv, self.mpitype], self.op.mpi_op)
            if self.finalize is not None:
                self.finalize(self.recv, self.comm.Get_size(), out=self.recv)
        else:
            allreduce(MPI.IN_PLACE if self.in_place else self.send, self.recv, self.op,
                      comm=self.comm, algorithm=self.algorithm, **self.options)


@contextlib.contextmanager
def vendor_forcings(comm, library, algorithms):
    """{``mpi:<name>``: :meth:`Runner`'s forcing} of each of the vendor
    ``library``'s ``algorithms`` on ``comm`` (made collectively, in the same
    order on every rank), their communicators freed at the end."""
    forcings = {a.label: library.forcing(comm, a) for a in algorithms}
    try:
        yield forcings
    finally:
        for forced, _, _ in forcings.values():
            if forced is not comm:
                forced.Free()


def batch_mean_us(comm, call, iters: int, warmup: int) -> float:
    """Microseconds per call of ``iters`` back-to-back calls after ``warmup``
    untimed ones, timed as one batch; the slowest rank's."""
    for _ in range(warmup):
        call()
    comm.Barrier()
    start = MPI.Wtime()
    for _ in range(iters):
        call()
    return comm.allreduce((MPI.Wtime() - start) / iters * 1e6, op=MPI.MAX)


def time_runner(comm, run, iters: int, warmup: int) -> np.ndarray:
    """Per-iteration seconds, each the maximum over ranks."""
    times = np.empty(iters)
    with getattr(run, "forced", contextlib.nullcontext)():
        for _ in range(warmup):
            run()
        comm.Barrier()
        for i in range(iters):
            t0 = MPI.Wtime()
            run()
            times[i] = MPI.Wtime() - t0
    worst = np.empty_like(times)
    comm.Allreduce(times, worst, MPI.MAX)
    return worst


def count_wrong(comm, algorithm, dtype, op, count, in_place, options, device="cpu",
                forcing=None) -> int:
    """Run once on exact data and count elements that differ from the vendor's
    result (with its default algorithm)."""
    data = make_data(np.dtype(dtype), op, count, comm.Get_rank(), "exact", 11)
    expected = reference(comm, data, op, device)
    send = to_device(data, device)
    recv = send.copy() if in_place else to_device(np.empty_like(data), device)
    runner = Runner(comm, algorithm, send, recv, op, in_place, options, forcing)
    with runner.forced():
        runner()
    got = to_host(runner.recv)
    return comm.allreduce(int(np.count_nonzero(got != expected)), op=MPI.SUM)


def scratch_of(comm, algorithm, count, dtype) -> Optional[int]:
    """Bytes of scratch the algorithm's cached plan holds (max over ranks);
    for ``auto``, the plan of what it ran."""
    if is_vendor(algorithm) or comm.Get_size() == 1:
        return None
    if algorithm == "auto":
        algorithm = auto_ran(comm, count, dtype)
    context = context_for(comm)
    most = max((plan.scratch_bytes for key, plan in context.plans.items()
                if key[0] == algorithm and key[1] == count and key[2] == dtype_label(dtype)), default=0)
    return comm.allreduce(most, op=MPI.MAX)


def _selector(comm, count, dtype):
    """``auto``'s live selector for ``count`` elements, if it has one."""
    for shape, selector in context_for(comm).selectors.items():
        if shape[0] == count and shape[1] == dtype_label(dtype):
            return selector
    return None


def auto_ran(comm, count, dtype) -> str:
    """What ``auto`` runs for ``count`` elements: the table's choice, or
    under live selection the selector's current algorithm."""
    selector = _selector(comm, count, dtype)
    if selector is not None:
        return selector.current
    return choose(count * dtype.itemsize, comm.Get_size(),
                  oversubscribed=context_for(comm).oversubscribed)


def auto_moves(comm, count, dtype) -> Optional[int]:
    """How often live selection moved for ``count`` elements (None: table only)."""
    selector = _selector(comm, count, dtype)
    return None if selector is None else selector.moves


def peak_traced_bytes(comm, run) -> int:
    """Peak bytes allocated (numpy reports to tracemalloc) during one call
    that repeats the call before it, max over ranks.  (The algorithms share
    their buffers in a benchmark, and a call binds itself to its buffers
    again after another algorithm ran on them: that first call is not the
    steady state.)"""
    run()
    tracemalloc.start()
    tracemalloc.reset_peak()
    run()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return comm.allreduce(peak, op=MPI.MAX)


#: in-place data that repeated calls leave as it is: sum and prod would
#: multiply it by p (or raise it to the p-th power) on every call, to inf or
#: through denormals (slow arithmetic) within a hundred calls; every other
#: op is idempotent on the equal values all ranks hold after one call
_FIXED_POINT = {"sum": 0, "prod": 1}


def timing_data(dtype: np.dtype, op, count: int, rank: int, in_place: bool) -> np.ndarray:
    """This rank's input for timed calls: the verification data, except
    where in-place calls would make it grow (``_FIXED_POINT``).  Results
    are checked separately, on the verification data (``-c``)."""
    fixed = _FIXED_POINT.get(resolve_op(op).name) if in_place else None
    if fixed is not None:
        return np.full(count, fixed, dtype=dtype)
    return make_data(dtype, op, count, rank, "exact", 5)


def paired_ratios(times: list, base: list) -> tuple:
    """(median, q1, q3) of ``times[i] / base[i]``: a ratio taken repeat by
    repeat, where each repeat ran both side by side."""
    ratios = [t / b for t, b in zip(times, base)]
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q1, q2, q3 = quantiles(ratios, n=4)
    return median(ratios), q1, q3


def repeat_order(algorithms: list, nbytes: int, repeat: int) -> list:
    """The order the algorithms run in during one repeat at one size: a
    permutation seeded by (size, repeat), so the same on every rank and in
    every run, and different from repeat to repeat.  A fixed order would
    give each algorithm the same place and the same predecessor every time
    (whose cache footprint and stragglers it inherits); shuffled, those
    effects fall on every algorithm alike and the medians compare them."""
    shuffled = np.random.default_rng([nbytes, repeat]).permutation(len(algorithms))
    return [algorithms[i] for i in shuffled]


def bench(comm, sizes, algorithms, dtype="float32", op="sum", iters=20, warmup=5,
          modes=(False,), check=False, repeats=1, options=None, progress=True,
          memory=False, device="cpu", forcings=None) -> list[Result]:
    """Results of every algorithm at every size; ``forcings`` maps each
    ``mpi:<name>`` among ``algorithms`` to its :meth:`Runner`'s forcing."""
    forcings = forcings or {}
    dtype = np.dtype(dtype)
    options = options or {}
    p = comm.Get_size()
    results = []
    bar = _progress(len(sizes) * len(modes), progress and comm.Get_rank() == 0)
    for nbytes in sizes:
        count = max(1, nbytes // dtype.itemsize)
        nbytes = count * dtype.itemsize
        n_iter, n_warm = iterations_for(nbytes, iters, warmup)
        for in_place in modes:
            host = timing_data(dtype, op, count, comm.Get_rank(), in_place)
            send = to_device(host, device)
            recv = send.copy() if in_place else to_device(np.empty_like(host), device)
            runners = {a: Runner(comm, a, send, recv, op, in_place, options, forcings.get(a))
                       for a in algorithms}
            per_repeat = {a: [] for a in algorithms}
            samples = {a: [] for a in algorithms}
            for repeat in range(repeats):
                for a in repeat_order(algorithms, nbytes, repeat):
                    t = time_runner(comm, runners[a], n_iter, n_warm)
                    per_repeat[a].append(float(t.mean()))
                    samples[a].append(t)
            for a in algorithms:
                allt = np.concatenate(samples[a])
                avg = float(np.median(per_repeat[a]))
                algbw = nbytes / avg / 1e9 if avg > 0 else 0.0
                res = Result(nbytes, count, dtype.name, op, a, in_place, avg * 1e6,
                             float(allt.min()) * 1e6, float(allt.max()) * 1e6, algbw,
                             algbw * (2 * (p - 1) / p if p > 1 else 1.0), iters=n_iter,
                             repeats_avg_us=[t * 1e6 for t in per_repeat[a]])
                if a == "auto" and p > 1:
                    res.runs = auto_ran(comm, count, dtype)
                    res.moves = auto_moves(comm, count, dtype)
                if check:
                    res.wrong = count_wrong(comm, a, dtype, op, count, in_place, options, device,
                                            forcings.get(a))
                if memory:
                    res.scratch_bytes = scratch_of(comm, a, count, dtype)
                    res.steady_alloc_bytes = peak_traced_bytes(comm, runners[a])
                results.append(res)
            vendor = next((r for r in results[-len(algorithms):] if r.algorithm == VENDOR), None)
            if vendor is not None:
                for r in results[-len(algorithms):]:
                    r.ratio_to_vendor = r.time_avg_us / vendor.time_avg_us
            bar.update(1, human(nbytes))
    bar.close()
    return results


class _progress:
    """Progress on stderr (tqdm) for rank 0; silent elsewhere."""

    def __init__(self, total, enabled):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, unit="size", leave=False,
                            disable=not sys.stderr.isatty() and total < 2)

    def update(self, n, label):
        if self.bar is not None:
            self.bar.set_postfix_str(label)
            self.bar.update(n)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# --- output -----------------------------------------------------------------

COLUMNS = ("size(B)", "count", "type", "redop", "algorithm", "inplace", "avg(us)", "min(us)",
           "max(us)", "algbw(GB/s)", "busbw(GB/s)", "vs_mpi", "#wrong")


def table(results: list[Result], meta: dict) -> str:
    lines = [
        f"# mpi_allreduce bench: {meta['ranks']} ranks on {meta['nodes']} node(s), "
        f"ranks/node {meta['ranks_per_node']}; {meta['mpi_library']}",
        f"# {BUSBW_NOTE}; vs_mpi = time / MPI.Allreduce time at that size",
        f"# iterations {meta['iters']} (fewer above 1 MiB), warm-up {meta['warmup']}, "
        f"repeats {meta['repeats']} (median; algorithms in a shuffled order each repeat)",
        "".join(f"{c:>{w}}" for c, w in zip(COLUMNS, _WIDTHS)),
    ]
    for r in results:
        cells = (r.size, r.count, r.dtype, r.op, r.algorithm, "yes" if r.in_place else "no",
                 f"{r.time_avg_us:.2f}", f"{r.time_min_us:.2f}", f"{r.time_max_us:.2f}",
                 f"{r.algbw_GBs:.3f}", f"{r.busbw_GBs:.3f}",
                 "" if r.ratio_to_vendor is None else f"{r.ratio_to_vendor:.2f}",
                 "-" if r.wrong is None else r.wrong)
        lines.append("".join(f"{str(c):>{w}}" for c, w in zip(cells, _WIDTHS)))
    return "\n".join(lines)


_WIDTHS = (11, 10, 9, 6, 23, 8, 11, 11, 11, 12, 12, 8, 7)


def metadata(comm, args_line: str, iters: int, warmup: int, repeats: int) -> dict:
    local = on_node(comm, "the benchmark's metadata: where the ranks run")[1]
    hosts = comm.allgather(MPI.Get_processor_name())
    locals_ = comm.allgather(local)
    slurm_nodes = comm.allgather(os.environ.get("SLURMD_NODENAME"))
    import mpi4py

    return {
        "ranks": comm.Get_size(),
        "nodes": len(set(hosts)),
        "ranks_per_node": sorted(set(locals_)),
        "hostnames": sorted(set(hosts)),
        "slurm_nodes": sorted({n for n in slurm_nodes if n}) or None,
        "mpi_library": mpi_library(),
        "mpi_standard": ".".join(map(str, MPI.Get_version())),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {platform.platform()}",
        "git_commit": _git_commit(),
        "command": args_line,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "iters": iters,
        "warmup": warmup,
        "repeats": repeats,
        "busbw": BUSBW_NOTE,
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("MPI_ALLREDUCE_", "OMPI_MCA_coll", "SLURM_JOB_ID",
                                 "SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_NNODES"))},
    }


def _git_commit() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def write_json(path: str, results: list[Result], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=1)


def write_csv(path: str, results: list[Result], meta: dict) -> None:
    import csv

    with open(path, "w", newline="") as f:
        f.write(f"# {json.dumps(meta)}\n")
        names = list(asdict(results[0]).keys()) if results else []
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in results:
            row = asdict(r)
            row["repeats_avg_us"] = ";".join(f"{t:.3f}" for t in r.repeats_avg_us)
            writer.writerow(row)


#: what ``plot`` reads of a ``bench --json`` file: metadata and every result's fields
META_FIELDS = ("ranks", "nodes", "mpi_library")
RESULT_FIELDS = {"algorithm": str, "in_place": bool, "size": (int, float),
                 "time_avg_us": (int, float), "busbw_GBs": (int, float)}


def check_results(doc, path: str) -> None:
    """Refuse (ValueError naming ``path``) what is not a ``bench --json``
    document: a ``meta`` object and a ``results`` list of objects, with
    the fields :data:`META_FIELDS` and :data:`RESULT_FIELDS`."""
    def refuse(why: str):
        raise ValueError(f"{path!r} is not a `bench --json` file: {why}")
    if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict) \
            or not isinstance(doc.get("results"), list):
        refuse("expected an object with 'meta' (an object) and 'results' (a list)")
    missing = [k for k in META_FIELDS if k not in doc["meta"]]
    if missing:
        refuse(f"its 'meta' lacks {', '.join(map(repr, missing))}")
    for n, result in enumerate(doc["results"]):
        if not isinstance(result, dict):
            refuse(f"result {n} is not an object")
        for name, kind in RESULT_FIELDS.items():
            if not isinstance(result.get(name), kind) or \
                    (kind is not bool and isinstance(result.get(name), bool)):
                refuse(f"result {n} has no {name!r} of the right type")


def load_results(paths) -> tuple[list[dict], list[dict]]:
    """The results and metadata of ``bench --json`` files; ValueError (or
    OSError) for a file that is not one."""
    results, metas = [], []
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
        except ValueError as exc:  # (not JSON, or not text)
            raise ValueError(f"{path!r} is not a `bench --json` file: not JSON: {exc}") from None
        check_results(doc, path)
        metas.append(doc["meta"])
        results.extend(doc["results"])
    return results, metas


def default_algorithms() -> list[str]:
    return [VENDOR] + list(ALGORITHMS)
