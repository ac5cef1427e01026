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
the last of its dtype) is reduced where it is, without packing (one made by
:meth:`Fusion.empty_like` through its home's call, below, which carries
which bucket it is).

A bucket's persistent call (:func:`~mpi_allreduce.allreduce_init`) carries
the bucket's *identity* in its spec, hence in the fingerprint its
messages' tags carry: the size of every array in it, in order (the dtype
and the total are in the spec already), and which bucket it is -- for a
packed bucket, the how-manieth bucket of exactly these sizes since the
last :meth:`Fusion.wait`; for a bucket of arrays made by
:meth:`Fusion.empty_like`, which of this fusion's homes (below) it is.
Both are functions of what every rank passes, never of the order in which
a rank happened to build its calls.  Ranks whose buckets differ (sizes
``[3, 5]`` on one rank and ``[5, 3]`` on another, buckets started in
another order) post messages that cannot match another bucket's: each
bucket is the same bucket on every rank or its call waits, and the
watchdog reports it.  (Packed arrays are known only by their sizes and
their place in the sequence: two arrays of one size swapped on one rank
are two other arrays of that size.)  A bucket that comes back with the
same identity reuses its packing buffer and its persistent request: a
training loop's steady state allocates nothing and builds nothing.

Packing copies every byte in and unpacking copies it out again.  Arrays
made by :meth:`Fusion.empty_like` live *inside* their buckets (as DDP's
``gradient_as_bucket_view`` gradients do): added in that order, a bucket of
them is reduced where it lies, so each byte moves once; the buckets and
therefore the bytes are the same as with packing.  Arrays added otherwise
are packed as before.  Such a bucket's memory (its *home*) and its
persistent request are made together in :meth:`Fusion.empty_like`, on
every rank at the same point of the program, so its tag is the same
everywhere whichever bucket a rank starts first.  An array of a home that
one rank rebinds (replaces by another of its size and dtype, letting the
old one go) is copied into the old one's place: still the same call as on
the other ranks.  While the old one is still referenced its place is not
free, the bucket is packed on that rank alone, and its call waits and is
reported.  A home is freed once none of its arrays is referenced any more,
and only the homes of the latest :data:`MAX_HOMES` buckets made keep their
requests (older ones are packed when added), so calling
:meth:`Fusion.empty_like` every step holds no more than the arrays the
caller keeps.

