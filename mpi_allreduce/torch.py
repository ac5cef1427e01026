"""A ``torch.distributed`` backend on this library, for training with pip alone.

``import mpi_allreduce.torch`` registers a backend named ``mpi_allreduce``::

    import torch.distributed as dist
    import mpi_allreduce.torch            # registers the backend
    dist.init_process_group("mpi_allreduce")   # under mpiexec or srun: no MASTER_ADDR needed

Rank and world size come from MPI.  Where the environment does not already
name them (``torchrun`` does), importing this module fills in ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` (rank 0's host name) and
``MASTER_PORT`` (the port of a store server rank 0 starts and keeps) from
``MPI.COMM_WORLD``, so torch's default ``env://`` rendezvous works
unchanged -- importing it is collective over ``COMM_WORLD``.  Under
``mpiexec`` (more than one rank in ``COMM_WORLD``) a ``file://`` or
``tcp://`` ``init_method`` that names no rank and world size takes them
from MPI too, as torch's own MPI backend does.

What runs where:

============================================== ==================================
``all_reduce`` (SUM, AVG, PRODUCT, MIN, MAX,    :func:`mpi_allreduce.iallreduce` in
BAND, BOR, BXOR, PREMUL_SUM)                    place (``auto``, or the options)
``reduce``                                      the same all-reduce on a copy,
                                                kept by the root
``reduce_scatter_tensor``, ``reduce_scatter``   :func:`mpi_allreduce.reduce_scatter`
``all_gather_into_tensor``, ``all_gather``      :func:`mpi_allreduce.allgather`
``broadcast``, ``gather``, ``scatter``,         MPI's non-blocking calls on the
``all_to_all(_single)``, ``send``/``recv``      group's communicator, moving bytes
(``recv`` from any source too), ``barrier``     (every dtype as it is)
============================================== ==================================

PREMUL_SUM multiplies every input by its factor, then sums.

Options for the all-reduces (``algorithm``, ``reproducible``, ...) are
given to :func:`configure`.  Subgroups
(``dist.new_group``) run on MPI sub-communicators of the member ranks.

CPU tensors are handed to the library without copies (through DLPack);
a tensor that is not contiguous is reduced in a contiguous copy that is
copied back.  CUDA tensors run on cupy arrays over their memory on torch's
current stream where cupy is installed (the all-reduces and the halves,
complete when they return); MPI's data movement, and every call where cupy
is missing, works on host copies written back once the call completes.
Where MPI runs threads (``MPI_THREAD_MULTIPLE``, mpi4py's
default request; :data:`ASYNC`), ``all_reduce`` and the MPI calls return
while their messages travel: ``async_op=True`` overlaps them with the
caller's computation, ``wait()`` completes the call on the caller's thread,
and ``get_future()`` hands it to the library's progress thread, which
completes it and its future without a ``wait()`` (DDP's hooks chain on
it; the library's ``Request.add_done_callback``).  Elsewhere, and
for ``reproducible`` all-reduces, the reduce-scatter and the allgather,
every call completes before it returns.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import itertools
import os
import socket
import threading
import zlib
from collections import OrderedDict
from datetime import timedelta
from typing import Optional
from urllib.parse import urlparse, urlunparse

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.futures import Future

from . import collectives
from .api import allreduce, empty_call, iallreduce, left, refused_everywhere
from .backend import device_view, has_device_arrays, on_stream
from .context import broken_by, cached_context, release, setup
from .engine import ENGINE, duplicate, mpi_threads, wait_for, wait_for_call
from .errors import OWN_ERRORS, ArgumentMismatch, Broken, Stalled
from .ops import tagged
from .options import keywords_for, options as resolve_options
from .progress import mpi_request
from .topology import on_node

__all__ = ["BACKEND", "ASYNC", "MPIAllreduceGroup", "configure"]

#: the name ``init_process_group`` takes
BACKEND = "mpi_allreduce"

_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor",
}

#: keyword arguments of mpi_allreduce.allreduce every all-reduce of the backend takes
_OPTIONS: dict = {}


def configure(**options) -> None:
    """Options of :func:`mpi_allreduce.allreduce` (``algorithm``,
    ``reproducible``, ``segment_size``, ...) for the backend's all-reduces,
    checked here (an unknown name raises ``TypeError``, a bad value
    ``ValueError``) by the function every call's options go through."""
    resolve_options(**options)
    _OPTIONS.clear()
    _OPTIONS.update(options)
    _REQUEST_OPTIONS.clear()
    _REQUEST_OPTIONS.update(keywords_for(options, "request"))


#: of :data:`_OPTIONS`, those a non-blocking all-reduce takes (made once, at configure)
_REQUEST_OPTIONS: dict = {}


def _halves() -> dict:
    """The configured options that the reduce-scatter and allgather take."""
    return keywords_for(_OPTIONS, "halves")


def _reduction(opts) -> tuple:
    """(the library's op, the factor every input is multiplied by first, or
    None): PREMUL_SUM (``dist._make_nccl_premul_sum(factor)``) is a sum of
    the inputs times its factor (a number or a one-element tensor), tagged
    ``premul`` (``ops.tagged``)."""
    reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    for torch_op, name in _OPS.items():
        if reduce_op == torch_op:
            return name, None
    if reduce_op == dist.ReduceOp.PREMUL_SUM:
        if not hasattr(reduce_op, "factor"):
            raise ValueError(f"the {BACKEND} backend needs a torch whose ReduceOp has .factor "
                             f"(2.13 has it; this is {torch.__version__}) to read "
                             "PREMUL_SUM's factor")
        # (tagged: a pre-multiplied sum is another call than a plain sum, so
        # ranks that pre-multiply and ranks that do not stall, never sum)
        return tagged("sum", "premul"), reduce_op.factor
    raise ValueError(f"the {BACKEND} backend does not support {reduce_op}")


def _scaled(tensor: torch.Tensor, factor) -> torch.Tensor:
    """``tensor`` times ``factor`` as a new tensor (``tensor`` itself without one)."""
    return tensor if factor is None else tensor * factor


def _as_exception(exc: BaseException) -> Exception:
    """What a torch future can hold: torch refuses an interrupt (a
    ``BaseException`` that is not an ``Exception``) and leaves the future
    never complete, so one is wrapped."""
    if isinstance(exc, Exception):
        return exc
    return RuntimeError(f"the call was interrupted: {type(exc).__name__}: {exc}")


class _Future(Future):
    """torch's future as this backend hands it out.  Its ``wait()`` in a
    callback on the progress thread completes it right there
    (``complete_here``: its call waited for, the thread advancing its other
    calls meanwhile, then the future set, which runs the callbacks chained
    on it), where torch's own wait would block the thread that completes
    every call; the other callbacks due keep their turn.  A ``then``
    callback may so wait for another call's future, as on gloo."""

    def __init__(self, complete_here=None):
        super().__init__()
        self.complete_here = complete_here

    def wait(self):
        if not self.done() and self.complete_here is not None \
                and ENGINE.ident == threading.get_ident():
            self.complete_here()
        return super().wait()

    def then(self, callback):
        """torch's ``then``, whose future is one of these too (waited on the
        thread, it completes this one first)."""
        chained = _Future(self.wait)

        def run(future):
            try:
                chained.set_result(callback(future))
            except BaseException as exc:  # noqa: BLE001 - handed to the chained future
                chained.set_exception(_as_exception(exc))
        self.add_done_callback(run)
        return chained


class _Done(dist.Work):
    """A call already complete (the blocking path): its future is made only
    when asked for (a third of the cost of a Work made from a future)."""

    def __init__(self, result):
        super().__init__()
        self._result = result

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self):
        return self._result

    def get_future(self) -> Future:
        future = _Future()
        future.set_result(self._result)
        return future


