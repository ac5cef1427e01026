"""Compare every algorithm with ``MPI.Allreduce`` on the same data.

For every algorithm x dtype x op x count x (in place, out of place):

* ``exact`` data: integers, or floats chosen so that the result is exact in
  any order (small integers for sums, powers of two for products, as
  nccl-tests does) -- the result must equal the vendor's bit for bit;
* ``random`` data (float and complex SUM/avg): uniform in [-1, 1), compared
  with a tolerance of ``p * p * eps`` (absolute; the sum of p values of
  magnitude <= 1 rounded p-1 times).

It also checks that every rank holds the same bytes, and that the element
after the receive buffer is untouched.  Then ``reduce_scatter`` (block and
vector forms) and ``allgather`` (``Allgather`` and ``Allgatherv`` forms), on
the ring and on each verified algorithm that offers its halves, against
``MPI.Reduce_scatter``/``_block`` and ``MPI.Allgather``/``v`` on exact
data, in place and not.  Then (host buffers, with the default ops)
MPI's pair type ``DOUBLE_INT`` with MAXLOC and MINLOC on every algorithm,
and a non-commutative user-defined ``MPI.Op`` that every algorithm keeping
rank order must run to MPI's result and every other must refuse.  A wrong
element anywhere makes the command exit non-zero.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from mpi4py import MPI

from .. import ALGORITHMS, allgather, allreduce, reduce_scatter, registry
from ..backend import cuda_aware_support, to_device, to_host
from ..ops import OPS, SUPPORTED_DTYPES, resolve_op, value_bytes
from ..options import keywords_for
from ..executor import wire_type

LARGE_COUNT = (1 << 20) + 3
#: the (dtype, op) pairs that also run at LARGE_COUNT elements
LARGE_CASES = (("float32", "sum"), ("int32", "max"), ("float64", "avg"))


def mpi_library() -> str:
    """The first line of the MPI library's version string (Open MPI ends it with a NUL)."""
    return MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()


def counts_for(size: int) -> list[int]:
    """0, 1, p-1, p, p+1, small primes, 2^k +- 1."""
    counts = {0, 1, size - 1, size, size + 1, 2, 3, 7, 13, 31, 97}
    for k in (4, 10, 14):
        counts.update({(1 << k) - 1, (1 << k) + 1})
    return sorted(c for c in counts if c >= 0)


def tolerance(dtype: np.dtype, size: int) -> float:
    eps = np.finfo(dtype).eps
    return float(size * size * eps)


def make_data(dtype: np.dtype, op: str, count: int, rank: int, kind: str, seed: int) -> np.ndarray:
    """This rank's input: deterministic in (seed, rank), exact where ``kind == 'exact'``."""
    rng = np.random.default_rng([seed, rank, count])
    if dtype == np.bool_:
        return rng.integers(0, 2, count).astype(bool)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        if op in ("band", "bor", "bxor", "min", "max"):
            return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
        if op in ("land", "lor", "lxor"):
            return rng.integers(0, 3, count).astype(dtype)
        if op == "prod":
            return rng.choice(np.array([1, 2, 3], dtype=dtype), count)
        low = 0 if info.min == 0 else -3
        return rng.integers(low, 4, count).astype(dtype)
    is_complex = np.issubdtype(dtype, np.complexfloating)
    if kind == "random":
        values = rng.uniform(-1, 1, count)
        if is_complex:
            values = values + 1j * rng.uniform(-1, 1, count)
        return values.astype(dtype)
    if op == "prod":
        choices = [1, -1, 1j, -1j, 1 + 1j] if is_complex else [1.0, -1.0, 2.0, -2.0, 0.5]
        return rng.choice(np.array(choices, dtype=dtype), count)
    if op in ("min", "max"):
        return rng.uniform(-100, 100, count).astype(dtype)
    values = rng.integers(-8, 9, count).astype(np.float64)
    if is_complex:
        values = values + 1j * rng.integers(-8, 9, count)
    return values.astype(dtype)


def reference(comm: MPI.Intracomm, data: np.ndarray, op: str, device: str = "cpu") -> np.ndarray:
    """``MPI.Allreduce`` of the running MPI on the same data, as a host array.

    float16 goes through float32 (MPI has no portable half type); ``avg``
    is the vendor's SUM divided by the size, as our algorithms do it.  With
    ``device='cuda'`` and a CUDA-aware MPI the vendor gets device buffers,
    otherwise host copies.
    """
    ours = resolve_op(op)
    send = data.astype(np.float32) if data.dtype == np.float16 else data
    if device != "cpu" and cuda_aware_support()[0]:
        dsend = to_device(send, device)
        dout = dsend.copy()
        comm.Allreduce([dsend, wire_type(send.dtype)], [dout, wire_type(send.dtype)],
                       ours.mpi_op)
        out = to_host(dout)
    else:
        out = np.empty_like(send)
        comm.Allreduce([send, wire_type(send.dtype)], [out, wire_type(send.dtype)], ours.mpi_op)
    out = out.astype(data.dtype)
    if ours.finalize is not None:
        ours.finalize(out, comm.Get_size(), out=out)
    return out


