"""The cost model: schedules timed on a fitted machine.

A message of n bytes costs ``alpha + n * beta`` on the wire -- or, once
fitted, the time measured for that size (a curve: MPI's protocols make it
no straight line) -- and ``o`` of software on each side when posted; a
local reduction of n bytes costs ``o_op + n * gamma``; a call starts with
``call_overhead``.  :func:`predict` does not restate a formula per
algorithm: it builds every rank's schedule and times them against each
other with :func:`mpi_allreduce.simulate.simulate` (no data), so what it
counts -- messages, segments, folds, the critical path through the root of
the driver or the leaders of hierarchical, the ports, ranks and cores that
messages share -- is what the executor runs.  :func:`fit` measures each
part with nothing else running (see its docstring); :func:`report` sets
the predictions beside measured times.  :mod:`.scale` gives the same
model's times in closed form for thousands of ranks.

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
from typing import Optional

import numpy as np

from .. import registry
from ..simulate import Machine, simulate
from ..topology import placement


@functools.lru_cache(maxsize=4096)
def predict(algorithm: str, n: float, p: int, prm: Machine, segment_bytes: Optional[int] = None,
            ranks_per_node: Optional[int] = None, itemsize: int = 4,
            nodes: Optional[tuple] = None) -> float:
    """Predicted seconds for an ``n``-byte all-reduce on ``p`` ranks: the
    schedules of all ranks timed on the machine ``prm`` (float32 elements
    by default).  ``nodes`` (the node of every rank) or ``ranks_per_node``
    (blocks of consecutive ranks) place the ranks on nodes, in place of
    ``prm``'s own: messages between nodes take the inter-node link and
    share their node's port."""
    if p <= 1 or n <= 0:
        return 0.0
    count = max(1, int(n) // itemsize)
    segment = max(1, (segment_bytes or (1 << 62)) // itemsize)
    if nodes is None and ranks_per_node and ranks_per_node < p:
        nodes = tuple((r // ranks_per_node) * ranks_per_node for r in range(p))
    options = None
    if algorithm == "hierarchical":
        layout = nodes or (0,) * p
        leaders = len(set(layout))
        inner = best_flat(n, leaders, prm, segment_bytes)[0] if leaders > 1 else "ring"
        options = {"nodes": layout, "inner": inner}
    dtype = {1: "u1", 2: "u2", 4: "float32", 8: "float64"}[itemsize]
    if nodes is not None and len(set(nodes)) == 1:
        nodes = None
    return simulate(algorithm, p, count, dtype, "sum", segment_size=segment, options=options,
                    machine=prm.placed(nodes), data=False).seconds


def best_flat(n: float, p: int, prm: Machine, segment_bytes: Optional[int] = None):
    """(name, seconds) of the cheapest of the registry's
    ``INNER_CANDIDATES`` by the model, on ``p`` ranks one a node (the
    inter-node link)."""
    if p <= 1:
        return "none", 0.0
    alpha, beta = prm.link(True)
    outer = Machine(alpha=alpha, beta=beta, gamma=prm.gamma, overhead=prm.overhead,
                    op_overhead=prm.op_overhead)
    return min(((name, predict(name, n, p, outer, segment_bytes))
                for name in registry.INNER_CANDIDATES), key=lambda t: t[1])


def fit_line(sizes, times) -> tuple[float, float]:
    """Least squares ``t = alpha + n beta`` with relative errors (so small and
    large messages count alike); both clipped at zero."""
    sizes = np.asarray(sizes, dtype=float)
    times = np.asarray(times, dtype=float)
    weights = 1.0 / times
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, times * weights, rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def fit_link(sizes, times, large: int = 1 << 17) -> tuple[float, float]:
    """(alpha + fixed software, beta) of ``t = alpha + n beta``: beta the
    slope over the sizes from ``large`` bytes on (MPI changes protocol
    above some kilobytes, so one line through all sizes fits neither end),
    alpha the median of what is left of the small sizes' times."""
    sizes = np.asarray(sizes, dtype=float)
    times = np.asarray(times, dtype=float)
    big = sizes >= large
    beta = max(float(np.polyfit(sizes[big], times[big], 1)[0]), 0.0) if big.sum() >= 2 else \
        fit_line(sizes, times)[1]
    small = sizes <= 4096
    alpha = float(np.median(times[small] - sizes[small] * beta)) if small.any() else \
        fit_line(sizes, times)[0]
    return max(alpha, 0.0), beta


#: bytes the large-message measurements walk through, beyond the last-level
#: cache of common CPUs: long vectors stream from memory in the algorithms too
STREAM_BYTES = 64 << 20


def measure_exchange(comm, sizes, pair, iters: int = 40, passes: int = 3,
                     both_ways: bool = True, fresh: bool = False) -> list[float]:
    """Seconds of one ``Sendrecv`` of n bytes each way between the two
    ranks of ``pair`` (as an algorithm's rounds run: both directions at
    once); the slower rank's mean, the median of ``passes``, per size, on
    every rank (the others wait).

    Not ``both_ways``: a ping-pong instead, half its round trip (a message
    with the link to itself).  Messages of 64 KiB and more come from
    successive places of a long buffer, as the segments of a long vector
    do.  ``fresh``: the sender writes the message just before it sends it
    (as an algorithm sends what it has just reduced or received), and the
    time of the write alone is taken off."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    peer = (pair[1] if rank == pair[0] else pair[0]) if rank in pair else None
    first = peer is not None and rank < peer

    def timed(call, reps):
        comm.Barrier()
        t0 = MPI.Wtime()
        if peer is not None:
            for k in range(reps):
                call(k)
        return comm.allreduce((MPI.Wtime() - t0) / reps, op=MPI.MAX)

    out = []
    for nbytes in sizes:
        span = nbytes if fresh or nbytes < 1 << 16 else max(nbytes, STREAM_BYTES)
        send, recv = np.ones(span, np.uint8), np.zeros(span, np.uint8)
        places = max(1, span // nbytes)
        reps = max(5, iters * 10 if nbytes <= 1 << 12 else iters if nbytes <= 1 << 16
                   else iters // 8)

        def message(k):
            at = (k % places) * nbytes
            block, into = send[at:at + nbytes], recv[at:at + nbytes]
            if fresh:
                block.fill(k & 127)
            if both_ways:
                comm.Sendrecv(block, peer, 7, into, peer, 7)
            elif first:
                comm.Send(block, peer, 7)
                comm.Recv(into, peer, 7)
            else:
                comm.Recv(into, peer, 7)
                comm.Send(block, peer, 7)

        def write(k):
            send[:nbytes].fill(k & 127)

        samples = []
        for _ in range(passes + 1):  # the first pass warms up: pages, connections
            t = timed(message, reps) - (timed(write, reps) if fresh else 0.0)
            samples.append(max(t, 0.0) / (1 if both_ways else 2))
        out.append(float(np.median(samples[1:])))
    return out


def measure_reduction(sizes, dtype=np.float32, iters: int = 20) -> list[float]:
    """Seconds for ``np.add(a, b, out=a)`` on ``n``-byte arrays, taken in
    turn from successive places of long arrays (as a long vector's
    segments are)."""
    import time

    out = []
    itemsize = np.dtype(dtype).itemsize
    for nbytes in sizes:
        n = max(1, nbytes // itemsize)
        span = max(n, STREAM_BYTES // itemsize // 2)
        a, b = np.ones(span, dtype=dtype), np.ones(span, dtype=dtype)
        places = span // n
        np.add(a, b, out=a)
        t0 = time.perf_counter()
        for k in range(iters):
            at = (k % places) * n
            np.add(a[at:at + n], b[at:at + n], out=a[at:at + n])
        out.append((time.perf_counter() - t0) / iters)
    return out


def node_cores(comm, nodes: tuple) -> int:
    """The cores rank 0's node's ranks may run on: the union of their CPU
    affinities (each rank may be bound to one)."""
    import os

    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    everyone = comm.allgather(mine)
    cores = set()
    for r, n in enumerate(nodes):
        if n == nodes[0]:
            cores.update(everyone[r])
    return max(1, len(cores))


def fit(comm, two_level: bool = False) -> Machine:
    """The machine's parameters, each measured with nothing else running
    (the simulator adds the sharing: of a node's port, and of its cores
    when its ranks outnumber them).

    * a message's time against its size: ``Sendrecv`` exchanges between
      ranks 0 and 1 (on one node with ``two_level``), less o for the two
      posts, kept as a curve and summed up as alpha (small sizes) and beta
      (the slope from 128 KiB on);
    * across nodes (``two_level``): a ping-pong between the first ranks of
      the first two nodes, one message at a time on the network
      (``alpha_inter``, ``beta_inter``, ``curve_inter``; the simulator
      queues concurrent messages on the nodes' ports), and whether an
      exchange both ways takes twice that (``half_duplex``);
    * the same inside the node with the sender writing each message just
      before it sends it (``curve_fresh``: on some launches of some
      machines such messages cost several times more);
    * o: a ``Sendrecv`` with nobody (``MPI.PROC_NULL``), o_op a ufunc on one
      element, gamma ``np.add`` on long vectors, on rank 0;
    * cores: those rank 0's node's ranks may run on;
    * the eager limit: where the curve steps up (:func:`eager_limit`);
    * the software of a call outside its rounds (:func:`measure_call`)."""
    if comm.Get_size() < 2:
        raise ValueError("fitting alpha and beta needs at least 2 ranks")
    sizes = [8 << k for k in range(0, 20)]  # 8 B .. 4 MiB
    p = comm.Get_size()
    nodes = placement(comm, "the model's fit: where the ranks run")[0] if two_level \
        else (0,) * p
    cores = node_cores(comm, nodes)
    overhead = op_overhead = gamma = 0.0
    if comm.Get_rank() == 0:
        overhead, op_overhead = measure_overheads()
        big = [1 << k for k in range(16, 24, 2)]
        gamma = fit_line(big, measure_reduction(big))[1]
    overhead, op_overhead, gamma = comm.bcast((overhead, op_overhead, gamma), root=0)

    by_node: dict = {}
    for r, n in enumerate(nodes):
        by_node.setdefault(n, []).append(r)
    members = by_node[nodes[0]]
    other = min((m[0] for n, m in by_node.items() if n != nodes[0]), default=None)

    def link(pair, both_ways=True, fresh=False):
        times = [max(t - 2 * overhead, 0.0) for t in
                 measure_exchange(comm, sizes, pair, both_ways=both_ways, fresh=fresh)]
        return fit_link(sizes, times) + (tuple(zip(sizes, times)),)

    alpha_inter = beta_inter = curve_inter = None
    half_duplex = False
    if other is not None:  # a message alone on the network: the ports' sharing is simulated
        alpha_inter, beta_inter, curve_inter = link((0, other), both_ways=False)
        # both ways at once: twice a message's time when the rank moves one at a time
        large = [n for n in sizes if n >= 1 << 20]
        both = measure_exchange(comm, large, (0, other))
        alone = [t for n, t in curve_inter if n >= 1 << 20]
        half_duplex = bool(np.median(np.divide(both, alone)) > 1.5)
    if len(members) > 1:
        alpha, beta, curve = link(tuple(members[:2]))
        curve_fresh = link(tuple(members[:2]), fresh=True)[2]
    else:  # one rank a node: the only link is across
        alpha, beta, curve, curve_fresh = alpha_inter, beta_inter, curve_inter, None
    call = measure_call(comm, (0, members[1] if len(members) > 1 else other))
    return comm.bcast(Machine(alpha=alpha, beta=beta, gamma=gamma, alpha_inter=alpha_inter,
                              beta_inter=beta_inter, overhead=overhead, op_overhead=op_overhead,
                              curve=curve, curve_inter=curve_inter, cores=cores,
                              curve_fresh=curve_fresh, eager_bytes=eager_limit(curve),
                              call_overhead=call, half_duplex=half_duplex), root=0)


def measure_call(comm, pair, iters: int = 2000) -> float:
    """Seconds of one call's software outside its rounds: an all-reduce of
    one float by recursive doubling between the ranks of ``pair`` (on a
    communicator of their own) against its one round done by hand (a
    ``Sendrecv`` and an ``np.add``); the best of three batches."""
    from mpi4py import MPI

    from ..api import allreduce
    from ..engine import blocking_collective

    rank = comm.Get_rank()
    sub = blocking_collective(comm, lambda: comm.Split(0 if rank in pair else MPI.UNDEFINED, rank),
                              "MPI_Comm_split (the model's pairs)")
    best = float("inf")
    if sub != MPI.COMM_NULL:
        peer = 1 - sub.Get_rank()
        x, y, t = np.ones(1, np.float32), np.zeros(1, np.float32), np.zeros(1, np.float32)

        def ours():
            allreduce(x, y, comm=sub, algorithm="recursive_doubling")

        def by_hand():
            sub.Sendrecv(x, peer, 7, t, peer, 7)
            np.add(x, t, out=y)

        for _ in range(3):
            times = []
            for call in (ours, by_hand):
                for _ in range(iters // 10):
                    call()
                sub.Barrier()
                t0 = MPI.Wtime()
                for _ in range(iters):
                    call()
                times.append(sub.allreduce((MPI.Wtime() - t0) / iters, op=MPI.MAX))
            best = min(best, max(times[0] - times[1], 0.0))
        sub.Free()
    return comm.allreduce(best if best < float("inf") else 0.0, op=MPI.MAX)


def eager_limit(curve: tuple) -> Optional[int]:
    """The longest message sent eagerly, read off a measured curve: the
    size before the first step up by half or more (the change to a
    rendezvous protocol), among sizes up to 64 KiB; None if there is none."""
    for (n0, t0), (n1, t1) in zip(curve, curve[1:]):
        if n1 > 1 << 16:
            break
        if t0 > 0 and t1 > 1.5 * t0:
            return int(n0)
    return None


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


def report(comm, sizes, iters: int = 20, json_path: Optional[str] = None,
           two_level: bool = False, repeats: int = 3, tolerance: float = 0.25) -> int:
    """Fit the parameters, then print predicted against measured time per
    algorithm and size (rank 0), how many points lie within ``tolerance``,
    and optionally write both to JSON.

    ``two_level``: ranks on several nodes (``MPI_COMM_TYPE_SHARED``): the
    fit has intra- and inter-node links and every algorithm is predicted on
    the real layout, messages across nodes sharing their node's port."""
    import json

    from ..api import DEFAULT_SEGMENT_BYTES
    from ..registry import ALGORITHMS
    from .bench import bench

    params = fit(comm, two_level)
    p = comm.Get_size()
    nodes = placement(comm, "the model's report: where the ranks run")[0] if two_level else None
    layout = nodes or (0,) * p
    local = layout.count(layout[0])  # ranks on rank 0's node
    results = bench(comm, sizes, list(ALGORITHMS), iters=iters, warmup=2, repeats=repeats,
                    progress=False)
    rows = []
    for r in results:
        predicted = predict(r.algorithm, r.size, p, params, DEFAULT_SEGMENT_BYTES, nodes=nodes)
        rows.append({"size": r.size, "algorithm": r.algorithm, "measured_us": r.time_avg_us,
                     "predicted_us": predicted * 1e6})
    if comm.Get_rank() != 0:
        return 0
    print(f"# {p} ranks, {local} on rank 0's node, {max(1.0, local / params.cores):.2g} ranks "
          f"a core there ({params.cores} cores); {iters} iterations x {repeats} repeats a point "
          f"(median)")
    if params.alpha_inter is not None:
        print(f"# across nodes: alpha = {params.alpha_inter * 1e6:.2f} us, beta = "
              f"{_rate(params.beta_inter)} GB/s a port, "
              f"{'half' if params.half_duplex else 'full'} duplex a rank")
    print(f"# o = {params.overhead * 1e6:.2f} us per message posted, o_op = "
          f"{params.op_overhead * 1e6:.2f} us per local action, "
          f"{params.call_overhead * 1e6:.2f} us per call; sends up to {params.eager_bytes} B eager")
    print(f"# alpha = {params.alpha * 1e6:.2f} us, beta = {_rate(params.beta)} GB/s (1/beta), "
          f"gamma = {_rate(params.gamma)} GB/s (1/gamma)")
    print(f"{'size(B)':>10} {'algorithm':>20} {'measured(us)':>13} {'predicted(us)':>14} "
          f"{'meas/pred':>10}")
    for row in rows:
        ratio = row["measured_us"] / row["predicted_us"] if row["predicted_us"] else float("nan")
        row["within"] = abs(ratio - 1) <= tolerance
        print(f"{row['size']:>10} {row['algorithm']:>20} {row['measured_us']:>13.1f} "
              f"{row['predicted_us']:>14.1f} {ratio:>10.2f}" + ("" if row["within"] else "  miss"))
    hits = sum(row["within"] for row in rows)
    print(f"# within +-{tolerance:.0%}: {hits} of {len(rows)} points ({hits / len(rows):.0%})")
    by_size: dict = {}
    for row in rows:
        by_size.setdefault(row["size"], []).append(row)
    agree = sum(min(v, key=lambda r: r["measured_us"])["algorithm"]
                == min(v, key=lambda r: r["predicted_us"])["algorithm"] for v in by_size.values())
    print(f"# the model picks the measured fastest algorithm at {agree} of {len(by_size)} sizes")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"params": params.parameters(), "ranks": p, "nodes": nodes, "rows": rows,
                       "within": hits / len(rows), "picked": agree, "sizes": len(by_size)},
                      f, indent=1)
    return 0


def _rate(per_byte: Optional[float]) -> str:
    return f"{1e-9 / per_byte:.2f}" if per_byte else "inf"