#: calls return while their messages travel (``async_op=True`` overlaps them with the
#: caller's computation) where MPI runs threads; else every call completes first
ASYNC = mpi_threads()


class _Part:
    """One request of a call in flight: the library's own, or one over
    MPI's requests (:func:`~mpi_allreduce.progress.mpi_request`); either
    way the engine's ``wait()``/``test()`` and its watchdog."""

    __slots__ = ("request", "done")

    def __init__(self, request):
        self.request, self.done = request, False

    def wait(self) -> None:
        if not self.done:
            self.request.wait()
            self.done = True

    def test(self) -> bool:
        if not self.done:
            self.done = self.request.test()
        return self.done

    def when_done(self, callback) -> None:
        """``callback()`` once the request is complete, waited or not."""
        if self.done:
            callback()
        else:
            self.request.add_done_callback(lambda request: callback())


class _Work(dist.Work):
    """A call in flight: its requests, what runs once they are done (copies
    back), and the future torch's hooks chain on.  ``wait()`` completes it
    on the caller's thread; ``get_future()`` hands it to the progress
    thread, so the future completes without a ``wait()`` (DDP waits on the
    future).

    A call with MPI's requests (broadcast, gathers, send/recv, barrier, ...)
    hands them to the library's engine as one request, so it is waited and
    watched as the library's own calls are: its group and ``kind`` name it
    in the watchdog's report; in the raise mode it raises
    :class:`~mpi_allreduce.errors.Stalled` past the deadline, and the group
    is unusable."""

    def __init__(self, requests, result, after=(), status=None, kind: str = "",
                 group: "Optional[MPIAllreduceGroup]" = None, cancel: bool = False):
        super().__init__()
        ours = [r for r in requests if not isinstance(r, MPI.Request)]
        mpis = [r for r in requests if isinstance(r, MPI.Request)]
        if mpis:
            ours.append(mpi_request(mpis, group._what(kind), group.comm,
                                    None if status is None else [status], cancel,
                                    group._stalled))
        self._parts = [_Part(r) for r in ours]
        self._status = status
        self._after, self._result = list(after), result
        self._future: Optional[Future] = None  # (made when asked for: most calls are waited)
        # (re-entrant: a part's completion callback may run inside this Work's
        # own _complete, on its thread, which then settles the future itself)
        self._lock = threading.RLock()
        self._settling = threading.RLock()  # (a then-callback may settle it again: done)
        self._running = False
        self._done = False
        self._error: Optional[BaseException] = None

    def _acquire(self) -> None:
        """Take the Work's lock; on the progress thread (a callback's wait)
        serving meanwhile: another thread may hold it while it waits for a
        part that the thread completes."""
        lock = self._lock
        if ENGINE.ident == threading.get_ident():
            ENGINE.serve_until(lambda: lock.acquire(False))
        else:
            lock.acquire()

    def _complete(self, error: Optional[BaseException] = None) -> None:
        """Wait for the parts and run what comes after, or end with ``error``."""
        lock = self._lock
        self._acquire()
        try:
            if self._done or self._running:
                return
            self._running = True
            try:
                if error is not None:
                    raise error
                for part in self._parts:
                    part.wait()
                for function in self._after:
                    function()
            except BaseException as exc:  # noqa: BLE001 - handed to wait() and the future
                self._error = exc
            self._done, self._running = True, False
            future = self._future
        finally:
            lock.release()
        if future is not None:
            if ASYNC and ENGINE.ident != threading.get_ident():
                # (a wait on another thread completed it: the future's callbacks
                # still run on the progress thread, in their turn)
                ENGINE.soon(functools.partial(self._settle, future))
            else:
                self._settle(future)

    def _settle(self, future: Future) -> None:
        """Set the future (once: a wait on the thread may have set it first)."""
        with self._settling:
            if future.done():
                return
            if self._error is None:
                future.set_result(self._result)
            else:
                future.set_exception(_as_exception(self._error))

    def _complete_future(self) -> None:
        """The future's ``complete_here``: the call waited for on this thread
        and the future set now."""
        self._complete()
        if self._future is not None:
            self._settle(self._future)

    def wait(self, timeout=None) -> bool:
        self._complete()
        future = self._future
        if future is not None and not future.done() and ASYNC \
                and ENGINE.ident != threading.get_ident():
            # its future is set on the progress thread, in its callbacks' turn;
            # as on torch's backends, wait() returns once that is done too
            future.wait()
        if self._error is not None:
            raise self._error
        if not self._done:  # (re-entered on this thread while its completion runs below)
            raise RuntimeError("a wait for a Work whose own completion is in progress lower "
                               "on this thread's stack; it cannot complete here")
        return True

    def is_completed(self) -> bool:
        if not self._done and self._lock.acquire(False):
            error = None
            try:
                ready = all(part.test() for part in self._parts)
            except Stalled as exc:  # (past the deadline in the raise mode)
                error, ready = exc, True
            finally:
                self._lock.release()
            if ready:
                self._complete(error)
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def _source_rank(self) -> int:  # noqa: N802 - torch's name
        """The rank a receive from any source matched (``recv_anysource``)."""
        if self._status is None:
            raise RuntimeError("only a receive from any source has a source rank")
        self.wait()
        return self._status.Get_source()

    def get_future(self) -> Future:
        """The call's future, completed once its parts are, whether or not
        anyone waits: each part's completion callback (the library's
        ``Request.add_done_callback``, run by the progress thread that then
        advances it), the last of them completing the call."""
        self._acquire()  # (against _complete: one of the two settles the future)
        try:
            future, first = self._future, self._future is None
            if first:
                future = self._future = _Future(self._complete_future)
            done = self._done
        finally:
            self._lock.release()
        if not first:
            return future
        if done:
            self._settle(future)
            return future
        left, lock = [len(self._parts)], threading.Lock()

        def part_done() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._complete()
        if not self._parts:
            self._complete()
        for part in self._parts:
            part.when_done(part_done)
        return future


def _overlaps(opts) -> bool:
    """Whether a call returns while its messages travel: where MPI runs
    threads, unless torch says the caller waits at once (``async_op=False``
    sets ``opts.asyncOp`` False; DDP leaves it True)."""
    return ASYNC and getattr(opts, "asyncOp", True)


def _offsets(counts: list) -> list:
    return [sum(counts[:i]) for i in range(len(counts))]


def _splits(splits, tensor: torch.Tensor, nbytes: int, size: int) -> tuple:
    """(bytes, offsets) per rank of an all_to_all_single tensor split along
    its first dimension (evenly without ``splits``); ValueError for splits
    that do not cut the tensor in one part a rank."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row = nbytes // rows if rows else 0
    if splits:
        splits = [int(n) for n in splits]
        if len(splits) != size or sum(splits) != rows or min(splits) < 0:
            raise ValueError(f"all_to_all_single: split sizes {splits} do not cut {rows} rows "
                             f"into {size} parts")
    elif rows % size:
        raise ValueError(f"all_to_all_single: {rows} rows do not split evenly over {size} "
                         "ranks (give split sizes)")
    counts = [n * row for n in (splits if splits else [rows // size] * size)]
    return counts, _offsets(counts)


def _described(tensors) -> tuple:
    """What a rank's tensors must share with its peers' in a broadcast,
    gather or scatter: each one's dtype and number of elements."""
    return tuple((str(t.dtype), t.numel()) for t in tensors)