@dataclass
class Row:
    algorithm: str
    dtype: str
    ops: list = field(default_factory=list)
    cases: int = 0
    max_count: int = 0
    wrong: int = 0
    not_identical: int = 0
    kinds: set = field(default_factory=set)


def run_case(comm, algorithm, dtype, op, count, in_place, kind, seed, options,
             device: str = "cpu") -> tuple[int, int]:
    """One comparison; returns (#wrong elements over all ranks, #ranks whose bytes differ)."""
    data = make_data(dtype, op, count, comm.Get_rank(), kind, seed)
    expected = reference(comm, data, op, device)
    # a sentinel element after the receive buffer that must stay untouched
    host_storage = np.zeros(count + 1, dtype=dtype)
    sentinel = make_data(dtype, "sum", 1, 99, "exact", seed + 1)[0]
    host_storage[count] = sentinel
    if in_place:
        host_storage[:count] = data
    storage = to_device(host_storage, device)
    recv = storage[:count]
    if in_place:
        allreduce(MPI.IN_PLACE, recv, op, comm=comm, algorithm=algorithm, **options)
    else:
        allreduce(to_device(data, device), recv, op, comm=comm, algorithm=algorithm, **options)
    storage = to_host(storage)
    recv = storage[:count]
    if kind == "exact":
        wrong = int(np.count_nonzero(recv != expected))
    else:
        tol = tolerance(dtype, comm.Get_size())
        wrong = int(np.count_nonzero(~np.isclose(recv, expected, rtol=0, atol=tol)))
    if storage[count] != sentinel:
        wrong += 1
    digest = hashlib.sha1(value_bytes(recv)).hexdigest()
    digests = comm.allgather(digest)
    differing = sum(d != digests[0] for d in digests)
    return comm.allreduce(wrong, op=MPI.SUM), differing


def variants(algorithms, options: dict) -> list[tuple[str, str, dict]]:
    """(label, algorithm, options) to run.  Without an explicit node layout,
    ``hierarchical`` runs twice: on the real nodes, and on emulated nodes of
    2 ranks each (the last one smaller when p is odd), so that the
    across-node phase runs on one machine too."""
    out = []
    for name in algorithms:  # (each with the options it uses: --inner is hierarchical's)
        out.append((name, name, keywords_for(options, "allreduce", name)))
        if name == "hierarchical" and "ranks_per_node" not in options:
            out.append(("hierarchical/rpn=2", name,
                        dict(keywords_for(options, "allreduce", name), ranks_per_node=2)))
    return out


def valid_ops(dtype: np.dtype, ops) -> list[str]:
    return [name for name in ops if OPS[name].valid_for(dtype)]


def verify(
    comm: MPI.Intracomm = MPI.COMM_WORLD,
    algorithms=ALGORITHMS,
    dtypes=SUPPORTED_DTYPES,
    ops=tuple(OPS),
    counts: Optional[list[int]] = None,
    large: bool = True,
    seed: int = 2026,
    options: Optional[dict] = None,
    out=sys.stdout,
    device: str = "cpu",
    halves: bool = True,
) -> int:
    """Run the matrix, print the table on rank 0, return the total #wrong.
    ``halves``: also reduce_scatter and allgather."""
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = counts_for(size) if counts is None else counts
    rows: list[Row] = []
    start = time.perf_counter()
    for label, algorithm, variant_options in variants(algorithms, options or {}):
        for dtype_name in dtypes:
            dtype = np.dtype(dtype_name)
            row = Row(label, dtype_name)
            rows.append(row)
            for op in valid_ops(dtype, ops):
                row.ops.append(op)
                kinds = ["exact"]
                if dtype.kind in "fc" and op in ("sum", "avg"):
                    kinds.append("random")
                case_counts = list(counts)
                if large and (dtype_name, op) in LARGE_CASES:
                    case_counts.append(LARGE_COUNT)
                for count in case_counts:
                    for in_place in (False, True):
                        for kind in kinds:
                            wrong, differing = run_case(comm, algorithm, dtype, op, count,
                                                        in_place, kind, seed, variant_options,
                                                        device)
                            row.cases += 1
                            row.max_count = max(row.max_count, count)
                            row.wrong += wrong
                            row.not_identical += differing
                            row.kinds.add(kind)
    if halves:
        # the ring's halves, and those of every verified algorithm that has them
        for name in dict.fromkeys(["ring"] + [a for a in algorithms if a in registry.HALVES]):
            rows += verify_halves(comm, dtypes, ops, counts, device, name)
    if device == "cpu" and "maxloc" in ops:  # (the default: every op)
        rows += verify_user_ops(comm, variants(algorithms, options or {}), counts)
    elapsed = time.perf_counter() - start
    total = sum(r.wrong + r.not_identical for r in rows)
    if rank == 0:
        print_table(rows, comm, counts, elapsed, out, device)
    return total


