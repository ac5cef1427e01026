"""Array backends: the only module that knows numpy from cupy.

A :class:`Backend` allocates, copies and reduces arrays where they live and
hands buffers to MPI.  Host (numpy) buffers go to MPI as they are.  Device
(cupy) buffers go to MPI directly when the MPI library is CUDA-aware;
otherwise every message is staged through pinned host buffers that are
allocated once and reused.  The stream is synchronized before any buffer
reaches MPI.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
from typing import Optional

import numpy as np
from mpi4py import MPI

from .config import CUDA_AWARE_ENV, environment, on_refresh

__all__ = ["Backend", "HostBackend", "backend_for", "cuda_aware_support", "as_array"]



class Backend:
    """Interface every backend implements (numpy semantics)."""

    name = "abstract"
    #: True when arrays live on a device (not host memory)
    device = False
    #: True when device buffers may be handed to MPI directly
    direct = True

    def __init__(self, xp):
        self.xp = xp

    # --- arrays -----------------------------------------------------------
    def empty(self, count: int, dtype) -> "np.ndarray":
        return self.xp.empty(count, dtype=dtype)

    def empty_shaped(self, shape, dtype):
        return self.xp.empty(shape, dtype=dtype)

    def copy(self, dst, src) -> None:
        """dst[...] = src (same backend, same size)."""
        self.xp.copyto(dst, src.reshape(dst.shape))

    @staticmethod
    def copier(dst, src) -> tuple:
        """The executor's step that copies ``src`` into ``dst``, views of one
        shape: ``(function, args)``; item assignment, a quarter of
        ``copyto``'s cost on a short vector."""
        return dst.__setitem__, (Ellipsis, src)

    def ufunc(self, ufunc):
        return getattr(self.xp, ufunc.__name__)

    def synchronize(self) -> None:
        """Wait until queued work on the current stream is done (before MPI)."""

    def device_synchronize(self) -> None:
        """Wait for every stream of the device: a caller's kernel on another
        stream may still be writing the send buffer when allreduce starts."""

    def is_contiguous(self, array) -> bool:
        return bool(array.flags.c_contiguous)

    def is_writeable(self, array) -> bool:
        # cupy before 14 has no writeable flag: its arrays are always writeable
        return bool(getattr(array.flags, "writeable", True))

    def shares_memory(self, a, b) -> bool:
        # the bounds test is cheap; the exact one only runs when bounds overlap
        return bool(np.may_share_memory(a, b) and np.shares_memory(a, b))

    def to_host(self, array) -> np.ndarray:
        return np.asarray(array)

    # --- messaging --------------------------------------------------------
    def post(self, comm, send, dest, recv, source, mpitype, tag, slot: str) -> "Pending":
        """Start a send and a receive without waiting (``slot`` names the
        staging buffers of backends that stage: one per message pair in
        flight); ``Pending.wait()`` or a true ``Pending.test()`` ends them."""
        self.synchronize()
        return Pending(_start(comm, send, dest, recv, source, mpitype, tag))


def byte_bounds(pointer: int, shape, strides, itemsize: int) -> tuple:
    """``[low, high)``: the bytes an array of this layout starting at
    ``pointer`` can touch (negative strides reach below the pointer); an
    empty array touches none (``low == high``)."""
    if any(n == 0 for n in shape):
        return pointer, pointer
    low = high = pointer
    for n, stride in zip(shape, strides):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + itemsize


def bounds_overlap(a: tuple, b: tuple) -> bool:
    """Whether two ``[low, high)`` byte ranges share a byte."""
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def device_bounds(array) -> tuple:
    """:func:`byte_bounds` of a cupy array (its device pointer)."""
    return byte_bounds(array.data.ptr, array.shape, array.strides, array.itemsize)