def _blocks_match(kind: str, role: str, blocks, own: torch.Tensor, size: int):
    """The root's refusal (a ValueError), or None, of a gather's outputs or a
    scatter's inputs (``blocks``) that are not one tensor a rank, each of
    ``own``'s dtype and size."""
    if len(blocks) != size:
        return ValueError(f"{kind}: the root's {role} list holds {len(blocks)} tensors, one a "
                          f"rank of {size} expected")
    wrong = [i for i, t in enumerate(blocks)
             if t.dtype != own.dtype or t.numel() != own.numel()]
    if wrong:
        return ValueError(f"{kind}: the root's {role} tensors {wrong} are not of this rank's "
                          f"dtype and size ({own.dtype}, {own.numel()} elements)")
    return None


def _digest(value) -> int:
    """A 64-bit digest of ``repr(value)`` (a tuple of numbers and names)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(),
                          "little")


def _mixed(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on unsigned 64-bit integers (wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _traffic(sources, targets, nbytes, kind: int) -> int:
    """The sum (modulo 2^64) of a hash of each message ``(source, target,
    bytes, kind)``: a rank's sends summed over every rank equal its
    receives summed over every rank when every pair agrees, and differ
    (but with odds of 2^-64) when some pair does not."""
    sources, targets, nbytes = (np.asarray(v, dtype=np.uint64).reshape(-1)
                                for v in (sources, targets, nbytes))
    h = _mixed(_mixed(_mixed(sources + np.uint64(kind + 1)) ^ targets) ^ nbytes)
    return int(h.sum(dtype=np.uint64))


def _bytes(array):
    """``array``'s memory as bytes, for MPI's data-movement calls (any dtype)."""
    return array.reshape(-1).view(np.uint8)


#: numpy views of the last tensors reduced, by (address, dtype, shape, strides): the
#: same tensor again (a DDP bucket, a training loop's buffer) gets the same array
#: object, which the library's kept calls recognise -- a repeat is then a look-up
#: instead of a validation, a plan and a bind.  A view holds its tensor's memory,
#: so an address in the key cannot be reused while it is kept; at most MAX_VIEWS
#: views and MAX_VIEW_BYTES of memory are held (the least recently used go first).
_VIEWS: "OrderedDict[tuple, object]" = OrderedDict()
MAX_VIEWS = 256  # (a model's parameter tensors, as the library's MAX_CALLS)
MAX_VIEW_BYTES = 256 << 20


def _array(tensor: torch.Tensor, keep: bool = False):
    """A numpy array over the tensor's memory (no copy; bfloat16 as
    ``ml_dtypes.bfloat16``, which numpy cannot import through DLPack), or
    for a CUDA tensor a cupy array over it.  ``keep``: the caller's own
    tensor, which it will pass again (an all-reduce's), whose view is kept
    in ``_VIEWS``; a temporary's is not (keeping it would keep its memory)."""
    if not keep:
        return _view(tensor)
    # (the strides too: a transposed square matrix has the address, dtype and
    # shape of the matrix, and its view must not be the matrix's)
    key = (tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride(), tensor.is_cuda)
    view = _VIEWS.get(key)
    if view is not None:
        _VIEWS.move_to_end(key)
        return view
    view = _VIEWS[key] = _view(tensor)
    while len(_VIEWS) > MAX_VIEWS or \
            (len(_VIEWS) > 1 and sum(v.nbytes for v in _VIEWS.values()) > MAX_VIEW_BYTES):
        _VIEWS.popitem(last=False)
    return view


def _view(tensor: torch.Tensor):
    """The array over ``tensor``'s memory (see :func:`_array`)."""
    _dense([tensor])
    tensor = tensor.detach()
    if tensor.device.type == "cuda":
        if tensor.dtype == torch.bfloat16:
            raise TypeError(f"the {BACKEND} backend's all-reduces on CUDA tensors run on "
                            "cupy, which has no bfloat16: reduce them as float32")
        view = device_view(tensor)
    elif tensor.device.type != "cpu":
        raise ValueError(f"the {BACKEND} backend takes CPU and CUDA tensors; got one on "
                         f"{tensor.device}")
    elif tensor.dtype == torch.bfloat16:
        import ml_dtypes

        view = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        view = tensor.numpy()
    return view


# --- CUDA tensors ---------------------------------------------------------------------

def _is_device(tensor: torch.Tensor) -> bool:
    """Whether a tensor lives in device memory (a CUDA tensor)."""
    return tensor.is_cuda


def _device_of(args) -> Optional[torch.device]:
    """The device of the first CUDA tensor among a call's arguments
    (tensors, lists of them, lists of lists), or None (on every call: kept
    to a third of a microsecond)."""
    for arg in args:
        if arg.__class__ is list or arg.__class__ is tuple:
            for item in arg:
                if item.__class__ is list or item.__class__ is tuple:
                    device = _device_of(item)
                    if device is not None:
                        return device
                elif isinstance(item, torch.Tensor) and item.is_cuda:
                    return item.device
        elif isinstance(arg, torch.Tensor) and arg.is_cuda:
            return arg.device
    return None


def _on_device(ours: bool):
    """A collective that takes CUDA tensors.  With cupy, ``ours`` (the
    library's all-reduce, reduce-scatter and allgather) run on cupy arrays
    over the tensors' memory, on torch's current stream (the library hands
    device buffers to a CUDA-aware MPI or stages them through host memory,
    and synchronizes the stream before MPI reads them); the call completes
    before it returns.  MPI's data movement (and ours without cupy) is
    :func:`_staged`.  CPU tensors go straight to the method."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            device = _device_of(args)
            if device is None:
                return method(self, *args, **kwargs)
            if not (ours and has_device_arrays()):
                return _staged(method, self, args, kwargs)
            with on_stream(device.index, torch.cuda.current_stream(device).cuda_stream):
                work = method(self, *args, **kwargs)
                work.wait()
            return work
        return call
    return wrap


class _Inner:
    """A torch Work as one part of a :class:`_Work`."""

    def __init__(self, work):
        self.work = work

    def wait(self) -> None:
        self.work.wait()

    def test(self) -> bool:
        return self.work.is_completed()

    def add_done_callback(self, callback) -> None:
        """``callback(self)`` once the inner Work is complete (its future's)."""
        self.work.get_future().add_done_callback(lambda future: callback(self))


def _staged(method, group, args, kwargs) -> "_Work":
    """``method`` on host copies of the call's device tensors; once it
    completes, the copies are written back to them (every device tensor of
    the call: outputs get their results, inputs their own values).  The
    call is as asynchronous as on host tensors: a ring of isend/irecv on
    device tensors does not wait for itself."""
    pairs = {}

    def host(arg):
        if isinstance(arg, torch.Tensor) and _is_device(arg):
            copy = arg.detach().to("cpu", copy=True)
            pairs[id(copy)] = (arg, copy)
            return copy
        if isinstance(arg, (list, tuple)):
            return type(arg)(host(a) for a in arg)
        return arg

    def device(result):
        if isinstance(result, torch.Tensor) and id(result) in pairs:
            return pairs[id(result)][0]
        if isinstance(result, (list, tuple)):
            return type(result)(device(r) for r in result)
        return result

    def back():
        for tensor, copy in pairs.values():
            tensor.copy_(copy)

    work = method(group, *[host(a) for a in args], **kwargs)
    return _Work([_Inner(work)], device(work._result), [back],
                 getattr(work, "_status", None))


def _dense(tensors) -> None:
    """Refuse sparse tensors with a clear message (as torch's MPI backend
    refuses them): the library reduces arrays of values."""
    for tensor in tensors:
        if tensor.layout != torch.strided:
            raise RuntimeError(f"the {BACKEND} backend takes dense tensors, got one of layout "
                               f"{tensor.layout} (call .to_dense() first)")


class _Chained(dist.Work):
    """A call's Work with one step after it (unpacking a coalesced
    all-reduce): ``wait()`` and the future run it once the call is done."""

    def __init__(self, work, after, result):
        super().__init__()
        self._work, self._after, self._result = work, after, result
        self._lock = threading.Lock()
        self._ran = False

    def _finish(self) -> None:
        with self._lock:
            if not self._ran:
                self._ran = True
                self._after()

    def wait(self, timeout=None) -> bool:
        self._work.wait()
        self._finish()
        return True

    def is_completed(self) -> bool:
        if self._work.is_completed():
            if self._work.exception() is None:
                self._finish()
            return True
        return False

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def get_future(self) -> Future:
        def then(future):
            future.value()  # (raises the call's error)
            self._finish()
            return self._result
        return self._work.get_future().then(then)


def _in_place(tensor: torch.Tensor, run) -> None:
    """``run(array)`` on ``tensor``'s memory, or on a contiguous copy written back."""
    work, back = _contiguous(tensor)
    run(_array(work, keep=back is None))
    if back is not None:
        back()


def _contiguous(tensor: torch.Tensor) -> tuple:
    """(a contiguous tensor over ``tensor``'s values, what writes it back or None)."""
    _dense([tensor])
    if tensor.is_contiguous():
        return tensor, None
    work = tensor.contiguous()
    return work, functools.partial(tensor.copy_, work)


def _refusing(method):
    """One of our calls (the library's all-reduce and its halves): whatever
    leaves it on this rank is dealt with as whatever leaves a call of the
    library (:func:`~mpi_allreduce.api.left`) -- an exception from the
    backend's own work before or between the library's calls (an op it
    does not support, a sparse tensor or one on another device, lists
    that do not match, torch's own checks) is this rank's refusal of the
    call (an empty call of its own first, so that where only this rank
    refuses, its peers' call stalls with it, reported on every rank,
    instead of meeting this rank's next call), an interrupt there breaks
    the group's communicator; the library's own errors, and refusals it
    made already, pass as they are."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            left(self.comm, exc)
    return call


def _pairs(kind: str, outputs, inputs) -> None:
    """Refuse outputs and inputs that do not pair up (one output for each
    input; ``zip`` would drop the rest, a result never written)."""
    if len(outputs) != len(inputs):
        raise ValueError(f"{kind}: {len(outputs)} outputs for {len(inputs)} inputs")


def _prepared(run) -> tuple:
    """(``run()``, None), or (None, its exception): a rank's own refusal of
    its tensors in an MPI-side collective (sparse, on a device it does not
    take, ...), found before the call's agreement so that every rank
    raises together (see :meth:`MPIAllreduceGroup._agreed`), never one
    rank alone while its peers' collective goes ahead."""
    try:
        return run(), None
    except (TypeError, ValueError, RuntimeError) as exc:
        return None, exc


def _mpi_side(method):
    """One of MPI's calls on the group (broadcast, gather, scatter,
    all-to-all, send/recv, barrier).  On a group where one stalled or was
    left by an exception, or whose communicator the library broke, it
    raises that again before posting anything: its messages could meet the
    earlier call's.  And whatever leaves it on this rank, but its agreed
    verdict (:meth:`MPIAllreduceGroup._agreed`: every rank raised it) and
    the library's own errors, breaks the group and the library's
    communicator there: an interrupt between the agreement and the post,
    say, leaves this rank one collective behind its peers."""
    name = method.__name__

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        try:
            self._refuse_if_broken()
            return method(self, *args, **kwargs)
        except BaseException as exc:
            if not (isinstance(exc, OWN_ERRORS) or refused_everywhere(exc)):
                self._breaks(exc, name)
            raise
    return checked


class MPIAllreduceGroup(dist.ProcessGroup):
    """A ProcessGroup whose collectives run on ``comm`` (an MPI communicator
    of the group's ranks, in group-rank order)."""

    def __init__(self, rank: int, size: int, comm: MPI.Intracomm):
        super().__init__(rank, size)
        self.comm = comm
        #: why the group is unusable (a call on it stalled or was left by an
        #: interrupt: Stalled or Broken, raised anew by each later call), or None
        self._broken: Optional[Broken] = None

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def _what(self, kind: str) -> str:
        """How the watchdog's report names a call of ``kind`` on this group."""
        comm = self.comm
        return (f"{kind} on the {BACKEND} backend's group of {comm.Get_size()} ranks "
                f"(rank {comm.Get_rank()} here)")

    def _refuse_if_broken(self) -> None:
        """Raise as a call on a broken group (or communicator) does."""
        if self._broken is not None:
            raise type(self._broken)(str(self._broken))
        context = cached_context(self.comm)
        if context is not None and context.broken is not None:
            raise context.refusal()

    def _breaks(self, exc: BaseException, what: str) -> None:
        """``exc`` left an MPI-side call on this rank: the group, and the
        library's communicator, are broken here."""
        self._broken = Broken(f"an earlier call on this group ({what}) was left by "
                              f"{type(exc).__name__}: {exc}; its messages are in disarray")
        broken_by(self.comm, exc, self._what(what))

    def _stalled(self, report: str) -> None:
        """A call on the group stalled: every later MPI call on it is refused
        (and the library's calls on its communicator: the request's stall
        broke the library's context of it, see ``progress.mpi_request``)."""
        self._broken = Stalled("an earlier call on this group stalled, its messages are in "
                               "disarray: " + report)

    def _agreed(self, kind: str, shape: tuple, sends=None, receives=None,
                error: Optional[Exception] = None) -> None:
        """Before an MPI-side collective moves a byte, every rank's
        description of it, compared on every rank (MPI's own collectives
        match by call order alone: a broadcast of 6 elements into 4 or 8,
        a gather of blocks of 2 into places of 3, a tensor of another dtype
        are a truncation error on one rank or silently partial or foreign
        bytes on another).  ``shape``: what must be the same everywhere
        (the root, the dtypes and sizes of the blocks); ``sends`` and
        ``receives``: (peers, bytes) of a call whose blocks differ by pair
        (all-to-all), compared as sums of hashes of every message (see
        :func:`_traffic`); ``error``: this rank's own refusal of its
        arguments.  One watched ``MPI_Iallgather`` of 32 bytes a rank;
        every rank reads the same rows, so every rank raises together --
        this rank's ``error``, else :class:`~mpi_allreduce.errors.ArgumentMismatch`
        -- or none does."""
        comm = self.comm
        size = comm.Get_size()
        if size == 1:
            if error is not None:
                error.refused_everywhere = True
                raise error
            return
        self._refuse_if_broken()  # (nothing is posted on a broken group)
        me = comm.Get_rank()
        mine = np.zeros(4, np.uint64)
        mine[0] = _digest((kind,) + shape)
        mine[1] = error is not None
        if sends is not None:
            mine[2] = _traffic(me, sends[0], sends[1], 0)
            mine[3] = _traffic(receives[0], me, receives[1], 0)
        rows = np.empty((size, 4), np.uint64)
        what = self._what(f"{kind} (its shape agreed)")
        try:  # (left by a stall or an interrupt, the library's context of comm breaks too)
            wait_for([comm.Iallgather(mine, rows)], what, cached_context(comm))
        except Stalled as exc:
            self._stalled(str(exc))
            raise
        except BaseException as exc:  # (an interrupt: the group's next call would meet it)
            self._broken = Broken(f"an earlier call on this group ({what}) was left by "
                                  f"{type(exc).__name__}: {exc}; its messages are in disarray")
            raise
        try:  # (the verdict, the same on every rank: it breaks nothing, see _mpi_side)
            if error is not None:
                raise error
            refused = [r for r in range(size) if rows[r, 1]]
            if refused:
                raise ArgumentMismatch(f"{kind}: rank(s) {refused} of this group refused their "
                                       "arguments; no rank sent anything")
            other = [r for r in range(size) if rows[r, 0] != rows[0, 0]]
            if other:
                raise ArgumentMismatch(
                    f"{kind}: the ranks disagree about the call (the root, the tensors' dtypes "
                    f"or sizes): rank(s) {other} differ from rank 0; this rank has {shape}; "
                    "no rank sent anything")
            if rows[:, 2].sum(dtype=np.uint64) != rows[:, 3].sum(dtype=np.uint64):
                raise ArgumentMismatch(
                    f"{kind}: what the ranks send each other does not match what they expect to "
                    "receive (split sizes or tensor sizes that differ by pair); no rank sent "
                    "anything")
        except Exception as verdict:
            verdict.refused_everywhere = True
            raise

    def _started(self, kind: str, requests, result, opts, after=(),
                 status=None) -> "dist.Work":
        """The Work of a call whose requests are in flight (completed now
        unless it overlaps, see :func:`_overlaps`), watched as ``kind``."""
        work = _Work(requests, result, after, status, kind, self, cancel=kind == "recv")
        if not _overlaps(opts):
            work.wait()
        return work

    # --- ours ------------------------------------------------------------------------------
    def _one_count(self, kind: str, tensors) -> None:
        """A call of ours given several tensors makes one library call for
        each: the ranks first agree on how many (:meth:`_agreed`), or a rank
        given fewer than its peers would meet their next call with its own
        (where one rank gives one tensor and its peers more, the one rank's
        call and the others' agreement stall, reported on every rank)."""
        if len(tensors) > 1:
            self._agreed(kind, (len(tensors),))

    def _no_tensors(self, kind: str):
        """A call of ours given no tensors: an empty call of its own
        (``api.empty_call``), never none at all."""
        empty_call(self.comm, f"torch: {kind} of no tensors")
        return _Done([])

    @_refusing
    @_on_device(ours=True)
    def allreduce(self, tensors, opts=None, _tag: str = ""):
        """(``_tag``: what else tells this call from another of the same
        count and dtype, in its op's identity, ``ops.tagged``: a coalesced
        call's tensor sizes.  A pre-multiplied sum is tagged too: ranks that
        pre-multiply and ranks that do not stall instead of summing.)"""
        if not tensors:
            return self._no_tensors("all_reduce")
        op, factor = _reduction(opts)
        self._one_count("all_reduce", tensors)
        if factor is not None:
            for tensor in tensors:
                tensor.mul_(factor)
        if _tag:
            op = tagged("sum" if factor is not None else op,
                        f"premul {_tag}" if factor is not None else _tag)
        # async_op is each rank's own choice in torch: it must not change the
        # messages, so both take the non-blocking call where MPI runs threads
        # (the synchronous one waits at once); a reproducible sum and live
        # selection (which times blocking calls) are blocking whatever
        # async_op says
        if not ASYNC or _OPTIONS.get("reproducible") or _OPTIONS.get("selection") == "live":
            for tensor in tensors:
                _in_place(tensor, lambda t: allreduce(MPI.IN_PLACE, t, op, comm=self.comm,
                                                      **_OPTIONS))
            return _Done(tensors)
        # (every tensor's view first: a tensor that this rank refuses is
        # refused before any of the call's requests starts)
        parts = [_contiguous(tensor) for tensor in tensors]
        views = [_array(work, keep=back is None) for work, back in parts]
        requests = [iallreduce(MPI.IN_PLACE, view, op, comm=self.comm, **_REQUEST_OPTIONS)
                    for view in views]
        after = [back for _, back in parts if back is not None]
        return self._started("all_reduce", requests, tensors, opts, after)

    @_refusing
    def allreduce_coalesced(self, tensors, opts=None):
        """One all-reduce of every tensor packed together (as gloo's):
        one call, and a tensor given twice is reduced once (each copy in
        the flat buffer holds the sum) and written back from it."""
        _dense(tensors)
        if len(tensors) < 2:
            return self.allreduce(tensors, opts)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        sizes = [t.numel() for t in tensors]

        def unpack():
            for tensor, piece in zip(tensors, torch.split(flat, sizes)):
                tensor.copy_(piece.reshape(tensor.shape))
        # (the tensors' sizes in the call's identity: one flat call's count
        # alone would let [3, 5] on one rank meet [5, 3] on another)
        work = self.allreduce([flat], opts, _tag=f"coalesced {len(sizes)}:"
                              f"{zlib.crc32(repr(sizes).encode()):08x}")
        if work.is_completed():
            unpack()
            return _Done(tensors)
        return _Chained(work, unpack, tensors)

    @_refusing
    @_on_device(ours=True)
    def reduce_scatter(self, outputs, inputs, opts=None):
        op, factor = _reduction(opts)
        _pairs("reduce_scatter", outputs, inputs)
        self._one_count("reduce_scatter", outputs)
        for output, parts in zip(outputs, inputs):
            whole = _array(_scaled(torch.cat([p.reshape(-1) for p in parts]), factor))
            _in_place(output, lambda t: collectives.reduce_scatter(
                whole, t, op, [p.numel() for p in parts], comm=self.comm, **_halves()))
        return _Done(outputs)

    @_refusing
    @_on_device(ours=True)
    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002 - torch's name
        op, factor = _reduction(opts)
        _in_place(output, lambda t: collectives.reduce_scatter(
            _array(_scaled(_contiguous(input)[0], factor)), t, op, comm=self.comm, **_halves()))
        return _Done(output)

    _reduce_scatter_base = reduce_scatter_single

    @_refusing
    @_on_device(ours=True)
    def allgather(self, outputs, inputs, opts=None):
        _pairs("all_gather", outputs, inputs)
        self._one_count("all_gather", inputs)
        for output_list, tensor in zip(outputs, inputs):
            counts = [o.numel() for o in output_list]
            whole = torch.empty(sum(counts), dtype=tensor.dtype, device=tensor.device)
            collectives.allgather(_array(_contiguous(tensor)[0]), _array(whole), counts,
                                  comm=self.comm, **_halves())
            for piece, out in zip(torch.split(whole, counts), output_list):
                out.copy_(piece.reshape(out.shape))
        return _Done(outputs)

    @_refusing
    @_on_device(ours=True)
    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's name
        """``input`` may be this rank's block of ``output`` (FSDP2 gathers in
        place): then MPI.IN_PLACE; any other overlap gathers a copy."""
        _dense([input, output])
        block = input.numel() * input.element_size()
        if output.is_contiguous() and input.is_contiguous() and input.numel() and \
                input.dtype == output.dtype and \
                input.data_ptr() == output.data_ptr() + self.rank() * block:
            send = MPI.IN_PLACE
        else:
            overlaps = input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()
            send = _array(input.clone() if overlaps else _contiguous(input)[0])
        _in_place(output, lambda t: collectives.allgather(send, t, comm=self.comm,
                                                           **_halves()))
        return _Done(output)

    _allgather_base = all_gather_single

    # --- the coalesced forms: one call per tensor ---------------------------------------
    @_refusing
    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """torch's layout: ``output_lists[rank][i]`` receives rank
        ``rank``'s ``inputs[i]`` (one allgather per input)."""
        if len(output_lists) != self.size() or any(len(o) != len(inputs) for o in output_lists):
            raise ValueError(f"all_gather_coalesced: output_tensor_lists must hold "
                             f"{self.size()} lists (one a rank) of {len(inputs)} tensors "
                             "(one an input)")
        return self.allgather([[output_lists[r][i] for r in range(self.size())]
                               for i in range(len(inputs))], inputs, opts)

    @_refusing
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        if not inputs:
            return self._no_tensors("all_gather_into_tensor_coalesced")
        _pairs("all_gather_into_tensor_coalesced", outputs, inputs)
        self._one_count("all_gather_into_tensor_coalesced", inputs)
        for output, tensor in zip(outputs, inputs):
            self.all_gather_single(output, tensor, opts)
        return _Done(outputs)

    @_refusing
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        if not inputs:
            return self._no_tensors("reduce_scatter_tensor_coalesced")
        _pairs("reduce_scatter_tensor_coalesced", outputs, inputs)
        self._one_count("reduce_scatter_tensor_coalesced", inputs)
        for output, tensor in zip(outputs, inputs):
            self.reduce_scatter_single(output, tensor, opts)
        return _Done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # --- what it does not do: an error, never the name-holding backend's nothing -------
    def _unsupported(name: str):
        def refuse(self, *args, **kwargs):
            raise RuntimeError(f"the {BACKEND} backend does not support {name}")
        refuse.__name__ = name
        refuse.__doc__ = f"Not supported: raises RuntimeError ({name})."
        return refuse

    monitored_barrier = _unsupported("monitored_barrier")
    split_group = _unsupported("split_group (use dist.new_group)")
    merge_remote_group = _unsupported("merge_remote_group")
    del _unsupported

    # --- MPI's (bytes: every dtype travels as it is) ------------------------------------
    @_on_device(ours=False)
    @_mpi_side
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        parts, error = _prepared(lambda: [(_bytes(_array(work)), back)
                                          for work, back in map(_contiguous, tensors)])
        self._agreed("broadcast", (root, _described(tensors)), error=error)
        requests = [self.comm.Ibcast(view, root=root) for view, _ in parts]
        after = [back for _, back in parts
                 if back is not None and self.comm.Get_rank() != root]
        return self._started("broadcast", requests, tensors, opts, after)

    @_refusing
    @_on_device(ours=True)
    def reduce(self, tensors, opts=None):
        """Our all-reduce on a copy, which the root keeps (every dtype and op
        the all-reduce takes, in the same order of combination)."""
        if not tensors:
            return self._no_tensors("reduce")
        root = opts.rootRank if opts is not None else 0
        op, factor = _reduction(opts)
        _dense(tensors)
        self._one_count("reduce", tensors)
        for tensor in tensors:
            work = (tensor.clone() if factor is None else tensor * factor).contiguous()
            allreduce(MPI.IN_PLACE, _array(work), op, comm=self.comm, **_OPTIONS)
            if self.comm.Get_rank() == root:
                tensor.copy_(work)
        return _Done(tensors)

    @_on_device(ours=False)
    @_mpi_side
    def gather(self, outputs, inputs, opts=None):
        root = opts.rootRank if opts is not None else 0
        is_root = self.comm.Get_rank() == root
        mine, error = _prepared(lambda: (_dense(outputs[0]) if is_root else None,
                                         _bytes(_array(_contiguous(inputs[0])[0])))[1])
        if is_root and error is None:
            error = _blocks_match("gather", "output", outputs[0], inputs[0], self.size())
        self._agreed("gather", (root, _described(inputs[:1])), error=error)
        if not is_root:
            return self._started("gather", [self.comm.Igather(mine, None, root=root)], outputs,
                                 opts)
        whole = np.empty(mine.size * self.comm.Get_size(), np.uint8)
        request = self.comm.Igather(mine, whole, root=root)

        def unpack():
            for piece, out in zip(np.split(whole, self.comm.Get_size()), outputs[0]):
                _in_place(out, lambda t: np.copyto(_bytes(t), piece))
        return self._started("gather", [request], outputs, opts, [unpack])

    @_on_device(ours=False)
    @_mpi_side
    def scatter(self, outputs, inputs, opts=None):
        root = opts.rootRank if opts is not None else 0
        is_root = self.comm.Get_rank() == root
        error = None
        if is_root:
            error = _blocks_match("scatter", "input", inputs[0], outputs[0], self.size())

        def views():
            out, back = _contiguous(outputs[0])
            whole = None
            if is_root and error is None:
                whole = np.concatenate([_bytes(_array(_contiguous(t)[0])) for t in inputs[0]])
            return _bytes(_array(out)), back, whole
        prepared, own = _prepared(views)
        self._agreed("scatter", (root, _described(outputs[:1])), error=error or own)
        mine, back, whole = prepared
        request = self.comm.Iscatter(whole, mine, root=root)
        return self._started("scatter", [request], outputs, opts,
                             [back] if back is not None else [])

    @_on_device(ours=False)
    @_mpi_side
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                      opts=None):
        size = self.comm.Get_size()
        error = None
        sends = receives = (list(range(size)), [0] * size)
        try:
            if input.dtype != output.dtype:
                raise TypeError(f"all_to_all_single: input is {input.dtype}, output "
                                f"{output.dtype}")
            sent = _splits(input_split_sizes, input, input.numel() * input.element_size(), size)
            got = _splits(output_split_sizes, output, output.numel() * output.element_size(),
                          size)
            sends, receives = (list(range(size)), sent[0]), (list(range(size)), got[0])
            out, back = _contiguous(output)
            source = _bytes(_array(_contiguous(input)[0]))
            target = _bytes(_array(out))
        except (TypeError, ValueError, RuntimeError) as exc:
            error = exc
        self._agreed("all_to_all_single", (str(input.dtype),), sends, receives, error)

        request = self.comm.Ialltoallv([source, sent, MPI.BYTE], [target, got, MPI.BYTE])
        return self._started("all_to_all_single", [request], output, opts,
                             [back] if back is not None else [])

    @_on_device(ours=False)
    @_mpi_side
    def alltoall(self, outputs, inputs, opts=None):
        size = self.comm.Get_size()
        error = None
        if len(inputs) != size or len(outputs) != size:
            error = ValueError(f"all_to_all: {len(inputs)} inputs and {len(outputs)} outputs "
                               f"on a group of {size} ranks (one a rank)")
        dtypes = sorted({str(t.dtype) for t in list(inputs) + list(outputs)})
        if len(dtypes) > 1 and error is None:
            error = TypeError(f"all_to_all: tensors of several dtypes {dtypes}")
        sends, own = _prepared(lambda: (_dense(outputs),
                                        [_bytes(_array(_contiguous(t)[0])) for t in inputs])[1])
        peers = list(range(min(size, len(inputs), len(outputs))))
        self._agreed("all_to_all", tuple(dtypes[:1]),
                     (peers, [inputs[j].numel() * inputs[j].element_size() for j in peers]),
                     (peers, [outputs[i].numel() * outputs[i].element_size() for i in peers]),
                     error or own)
        source = np.concatenate(sends) if sends else np.empty(0, np.uint8)
        recv_counts = [t.numel() * t.element_size() for t in outputs]
        target = np.empty(sum(recv_counts), np.uint8)
        send_counts = [s.size for s in sends]
        request = self.comm.Ialltoallv([source, (send_counts, _offsets(send_counts)), MPI.BYTE],
                                       [target, (recv_counts, _offsets(recv_counts)), MPI.BYTE])

        def unpack():
            at = 0
            for out, n in zip(outputs, recv_counts):
                _in_place(out, lambda t: np.copyto(_bytes(t), target[at:at + n]))
                at += n
        return self._started("all_to_all", [request], outputs, opts, [unpack])

    @_on_device(ours=False)
    @_mpi_side
    def send(self, tensors, dst, tag=0):
        requests = [self.comm.Isend(_bytes(_array(_contiguous(t)[0])), dst, tag=tag)
                    for t in tensors]
        return self._started("send", requests, tensors, None)

    @_on_device(ours=False)
    @_mpi_side
    def recv(self, tensors, src, tag=0, status=None):
        requests, after = [], []
        for tensor in tensors:
            work, back = _contiguous(tensor)
            requests.append(self.comm.Irecv(_bytes(_array(work)), src, tag=tag))
            if back is not None:
                after.append(back)
        return self._started("recv", requests, tensors, None, after, status)

    def recv_anysource(self, tensors, tag=0):
        """``dist.recv`` without ``src``: from whichever rank sends first (on
        the group's own communicator, which no library message uses); the
        Work's ``_source_rank()`` says which."""
        if len(tensors) != 1:
            raise ValueError(f"recv from any source takes one tensor, got {len(tensors)}")
        return self.recv(tensors, MPI.ANY_SOURCE, tag, MPI.Status())

    @_mpi_side
    def barrier(self, opts=None):
        # (agreed as MPI's other collectives are: a barrier on one rank where
        # its peers broadcast is told apart, not matched with theirs)
        self._agreed("barrier", ())
        return self._started("barrier", [self.comm.Ibarrier()], None, opts)

    def shutdown(self) -> None:
        """torch destroys the group (``destroy_process_group``, every member
        calls it): the library's duplicate communicator and caches for it
        and the group's own communicator are freed; a later call on the
        group raises."""
        comm, self.comm = self.comm, MPI.COMM_NULL
        if comm != MPI.COMM_NULL:
            release(comm)
            comm.Free()
        try:  # (the do-nothing backend that holds the group's name)
            super().shutdown()
        except (AttributeError, RuntimeError):
            pass

    def __repr__(self) -> str:
        return f"<{BACKEND} process group: rank {self.rank()} of {self.size()}>"


def _create(options, backend_options=None) -> MPIAllreduceGroup:
    """torch's creator (extended API): the group's MPI communicator from its
    global ranks (collective over the members only, as torch calls it)."""
    world = MPI.COMM_WORLD
    ranks = list(getattr(options, "global_ranks_in_group", []) or [])
    what = f"making a {BACKEND} process group of {len(ranks) or world.Get_size()} ranks"
    if not ranks or ranks == list(range(world.Get_size())):
        comm = duplicate(world, what + ": MPI_Comm_idup")
    else:  # (collective over the members only, as torch calls it: waited for, watched)
        whole = world.Get_group()
        members = whole.Incl(ranks)
        try:
            comm = wait_for_call(lambda: world.Create_group(members),
                                 what + ": MPI_Comm_create_group", key=world.handle)
        finally:
            members.Free()
            whole.Free()
    if comm.Get_size() != options.group_size or comm.Get_rank() != options.group_rank:
        raise RuntimeError(f"{BACKEND}: torch's group (rank {options.group_rank} of "
                           f"{options.group_size}) is not MPI's (rank {comm.Get_rank()} of "
                           f"{comm.Get_size()}): launch every process with mpiexec or srun")
    # the library's set-up (its own duplicate of the communicator), collective
    # here as the group's making is in torch, not at the group's first call
    setup(comm)
    group = MPIAllreduceGroup(options.group_rank, options.group_size, comm)
    _hold_name(group)
    return group


def _hold_name(group: MPIAllreduceGroup) -> None:
    """Give the group a place for the name torch sets on it (FSDP2's
    ``DeviceMesh`` asks for it).  torch keeps a group's name in its C++
    backends, and a group written in Python has none: a do-nothing C++
    backend (torch's ``FakeProcessGroup``) is registered to hold it.  Every
    collective of the group is the group's own method (the ``_coalesced``
    ones too), so none reaches that backend; without it the name is unset
    and FSDP2 does not run."""
    fake = getattr(torch._C._distributed_c10d, "FakeProcessGroup", None)
    try:  # (torch's internals: where they differ, the group runs without a name)
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM,
                                fake._create_internal(group.rank(), group.size()))
    except (AttributeError, TypeError, RuntimeError):
        pass