def verify_halves(comm, dtypes, ops, counts, device: str = "cpu", algorithm: str = "ring") -> list:
    """reduce_scatter and allgather on ``algorithm`` (one of
    ``registry.HALVES``) against MPI's on exact data: per dtype, every
    valid op (reduce_scatter), blocks of every count (block forms) and
    uneven blocks (vector forms), in place and not."""
    size, rank = comm.Get_size(), comm.Get_rank()
    rows = []
    uneven = [[(c + r) % (c + 2) for r in range(size)] for c in counts]
    for dtype_name in dtypes:
        dtype = np.dtype(dtype_name)
        if wire_type(dtype) == MPI.BYTE:
            continue  # no MPI type to reduce with (float16): nothing to compare against
        suffix = "" if algorithm == "ring" else f":{algorithm}"
        scatter = Row("reduce_scatter" + suffix, dtype_name)
        gather = Row("allgather" + suffix, dtype_name)
        for op in valid_ops(dtype, ops):
            scatter.ops.append(op)
            for blocks in [[c] * size for c in counts] + uneven:
                for in_place in (False, True):
                    wrong = _check_reduce_scatter(comm, dtype, op, blocks, in_place, device,
                                                  algorithm)
                    scatter.cases += 1
                    scatter.max_count = max(scatter.max_count, sum(blocks))
                    scatter.wrong += wrong
        gather.ops.append("-")
        for blocks in [[c] * size for c in counts] + uneven:
            for in_place in (False, True):
                part = make_data(dtype, "sum", blocks[rank], rank, "exact", 11)
                want = np.empty(sum(blocks), dtype)
                comm.Allgatherv(part, [want, blocks])
                got = np.zeros(sum(blocks), dtype)
                if in_place:
                    got[sum(blocks[:rank]):sum(blocks[:rank + 1])] = part
                    result = allgather(MPI.IN_PLACE, to_device(got, device), blocks, comm=comm,
                                       algorithm=algorithm)
                else:
                    result = allgather(to_device(part, device), to_device(got, device), blocks,
                                       comm=comm, algorithm=algorithm)
                gather.cases += 1
                gather.max_count = max(gather.max_count, sum(blocks))
                gather.wrong += comm.allreduce(int(np.count_nonzero(to_host(result) != want)))
        for row in (scatter, gather):
            row.kinds.add("exact")
        rows += [scatter, gather]
    return rows


#: the order-recording op's encoding: the interval of ranks [a, b] is a * K + b
K = 1 << 20


def interval(first, second):
    """[a, b] OP [c, d] = [a, d] if c == b + 1, else -1 (int64 arrays):
    associative, not commutative; the reduction of [r, r] over p ranks is
    [0, p-1] only if every combination took its operands in rank order,
    each once.  Rank r contributes ``r * (K + 1)``."""
    a, b = np.divmod(first, K)
    c, d = np.divmod(second, K)
    ok = (first >= 0) & (second >= 0) & (c == b + 1)
    return np.where(ok, a * K + d, -1)


def interval_mpi(inbuf, inoutbuf, datatype):
    """:func:`interval` as an MPI user function: inout = in OP inout."""
    second = np.frombuffer(inoutbuf, np.int64)
    second[...] = interval(np.frombuffer(inbuf, np.int64), second)