class Pending:
    """Requests in flight, and what to do once they are done."""

    __slots__ = ("requests", "after")

    def __init__(self, requests, after=None):
        self.requests = requests
        self.after = after

    def wait(self) -> None:
        MPI.Request.Waitall(self.requests)
        if self.after is not None:
            self.after()

    def test(self) -> bool:
        """Whether the messages are done (then what follows them has run)."""
        if not MPI.Request.Testall(self.requests):
            return False
        if self.after is not None:
            self.after()
            self.after = None
        return True


# --- the MPI calls that move a round's messages: made here, and only here ------------

def exchange(comm, mpitype, tag, send, dest, recv, source) -> tuple:
    """A blocking call's round of at most one send and one receive (host
    memory), as one step ``(function, args)``: the MPI call with its
    message specs made once."""
    if send is not None and recv is not None:
        return comm.Sendrecv, ([send, mpitype], dest, tag, [recv, mpitype], source, tag)
    if send is not None:
        return comm.Send, ([send, mpitype], dest, tag)
    return comm.Recv, ([recv, mpitype], source, tag)


#: (receive, send) of the non-blocking ways to move a message
_STARTED = {"start": ("Irecv", "Isend"), "init": ("Recv_init", "Send_init")}


def message_calls(comm, pairs, mpitype, how: str = "start") -> list:
    """A round's messages (``pairs`` of (send, dest, recv, source)) as
    ``(MPI call, message spec, peer)``, receives first, each made by
    :func:`started` with a tag: ``how`` "start" (``MPI_Irecv``,
    ``MPI_Isend``) or "init" (persistent ``MPI_Recv_init``, ``MPI_Send_init``)."""
    receive, send_name = (getattr(comm, name) for name in _STARTED[how])
    calls = []
    for send, dest, recv, source in pairs:
        if recv is not None:
            calls.append((receive, [recv, mpitype], source))
        if send is not None:
            calls.append((send_name, [send, mpitype], dest))
    return calls


def started(calls: list, tag: int) -> list:
    """The MPI requests of :func:`message_calls`' calls with ``tag``."""
    return [call(spec, peer, tag) for call, spec, peer in calls]


def _start(comm, send, dest, recv, source, mpitype, tag) -> list:
    """One pair's requests posted now: what :func:`message_calls` and
    :func:`started` make, without building the calls first (this runs for
    every round of every non-blocking call; going through them cost 0.85
    us more a pair)."""
    requests = []
    if recv is not None:
        requests.append(comm.Irecv([recv, mpitype], source, tag))
    if send is not None:
        requests.append(comm.Isend([send, mpitype], dest, tag))
    return requests


class HostBackend(Backend):
    name = "numpy"

    def __init__(self):
        super().__init__(np)


class Slots:
    """Names of staging buffers (``slot``), one per call that may be in
    flight at the same time as another: a blocking call bound to its arrays
    (``executor.Bound``) or a non-blocking one (``engine.Operation``) takes
    one when it is made and gives it back when it is gone, so two calls --
    on two communicators, from two threads -- never stage through one
    buffer, and the buffers are as many as the calls alive at once, not
    one per call ever made.  A call given up with messages in flight (an
    interrupt, a stall) never gives its name back: a late message may
    still land in its buffers."""

    def __init__(self):
        self._free: list = []
        self._next = itertools.count(1)  # next() is atomic: threads get distinct names

    def take(self) -> str:
        try:
            return self._free.pop()
        except IndexError:
            return f"c{next(self._next)}"

    def give(self, slot: Optional[str]) -> None:
        if slot:
            self._free.append(slot)


SLOTS = Slots()


class Slot:
    """A call's name for its staging buffers (``name``), taken from
    :data:`SLOTS` for as long as this object lives: what runs the call holds
    it (a blocking call's compiled steps, an operation).  ``""`` on the host,
    where nothing is staged."""

    __slots__ = ("name",)

    def __init__(self, staged: bool = True):
        self.name = ""  # (what __del__ finds where an interrupt lands in the take)
        if staged:
            self.name = SLOTS.take()

    def burn(self) -> None:
        """The call was given up with messages in flight: its name (and
        buffers) are never used again."""
        self.name = ""

    def __del__(self):
        SLOTS.give(self.name)


