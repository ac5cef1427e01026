"""Fusion: all-reduce many arrays as few messages.

Gradients arrive one tensor at a time during backpropagation, most of them
small.  A :class:`Fusion` packs them, in the order they are added, into
*buckets* of about ``bucket_bytes`` (one dtype per bucket), starts each
bucket's all-reduce as soon as it is full -- so it travels while more
gradients are computed -- and on :meth:`Fusion.wait` unpacks the results
into the arrays themselves (Horovod's tensor fusion, PyTorch DDP's
buckets).  Every rank must add the same arrays (shape and dtype) in the
same order.

Bucket boundaries depend only on that sequence, so the same inputs give the
same bytes every run.  A bucket of one array (one larger than a bucket, or
the last of its dtype) is reduced where it is, without packing.  A bucket that comes back with the same arrays'
shapes reuses its packing buffer and its persistent request
(:func:`~mpi_allreduce.allreduce_init`): a training loop's steady state
allocates nothing and builds nothing.

Packing copies every byte in and unpacking copies it out again.  Arrays
made by :meth:`Fusion.empty_like` live *inside* their buckets (as DDP's
``gradient_as_bucket_view`` gradients do): added in that order, a bucket of
them is reduced where it lies, so each byte moves once; the buckets and
therefore the bytes are the same as with packing.  Arrays added otherwise
are packed as before.

A :class:`Fusion` owns MPI resources (its buckets' persistent requests and
their tags): :meth:`Fusion.free` releases them, as does leaving a ``with
Fusion(...) as fusion:`` block or dropping the last reference to it.
"""

from __future__ import annotations

from collections import OrderedDict

from mpi4py import MPI

from .api import allreduce_init, iallreduce
from .backend import as_array, backend_for
from .ops import dtype_label

__all__ = ["Fusion", "bucket_bounds", "DEFAULT_BUCKET_BYTES"]

#: default bucket size (PyTorch DDP uses 25 MB, Horovod 64 MB; smaller
#: buckets start sooner, larger ones pay fewer per-message costs)
DEFAULT_BUCKET_BYTES = 4 << 20
#: buckets (packing buffer and persistent request) kept for reuse
MAX_KEPT = 64


def _finish(bucket) -> None:
    """Wait for a started bucket and write its results into its arrays."""
    bucket.request.wait()
    if bucket.buffer is None:  # reduced in place
        return
    backend = backend_for(bucket.buffer)
    offset = 0
    for array in bucket.arrays:
        backend.copy(array, bucket.buffer[offset:offset + array.size])
        offset += array.size


def bucket_bounds(nbytes: list, bucket_bytes: int) -> list:
    """Consecutive groups of arrays of these sizes, each group closed once it
    holds ``bucket_bytes`` or the next array would take it past that (an
    array larger than a bucket is a group of its own): ``(start, stop)``
    index pairs.  What :class:`Fusion` does as arrays arrive, in one go."""
    groups, start, held = [], 0, 0
    for i, n in enumerate(nbytes):
        if held and held + n > bucket_bytes:
            groups.append((start, i))
            start, held = i, 0
        held += n
        if held >= bucket_bytes:
            groups.append((start, i + 1))
            start, held = i + 1, 0
    if start < len(nbytes):
        groups.append((start, len(nbytes)))
    return groups


class _Home:
    """A bucket's own memory, handed out as arrays by :meth:`Fusion.empty_like`:
    the buffer, the arrays that are views of it (in order), and its
    persistent request (made on first use)."""

    __slots__ = ("buffer", "views", "request")

    def __init__(self, buffer, views: list):
        self.buffer, self.views, self.request = buffer, views, None


class _Bucket:
    """Arrays of one dtype being packed; then the request reducing them."""

    __slots__ = ("arrays", "nbytes", "buffer", "request")

    def __init__(self):
        self.arrays: list = []
        self.nbytes = 0
        self.buffer = self.request = None


