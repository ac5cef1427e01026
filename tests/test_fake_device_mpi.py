"""The GPU code paths, exercised on the CPU with a FAKE device backend.

These are test doubles, not a GPU: "device" arrays are numpy arrays of a
subclass, and the fake device defers every write a "kernel" makes until
the stream is synchronized, the way a GPU would still be computing.  What
they can show without a GPU:

* staged path (MPI not CUDA-aware): results are right, MPI is never handed
  a device array, and the pinned staging buffers are reused, not reallocated;
* direct path (CUDA-aware MPI): results are right only if the stream is
  synchronized before every buffer reaches MPI (the deferred writes make a
  missing synchronize produce wrong numbers);
* busy stream: a write still pending on another stream when allreduce is
  called is waited for.

What they cannot show: cupy itself, real streams, real pinned memory, a
CUDA-aware MPI.  tests/test_gpu_mpi.py does that where a GPU exists.
"""

from __future__ import annotations

import gc
import sys
import threading

import numpy as np
import pytest
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce.backend import Backend, StagedBackend, register_backend, unregister_backend

from .helpers import VARIANTS, VARIANT_IDS, expected, mine

pytestmark = pytest.mark.mpi


class FakeDeviceArray(np.ndarray):
    """Test double for a device array (lives in host memory)."""


class FakeStreams:
    """Deferred writes: ``current`` is the library's stream, ``other`` a caller's."""

    def __init__(self):
        self.current: list = []
        self.other: list = []

    @staticmethod
    def _apply(queue):
        while queue:
            out, value = queue.pop(0)
            np.copyto(out.view(np.ndarray), value)

    def flush_current(self):
        self._apply(self.current)

    def flush_all(self):
        self._apply(self.other)
        self._apply(self.current)


class FakeDeviceMixin:
    """Kernels (ufuncs, copies) run in stream order but their results only
    land when the stream is synchronized."""

    def _init_fake(self):
        self.streams = FakeStreams()
        self.synchronizations = 0

    def empty(self, count, dtype):
        return np.zeros(count, dtype=dtype).view(FakeDeviceArray)

    def empty_shaped(self, shape, dtype):
        return np.zeros(shape, dtype=dtype).view(FakeDeviceArray)

    def copy(self, dst, src):
        self.streams.flush_current()  # stream order: earlier kernels are done
        self.streams.current.append((dst, np.array(src).reshape(dst.shape)))

    def ufunc(self, ufunc):
        def kernel(a, b, out):
            self.streams.flush_current()
            self.streams.current.append((out, ufunc(np.asarray(a), b)))
        return kernel

    def synchronize(self):
        self.synchronizations += 1
        self.streams.flush_current()

    def device_synchronize(self):
        self.streams.flush_all()

    def to_host(self, array):
        self.streams.flush_all()
        return np.array(array.view(np.ndarray))


class CheckingComm:
    """Wraps the library's communicator: fails if a device array reaches MPI."""

    def __init__(self, comm):
        self.comm = comm

    @staticmethod
    def _check(*bufs):
        for b in bufs:
            if b is not None and isinstance(b[0], FakeDeviceArray):
                raise AssertionError("a device buffer was handed to an MPI that is not CUDA-aware")

    def Isend(self, buf, dest, tag):
        self._check(buf)
        return self.comm.Isend(buf, dest, tag)

    def Irecv(self, buf, source, tag):
        self._check(buf)
        return self.comm.Irecv(buf, source, tag)


class FakeStagedDevice(FakeDeviceMixin, StagedBackend):
    """TEST DOUBLE: a device whose MPI is not CUDA-aware (staged path)."""

    name = "fake-device-staged (test double)"

    def __init__(self):
        super().__init__(np)
        self._init_fake()
        self.allocations = 0

    def _host_buffer(self, nbytes):
        self.allocations += 1
        return np.zeros(nbytes, dtype=np.uint8)

    def _to_host(self, host, device):
        self.streams.flush_current()  # a stream-ordered device-to-host copy
        np.copyto(host, device.view(np.ndarray))

    def _from_host(self, device, host):
        self.streams.flush_current()
        np.copyto(device.view(np.ndarray), host)

    def post(self, comm, *args):
        return super().post(CheckingComm(comm), *args)