class StagedBackend(Backend):
    """Device arrays with an MPI that cannot read device memory.

    Messages are copied into pinned host buffers (kept and grown, never
    reallocated per message), sent from there, and copied back.  Subclasses
    supply :meth:`_host_buffer`, :meth:`_to_host` and :meth:`_from_host`.
    """

    device = True
    direct = False

    def __init__(self, xp):
        super().__init__(xp)
        self._staging: dict[str, np.ndarray] = {}

    def staging_buffer(self, which: str, nbytes: int) -> np.ndarray:
        buf = self._staging.get(which)
        if buf is None or buf.nbytes < nbytes:
            buf = self._host_buffer(max(nbytes, 1))
            self._staging[which] = buf
        return buf[:nbytes]

    @property
    def staging_bytes(self) -> int:
        return sum(b.nbytes for b in self._staging.values())

    def _stage(self, send, recv, slot: str):
        """Host buffers for one exchange: ``send`` copied in, ``recv`` to fill.

        The device-to-host copy is ordered after earlier work on the stream;
        the caller's synchronize() makes sure it has landed before MPI reads it.
        """
        hsend = hrecv = None
        if send is not None:
            hsend = self.staging_buffer(f"send{slot}", send.nbytes).view(send.dtype)
            self._to_host(hsend, send)
        if recv is not None:
            hrecv = self.staging_buffer(f"recv{slot}", recv.nbytes).view(recv.dtype)
        return hsend, hrecv

    def post(self, comm, send, dest, recv, source, mpitype, tag, slot: str) -> Pending:
        hsend, hrecv = self._stage(send, recv, slot)
        self.synchronize()
        after = None if recv is None else (lambda: self._from_host(recv, hrecv))
        return Pending(_start(comm, hsend, dest, hrecv, source, mpitype, tag), after)

    def _host_buffer(self, nbytes: int) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _to_host(self, host: np.ndarray, device) -> None:  # pragma: no cover
        raise NotImplementedError

    def _from_host(self, device, host: np.ndarray) -> None:  # pragma: no cover
        raise NotImplementedError


class CupyBackend(Backend):
    """cupy arrays with a CUDA-aware MPI: device pointers go straight to MPI."""

    name = "cupy"
    device = True
    direct = True

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    def device_synchronize(self) -> None:
        self.xp.cuda.Device().synchronize()

    def shares_memory(self, a, b) -> bool:
        # cupy's exact test costs a third of a millisecond even on two arrays
        # far apart (an H200, cupy 14.2): the bounds first, from the pointers
        if not bounds_overlap(device_bounds(a), device_bounds(b)):
            return False
        return bool(self.xp.shares_memory(a, b))

    def to_host(self, array) -> np.ndarray:
        return self.xp.asnumpy(array)


class StagedCupyBackend(StagedBackend, CupyBackend):
    """cupy arrays staged through pinned host memory (MPI not CUDA-aware)."""

    name = "cupy-staged"
    direct = False

    def _host_buffer(self, nbytes: int) -> np.ndarray:
        mem = self.xp.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def _to_host(self, host, device) -> None:
        device.get(out=host)

    def _from_host(self, device, host) -> None:
        device.set(host)


@on_refresh
def _forget_cuda_awareness() -> None:
    cuda_aware_support.cache_clear()
    _cupy_backends.clear()


