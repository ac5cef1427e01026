"""Where a short all-reduce of cupy arrays spends its time, part by part (GPU).

On 2 ranks, each with a GPU through cupy, side by side in one launch:

* whole calls at 8 B (2 float32): ``mar.allreduce`` under ``auto``,
  ``recursive_doubling`` and ``ring``, repeated on the same arrays, and the
  vendor's ``MPI.Allreduce`` on host copies (``cupy.asnumpy`` in, ``set`` out)
  and on host arrays;
* the pieces a staged call is made of, each alone: the device's and the
  stream's synchronize, a device-to-host copy into pinned memory, a
  host-to-device copy, a cupy add into an output array, ``cupy.shares_memory``
  of two distinct arrays;
* rank 0's profile of 300 ``auto`` calls (cProfile, the 25 functions of most
  time of their own);
* where torch with CUDA imports: ``dist.all_reduce`` of an 8-byte CUDA tensor
  on this library's torch backend, and its profile likewise.

Each time: the mean per call over 300 calls after 30 warm-up calls, the best
of 3 rounds (rank 0's).  Run (the figures in docs/gpu.md)::

    mpiexec -n 2 python benchmarks/device_parts.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import backend

comm = MPI.COMM_WORLD
if comm.Get_size() != 2:
    raise SystemExit("run on 2 ranks: mpiexec -n 2 python benchmarks/device_parts.py")
backend.select_device(comm, "cuda")
import cupy as cp  # noqa: E402 - after the device is chosen

N, WARM, ROUNDS = 300, 30, 3
send = cp.ones(2, cp.float32)
recv = cp.empty_like(send)
other = cp.ones(2, cp.float32)
host = np.ones(2, np.float32)
host_out = np.empty_like(host)
pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(8), np.float32, count=2)


def timed(fn) -> float:
    """Best of ROUNDS of the mean of N calls (microseconds), after WARM calls."""
    for _ in range(WARM):
        fn()
    best = float("inf")
    for _ in range(ROUNDS):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(N):
            fn()
        best = min(best, (time.perf_counter() - t0) / N * 1e6)
    return best


def vendor_staged():
    h = cp.asnumpy(send)
    comm.Allreduce(h, host_out, MPI.SUM)
    recv.set(host_out)


rows = [(f"mar.allreduce {name}", (lambda name=name: mar.allreduce(send, recv, MPI.SUM, comm=comm,
                                                                  algorithm=name)))
        for name in ("auto", "recursive_doubling", "ring")]
rows += [("MPI.Allreduce on host copies", vendor_staged),
         ("MPI.Allreduce on host arrays", lambda: comm.Allreduce(host, host_out, MPI.SUM)),
         ("cupy Device().synchronize()", lambda: cp.cuda.Device().synchronize()),
         ("cupy stream synchronize()", lambda: cp.cuda.get_current_stream().synchronize()),
         ("device-to-host 8 B into pinned (get(out=))", lambda: send.get(out=pinned)),
         ("host-to-device 8 B (set())", lambda: recv.set(pinned)),
         ("cupy.add(send, other, out=recv)", lambda: cp.add(send, other, out=recv)),
         ("cupy.shares_memory(send, recv)", lambda: cp.shares_memory(send, recv)),
         ("the backend's shares_memory (bounds first)",
          lambda: backend.backend_for(send).shares_memory(send, recv))]
results = [(label, timed(fn)) for label, fn in rows]
check = cp.asnumpy(recv)



def profiled(fn) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(N):
        fn()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


profiles = [("auto calls", profiled(lambda: mar.allreduce(send, recv, MPI.SUM, comm=comm)))]
try:
    import torch
    import torch.distributed as dist
    import mpi_allreduce.torch  # noqa: F401 - registers the backend
    usable = torch.cuda.is_available()
except ImportError:
    usable = False
if usable:
    dist.init_process_group("mpi_allreduce")
    tensor = torch.ones(2, device=torch.device("cuda", cp.cuda.Device().id))

    def torch_call():
        dist.all_reduce(tensor)
        torch.cuda.synchronize()
    results.append(("torch dist.all_reduce, CUDA tensor (ours)", timed(torch_call)))
    profiles.append(("torch dist.all_reduce calls", profiled(torch_call)))
if comm.Get_rank() == 0:
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; cupy {cp.__version__}; "
          f"{MPI.Get_library_version().splitlines()[0].strip()}; 2 ranks; "
          f"path: {type(backend.backend_for(send)).__name__}")
    print(f"# mean per call (us) of {N} calls after {WARM} warm-up, best of {ROUNDS}; rank 0")
    for label, us in results:
        print(f"{label:48s} {us:10.2f}")
    print(f"# last result {check.tolist()} (expected [2.0, 2.0])")
    for label, text in profiles:
        print(f"# profile of {N} {label} (rank 0), by time of their own")
        print(text)
sys.stdout.flush()
if usable:
    dist.destroy_process_group()