def verify_user_ops(comm, runs, counts) -> list:
    """MPI's pair type DOUBLE_INT with MAXLOC and MINLOC (ties included)
    on every algorithm, and a non-commutative user-defined MPI.Op on every
    algorithm that combines in rank order (the others must refuse it on
    every rank), against MPI.Allreduce with the same op."""
    from mpi4py.util import dtlib

    from ..registry import ORDERED

    rank = comm.Get_rank()
    pair = np.dtype(dtlib.to_numpy_dtype(MPI.DOUBLE_INT))
    ordered_op = MPI.Op.Create(interval_mpi, commute=False)
    rows = []
    try:
        for label, algorithm, options in runs:
            loc = Row(label, "DOUBLE_INT", ["maxloc", "minloc"])
            ordered = Row(label, "int64", ["user op, not commutative"])
            for count in counts:
                rng = np.random.default_rng([rank, count])
                data = np.zeros(count, pair)
                data["f0"] = rng.integers(0, 3, count)  # few values: ties
                data["f1"] = rng.integers(0, 1000, count)
                for op in (MPI.MAXLOC, MPI.MINLOC):
                    for in_place in (False, True):
                        loc.wrong += _check_loc(comm, data, op, in_place, algorithm, options)
                        loc.cases += 1
                ordered.wrong += _check_ordered(comm, ordered_op, count, algorithm in ORDERED,
                                                algorithm, options)
                ordered.cases += 1
                loc.max_count = ordered.max_count = max(loc.max_count, count)
            loc.kinds.add("exact")
            ordered.kinds.add("exact" if algorithm in ORDERED else "refused")
            rows += [loc, ordered]
    finally:
        ordered_op.Free()
    return rows


def _check_loc(comm, data, op, in_place, algorithm, options) -> int:
    """Elements (over all ranks) whose value or index differ from MPI's."""
    want = np.empty_like(data)
    comm.Allreduce([data, MPI.DOUBLE_INT], [want, MPI.DOUBLE_INT], op)
    got = data.copy()
    allreduce(MPI.IN_PLACE if in_place else data, got, op, comm=comm, algorithm=algorithm,
              **options)
    bad = (got["f0"] != want["f0"]) | (got["f1"] != want["f1"])
    return comm.allreduce(int(np.count_nonzero(bad)))


def _check_ordered(comm, op, count, ordered: bool, algorithm, options) -> int:
    """The non-commutative ``op``: elements that differ from MPI's result
    where ``algorithm`` keeps rank order, 1 where it was refused (or not
    refused) wrongly."""
    mine = np.full(count, comm.Get_rank() * (K + 1), np.int64)
    want = np.empty_like(mine)
    comm.Allreduce(mine, want, op)
    try:
        got = allreduce(mine, None, op, comm=comm, algorithm=algorithm, **options)
    except ValueError:
        return int(ordered)  # a refusal is right only where rank order is not kept
    if not ordered:
        return 1
    return comm.allreduce(int(np.count_nonzero(got != want)))


def _check_reduce_scatter(comm, dtype, op, blocks, in_place, device, algorithm) -> int:
    rank = comm.Get_rank()
    ours = resolve_op(op)
    data = make_data(dtype, op, sum(blocks), rank, "exact", 13)
    want = np.empty(blocks[rank], dtype)
    comm.Reduce_scatter([data, wire_type(dtype)], [want, wire_type(dtype)], blocks, ours.mpi_op)
    if ours.finalize is not None:
        ours.finalize(want, comm.Get_size(), out=want)
    if in_place:
        buf = to_device(data.copy(), device)
        got = to_host(reduce_scatter(MPI.IN_PLACE, buf, op, blocks, comm=comm,
                                     algorithm=algorithm))[:blocks[rank]]
    else:
        got = to_host(reduce_scatter(to_device(data, device), None, op, blocks, comm=comm,
                                     algorithm=algorithm))
    return comm.allreduce(int(np.count_nonzero(got != want)))


def print_table(rows, comm, counts, elapsed, out, device="cpu") -> None:
    size = comm.Get_size()
    print(f"# mpi_allreduce verify: {size} ranks, {device} buffers, "
          f"{mpi_library()}", file=out)
    print(f"# counts: {', '.join(map(str, counts))} (+{LARGE_COUNT} for "
          f"{', '.join('/'.join(c) for c in LARGE_CASES)}); in place and out of place", file=out)
    print("# exact data must match MPI.Allreduce bit for bit; random float data within "
          "p*p*eps absolute; 'differ' = ranks whose result bytes differ from rank 0's", file=out)
    width = max([19] + [len(r.algorithm) for r in rows])
    header = (f"{'algorithm':<{width}} {'dtype':<10} {'ops':<41} {'data':<12} {'cases':>6} "
              f"{'max count':>9} {'differ':>6} {'#wrong':>6}")
    print(header, file=out)
    for r in rows:
        print(f"{r.algorithm:<{width}} {r.dtype:<10} {','.join(r.ops):<41} "
              f"{'+'.join(sorted(r.kinds)):<12} {r.cases:>6} {r.max_count:>9} "
              f"{r.not_identical:>6} {r.wrong:>6}", file=out)
    wrong = sum(r.wrong for r in rows)
    differ = sum(r.not_identical for r in rows)
    cases = sum(r.cases for r in rows)
    verdict = "OK" if wrong + differ == 0 else "FAILED"
    print(f"# {verdict}: {cases} cases, {wrong} wrong elements, {differ} differing ranks, "
          f"{elapsed:.1f} s", file=out)