@functools.lru_cache(maxsize=1)
def cuda_aware_support() -> tuple[bool, str]:
    """Whether the loaded MPI library can take device buffers, and why we think so.

    ``MPI_ALLREDUCE_CUDA_AWARE=1/0`` forces the answer.  Otherwise we look up
    Open MPI's ``MPIX_Query_cuda_support`` or MPICH's ``MPIX_GPU_query_support``
    in the process (mpi4py has no such query of its own).
    """
    forced = environment().cuda_aware
    if forced is not None:
        return forced, f"forced by {CUDA_AWARE_ENV}={os.environ.get(CUDA_AWARE_ENV, '').strip()}"
    for name in _libmpi_candidates():
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(lib, "MPIX_Query_cuda_support"):
            fn = lib.MPIX_Query_cuda_support
            fn.restype = ctypes.c_int
            ok = bool(fn())
            return ok, f"MPIX_Query_cuda_support() returned {int(ok)} ({name})"
        if hasattr(lib, "MPIX_GPU_query_support"):
            fn = lib.MPIX_GPU_query_support
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            flag = ctypes.c_int(0)
            gpu_type_cuda = 1  # MPIX_GPU_SUPPORT_CUDA
            fn(gpu_type_cuda, ctypes.byref(flag))
            ok = bool(flag.value)
            return ok, f"MPIX_GPU_query_support(CUDA) returned {int(ok)} ({name})"
    return False, "the MPI library exports no CUDA-awareness query; assuming host memory only"


def _libmpi_candidates() -> list[Optional[str]]:
    """The shared objects to look in: the process itself, then libmpi by path."""
    names: list[Optional[str]] = [None]
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "libmpi" in os.path.basename(path) and path not in names:
                    names.append(path)
    except OSError:  # pragma: no cover - not Linux
        pass
    return names


_HOST = HostBackend()
_cupy_backends: dict[bool, Backend] = {}


#: why cupy did not import, where it did not (for select_device's refusal)
_cupy_import_error: Optional[ImportError] = None


@functools.lru_cache(maxsize=1)
def _cupy():
    global _cupy_import_error
    try:
        import cupy  # noqa: WPS433 - the one place cupy is imported
    except ImportError as exc:  # pragma: no cover - depends on the machine
        _cupy_import_error = exc
        return None
    return cupy


def _dlpack_is_cuda(obj) -> bool:
    try:
        dev_type, _ = obj.__dlpack_device__()
    except Exception:  # noqa: BLE001 - foreign objects
        return False
    return int(dev_type) in (2, 13)  # kDLCUDA, kDLCUDAManaged


#: (array type, backend) pairs checked before numpy and cupy (see register_backend)
_REGISTERED: list = []


def register_backend(array_type: type, backend: Backend) -> None:
    """Route arrays of ``array_type`` (checked before numpy) to ``backend``.
    The tests use this for a fake device backend that runs on the CPU."""
    _REGISTERED.insert(0, (array_type, backend))


def unregister_backend(array_type: type) -> None:
    _REGISTERED[:] = [(t, b) for t, b in _REGISTERED if t is not array_type]


def as_array(obj):
    """Return ``obj`` as a numpy or cupy array viewing its memory (no copy
    for anything with a buffer): numpy arrays (subclasses viewed as plain
    arrays), cupy arrays, objects with ``__cuda_array_interface__`` or
    ``__dlpack__`` (CPU or CUDA), and the buffer protocol (``bytearray``,
    ``array.array``, ``memoryview``...).  Lists and other array-likes become
    new numpy arrays."""
    for array_type, _ in _REGISTERED:
        if isinstance(obj, array_type):
            return obj
    if isinstance(obj, np.ndarray):
        # a subclass (np.matrix: 2-D views, its own broadcasting) as the
        # plain array it is; the result still lands in the caller's memory
        return obj if type(obj) is np.ndarray else obj.view(np.ndarray)
    if hasattr(obj, "__cuda_array_interface__"):
        cp = _cupy()
        if cp is not None and isinstance(obj, cp.ndarray):
            # (device memory; an empty one has the null pointer, which the
            # runtime calls host memory: it stays a cupy array all the same)
            return obj
        if _host_pointer(obj, cp):  # host memory behind the interface
            return _host_view(obj)
        return _cupy_for(obj).asarray(obj)
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        if _dlpack_is_cuda(obj):
            return _cupy_for(obj).from_dlpack(obj)
        return _from_dlpack(obj)
    try:
        view = memoryview(obj)
    except TypeError:
        view = None
    if view is not None:
        return np.asarray(view)
    if hasattr(obj, "__array__") or isinstance(obj, (list, tuple)):
        return np.asarray(obj)
    raise TypeError(f"expected an array or a buffer, got {type(obj).__name__}")


