"""GPU tests: cupy buffers, staged and direct, and the busy-stream case.

Skipped (with the reason) where cupy or a GPU is missing; on a GPU machine
tests/test_launch.py runs them under mpiexec like every MPI test.  The
direct path runs only where the MPI is CUDA-aware (MPIX query)."""

from __future__ import annotations

import numpy as np
import pytest

import mpi_allreduce as mar
from mpi_allreduce import backend, config

from .helpers import VARIANTS, VARIANT_IDS, expected, mine

cp = pytest.importorskip("cupy", reason="cupy is not installed (pip install 'mpi_allreduce[gpu]')")
try:
    GPUS = cp.cuda.runtime.getDeviceCount()
except Exception:  # noqa: BLE001 - no driver
    GPUS = 0
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(GPUS == 0, reason="no GPU visible to cupy")]

PATHS = ["staged", "direct"]


@pytest.fixture(scope="module", autouse=True)
def gpu_device():
    """Each rank takes its GPU once, on every rank together (a collective on
    the world: a test of a sub-communicator runs on some ranks only)."""
    from mpi4py import MPI

    backend.select_device(MPI.COMM_WORLD, "cuda")


@pytest.fixture(params=PATHS)
def gpu_path(request, monkeypatch):
    if request.param == "direct":
        config.refresh()
        if not backend.cuda_aware_support()[0]:
            pytest.skip("the MPI library is not CUDA-aware")
    monkeypatch.setenv(config.CUDA_AWARE_ENV, "1" if request.param == "direct" else "0")
    config.refresh()
    yield request.param
    monkeypatch.delenv(config.CUDA_AWARE_ENV)
    config.refresh()


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("float16", "sum"), ("int64", "max"),
                                      ("complex64", "prod"), ("bool", "lxor"), ("float64", "avg")])
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_cupy_buffers(comm, gpu_path, variant, dtype, op, in_place):
    _, algorithm, options = variant
    count = 3 * comm.Get_size() + 2
    data = cp.asarray(mine(comm, dtype, op, count))
    if in_place:
        out = mar.allreduce(mar_in_place(), data, op, comm=comm, algorithm=algorithm, **options)
    else:
        out = mar.allreduce(data, None, op, comm=comm, algorithm=algorithm, **options)
    assert isinstance(out, cp.ndarray)
    np.testing.assert_array_equal(cp.asnumpy(out), expected(comm, dtype, op, count))


def mar_in_place():
    from mpi4py import MPI

    return MPI.IN_PLACE


@pytest.mark.parametrize("algorithm", list(mar.ALGORITHMS))
def test_busy_stream(comm, gpu_path, algorithm):
    """sendbuf is still being written by a kernel on another stream."""
    n = 1 << 20
    target = mine(comm, "float32", "sum", n)
    send = cp.zeros(n, dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        big = cp.random.random((2048, 2048), dtype=cp.float32)
        for _ in range(4):
            big = big @ big  # keep the stream busy
        send[...] = cp.asarray(target)
    out = mar.allreduce(send, comm=comm, algorithm=algorithm)
    np.testing.assert_array_equal(cp.asnumpy(out), expected(comm, "float32", "sum", n))


@pytest.mark.parametrize("persistent", [False, True], ids=["iallreduce", "persistent"])
def test_cupy_nonblocking(comm, gpu_path, persistent):
    """Several calls in flight on device buffers (staging slots of their
    own), short ones progressed by the caller, long ones by the thread."""
    p = comm.Get_size()
    counts = [3 * p + 2, 1 << 17, 5]
    sends = [cp.asarray(mine(comm, "float32", "sum", n)) for n in counts]
    outs = [cp.zeros_like(s) for s in sends]
    if persistent:
        requests = [mar.allreduce_init(s, o, "sum", comm=comm) for s, o in zip(sends, outs)]
        for _ in range(2):
            for r in requests:
                r.start()
            mar.waitall(requests[::-1])
        for r in requests:
            r.free()
    else:
        mar.waitall([mar.iallreduce(s, o, "sum", comm=comm, segment_size=4096)
                     for s, o in zip(sends, outs)][::-1])
    for n, out in zip(counts, outs):
        np.testing.assert_array_equal(cp.asnumpy(out), expected(comm, "float32", "sum", n))


def test_cupy_halves_and_fusion(comm, gpu_path):
    from mpi4py import MPI

    p, rank = comm.Get_size(), comm.Get_rank()
    data = mine(comm, "int64", "sum", 4 * p)
    want = np.empty(4, np.int64)
    comm.Reduce_scatter_block(data, want, MPI.SUM)
    got = mar.reduce_scatter(cp.asarray(data), None, "sum", comm=comm)
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    gathered = mar.allgather(cp.arange(3) + 10 * rank, comm=comm)
    np.testing.assert_array_equal(cp.asnumpy(gathered),
                                  np.arange(3)[None, :] + 10 * np.arange(p)[:, None])
    arrays = [cp.full(s, rank + 1, cp.float32) for s in [(7,), (300, 3), (1 << 16,), ()]]
    mar.Fusion(comm, op="sum", bucket_bytes=4096).allreduce(arrays)
    for a in arrays:
        assert (cp.asnumpy(a) == p * (p + 1) / 2).all()


def test_empty_cupy_blocks_stay_on_the_device(comm, gpu_path):
    """An empty cupy array has the null pointer, which the CUDA runtime calls
    host memory: it is still a device buffer, so an empty block of a
    vector Allgatherv or of a zero-length all-reduce is accepted beside a
    non-empty device buffer (found by verify --device cuda on a GPU)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    blocks = [r % 2 for r in range(size)]  # (rank 0's block empty)
    part = cp.full(blocks[rank], rank, dtype=cp.float32)
    got = mar.allgather(part, cp.zeros(sum(blocks), cp.float32), blocks, comm=comm)
    want = np.concatenate([np.full(b, r, np.float32) for r, b in enumerate(blocks)])
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    empty = mar.allreduce(cp.zeros(0, cp.float32), cp.zeros(0, cp.float32), comm=comm)
    assert isinstance(empty, cp.ndarray) and empty.size == 0
    assert isinstance(backend.as_array(cp.zeros(0, cp.int8)), cp.ndarray)