class FakeDirectDevice(FakeDeviceMixin, Backend):
    """TEST DOUBLE: a device with a CUDA-aware MPI (buffers go to MPI directly)."""

    name = "fake-device-direct (test double)"
    device = True
    direct = True

    def __init__(self):
        super().__init__(np)
        self._init_fake()


@pytest.fixture(params=[FakeStagedDevice, FakeDirectDevice], ids=["staged", "direct"])
def fake(request):
    backend = request.param()
    register_backend(FakeDeviceArray, backend)
    yield backend
    unregister_backend(FakeDeviceArray)


def on_device(array):
    return np.array(array).view(FakeDeviceArray)


@pytest.mark.comm_kinds("world", "reversed", "even")
@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("count", [0, 1, 5, 97])
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_core_matrix_on_fake_device(comm, fake, variant, count, in_place):
    """Every algorithm's rounds on device arrays, staged and direct, on the
    world (1, 3, 5 and 8 ranks over the launches; the four of
    conftest.PATH_VARIANTS also on the 3 ranks reversed and on 2 strided):
    the device handling is the backend's and the executor's, the same at
    every size; each algorithm's index maths at every size (2, 4 and 7
    too) is the host tests' (``test_counts``)."""
    _, algorithm, options = variant
    data = mine(comm, "float32", "sum", count)
    if in_place:
        recv = on_device(data)
        out = mar.allreduce(MPI.IN_PLACE, recv, "sum", comm=comm, algorithm=algorithm,
                            segment_size=7, **options)
    else:
        out = mar.allreduce(on_device(data), None, "sum", comm=comm, algorithm=algorithm,
                            segment_size=7, **options)
    assert isinstance(out, FakeDeviceArray)
    np.testing.assert_array_equal(fake.to_host(out), expected(comm, "float32", "sum", count))