def _cupy_for(obj):
    """cupy, for a device array ``obj``; a clear error where it is missing."""
    cp = _cupy()
    if cp is None:
        raise TypeError(f"{type(obj).__name__} is a device array but cupy is not installed "
                        "(pip install 'mpi_allreduce[gpu]')")
    return cp


def _host_pointer(obj, cp) -> bool:
    """Whether the memory behind a CUDA array interface is host memory: the
    CUDA runtime says so, or there is no CUDA driver at all (then no
    pointer can be device memory)."""
    pointer = obj.__cuda_array_interface__["data"][0]
    if cp is not None:
        try:
            return int(cp.cuda.runtime.pointerGetAttributes(pointer).type) in (0, 1)
        except Exception:  # noqa: BLE001 - no device, or an old runtime: ask the driver
            pass
    return not _cuda_driver()


@functools.lru_cache(maxsize=1)
def _cuda_driver() -> bool:
    import ctypes.util
    return ctypes.util.find_library("cuda") is not None


class _Interface:
    """Holds a host array interface (and its owner) for numpy to view."""

    def __init__(self, owner, interface):
        self.owner, self.__array_interface__ = owner, interface


class _Exported:
    """One DLPack capsule already taken from its producer, for numpy."""

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


def _from_dlpack(obj) -> np.ndarray:
    """A CPU DLPack object as a numpy view of its memory.  Some producers
    tie the tensor's description to the capsule object rather than to
    the tensor's deleter; the view keeps the capsule alive until numpy's
    array (whose deleter reads that description) is gone."""
    device = obj.__dlpack_device__()
    legacy = False
    try:
        capsule = obj.__dlpack__(max_version=(1, 0))
    except TypeError:  # a producer of DLPack before 1.0
        capsule, legacy = obj.__dlpack__(), True
    try:
        array = np.from_dlpack(_Exported(capsule, device))
    except (RuntimeError, BufferError, TypeError):  # a dtype numpy does not import
        return _dlpack_raw(capsule, legacy)
    interface = dict(array.__array_interface__)
    if legacy:  # before 1.0 DLPack had no read-only flag: writeable, as MPI takes it
        interface["data"] = (interface["data"][0], False)
    # (a tuple releases its items last first: the array, then the capsule)
    return np.asarray(_Interface((capsule, array), interface))


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


#: DLPack (type code, bits, lanes) -> numpy dtype, for the ones numpy will
#: not import.  A complex number may also come as two lanes of its float
#: (kDLFloat, bits, 2): so mpi4py writes complex long double, whose 256
#: bits do not fit DLPack's 8-bit field, and so mpi4py reads any complex
_DLPACK_DTYPES = {
    (2, 8 * np.dtype(np.longdouble).itemsize, 1): np.dtype(np.longdouble),
    **{(2, 8 * np.dtype(real).itemsize, 2): np.dtype(complex_)
       for real, complex_ in ((np.float32, np.complex64), (np.float64, np.complex128),
                              (np.longdouble, np.clongdouble))},
}


