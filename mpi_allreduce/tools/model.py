"""The cost model: schedules timed on a fitted machine.

A message of n bytes costs ``alpha + n * beta`` on the wire and ``o`` of
software on each side when posted; a local reduction of n bytes costs
``o_op + n * gamma``.  :func:`predict` does not restate a formula per
algorithm: it builds every rank's schedule and times them against each
other with :func:`mpi_allreduce.simulate.simulate` (no data), so what it
counts -- messages, segments, folds, the critical path through the root of
the driver or the leaders of hierarchical -- is what the executor runs.
:func:`fit` measures alpha and beta by ping-pong between ranks 0 and 1, o
as the cost of an mpi4py ``Sendrecv`` call with nobody at the other end,
o_op as the cost of a ufunc call on one element, and gamma by timing the
reduction ufunc on long vectors.

For reference, the textbook forms (Thakur, Rabenseifner and Gropp, 2005),
which the simulated times reproduce with o = o_op = 0:

=================== ================================================================
algorithm           time
=================== ================================================================
driver              (p-1)(S + 1) a + 2 (p-1) n b + (p-1) n g
ring                2(p-1) S a + 2 n (p-1)/p b + n (p-1)/p g      (S segments per block)
recursive_doubling  lg P (S a + n b + n g) [+ (S + 1) a + 2 n b + n g if p != P]
rabenseifner        (sum_k S_k + lg P) a + 2 n (P-1)/P b + n (P-1)/P g [+ fold as above]
hierarchical        4(q-1) a_i + 4 n (q-1)/q b_i + n (q-1)/q g + T_inner(m, a_e, b_e)
=================== ================================================================
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from ..simulate import Machine, simulate


@dataclass(frozen=True)
class Params:
    alpha: float  # seconds per message on the wire
    beta: float  # seconds per byte on the wire
    gamma: float  # seconds per byte reduced
    #: across nodes, for hierarchical (defaults to the same link)
    alpha_inter: Optional[float] = None
    beta_inter: Optional[float] = None
    #: software: seconds per message posted (each side), per local action
    overhead: float = 0.0
    op_overhead: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def machine_of(prm: Params, nodes: Optional[tuple] = None) -> Machine:
    return Machine(overhead=prm.overhead, alpha=prm.alpha, beta=prm.beta, gamma=prm.gamma,
                   op_overhead=prm.op_overhead, alpha_inter=prm.alpha_inter,
                   beta_inter=prm.beta_inter, nodes=nodes)


@functools.lru_cache(maxsize=4096)
def predict(algorithm: str, n: float, p: int, prm: Params, segment_bytes: Optional[int] = None,
            ranks_per_node: Optional[int] = None, itemsize: int = 4) -> float:
    """Predicted seconds for an ``n``-byte all-reduce on ``p`` ranks: the
    schedules of all ranks timed on ``prm`` (float32 elements by default)."""
    if p <= 1 or n <= 0:
        return 0.0
    count = max(1, int(n) // itemsize)
    segment = max(1, (segment_bytes or (1 << 62)) // itemsize)
    options, nodes = None, None
    if algorithm == "hierarchical":
        q = min(ranks_per_node or p, p)
        nodes = tuple((r // q) * q for r in range(p))
        leaders = len(set(nodes))
        inner = best_flat(n, leaders, prm, segment_bytes)[0] if leaders > 1 else "ring"
        options = {"nodes": nodes, "inner": inner}
    dtype = {1: "u1", 2: "u2", 4: "float32", 8: "float64"}[itemsize]
    return simulate(algorithm, p, count, dtype, "sum", segment_size=segment, options=options,
                    machine=machine_of(prm, nodes), data=False).seconds


FLAT = ("ring", "recursive_doubling", "rabenseifner")


def best_flat(n: float, p: int, prm: Params, segment_bytes: Optional[int] = None):
    """(name, seconds) of the cheapest flat algorithm by the model (across
    nodes: the inter-node link)."""
    if p <= 1:
        return "none", 0.0
    outer = Params(prm.alpha if prm.alpha_inter is None else prm.alpha_inter,
                   prm.beta if prm.beta_inter is None else prm.beta_inter, prm.gamma,
                   overhead=prm.overhead, op_overhead=prm.op_overhead)
    return min(((name, predict(name, n, p, outer, segment_bytes)) for name in FLAT),
               key=lambda t: t[1])


def fit_line(sizes, times) -> tuple[float, float]:
    """Least squares ``t = alpha + n beta`` with relative errors (so small and
    large messages count alike); both clipped at zero."""
    sizes = np.asarray(sizes, dtype=float)
    times = np.asarray(times, dtype=float)
    weights = 1.0 / times
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, times * weights, rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def measure_pingpong(comm, sizes, iters: int = 50, peer: int = 1) -> list[float]:
    """One-way time per size between rank 0 and ``peer`` (on every rank)."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    out = []
    for nbytes in sizes:
        buf = np.zeros(nbytes, dtype=np.uint8)
        reps = max(5, iters if nbytes <= 1 << 16 else iters // 10)
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(reps):
            if rank == 0:
                comm.Send(buf, peer, 7)
                comm.Recv(buf, peer, 7)
            elif rank == peer:
                comm.Recv(buf, 0, 7)
                comm.Send(buf, 0, 7)
        out.append((MPI.Wtime() - t0) / reps / 2)
    return comm.bcast(out if rank == 0 else None, root=0)


def measure_reduction(sizes, dtype=np.float32, iters: int = 20) -> list[float]:
    """Seconds for ``np.add(a, b, out=a)`` on ``n``-byte arrays."""
    import time

    out = []
    for nbytes in sizes:
        a = np.ones(max(1, nbytes // np.dtype(dtype).itemsize), dtype=dtype)
        b = np.ones_like(a)
        np.add(a, b, out=a)
        t0 = time.perf_counter()
        for _ in range(iters):
            np.add(a, b, out=a)
        out.append((time.perf_counter() - t0) / iters)
    return out


def node_layout(comm) -> tuple[int, Optional[int]]:
    """(ranks on rank 0's node, the lowest rank on another node or None)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local = node.Get_size()
    leader = comm.Get_rank() if node.Get_rank() == 0 else None
    node.Free()
    leaders = [r for r in comm.allgather(leader) if r is not None]
    return local, (leaders[1] if len(leaders) > 1 else None)


def fit(comm, two_level: bool = False) -> Params:
    """alpha and beta from ping-pong between ranks 0 and 1; gamma from np.add.

    With ``two_level`` the intra-node link is measured between rank 0 and
    a rank on its node, and the inter-node link between rank 0 and the
    first rank of another node (``alpha_inter``, ``beta_inter``)."""
    sizes = [8 << k for k in range(0, 20, 2)]  # 8 B .. 2 MiB
    if comm.Get_size() < 2:
        raise ValueError("fitting alpha and beta needs at least 2 ranks")
    local, remote = node_layout(comm) if two_level else (comm.Get_size(), None)
    alpha, beta = fit_line(sizes, measure_pingpong(comm, sizes, peer=1 if local > 1 else remote))
    alpha_inter = beta_inter = None
    if remote is not None:
        alpha_inter, beta_inter = fit_line(sizes, measure_pingpong(comm, sizes, peer=remote))
    big = [1 << k for k in range(16, 24, 2)]
    gamma = fit_line(big, measure_reduction(big))[1]
    overhead, op_overhead = measure_overheads()
    # the ping-pong's one-way time holds the software of a send and a receive
    alpha = max(alpha - 2 * overhead, 0.0)
    if alpha_inter is not None:
        alpha_inter = max(alpha_inter - 2 * overhead, 0.0)
    return comm.bcast(Params(alpha, beta, gamma, alpha_inter, beta_inter, overhead,
                             op_overhead), root=0)


def measure_overheads(iters: int = 20000) -> tuple:
    """(o, o_op): seconds of an mpi4py ``Sendrecv`` call whose peers are
    ``MPI.PROC_NULL`` (the software of posting a message, nothing on the
    wire), and of a ufunc call on one element (the fixed cost of a local
    action); the best of five batches."""
    import time

    from mpi4py import MPI

    buf, other = np.zeros(1, np.float32), np.zeros(1, np.float32)
    spec, ospec = [buf, MPI.FLOAT], [other, MPI.FLOAT]
    sendrecv, nobody, add = MPI.COMM_SELF.Sendrecv, MPI.PROC_NULL, np.add
    best_msg = best_op = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            sendrecv(spec, nobody, 0, ospec, nobody, 0)
        best_msg = min(best_msg, (time.perf_counter() - t0) / iters)
        t0 = time.perf_counter()
        for _ in range(iters):
            add(buf, other, buf)
        best_op = min(best_op, (time.perf_counter() - t0) / iters)
    # one Sendrecv call posts two messages (a send and a receive)
    return best_msg / 2, best_op


def report(comm, sizes, iters: int = 10, json_path: Optional[str] = None,
           two_level: bool = False) -> int:
    """Fit the parameters, then print predicted against measured time per
    algorithm and size (rank 0), and optionally write both to JSON.

    ``two_level``: separate intra- and inter-node links; flat algorithms are
    predicted with the inter-node link (their slowest hop), hierarchical
    with both."""
    import json

    from ..api import DEFAULT_SEGMENT_BYTES
    from .bench import bench

    params = fit(comm, two_level)
    p = comm.Get_size()
    local = node_layout(comm)[0] if two_level else p
    flat = params
    if params.alpha_inter is not None:
        flat = Params(params.alpha_inter, params.beta_inter, params.gamma)
    from ..registry import ALGORITHMS, FLAT_ALGORITHMS

    algorithms = list(ALGORITHMS if two_level else FLAT_ALGORITHMS)
    results = bench(comm, sizes, algorithms, iters=iters, warmup=2, progress=False)
    rows = []
    for r in results:
        if r.algorithm == "hierarchical":
            predicted = predict(r.algorithm, r.size, p, params, DEFAULT_SEGMENT_BYTES,
                                ranks_per_node=local)
        else:
            predicted = predict(r.algorithm, r.size, p, flat, DEFAULT_SEGMENT_BYTES)
        rows.append({"size": r.size, "algorithm": r.algorithm, "measured_us": r.time_avg_us,
                     "predicted_us": predicted * 1e6})
    if comm.Get_rank() == 0:
        if params.alpha_inter is not None:
            print(f"# inter-node: alpha = {params.alpha_inter * 1e6:.2f} us, beta = "
                  f"{1e-9 / params.beta_inter if params.beta_inter else float('inf'):.2f} GB/s; "
                  f"{local} ranks on rank 0's node")
        print(f"# o = {params.overhead * 1e6:.2f} us per message posted, o_op = "
              f"{params.op_overhead * 1e6:.2f} us per local action")
        print(f"# alpha = {params.alpha * 1e6:.2f} us, beta = {1e-9 / params.beta if params.beta else float('inf'):.2f} GB/s "
              f"(1/beta), gamma = {1e-9 / params.gamma if params.gamma else float('inf'):.2f} GB/s (1/gamma); "
              f"{p} ranks")
        print(f"{'size(B)':>10} {'algorithm':>20} {'measured(us)':>13} {'predicted(us)':>14} {'meas/pred':>10}")
        for row in rows:
            ratio = row["measured_us"] / row["predicted_us"] if row["predicted_us"] else float("nan")
            print(f"{row['size']:>10} {row['algorithm']:>20} {row['measured_us']:>13.1f} "
                  f"{row['predicted_us']:>14.1f} {ratio:>10.2f}")
        by_size = {}
        for row in rows:
            by_size.setdefault(row["size"], []).append(row)
        agree = sum(min(v, key=lambda r: r["measured_us"])["algorithm"]
                    == min(v, key=lambda r: r["predicted_us"])["algorithm"] for v in by_size.values())
        print(f"# the model picks the measured fastest algorithm at {agree} of {len(by_size)} sizes")
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"params": params.as_dict(), "ranks": p, "rows": rows}, f, indent=1)
    return 0