def test_staging_buffers_are_reused(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank sends nothing")
    backend = FakeStagedDevice()
    register_backend(FakeDeviceArray, backend)
    try:
        x = on_device(mine(comm, "int64", "sum", 1000))
        mar.allreduce(x, comm=comm, algorithm="ring_pipelined", segment_size=64)
        first, allocations = dict(backend._staging), backend.allocations
        for _ in range(3):
            out = mar.allreduce(x, comm=comm, algorithm="ring_pipelined", segment_size=64)
        assert backend.allocations == allocations and allocations > 0
        assert all(backend._staging[k] is v for k, v in first.items())
        assert backend.staging_bytes <= 4 * 64 * 8  # two slots of send and receive segments
        np.testing.assert_array_equal(backend.to_host(out), expected(comm, "int64", "sum", 1000))
    finally:
        unregister_backend(FakeDeviceArray)



class PerThreadStreams(FakeStagedDevice):
    """TEST DOUBLE: the staged device with a current stream per thread, as
    cupy's is."""

    def __init__(self):
        self._local = threading.local()
        super().__init__()

    @property
    def streams(self):
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = FakeStreams()
        return streams

    @streams.setter
    def streams(self, value):  # (the mixin's one queue: each thread makes its own)
        pass


@pytest.mark.comm_kinds("world")
@pytest.mark.parametrize("kind", ["blocking", "non-blocking"])
def test_staging_buffers_are_bounded_over_calls_on_fresh_arrays(comm, kind):
    """Calls on new arrays each time (each a call of its own): the pinned
    staging buffers are as many as the calls alive at once, not one pair
    per call ever made (400 pairs after 200 non-blocking calls before)."""
    if comm.Get_size() == 1:
        pytest.skip("one rank sends nothing")
    backend = FakeStagedDevice()
    register_backend(FakeDeviceArray, backend)
    try:
        counts = []
        for i in range(120):
            x = on_device(mine(comm, "float64", "sum", 300))
            if kind == "blocking":
                out = mar.allreduce(x, comm=comm, algorithm="ring")
            else:
                out = mar.iallreduce(x, comm=comm, algorithm="ring").wait()
            np.testing.assert_array_equal(backend.to_host(out),
                                          expected(comm, "float64", "sum", 300))
            if i in (20, 119):
                gc.collect()
                counts.append((len(backend._staging), backend.allocations))
        assert counts[1] == counts[0] and counts[0][0] <= 8, counts
    finally:
        unregister_backend(FakeDeviceArray)


@pytest.mark.skipif(MPI.Query_thread() != MPI.THREAD_MULTIPLE,
                    reason="two threads calling MPI need MPI_THREAD_MULTIPLE")
@pytest.mark.parametrize("kind", ["blocking", "non-blocking"])
def test_two_threads_on_two_communicators_never_share_staging_buffers(comm, kind):
    """Two threads, each calling on a communicator of its own with device
    arrays of its own values: each stages through buffers of its own call
    (they shared one pair per round before: 5 to 91 wrong results in 300
    calls a thread), so every result is that thread's sum."""
    if comm.Get_size() == 1:
        pytest.skip("one rank sends nothing")
    backend = PerThreadStreams()
    register_backend(FakeDeviceArray, backend)
    comms = [comm.Dup(), comm.Dup()]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    wrong, errors = [0, 0], []

    def work(k):
        try:
            c, p = comms[k], comms[k].Get_size()
            for _ in range(150):
                x = on_device(np.full(64, float(k + 1)))
                if kind == "blocking":
                    out = mar.allreduce(x, comm=c, algorithm="ring")
                else:
                    out = mar.iallreduce(x, comm=c, algorithm="ring").wait()
                wrong[k] += int(np.count_nonzero(backend.to_host(out) != (k + 1) * p))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
        unregister_backend(FakeDeviceArray)
        for c in comms:
            c.Free()
    assert not errors and wrong == [0, 0], (errors, wrong)


def test_missing_synchronize_would_be_caught(comm):
    """The fake is strict enough: with synchronize() disabled, results go wrong."""
    if comm.Get_size() == 1:
        pytest.skip("one rank sends nothing")

    class Careless(FakeDirectDevice):
        def synchronize(self):
            pass

    backend = Careless()
    register_backend(FakeDeviceArray, backend)
    try:
        # the ring sends, in its allgather, blocks that a kernel has just reduced
        out = mar.allreduce(on_device(mine(comm, "int32", "sum", 50)), comm=comm,
                            algorithm="ring")
        wrong = np.count_nonzero(backend.to_host(out) != expected(comm, "int32", "sum", 50))
    finally:
        unregister_backend(FakeDeviceArray)
    assert comm.allreduce(wrong) > 0


@pytest.mark.parametrize("algorithm", list(mar.ALGORITHMS))
def test_busy_stream_is_waited_for(comm, fake, algorithm):
    """A kernel on the caller's own stream is still writing sendbuf when
    allreduce is called: the library must wait for it."""
    send = on_device(np.zeros(40, dtype=np.float64))
    fake.streams.other.append((send, mine(comm, "float64", "sum", 40)))  # pending write
    out = mar.allreduce(send, comm=comm, algorithm=algorithm)
    np.testing.assert_array_equal(fake.to_host(out), expected(comm, "float64", "sum", 40))


def test_host_only_ops_are_refused_for_device_arrays(comm, fake):
    """MPI_Reduce_local (user MPI.Ops) and the pair ops need host memory:
    device arrays get the same TypeError on every rank, before any message."""
    from mpi4py.util import dtlib

    op = MPI.Op.Create(lambda a, b, t: None, commute=True)
    try:
        device = np.ones(4).view(FakeDeviceArray)
        with pytest.raises(TypeError, match="host memory only"):
            mar.allreduce(device, op=op, comm=comm)
        pairs = np.zeros(4, dtlib.to_numpy_dtype(MPI.DOUBLE_INT)).view(FakeDeviceArray)
        with pytest.raises(TypeError, match="host memory only"):
            mar.allreduce(pairs, op=MPI.MAXLOC, comm=comm)
    finally:
        op.Free()
    comm.Barrier()


def test_a_callable_op_runs_on_device_arrays(comm, fake):
    """A Python callable is applied where the data is (its result lands
    after the stream is synchronized, like any kernel's)."""
    data = mine(comm, "float64", "max", 2 * comm.Get_size() + 1)
    got = mar.allreduce(data.copy().view(FakeDeviceArray), op=mar.user_op(np.maximum),
                        comm=comm, algorithm="recursive_doubling")
    np.testing.assert_array_equal(fake.to_host(got), expected(comm, "float64", "max",
                                                              2 * comm.Get_size() + 1))