def _dlpack_raw(capsule, legacy: bool) -> np.ndarray:
    """A contiguous CPU DLPack tensor read directly (numpy refuses some
    dtypes, long double among them): its elements as the matching numpy
    dtype, else as opaque items of its size.  The capsule is not consumed:
    the view keeps it, and its producer frees the tensor when it goes."""
    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    name = b"dltensor" if legacy else b"dltensor_versioned"
    pointer = api.PyCapsule_GetPointer(capsule, name)
    # DLManagedTensor starts with the DLTensor; the versioned one with a
    # version, a manager context, a deleter and flags (2*4 + 8 + 8 + 8 bytes)
    offset = 0 if legacy else 32
    tensor = _DLTensor.from_address(pointer + offset)
    # DLPACK_FLAG_BITMASK_READ_ONLY (legacy tensors have no flags)
    readonly = not legacy and bool(ctypes.c_uint64.from_address(pointer + 24).value & 1)
    shape = [tensor.shape[i] for i in range(tensor.ndim)]
    count = int(np.prod(shape)) if shape else 1
    itemsize = tensor.dtype.bits * tensor.dtype.lanes // 8
    if tensor.strides and tensor.ndim:
        expected, strides = 1, [tensor.strides[i] for i in range(tensor.ndim)]
        for extent, stride in zip(reversed(shape), reversed(strides)):
            if extent > 1 and stride != expected:
                raise TypeError("a strided DLPack tensor of a dtype numpy cannot import")
            expected *= extent
    dtype = _DLPACK_DTYPES.get((tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes),
                               np.dtype((np.void, itemsize)))
    interface = {"version": 3, "shape": (count,), "typestr": dtype.str,
                 "data": ((tensor.data or 0) + tensor.byte_offset, readonly)}
    if dtype.kind == "V":
        interface["descr"] = dtype.descr
    return np.asarray(_Interface(capsule, interface))


def _host_view(obj) -> np.ndarray:
    cai = obj.__cuda_array_interface__
    interface = {"version": 3, "shape": tuple(cai["shape"]), "typestr": cai["typestr"],
                 "data": tuple(cai["data"]), "strides": cai.get("strides")}
    if cai.get("descr"):
        interface["descr"] = cai["descr"]
    return np.asarray(_Interface(obj, interface))


def backend_for(array) -> Backend:
    """The backend that owns ``array``."""
    for array_type, backend in _REGISTERED:
        if isinstance(array, array_type):
            return backend
    if isinstance(array, np.ndarray):
        return _HOST
    cp = _cupy()
    if cp is not None and isinstance(array, cp.ndarray):
        aware, _ = cuda_aware_support()
        backend = _cupy_backends.get(aware)
        if backend is None:
            backend = CupyBackend(cp) if aware else StagedCupyBackend(cp)
            _cupy_backends[aware] = backend
        return backend
    raise TypeError(f"no backend for {type(array).__name__}")


# --- device selection and data placement (verify, bench, info) -------------