#: rank 0's store server when this module filled in ``MASTER_PORT``: held
#: for the life of the process, so the port stays taken; torch's rank 0
#: store (a multi-tenant ``TCPStore``) joins this server on that port at
#: every ``env://`` rendezvous instead of binding one of its own, and each
#: rendezvous keeps its keys apart (:func:`_fresh_keys`)
_SERVER: Optional[dist.TCPStore] = None

#: the process that filled in the environment (:func:`_fill_environment`):
#: processes it starts inherit the values, which are not theirs
_FILLED_BY = "MPI_ALLREDUCE_TORCH_ENV_OF"

#: the longest host name :func:`_fill_environment` passes on (bytes; DNS's limit)
_HOST_BYTES = 255


def _fill_environment() -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from MPI,
    unless the launcher set them (collective over COMM_WORLD, every message
    watched).

    Values that another process filled in (a parent that imported this
    module, then started these processes under mpiexec: a test suite, a
    driver script) are filled in again: they name the parent's rank, size
    and store, not this job's.

    Rank 0 starts the rendezvous store's server itself, on a port the
    system picks, and keeps it (:data:`_SERVER`): a port probed and let go
    would be free for anyone to take before torch binds it, and a rank 0
    that then fails to bind leaves the other ranks waiting on it.  Where
    the server cannot start here, rank 0 falls back to a probed port
    (torch binds it later)."""
    global _SERVER
    world = MPI.COMM_WORLD
    what = "filling in the torch environment"
    # (values another process filled in -- a parent that imported this module
    # and then started these processes -- are its own, not a launcher's)
    inherited = os.environ.get(_FILLED_BY, str(os.getpid())) != str(os.getpid())
    missing = np.array([inherited or not all(name in os.environ for name in
                                             ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                              "MASTER_PORT"))], dtype=np.int32)
    wait_for([world.Iallreduce(MPI.IN_PLACE, missing, MPI.MAX)], what + ": whether it is needed")
    if not missing[0]:
        return
    address = np.zeros(2 + _HOST_BYTES, dtype=np.uint8)   # the port's two bytes, then the host
    if world.Get_rank() == 0:
        host = socket.gethostname().encode()[:_HOST_BYTES]
        try:  # (its own client connects through the loopback: the server listens on all)
            _SERVER = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                                    wait_for_workers=False, timeout=timedelta(seconds=30))
            port = int(_SERVER.port)
        except (RuntimeError, OSError, TypeError):  # (TypeError: a stand-in torch, as the
            # documentation's build imports this module with, whose store has no port)
            with socket.socket() as probe:
                probe.bind(("", 0))
                port = probe.getsockname()[1]
        address[:2] = divmod(port, 256)
        address[2:2 + len(host)] = np.frombuffer(host, dtype=np.uint8)
    wait_for([world.Ibcast(address, root=0)], what + ": rank 0's host and port")
    port = int(address[0]) * 256 + int(address[1])
    host = address[2:].tobytes().rstrip(b"\0").decode()
    local = on_node(world, what + ": where the ranks run")[0]
    os.environ.update({"RANK": str(world.Get_rank()), "WORLD_SIZE": str(world.Get_size()),
                       "LOCAL_RANK": str(local), "MASTER_ADDR": host,
                       "MASTER_PORT": str(port), _FILLED_BY: str(os.getpid())})


def _ranks_from_mpi(handler):
    """torch's rendezvous ``handler`` (``file://``, ``tcp://``) with this
    process's rank and the world size from MPI where the URL names neither
    and mpiexec started more than one rank (a lone process, as under
    torchrun, keeps torch's own error)."""
    def rendezvous(url: str, **kwargs):
        parts = urlparse(url)
        query = dict(pair.split("=", 1) for pair in parts.query.split("&") if "=" in pair)
        world = MPI.COMM_WORLD
        if "rank" not in query and "world_size" not in query and world.Get_size() > 1:
            query.update(rank=str(world.Get_rank()), world_size=str(world.Get_size()))
            url = urlunparse(parts._replace(query="&".join(f"{k}={v}"
                                                           for k, v in query.items())))
        return handler(url, **kwargs)
    rendezvous.wrapped = handler
    return rendezvous


#: the group's methods -> the names torch's backends give their profiler
#: events (``<backend>:<name>``, as gloo's ``gloo:all_reduce``) and which
#: positional argument holds the call's input tensors, whose shapes the
#: event records (as torch's MPI backend records its Work's inputs; None:
#: no tensors)
_PROFILED = {
    "allreduce": ("all_reduce", 0), "allreduce_coalesced": ("all_reduce", 0),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_single": ("_reduce_scatter_base", 1),
    "_reduce_scatter_base": ("_reduce_scatter_base", 1), "allgather": ("all_gather", 1),
    "all_gather_single": ("_allgather_base", 1), "_allgather_base": ("_allgather_base", 1),
    "allgather_coalesced": ("all_gather", 1),
    "allgather_into_tensor_coalesced": ("allgather_into_tensor_coalesced", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", 1),
    "broadcast": ("broadcast", 0), "reduce": ("reduce", 0), "gather": ("gather", 1),
    "scatter": ("scatter", 1), "alltoall_base": ("all_to_all", 1), "alltoall": ("all_to_all", 1),
    "send": ("send", 0), "recv": ("recv", 0), "recv_anysource": ("recvAnySource", 0),
    "barrier": ("barrier", None),
}


def _tensors_in(value) -> list:
    """The tensors of one argument of a call: a tensor, or a list of them
    (a list of lists for the per-rank inputs of reduce_scatter)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    return []


def _profiled(method, title: str, inputs):
    """``method`` recording an event ``<backend>:<title>`` in torch's
    profiler while one runs (``torch.profiler``, the autograd profiler),
    with the shapes of its input tensors (positional argument ``inputs``):
    it starts with the call and ends on the thread that completes the
    call's work (the progress thread) (:class:`_Profiled`), so it spans an
    asynchronous call's messages.  Nothing is recorded, and one check is
    the cost, while no profiler runs."""
    name = f"{BACKEND}:{title}"
    # (the inputs' parameter by name too: a call may pass it by keyword)
    keyword = None if inputs is None else list(inspect.signature(method).parameters)[inputs + 1]

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if not torch.autograd._profiler_enabled() or getattr(_RECORDING, "on", False):
            return method(self, *args, **kwargs)
        _RECORDING.on = True  # (a coalesced call's inner calls are part of its event)
        try:
            tensors = [] if inputs is None else _tensors_in(
                args[inputs] if inputs < len(args) else kwargs.get(keyword))
            event = _Event(name, tensors)
            try:
                return _Profiled(method(self, *args, **kwargs), event)
            except BaseException:
                event.end()
                raise
        finally:
            _RECORDING.on = False
    return call


class _Event:
    """One event of torch's profiler, begun here with its input tensors
    (their shapes are recorded where the profiler records shapes) and
    ended by :meth:`end` on any thread: its end callbacks run when a
    future completes (the profiler's state goes with them to the thread
    that completes it, so that thread's end is recorded, and the profiler
    calls the event asynchronous, as it calls torch's backends' events)."""

    def __init__(self, name: str, tensors: list):
        handle = torch._C._autograd._record_function_with_args_enter(name, *tensors)
        self._ended = Future()
        try:
            torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction(handle,
                                                                             self._ended)
        except BaseException:
            torch._C._autograd._record_function_with_args_exit(handle)  # (ended here, then)
            raise

    def end(self) -> None:
        self._ended.set_result(None)


class _Profiled(dist.Work):
    """A call's Work while torch's profiler runs: the call's event ends on
    the progress thread once the call is complete, as torch's backends
    end theirs on their worker threads (so the profiler shows it as an
    asynchronous event spanning the messages, as it shows theirs);
    ``wait()`` and the future complete after the event has ended."""

    def __init__(self, work, event: _Event):
        super().__init__()
        self._work, self._event = work, event
        self._future = _Future(functools.partial(self._complete_here, work.get_future()))
        work.get_future().add_done_callback(self._elsewhere)

    def _elsewhere(self, future: Future) -> None:
        """The end on the progress thread: there already for a call it
        completes; handed over for one complete before (a blocking call)."""
        if threading.get_ident() == ENGINE.ident:
            self._complete(future)
        else:
            ENGINE.soon(functools.partial(self._complete, future))

    def _complete(self, future: Future) -> None:
        """(On the progress thread, the thread that completes calls; once.)"""
        if self._future.done():
            return
        self._event.end()
        try:
            value = future.value()
        except BaseException as exc:  # noqa: BLE001 - handed to wait() and the future
            self._future.set_exception(_as_exception(exc))
        else:
            self._future.set_result(value)

    def _complete_here(self, future: Future) -> None:
        """The future's ``complete_here`` (a callback's wait on the thread)."""
        future.wait()
        self._complete(future)

    def wait(self, timeout=None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._work.exception() is None

    def exception(self):
        return self._work.exception() if self._future.done() else None

    def get_future(self) -> Future:
        return self._future

    def _source_rank(self) -> int:  # noqa: N802 - torch's name
        return self._work._source_rank()


#: whether this thread is inside a recorded call
_RECORDING = threading.local()


for _method, (_title, _inputs) in _PROFILED.items():
    setattr(MPIAllreduceGroup, _method,
            _profiled(getattr(MPIAllreduceGroup, _method), _title, _inputs))
del _method, _title, _inputs


def _fresh_keys(handler):
    """torch's ``env://`` rendezvous ``handler``, where this module filled in
    the environment: each rendezvous of the process under a prefix of its
    own in the store.  Rank 0's store server (:data:`_SERVER`) lives as
    long as the process -- a group made again right after one is destroyed
    finds it there, where a server torn down with the group would reset
    the connection of a rank that came back sooner -- so a group made
    again must not read the keys the one before it left (torch names its
    groups from 0 again after ``destroy_process_group``)."""
    count = itertools.count()

    def rendezvous(url: str, **kwargs):
        number = next(count)
        for store, rank, size in handler(url, **kwargs):
            if os.environ.get(_FILLED_BY) == str(os.getpid()):
                store = dist.PrefixStore(f"{BACKEND}/{number}", store)
            yield store, rank, size
    rendezvous.wrapped = handler
    return rendezvous


def _take_ranks_from_mpi() -> None:
    module = importlib.import_module("torch.distributed.rendezvous")
    handlers = getattr(module, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict):  # (torch's internals: elsewhere, torch's own)
        return
    for scheme in ("file", "tcp"):
        if scheme in handlers and not hasattr(handlers[scheme], "wrapped"):
            handlers[scheme] = _ranks_from_mpi(handlers[scheme])
    if "env" in handlers and not hasattr(handlers["env"], "wrapped"):
        handlers["env"] = _fresh_keys(handlers["env"])


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
_take_ranks_from_mpi()
_fill_environment()
