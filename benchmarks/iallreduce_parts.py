"""Where a repeated 8-byte ``iallreduce`` + ``wait`` spends its time, part by part.

Side by side in one launch, on 2 ranks, on the same buffers, each row one
more piece of the kept call taken away (the library's internals are used
directly, so this reads them as they are):

* ``iallreduce``: ``mar.iallreduce(send, recv).wait()``, the whole call;
* ``kept start + wait``: the kept call's start (``Remembered.run``: the
  guard, the tag claim, the messages, the request) and ``wait()``, without
  the public function and its look-up of the kept call;
* ``kept start + raw wait``: the same start, then ``MPI_Waitall`` and the
  add by hand (no ``wait()`` method);
* ``claim + raw``: the context's tag claim, ``Irecv`` + ``Isend`` of the
  kept call's messages, ``MPI_Waitall``, the add: no guard, no request;
* ``raw``: the same messages with a fixed tag, ``MPI_Waitall``, the add --
  the least any non-blocking call of this exchange costs in Python.

Each row: the best of 3 batches of 20,000 calls, in 3 rounds (rank 0's
mean per call).  Run::

    mpiexec -n 2 python benchmarks/iallreduce_parts.py | tee benchmarks/results/iallreduce-parts-np2.txt
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce.context import CALLS

comm = MPI.COMM_WORLD
if comm.Get_size() != 2:
    raise SystemExit("run on 2 ranks: mpiexec -n 2 python benchmarks/iallreduce_parts.py")
send = np.ones(2, np.float32)
recv = np.empty_like(send)
for _ in range(5):
    mar.iallreduce(send, recv, MPI.SUM, comm=comm).wait()
kept = next(v for k, v in CALLS.items() if isinstance(k, tuple))
start = kept.run
probe = start()
probe.wait()
op = probe._op
context, posts, after = op.context, op.round[3], op.round[2]
if op.round[0] or op.round[1]:
    raise SystemExit("the kept call is not one round of messages and an add")
waitall = MPI.Request.Waitall


def whole():
    mar.iallreduce(send, recv, MPI.SUM, comm=comm).wait()


def kept_wait():
    start().wait()


def kept_raw():
    request = start()
    waitall(op.live)
    for function, args in after:
        function(*args)
    op.unwaited, op.done, request._state = False, True, "complete"


def claim_raw():
    tag = context.claim(op, 12345, False)
    waitall([call(spec, peer, tag) for call, spec, peer in posts])
    for function, args in after:
        function(*args)


def raw():
    waitall([call(spec, peer, 77) for call, spec, peer in posts])
    for function, args in after:
        function(*args)


ROWS = [("iallreduce", whole), ("kept start + wait", kept_wait),
        ("kept start + raw wait", kept_raw), ("claim + raw", claim_raw), ("raw", raw)]
N = 20000
best: dict = {}
for _ in range(3):
    for name, call in ROWS:
        for _ in range(1000):
            call()
        times = []
        for _ in range(3):
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(N):
                call()
            times.append((time.perf_counter() - t) / N * 1e6)
        best.setdefault(name, []).append(min(times))
if comm.Get_rank() == 0:
    print(f"# 8 B float32 sum on 2 ranks, {MPI.Get_library_version().splitlines()[0]}")
    print("# us per call, best of 3 batches of 20000, three rounds; then the step to the row below")
    medians = {name: sorted(v)[1] for name, v in best.items()}
    names = [name for name, _ in ROWS]
    for i, name in enumerate(names):
        step = medians[name] - medians[names[i + 1]] if i + 1 < len(names) else medians[name]
        print(f"{name:>22} " + " ".join(f"{t:6.2f}" for t in best[name])
              + f"   median {medians[name]:5.2f}   step {step:5.2f}")