class DeviceUnavailable(RuntimeError):
    """``--device cuda`` where a rank cannot use it: cupy is not installed
    or does not import, or finds no GPU.  :func:`select_device` raises it on
    every rank of the communicator alike, its message one line naming the
    ranks that lack the device and why (the command line turns it into a
    usage error, exit status 2)."""


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line: cupy's import error spans a
    screen of advice, its cause on the line after ``Original error:``."""
    lines = [line.strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line and line.strip("=")]
    if "Original error:" in lines[:-1]:
        return lines[lines.index("Original error:") + 1]
    return lines[0] if lines else type(exc).__name__


def held_on(device: str, dtypes) -> list:
    """Those of ``dtypes`` a buffer on ``device`` can hold: all on the CPU;
    cupy has no long double (nor its complex) where it differs from
    float64."""
    if device == "cpu":
        return list(dtypes)
    longer = {np.dtype(t) for t in (np.longdouble, np.clongdouble)} - {
        np.dtype(np.float64), np.dtype(np.complex128)}
    return [d for d in dtypes if np.dtype(d) not in longer]


def device_unavailable(device: str) -> Optional[str]:
    """Why this rank cannot use ``device`` ('cpu' or 'cuda'), or None where
    it can; a look at this process alone (no message).  For 'cuda': cupy
    installed, importing, and finding at least one GPU (it starts CUDA)."""
    if device == "cpu":
        return None
    if device != "cuda":
        raise ValueError(f"unknown device {device!r}; expected 'cpu' or 'cuda'")
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'mpi_allreduce[gpu]')"
    try:
        cp = _cupy()
    except Exception as exc:  # noqa: BLE001 - a cupy that fails to import otherwise
        return f"cupy does not import: {type(exc).__name__}: {_one_line(exc)}"
    if cp is None:
        exc = _cupy_import_error
        return "cupy does not import" + (f": {_one_line(exc)}" if exc else "")
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no device: CUDARuntimeError
        return f"cupy finds no GPU: {_one_line(exc)}"
    if count < 1:
        return "cupy finds no GPU: none is visible"
    return None


def select_device(comm, device: str) -> str:
    """Make ``device`` ('cpu' or 'cuda') current for this rank and describe the choice.

    For 'cuda' the rank takes GPU (local rank mod visible GPUs), so several
    ranks may share one GPU.  A collective on ``comm`` for 'cuda': the ranks
    first agree whether each can use it, and where any cannot, every rank
    raises :class:`DeviceUnavailable` alike (none is left waiting for the
    others; the exchange is watched, on the library's communicator); 'cpu'
    sends no message.
    """
    why = device_unavailable(device)
    if device == "cpu":
        return "cpu"
    from .context import context_for  # (the context imports this module)

    everyone = context_for(comm).allgather_object(why, "device", f"choosing the device "
                                                                 f"({device}): whether every "
                                                                 "rank can use it")
    refusals = [(rank, reason) for rank, reason in enumerate(everyone) if reason]
    if refusals:
        reasons: dict = {}
        for rank, reason in refusals:
            reasons.setdefault(reason, []).append(rank)
        everywhere = len(refusals) == comm.Get_size()
        raise DeviceUnavailable("; ".join(
            ("" if everywhere else _ranks_phrase(ranks) + ": ") + reason
            for reason, ranks in reasons.items()))
    cp = _cupy()
    count = cp.cuda.runtime.getDeviceCount()
    from .topology import on_node

    index = on_node(comm, "choosing a GPU: where the ranks run")[0] % count
    cp.cuda.Device(index).use()
    aware, why = cuda_aware_support()
    return (f"cuda:{index} of {count} visible; "
            f"{'direct to MPI (CUDA-aware)' if aware else 'staged through pinned host memory'} -- {why}")


def _ranks_phrase(ranks: list) -> str:
    """'rank 3', 'ranks 0, 2, 5', 'ranks 0, 1, ..., 7 and 3 more' (at most 8 named)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    named = ", ".join(map(str, ranks[:8]))
    return f"ranks {named}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def to_device(array: np.ndarray, device: str):
    """A copy of host ``array`` on ``device`` ('cpu' returns it unchanged)."""
    if device == "cpu":
        return array
    cp = _cupy()
    if cp is None:
        raise RuntimeError("device arrays need cupy: pip install 'mpi_allreduce[gpu]'")
    return cp.asarray(array)


def to_host(array) -> np.ndarray:
    """``array`` as a numpy array (a copy for device arrays)."""
    return backend_for(array).to_host(array)


# --- device tensors of other frameworks (the torch backend) -----------------

def has_device_arrays() -> bool:
    """Whether device arrays are reduced where they live here (cupy is
    installed); where not, a framework's device tensors go through host
    copies instead."""
    return _cupy() is not None


def device_view(tensor):
    """A cupy array over the memory of ``tensor``, a CUDA DLPack exporter
    (a torch CUDA tensor): no copy, so results land in the tensor."""
    return _cupy_for(tensor).from_dlpack(tensor)


@contextlib.contextmanager
def on_stream(device: int, stream: int):
    """Device work in the ``with`` block on CUDA device ``device`` and the
    stream whose ``cudaStream_t`` is ``stream`` (a framework's current
    stream, such as torch's ``current_stream(device).cuda_stream``): the
    library's kernels, and the synchronizing before MPI reads a buffer,
    follow the caller's work on that stream."""
    cp = _cupy()
    if cp is None:
        raise RuntimeError("device streams need cupy: pip install 'mpi_allreduce[gpu]'")
    with cp.cuda.Device(device), cp.cuda.ExternalStream(stream, device):
        yield