class Fusion:
    """All-reduce arrays added one by one, in buckets started as they fill.

    >>> fusion = Fusion(comm, op="avg", bucket_bytes=1 << 22)
    >>> for grad in grads_in_backprop_order:   # as each is computed
    ...     fusion.add(grad)
    >>> fusion.wait()                          # every grad now holds the average

    ``op``, ``algorithm`` and ``comm`` as for :func:`~mpi_allreduce.allreduce`
    (``auto`` takes the decision table's choice for the bucket's size).
    """

    def __init__(self, comm: MPI.Intracomm = MPI.COMM_WORLD, op="sum",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, algorithm: str = "auto"):
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        self.comm, self.op, self.algorithm = comm, op, algorithm
        self.bucket_bytes = bucket_bytes
        self._open: dict = {}  # (dtype, backend) -> the bucket being filled
        self._started: list = []  # buckets in flight, in the order started
        #: (dtype, backend, shapes) -> [(buffer, persistent request), ...], least recent first
        self._kept: "OrderedDict[tuple, list]" = OrderedDict()
        #: buckets' own memory (empty_like): id(first view) -> its _Home (the views
        #: are held by their home, so an id here names the very array)
        self._homes: dict = {}
        #: inside allreduce(): the oldest bucket is finished as the next starts
        self._serial = False

    def add(self, array) -> None:
        """Queue ``array`` (reduced in place; do not touch it until
        :meth:`wait`).  Starts the bucket it fills."""
        array = as_array(array)
        if not backend_for(array).is_writeable(array):
            raise ValueError("fused arrays are reduced in place: this one is read-only")
        key = (dtype_label(array.dtype), backend_for(array))
        bucket = self._open.get(key)
        if bucket is not None and bucket.nbytes + array.nbytes > self.bucket_bytes:
            self._start(key)
            bucket = None
        if bucket is None:
            bucket = self._open[key] = _Bucket()
        bucket.arrays.append(array)
        bucket.nbytes += array.nbytes
        if bucket.nbytes >= self.bucket_bytes:
            self._start(key)

    def empty_like(self, arrays) -> list:
        """New arrays of the shapes, dtypes and devices of ``arrays`` that
        live inside the buckets they will fill: add them (all, in this
        order) and the buckets are reduced where they lie, with no packing
        and no unpacking.  Their values are uninitialised; write into them
        (``out=``, ``[...] =``) rather than rebinding them."""
        arrays = [as_array(a) for a in arrays]
        made = [None] * len(arrays)
        by_key: dict = {}
        for i, array in enumerate(arrays):
            by_key.setdefault((dtype_label(array.dtype), backend_for(array)), []).append(i)
        for (_, backend), where in by_key.items():
            sizes = [arrays[i].nbytes for i in where]
            for start, stop in bucket_bounds(sizes, self.bucket_bytes):
                members = where[start:stop]
                dtype = arrays[members[0]].dtype
                if len(members) == 1:  # a bucket of one is reduced where it is anyway
                    made[members[0]] = backend.empty_shaped(arrays[members[0]].shape, dtype)
                    continue
                buffer = backend.empty(sum(arrays[i].size for i in members), dtype)
                views, offset = [], 0
                for i in members:
                    view = buffer[offset:offset + arrays[i].size].reshape(arrays[i].shape)
                    offset += arrays[i].size
                    made[i] = view
                    views.append(view)
                self._homes[id(views[0])] = _Home(buffer, views)
        return made

    def _home_of(self, arrays: list):
        """The home whose views ``arrays`` are, all of them in order, or None."""
        home = self._homes.get(id(arrays[0]))
        if home is None or len(home.views) != len(arrays) or \
                any(a is not v for a, v in zip(arrays, home.views)):
            return None
        if home.request is None:
            home.request = allreduce_init(MPI.IN_PLACE, home.buffer, self.op, comm=self.comm,
                                          algorithm=self.algorithm)
        return home

    def flush(self) -> None:
        """Start every bucket still filling (:meth:`wait` does this first)."""
        for key in list(self._open):
            self._start(key)

    def wait(self) -> None:
        """Finish every bucket and write the results into the arrays."""
        self.flush()
        started, self._started = self._started, []
        for bucket in started:
            _finish(bucket)

    def free(self) -> None:
        """Release the kept buckets (packing buffers, persistent requests
        and their tags).  Not while buckets are in flight: wait() first."""
        if self._started:
            raise RuntimeError("Fusion.free() with buckets in flight: wait() first")
        kept, self._kept = self._kept, OrderedDict()
        for pool in kept.values():
            for _, request in pool:
                request.free()
        for home in self._homes.values():
            if home.request is not None:
                home.request.free()
                home.request = None

    def __enter__(self) -> "Fusion":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.wait()
        if not self._started:
            self.free()

    def __del__(self):
        if not getattr(self, "_started", True):
            self.free()

    def allreduce(self, arrays) -> None:
        """All-reduce every array of ``arrays`` in place, fused.  Nothing
        runs between the buckets here, so each is finished once the next
        has started: buckets in flight side by side would only share the
        memory and the progress (docs/results.md: fusion)."""
        self._serial = True
        try:
            for array in arrays:
                self.add(array)
            self.wait()
        finally:
            self._serial = False

    @property
    def buckets_in_flight(self) -> int:
        return len(self._started)

    def _start(self, key) -> None:
        self._launch(key)
        if self._serial and len(self._started) > 1:
            _finish(self._started.pop(0))

    def _launch(self, key) -> None:
        bucket = self._open.pop(key)
        (first, *more), backend = bucket.arrays, key[1]
        if not more and backend.is_contiguous(first):
            # one array alone (one larger than a bucket, say): reduced where
            # it is, without packing
            bucket.request = iallreduce(MPI.IN_PLACE, first, self.op, comm=self.comm,
                                        algorithm=self.algorithm)
            self._started.append(bucket)
            return
        home = self._home_of(bucket.arrays) if more else None
        if home is not None:  # the arrays live in the bucket: reduced where they lie
            bucket.request = home.request
            bucket.request.start()
            self._started.append(bucket)
            return
        bucket.buffer, bucket.request = self._reusable(key, bucket.arrays)
        backend = backend_for(bucket.buffer)
        offset = 0
        for array in bucket.arrays:
            backend.copy(bucket.buffer[offset:offset + array.size], array)
            offset += array.size
        bucket.request.start()
        self._started.append(bucket)

    def _reusable(self, key, arrays: list) -> tuple:
        """A packing buffer and its persistent request for arrays of these
        shapes: one kept from an earlier step if it is free, else a new one."""
        shapes = (key, tuple(a.shape for a in arrays))
        pool = self._kept.pop(shapes, [])
        self._kept[shapes] = pool  # most recently used last
        busy = {id(b.buffer) for b in self._started}
        for entry in pool:
            if id(entry[0]) not in busy:
                return entry
        buffer = backend_for(arrays[0]).empty(sum(a.size for a in arrays), arrays[0].dtype)
        entry = (buffer, allreduce_init(MPI.IN_PLACE, buffer, self.op, comm=self.comm,
                                        algorithm=self.algorithm))
        pool.append(entry)
        while len(self._kept) > MAX_KEPT:
            _, old = self._kept.popitem(last=False)
            for _, request in old:
                if not any(b.request is request for b in self._started):
                    request.free()
        return entry