A :class:`Fusion` owns MPI resources (its buckets' persistent requests and
their tags): :meth:`Fusion.free` releases them, as does leaving a ``with
Fusion(...) as fusion:`` block or dropping the last reference to it.
"""

from __future__ import annotations

import weakref
import zlib
from collections import OrderedDict

from mpi4py import MPI

from .api import _request, empty_call, iallreduce, left, refused_everywhere
from .backend import as_array, backend_for
from .buffers import names_memory
from .context import broken_by, cached_context
from .errors import RequestError
from .ops import check_dtype, dtype_label, resolve_op
from .options import Options, options

__all__ = ["Fusion", "bucket_bounds", "DEFAULT_BUCKET_BYTES"]

#: default bucket size (PyTorch DDP uses 25 MB, Horovod 64 MB; smaller
#: buckets start sooner, larger ones pay fewer per-message costs)
DEFAULT_BUCKET_BYTES = 4 << 20
#: packed buckets (packing buffer and persistent request) kept for reuse
#: (never fewer than the last step had: those between two wait()s)
MAX_KEPT = 64
#: homes (empty_like's buckets) that keep their persistent requests: those
#: of the latest buckets made (never fewer than one empty_like call's)
MAX_HOMES = 128


def _finish(bucket) -> None:
    """Wait for a started bucket and write its results into the arrays
    that were packed into it."""
    bucket.request.wait()
    if bucket.home is not None:
        bucket.home.busy = False
    if not bucket.packed:  # reduced in place
        return
    buffer = bucket.buffer
    backend = backend_for(buffer)
    for array, start, stop in bucket.packed:
        backend.copy(array, buffer[start:stop])


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


def _spans(sizes: tuple) -> list:
    """Each array's ``(start, stop)`` in its bucket's buffer."""
    spans, offset = [], 0
    for n in sizes:
        spans.append((offset, offset + n))
        offset += n
    return spans


def _identity(what: str, sizes: tuple) -> str:
    """The salt of a bucket's spec: which bucket, and its arrays' sizes in
    order (a digest: the spec's fingerprint is one anyway)."""
    return f"fusion {what}: {len(sizes)} arrays, sizes {zlib.crc32(repr(sizes).encode()):08x}"


#: the salt of the empty call that stands for a step of no arrays
EMPTY_STEP = "fusion: a step with no arrays"


def _persistent(buffer, op, comm, opts: Options, salt: str):
    """``allreduce_init(MPI.IN_PLACE, buffer, op, ...)`` with ``salt`` in its spec."""
    return _request(MPI.IN_PLACE, buffer, op, comm, opts, persistent=True, salt=salt)


def _release(request) -> None:
    """Free a persistent request; one left active by a wait that raised (a
    stall: its communicator is unusable) is left as it is."""
    try:
        request.free()
    except RequestError:
        pass


def _strong(view):
    """A reference to an array without weak references: held for good."""
    return lambda: view


class _Home:
    """A bucket's own memory, handed out as arrays by :meth:`Fusion.empty_like`:
    the buffer, the arrays that are views of it (by weak reference: a
    home whose arrays are all gone is freed), their sizes, and its
    persistent request (made with the home), in flight or not."""

    __slots__ = ("key", "buffer", "refs", "sizes", "spans", "request", "busy")

    def __init__(self, key, buffer, refs: list, sizes: tuple, request):
        self.key, self.buffer, self.refs, self.sizes = key, buffer, refs, sizes
        self.spans, self.request, self.busy = _spans(sizes), request, False

    def view(self, index: int):
        """The array at ``index``, or None once it is gone."""
        return self.refs[index]()


class _Bucket:
    """Arrays of one dtype being packed; then the request reducing them.
    ``packed``: (array, start, stop) of each array copied into ``buffer``
    (and out again when it is done); ``home``: the home it is, if any."""

    __slots__ = ("arrays", "nbytes", "buffer", "request", "packed", "home")

    def __init__(self):
        self.arrays: list = []
        self.nbytes = 0
        self.buffer = self.request = self.home = None
        self.packed: list = []


class Fusion:
    """All-reduce arrays added one by one, in buckets started as they fill.

    >>> fusion = Fusion(comm, op="avg", bucket_bytes=1 << 22)
    >>> for grad in grads_in_backprop_order:   # as each is computed
    ...     fusion.add(grad)
    >>> fusion.wait()                          # every grad now holds the average

    ``op``, ``comm``, ``algorithm`` and the other options as for
    :func:`~mpi_allreduce.iallreduce` (``auto`` takes the decision table's
    choice for the bucket's size), checked here, once.
    """

    def __init__(self, comm: MPI.Intracomm = MPI.COMM_WORLD, op="sum",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, algorithm: str = "auto", **keywords):
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) \
                or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        self.options = options("request", algorithm=algorithm, **keywords)
        self._keywords = dict(keywords, algorithm=algorithm)
        self.comm, self.op, self.algorithm = comm, op, self.options.algorithm
        self.bucket_bytes = bucket_bytes
        self._open: dict = {}  # (dtype, backend) -> the bucket being filled
        self._started: list = []  # buckets in flight, in the order started
        #: the arrays added since the last wait, by id (each at most once a step)
        self._queued: dict = {}
        #: packed buckets by identity, (dtype, backend, sizes, occurrence) ->
        #: (buffer, persistent request), least recently used first
        self._kept: "OrderedDict[tuple, tuple]" = OrderedDict()
        #: buckets of each (dtype, backend, sizes) started since the last wait();
        #: how many of them were packed, and how many in the step before
        self._seen: dict = {}
        self._packed = self._packed_before = 0
        #: homes (empty_like's buckets) by number, oldest first; the number
        #: counts the homes this fusion made, alike on every rank
        self._homes: dict = {}
        self._made = 0
        #: buckets launched (counted as each leaves the queue)
        self._launched = 0
        #: id(array of a home) -> (home's number, index): an entry goes as its
        #: array dies, before the id can name another object
        self._where: dict = {}
        #: numbers of homes whose arrays have all died (freed by _sweep)
        self._dead: list = []
        #: inside allreduce(): the oldest bucket is finished as the next starts
        self._serial = False

    def add(self, array) -> None:
        """Queue ``array`` (reduced in place; do not touch it until
        :meth:`wait`).  Starts the bucket it fills."""
        launched, key, bucket, given, queued = self._launched, None, None, array, self._queued
        try:  # (one handler for the whole add: no gap between its parts)
            if not names_memory(array):
                raise TypeError(f"fused arrays are reduced in place: give an array or a buffer, "
                                f"not a {type(array).__name__} (it would be copied, and the "
                                "result lost)")
            array = as_array(array)
            if not backend_for(array).is_writeable(array):
                raise ValueError("fused arrays are reduced in place: this one is read-only")
            op = resolve_op(self.op)  # (refused here, never as its bucket starts)
            check_dtype(array.dtype, op)
            if backend_for(array).device and not op.device:
                raise TypeError(f"op {op.name!r} runs on host memory only")
            if queued.get(id(given)) is not None:
                self._refuse_if_broken()  # (a retry after an interrupt: Broken first)
                raise ValueError("this array is added already in this step (its bucket may "
                                 "be in flight): add each array once between two wait()s")
            key = (dtype_label(array.dtype), backend_for(array))
            bucket = self._open.get(key)
            # (closed as bucket_bounds closes a group: never a bucket of
            # empty arrays alone, so the buckets are empty_like's homes)
            if bucket is not None and bucket.nbytes and \
                    bucket.nbytes + array.nbytes > self.bucket_bytes:
                self._start(key)
                bucket = None
            if bucket is None:
                bucket = self._open[key] = _Bucket()
            bucket.arrays.append(array)
            bucket.nbytes += array.nbytes
            queued[id(given)] = given  # (held: its id names it until the step's wait)
            if bucket.nbytes >= self.bucket_bytes:
                self._start(key)
        except BaseException as exc:
            if key is None and isinstance(exc, Exception):
                # this rank's refusal of the array, before anything was
                # queued (api.left: where only this rank refuses it, its
                # peers' bucket with it stalls with this rank's empty call,
                # reported, instead of meeting its next bucket)
                left(self.comm, exc)
            # otherwise the add has not added (the array taken back from a
            # bucket not yet started), but where it launched a bucket, that
            # bucket's messages may be in flight; and an interrupt may come
            # as well where a rank goes on without the array as where it adds
            # it again -- its peers' buckets cannot tell: the communicator is
            # broken, as by any call an exception leaves
            if bucket is not None and self._launched == launched \
                    and self._open.get(key) is bucket:
                if bucket.arrays and bucket.arrays[-1] is array:
                    bucket.arrays.pop()
                    queued.pop(id(given), None)
                bucket.nbytes = sum(a.nbytes for a in bucket.arrays)
            self._breaks(exc, "Fusion.add")
            raise

    def _breaks(self, exc: BaseException, what: str) -> None:
        """An exception left a part of a step after it changed what the
        peers see (a bucket launched, a request made or finished): the step
        cannot be taken again, so the communicator is broken on this rank
        (``Context.breaks``: its later calls raise, its peers stall and are
        reported).  Not for a refusal every rank made (``api.refused``: their
        empty calls met, the communicator is as it was)."""
        if not refused_everywhere(exc):
            broken_by(self.comm, exc, what)  # (one with no context yet gets one, broken)

    def empty_like(self, arrays) -> list:
        """New arrays of the shapes, dtypes and devices of ``arrays`` that
        live inside the buckets they will fill: add them (all, in this
        order) and the buckets are reduced where they lie, with no packing
        and no unpacking.  Their values are uninitialised; write into them
        (``out=``, ``[...] =``) rather than rebinding them.

        Every rank must call it with the same shapes and dtypes at the same
        point of its program (each bucket's persistent call is made here,
        so its tag is the same on every rank).  The memory stays only as
        long as the caller holds the arrays; calling it every step holds
        no more than that (better: call it once and write into the arrays
        every step)."""
        self._sweep()
        arrays = [as_array(a) for a in arrays]
        op = resolve_op(self.op)  # (refused here, alike on every rank: nothing made yet)
        for array in arrays:
            check_dtype(array.dtype, op)
            if backend_for(array).device and not op.device:
                raise TypeError(f"op {op.name!r} runs on host memory only")
        try:
            return self._empty_like(arrays)
        except BaseException as exc:
            # homes made on this rank and not on its peers, or none made where
            # the peers made theirs (an interrupt before the first): the next
            # homes' numbers, and their requests' tags, would be the peers'
            # shifted -- a rank that goes on would meet its peers' earlier step
            self._breaks(exc, "Fusion.empty_like")
            raise

    def _empty_like(self, arrays: list) -> list:
        made = [None] * len(arrays)
        by_key: dict = {}
        for i, array in enumerate(arrays):
            by_key.setdefault((dtype_label(array.dtype), backend_for(array)), []).append(i)
        first = self._made
        for key, where in by_key.items():
            backend = key[1]
            sizes = [arrays[i].nbytes for i in where]
            for start, stop in bucket_bounds(sizes, self.bucket_bytes):
                members = where[start:stop]
                dtype = arrays[members[0]].dtype
                # (a bucket of one array too: its home's request carries which
                # bucket it is, so ranks that add such buckets in another order
                # stall, never sum one rank's array with another's)
                counts = tuple(int(arrays[i].size) for i in members)
                buffer = backend.empty(sum(counts), dtype)
                views = [buffer[a:b].reshape(arrays[i].shape)
                         for i, (a, b) in zip(members, _spans(counts))]
                for i, view in zip(members, views):
                    made[i] = view
                self._home(key, buffer, views, counts)
        self._evict(min(first, self._made - MAX_HOMES))
        return made

    def _home(self, key, buffer, views: list, sizes: tuple) -> None:
        """Make the home of these views, and its persistent request (now:
        every rank makes it at this point, so its tag is the same everywhere)."""
        number = self._made
        request = _persistent(buffer, self.op, self.comm, self.options,
                              _identity(f"home {number}", sizes))
        self._made += 1
        where, dead, left = self._where, self._dead, [len(views)]
        refs = []
        for index, view in enumerate(views):
            def gone(ref, ident=id(view), number=number):
                # (no reference to the fusion or the home here: no cycle)
                if where.get(ident, (None,))[0] == number:
                    del where[ident]
                left[0] -= 1
                if not left[0]:
                    dead.append(number)
            try:
                refs.append(weakref.ref(view, gone))
            except TypeError:  # an array type without weak references
                refs.append(_strong(view))
            where[id(view)] = (number, index)
        self._homes[number] = _Home(key, buffer, refs, sizes, request)

    def _sweep(self) -> None:
        """Free the homes whose arrays have all died."""
        while self._dead:
            home = self._homes.pop(self._dead.pop(), None)
            if home is not None:
                self._drop(home.request)

    def _evict(self, below: int) -> None:
        """Forget the homes numbered below ``below`` (the same on every
        rank): their arrays stay valid and are packed from now on."""
        for number in [n for n in self._homes if n < below]:
            home = self._homes.pop(number)
            for ref in home.refs:
                view = ref()
                if view is not None and self._where.get(id(view), (None,))[0] == number:
                    del self._where[id(view)]
            self._drop(home.request)

    def _drop(self, request) -> None:
        """Free a request no longer kept (one in flight is released once it
        is done and dropped)."""
        if not any(b.request is request for b in self._started):
            _release(request)

    def _home_for(self, key, arrays: list):
        """The home whose bucket these arrays are: the same sizes, and each
        array either the home's own at its place or one rebound in place of
        a home array that is gone (copied into its place).  Else None.
        Returns (home, the places of rebound arrays)."""
        where, homes = self._where, self._homes
        if not all(a.flags.c_contiguous for a in arrays):
            # (a home's array whose strides were assigned in place: its values
            # no longer lie in the home's order, and are packed in theirs)
            return None, ()
        spot = where.get(id(arrays[0]))
        if spot is not None and spot[1] == 0:  # most often: the home's arrays, in order
            home = homes.get(spot[0])
            if home is not None and not home.busy and home.key == key and \
                    len(home.refs) == len(arrays) and \
                    all(ref() is array for ref, array in zip(home.refs, arrays)):
                return home, ()
        home = None
        for index, array in enumerate(arrays):
            spot = where.get(id(array))
            if spot is not None and spot[1] == index:
                home = homes.get(spot[0])
                if home is not None and home.view(index) is array:
                    break
                home = None
        if home is None or home.key != key or \
                home.sizes != tuple(int(a.size) for a in arrays):
            return None, ()
        if home.busy:
            return None, ()  # in flight already (the same arrays added twice)
        rebound = [i for i, array in enumerate(arrays) if home.view(i) is not array]
        for i in rebound:
            # the home's array there must be gone (else the caller still
            # holds it), and the newcomer must not be of the home's memory
            if home.view(i) is not None or key[1].shares_memory(arrays[i], home.buffer):
                return None, ()
        return home, rebound

    def flush(self) -> None:
        """Start every bucket still filling (:meth:`wait` does this first)."""
        launched = self._launched
        try:
            for key in list(self._open):
                self._start(key)
        except BaseException as exc:
            # (a bucket left the queue, see add; or an interrupt, after which
            # this rank may go on with the step as its peers cannot tell)
            if self._launched != launched or not isinstance(exc, Exception):
                self._breaks(exc, "Fusion.flush")
            raise

    def wait(self) -> None:
        """Finish every bucket and write the results into the arrays (on a
        communicator a call broke, raise as every call on it does, even
        with nothing left to finish: the last wait's results were lost)."""
        self._queued.clear()
        try:
            self._refuse_if_broken()
            self.flush()
            started, self._started = self._started, []
            self._seen.clear()
            self._packed_before, self._packed = self._packed, 0
            if not started:
                # a step of no arrays is no short cut either: an empty call of
                # its own, so a rank whose step is empty where its peers' is
                # not stalls with them instead of meeting their next step
                empty_call(self.comm, EMPTY_STEP)
            for bucket in started:
                _finish(bucket)
        except BaseException as exc:
            # (a wait is the step's end, one call: one that raises has lost
            # the step -- buckets launched, some of them unpacked -- and no
            # retry can take it again)
            self._breaks(exc, "Fusion.wait")
            raise
        self._sweep()

    def _refuse_if_broken(self) -> None:
        """On a communicator a call broke, raise as every call on it does,
        before anything is packed: a bucket given up in flight may still be
        sent from its buffer (a peer that comes late reads it then), so
        nothing may be written there again."""
        context = cached_context(self.comm)
        if context is not None and context.broken is not None:
            self._started = []
            raise context.refusal()

    def free(self) -> None:
        """Release the kept buckets (packing buffers, persistent requests
        and their tags) and the homes' requests (their arrays stay valid and
        are packed from now on).  Not while buckets are in flight: wait() first."""
        if self._started:
            raise RuntimeError("Fusion.free() with buckets in flight: wait() first")
        kept, self._kept = self._kept, OrderedDict()
        for _, request in kept.values():
            _release(request)
        homes, self._homes = self._homes, {}
        self._where.clear()
        self._dead.clear()
        for home in homes.values():
            _release(home.request)

    def __enter__(self) -> "Fusion":
        return self

    def __exit__(self, *exc) -> None:
        # (the arrays added since the last wait, if any: an exit after a wait
        # is no step of its own, on any rank, so it makes no empty call)
        if exc[0] is None and (self._open or self._started):
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
        try:  # (an interrupt between its parts breaks the communicator, as inside them)
            self._serial = True
            for array in arrays:
                self.add(array)
            self.wait()
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._breaks(exc, "Fusion.allreduce")
            raise
        finally:
            self._serial = False

    @property
    def buckets_in_flight(self) -> int:
        return len(self._started)

    @property
    def held(self) -> dict:
        """What this fusion holds now: homes, packed buckets kept, and
        their bytes."""
        homes = list(self._homes.values())
        return {"homes": len(homes), "kept": len(self._kept),
                "bytes": sum(int(h.buffer.nbytes) for h in homes)
                + sum(int(buffer.nbytes) for buffer, _ in self._kept.values())}

    def _start(self, key) -> None:
        self._launch(key)
        if self._serial and len(self._started) > 1:
            _finish(self._started.pop(0))

    def _launch(self, key) -> None:
        self._refuse_if_broken()
        self._launched += 1  # (counted before the bucket leaves the queue: see add)
        bucket = self._open.pop(key)
        (first, *more), backend = bucket.arrays, key[1]
        home, rebound = self._home_for(key, bucket.arrays)
        if not more and home is None:
            # one array alone (one larger than a bucket, say): reduced in a
            # call of its own, whatever its layout on this rank (how an array
            # lies in memory is each rank's own affair, never what decides
            # the messages): where it is, or a strided one through a copy
            target = first
            if not backend.is_contiguous(first):
                target = backend.empty(int(first.size), first.dtype)
                backend.copy(target[0:first.size], first)
                bucket.buffer, bucket.packed = target, [(first, 0, int(first.size))]
            bucket.request = iallreduce(MPI.IN_PLACE, target, self.op, comm=self.comm,
                                        **self._keywords)
            self._started.append(bucket)
            return
        sizes = home.sizes if home is not None else tuple(int(a.size) for a in bucket.arrays)
        # the how-manieth bucket of these sizes in this step, alike on every rank
        shape = (key, sizes)
        occurrence = self._seen.get(shape, 0)
        self._seen[shape] = occurrence + 1
        if home is not None:  # the arrays live in the bucket: reduced where they lie
            bucket.buffer, bucket.request, bucket.home = home.buffer, home.request, home
            home.busy = True
            bucket.packed = [(bucket.arrays[i], *home.spans[i]) for i in rebound]
        else:
            bucket.buffer, bucket.request = self._reusable(key, bucket.arrays, sizes,
                                                           occurrence)
            bucket.packed = [(a, *span) for a, span in zip(bucket.arrays, _spans(sizes))]
        buffer = bucket.buffer
        for array, start, stop in bucket.packed:
            backend.copy(buffer[start:stop], array)
        bucket.request.start()
        self._started.append(bucket)

    def _reusable(self, key, arrays: list, sizes: tuple, occurrence: int) -> tuple:
        """The packing buffer and persistent request of the ``occurrence``-th
        bucket of arrays of these sizes in a step: kept from an earlier step,
        else new (made as the bucket first starts: every rank starts the
        same buckets in the same order)."""
        identity = (key, sizes, occurrence)
        entry = self._kept.pop(identity, None)
        if entry is None:
            buffer = backend_for(arrays[0]).empty(sum(sizes), arrays[0].dtype)
            entry = (buffer, _persistent(buffer, self.op, self.comm, self.options,
                                         _identity(f"bucket {occurrence}", sizes)))
        self._kept[identity] = entry  # most recently used last
        self._packed += 1
        # (a step of more buckets than MAX_KEPT keeps them all: it must not
        # build them again every step)
        while len(self._kept) > max(MAX_KEPT, self._packed, self._packed_before):
            _, (_, request) = self._kept.popitem(last=False)
            self._drop(request)
        return entry
