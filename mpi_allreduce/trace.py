"""Traces: what every round of a call did, and when, in the Chrome trace
event format (it opens in Perfetto and in ``chrome://tracing``).  This
module is what a traced run needs: the recording and the writing.
Reading, merging, checking and reporting traces, and the simulator's
predicted traces, are in :mod:`mpi_allreduce.tools.traces`.

With ``MPI_ALLREDUCE_TRACE=DIR`` every call bound from then on is compiled
with recording steps (:func:`instrument`; with the setting off nothing is
added, so an untraced call runs exactly the steps it ran before).  Per
call it records, on this rank's clock, the call, each round -- its start,
when its messages were posted, when they were done -- each local reduction
and copy with its bytes, and each message with its peer and bytes.  The
same stages serve blocking, non-blocking and persistent calls, the halves
and fusion, so they are all traced alike.

A rank holds at most :data:`CHUNK_EVENTS` events in memory: it writes them
to its file ``DIR/rank-R-PID.json`` when that many are held (at the end of
a call once three quarters are), when :data:`FLUSH_SECONDS` pass without a
write (once the rank's calls pause), at exit, and when :func:`flush` is
called (the library calls it before ``MPI_Abort``).  The file is a Chrome
trace in the JSON array format, one event a line: ``[``, the events (each
line after the first begins with its comma), and ``]`` at exit.  A file
whose process was aborted or killed lacks the ``]`` (the format allows
it; a last line cut short is left out when it is read here), and holds
everything written until then.  Its times
are microseconds from the rank's origin, ``origin_ns`` (wall clock) in the
args of its ``process_name`` event.  ``python -m mpi_allreduce trace DIR``
merges the files (:func:`~mpi_allreduce.tools.traces.merge`: wall clocks,
as the ranks read them).  :func:`collect` (collective: ``bench --trace``
and ``verify --trace`` call it) instead gathers every rank's events to
rank 0 on rank 0's clock (offsets taken after a barrier) and writes one
file for the run; the rank files it read are removed.

The events, one process per rank (``pid``: the rank in ``COMM_WORLD``):

============ ============ =====================================================
name         category     what
============ ============ =====================================================
the call     ``call``     a call, from its first step to its last (args:
                          algorithm, elements, bytes, kind)
``round K``  ``round``    round K: from its start to the end of its messages
                          (args: ``posted_us``, when the messages were posted)
``reduce``   ``local``    a local reduction (``copy``: a copy; ``finalize``:
``copy``                  an op's last step, e.g. avg's division)
``send``     ``message``  a message to ``peer`` (``recv``: from ``peer``),
``recv``                  from its posting to the end of its round; ``key``
                          pairs a send with its receive in the other rank
============ ============ =====================================================

Calls in flight together take separate lanes (``tid``); messages have a
lane per peer and direction.  Flow events (``ph`` ``s``/``f``) join every
send to its receive in a merged or collected trace.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import threading
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Optional

from .config import on_refresh
from .threads import start_daemon

__all__ = ["Tracer", "tracer", "instrument", "flush", "collect", "write", "TraceError",
           "CHUNK_EVENTS", "FLUSH_SECONDS"]

#: lane (``tid``) of blocking calls; non-blocking calls take 1, 2, ...
BLOCKING_LANE = 0
#: lanes of messages: to peer P, ``SEND_LANE + P``; from P, ``RECV_LANE + P``
SEND_LANE, RECV_LANE = 100000, 200000
#: events a rank holds in memory at most before it writes them to its file
CHUNK_EVENTS = 4096
#: seconds without a write after which what a rank holds is written, however little,
#: once its calls pause (a rank killed by another's abort while waiting loses nothing)
FLUSH_SECONDS = 1.0

def _plain(value):
    """What JSON cannot hold, as it can (numpy's scalars as numbers, the rest
    as text): a write inside a call never fails on an argument."""
    try:
        return value.item()
    except Exception:
        return str(value)


_encode = json.JSONEncoder(separators=(",", ":"), default=_plain).encode
# one event a line, encoded by json's C encoder made once (``_encode`` makes one per call)
_encoder = json.encoder.c_make_encoder and json.encoder.c_make_encoder(
    None, _plain, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)
_quote = json.encoder.encode_basestring_ascii


def _line(event: dict) -> str:
    return "".join(_encoder(event, 0)) if _encoder else _encode(event)


class TraceError(ValueError):
    """A trace that is not one this package writes (or a broken one)."""


def _now() -> int:
    return time.time_ns()


class Tracer:
    """One rank's recorder: events as recorded (raw: integer nanoseconds of
    the wall clock), at most ``chunk`` held at once, written to this
    process's file as Chrome events.  Counters: ``written`` (events
    written, in all), ``peak`` (the most held at once), ``dropped`` (events
    a failed write lost; reported once on stderr)."""

    def __init__(self, directory: str, rank: int, chunk: int = CHUNK_EVENTS):
        self.directory, self.rank = directory, rank
        self.chunk = max(1, int(chunk))
        self.soon = self.chunk - self.chunk // 4  # held at a call's end: written then
        self.events: deque = deque()  # appended by any thread, taken from the left
        self.calls: dict = defaultdict(int)  # group -> calls started on it
        self.lanes: set = set()  # lanes of non-blocking calls in flight
        self.lock = threading.Lock()
        self.io = threading.RLock()  # the file (held while writing; a flush may come
        # from another thread, before an abort)
        self.origin = _now()  # time 0 of this rank's events
        self.path: Optional[str] = None  # the file being written, None before the first
        self.files: list = []  # the files written since the last take()
        self.named: set = set()  # lanes named in the current file
        self.written = self.peak = self.dropped = 0
        self.last_write = time.monotonic()
        self.told = False  # (of a failed write)

    def call_number(self, group: tuple) -> int:
        with self.lock:
            self.calls[group] += 1
            return self.calls[group]

    def lane(self) -> int:
        with self.lock:
            lane = 1
            while lane in self.lanes:
                lane += 1
            self.lanes.add(lane)
            return lane

    def free_lane(self, lane: int) -> None:
        with self.lock:
            self.lanes.discard(lane)

    def add(self, event: dict) -> None:
        events = self.events
        events.append(event)
        if len(events) >= self.chunk:
            self.flush()

    def call_ended(self) -> None:
        """At a call's end (outside its timed events): write what is held
        if the chunk is nearly full, so a write seldom falls inside a call."""
        if len(self.events) >= self.soon:
            self.flush()

    def flush(self) -> Optional[str]:
        """Write what is held to this process's file (made at the first
        write); returns its path (None before any)."""
        with self.io:
            events = self.events
            n = len(events)
            if n > self.peak:
                self.peak = n
            if n:
                self._write([events.popleft() for _ in range(n)])
            self.last_write = time.monotonic()
            return self.path

    def close(self) -> Optional[str]:
        """:meth:`flush`, then end the file with its ``]`` (at exit): a
        whole JSON array.  A later event starts another file.  Returns the
        path of the file closed (None if none was open)."""
        with self.io:
            self.flush()
            path, self.path = self.path, None
            if path is not None:
                self._append(path, "]\n", 0)
            return path

    def take(self) -> list:
        """Every event since the last take, as Chrome events (times in
        microseconds from ``origin``), read back from the files this
        tracer wrote, which are removed (:func:`collect`)."""
        with self.io:
            self.flush()
            out: list = []
            for path in self.files:
                try:
                    out += _read_events(path)[0]
                    os.remove(path)
                except (OSError, TraceError):
                    pass  # (removed under us, or cut short where a write failed)
            self.files, self.path = [], None
            return out

    def _write(self, raw: list) -> None:
        if self.path is None and not self._start():
            self.dropped += len(raw)
            return
        lines = []
        rank, origin, named = self.rank, self.origin, self.named
        for e in raw:
            tid = _tid(e)
            if tid not in named:
                named.add(tid)
                lines.append("," + _line(_thread_name(rank, tid)))
            lines.append("," + _chrome_line(rank, e, tid, origin))
        lines.append("")
        if self._append(self.path, "\n".join(lines), len(raw)):
            self.written += len(raw)

    def _start(self) -> bool:
        """A new file, its first lines written: the rank's name and origin."""
        head = "[\n" + "\n,".join(_encode(e) for e in _process_names(self.rank, self.origin))
        stem = os.path.join(self.directory, f"rank-{self.rank}-{os.getpid()}")
        for k in range(1, 1000):
            path = f"{stem}.json" if k == 1 else f"{stem}-{k}.json"
            try:
                with open(path, "x") as f:
                    f.write(head + "\n")
            except FileExistsError:
                continue
            except OSError as exc:
                self._failed(path, exc)
                return False
            self.path = path
            self.files.append(path)
            self.named = set()
            return True
        self._failed(f"{stem}.json", OSError("no free file name"))
        return False

    def _append(self, path: str, text: str, n: int) -> bool:
        try:
            with open(path, "a") as f:
                f.write(text)
            return True
        except OSError as exc:
            self.dropped += n
            self._failed(path, exc)
            return False

    def _failed(self, path: str, exc: OSError) -> None:
        if not self.told:
            self.told = True
            sys.stderr.write(f"mpi_allreduce: rank {self.rank}: cannot write the trace file "
                             f"{path}: {exc}; its events are dropped\n")
            sys.stderr.flush()


#: every tracer made in this process (each written at exit; a few at most: one per
#: change of the setting)
_TRACERS: list = []
_START = threading.Lock()
#: the writer thread, the last one kept (threads.start_daemon)
_WRITER: list = []


def _keep(t: Tracer) -> None:
    """Register ``t``: written at exit, and by the writer thread (started
    with the first tracer)."""
    with _START:
        if not _TRACERS:
            atexit.register(_close_all)
        if not (_WRITER and _WRITER[-1].is_alive()):
            start_daemon(_write_now_and_then, "mpi_allreduce-trace", _kept_writer,
                         lambda: _WRITER[-1] if _WRITER else None)
        _TRACERS.append(t)


def _kept_writer(thread) -> None:
    _WRITER[:] = [thread]


def _write_now_and_then() -> None:
    """The writer thread: what a tracer holds, once FLUSH_SECONDS passed
    without a write and the rank has recorded nothing for a tenth of that
    (its calls paused, or stalled: a write here then delays no call)."""
    while True:
        time.sleep(max(0.05, FLUSH_SECONDS / 4))
        for t in list(_TRACERS):
            try:
                if t.events and time.monotonic() - t.last_write >= FLUSH_SECONDS and \
                        _now() - t.events[-1]["t1"] >= FLUSH_SECONDS * 1e8:
                    t.flush()
            except Exception:  # (never let this thread die of one)
                pass


def _close_all() -> None:
    for t in list(_TRACERS):
        t.close()


def flush() -> None:
    """Write every event held in memory to its rank file now: what to call
    before ``MPI_Abort``, so the files show everything until then.  Nothing
    to do (and nothing it costs) with tracing off; it never raises."""
    for t in list(_TRACERS):
        try:
            t.flush()
        except Exception:  # (an abort must go on)
            pass


@functools.lru_cache(maxsize=1)
def tracer() -> Optional[Tracer]:
    """This process's tracer, or None when ``MPI_ALLREDUCE_TRACE`` is unset."""
    from .config import environment

    directory = environment().trace
    if directory is None:
        return None
    from mpi4py import MPI

    t = Tracer(directory, MPI.COMM_WORLD.Get_rank())
    _keep(t)
    return t


@on_refresh
def _refresh() -> None:
    tracer.cache_clear()


def _group(comm) -> tuple:
    """The ranks of ``comm`` in COMM_WORLD (the same tuple on every member)."""
    from mpi4py import MPI

    return tuple(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                           MPI.COMM_WORLD.Get_group()))


def _nbytes(args) -> int:
    size = 0
    for a in args:
        if isinstance(a, list) and a:
            a = a[0]
        size = max(size, int(getattr(a, "nbytes", 0) or 0))
    return size


class _Call:
    """The recording steps of one bound call (one call in flight at a time)."""

    def __init__(self, t: Tracer, plan, blocking: bool, stages: list):
        from mpi4py import MPI

        self.t, self.blocking = t, blocking
        self.group = _group(plan.comm)
        self.world = t.rank
        self.name = plan.schedule.algorithm
        self.args = {"algorithm": plan.schedule.algorithm, "elements": plan.schedule.count,
                     "bytes": plan.schedule.count * plan.dtype.itemsize,
                     "dtype": plan.dtype.name, "op": plan.op.name, "ranks": len(self.group),
                     "kind": "blocking" if blocking else "non-blocking or persistent"}
        # per stage: (direction, peer in COMM_WORLD, bytes, n-th message with that peer)
        seen: dict = defaultdict(int)
        self.messages = []
        for stage in stages:
            out = []
            for send, dest, recv, source in stage.pairs:
                for kind, view, peer in (("send", send, dest), ("recv", recv, source)):
                    if view is None or peer == MPI.PROC_NULL:
                        continue
                    seen[(kind, peer)] += 1
                    out.append((kind, self.group[peer], int(view.nbytes), seen[(kind, peer)]))
            self.messages.append(out)
        self.number = self.lane = 0
        self.started = 0
        self.round = None  # [index, start, posted]

    def begin(self, index: int) -> None:
        now = _now()
        if index == 0:
            self.number = self.t.call_number(self.group)
            self.lane = BLOCKING_LANE if self.blocking else self.t.lane()
            self.started = now
        else:
            self._close(now)
        self.round = [index, now, now]

    def posted(self, index: int) -> None:
        self.round[2] = _now()

    def finish(self) -> None:
        now = _now()
        self._close(now)
        self.t.add({"ev": "call", "name": self.name, "lane": self.lane, "t0": self.started,
                    "t1": now, "args": dict(self.args, call=self.number)})
        if not self.blocking:
            self.t.free_lane(self.lane)
        self.t.call_ended()

    def _close(self, now: int) -> None:
        if self.round is None:
            return
        index, start, posted = self.round
        self.round = None
        self.t.add({"ev": "round", "name": f"round {index}", "lane": self.lane, "t0": start,
                    "t1": now, "args": {"posted_us": (posted - start) / 1e3,
                                        "messages": len(self.messages[index]),
                                        "algorithm": self.name}})
        for kind, peer, nbytes, nth in self.messages[index]:
            src, dst = (self.world, peer) if kind == "send" else (peer, self.world)
            self.t.add({"ev": kind, "name": kind, "peer": peer, "t0": posted, "t1": now,
                        "args": {"peer": peer, "bytes": nbytes, "round": index,
                                 "key": f"{self.group}/{self.number}/{src}>{dst}/{nth}"}})

    def local(self, index: int, kind: str, function, args) -> None:
        t0 = _now()
        function(*args)
        self.t.add({"ev": "local", "name": kind, "lane": self.lane, "t0": t0, "t1": _now(),
                    "args": {"bytes": _nbytes(args), "round": index}})


def _kind(function, backend) -> str:
    if function == backend.copy or getattr(function, "__name__", "") == "__setitem__":
        return "copy"  # (the executor's copies are item assignments: Backend.copier)
    if function == backend.device_synchronize:
        return "synchronize"
    return "reduce"


def instrument(plan, stages: list, blocking: bool, t: Tracer) -> list:
    """``stages`` with recording steps: a marker at the start of each round
    and after its leading local steps, every local step timed, and a last
    stage that closes the call."""
    if not stages:
        return stages
    call = _Call(t, plan, blocking, stages)
    backend = plan.backend
    finalize = plan.op.finalize

    def timed(index, steps, last=False):
        out = []
        for i, (function, args) in enumerate(steps):
            kind = "finalize" if last and finalize is not None and i == len(steps) - 1 and \
                not stages[index].pairs else _kind(function, backend)
            out.append((call.local, (index, kind, function, args)))
        return tuple(out)

    traced = []
    for index, stage in enumerate(stages):
        last = index == len(stages) - 1
        before = ((call.begin, (index,)),) + timed(index, stage.before, last) + \
            ((call.posted, (index,)),)
        traced.append(stage._replace(before=before, overlap=timed(index, stage.overlap, last)))
    traced.append(stages[0]._replace(before=((call.finish, ()),), pairs=(), overlap=()))
    return traced


# -- files ----------------------------------------------------------------------------


def _tid(e: dict) -> int:
    if e["ev"] in ("send", "recv"):
        return (SEND_LANE if e["ev"] == "send" else RECV_LANE) + e["peer"]
    return e["lane"]


def _chrome(rank: int, e: dict, offset: int = 0, origin: int = 0) -> dict:
    """A raw event as a Chrome trace event (``ts``/``dur`` in microseconds)."""
    ts = (e["t0"] + offset - origin) / 1e3
    dur = max(0.0, (e["t1"] - e["t0"]) / 1e3)
    kind = e["ev"]
    cat = "message" if kind in ("send", "recv") else "local" if kind == "local" else kind
    return {"name": e["name"], "cat": cat, "ph": "X", "pid": rank, "tid": _tid(e), "ts": ts,
            "dur": dur, "args": e["args"]}


def _chrome_line(rank: int, e: dict, tid: int, origin: int) -> str:
    """``_chrome(rank, e, 0, origin)`` as a line of JSON, made without the
    dict (this runs inside calls, for every event)."""
    kind, args = e["ev"], e["args"]
    cat = "message" if kind in ("send", "recv") else "local" if kind == "local" else kind
    if cat == "message" and args.keys() == _MESSAGE_ARGS:  # (half the events: written here)
        text = (f'{{"peer":{args["peer"]},"bytes":{args["bytes"]},"round":{args["round"]},'
                f'"key":{_quote(args["key"])}}}')
    else:
        text = _line(args)
    return (f'{{"name":{_quote(e["name"])},"cat":"{cat}","ph":"X","pid":{rank},'
            f'"tid":{tid},"ts":{(e["t0"] - origin) / 1e3!r},'
            f'"dur":{max(0.0, (e["t1"] - e["t0"]) / 1e3)!r},"args":{text}}}')


#: the args of a message event (_Call._close)
_MESSAGE_ARGS = {"peer", "bytes", "round", "key"}


def _process_names(rank: int, origin: Optional[int] = None) -> list:
    """Metadata events naming the rank's process (and, in a rank's file,
    giving its origin)."""
    args: dict = {"name": f"rank {rank}"}
    if origin is not None:
        args["origin_ns"] = origin
    return [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": args},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
             "args": {"sort_index": rank}}]


def _thread_name(rank: int, tid: int) -> dict:
    """The metadata event naming a lane."""
    if tid >= RECV_LANE:
        name = f"recv from {tid - RECV_LANE}"
    elif tid >= SEND_LANE:
        name = f"send to {tid - SEND_LANE}"
    else:
        name = "blocking calls" if tid == BLOCKING_LANE else f"calls in flight {tid}"
    return {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}


def _names(rank: int, events: list) -> list:
    """Metadata events naming the rank's process and the lanes of its raw events."""
    return _process_names(rank) + [_thread_name(rank, tid)
                                   for tid in sorted({_tid(e) for e in events})]


def _flows(events: list) -> list:
    """A flow arrow from every send to its receive (both must be there)."""
    ends = {}
    for e in events:
        if e.get("cat") == "message":
            ends.setdefault(e["args"]["key"], {})[e["name"]] = e
    out = []
    for n, (key, pair) in enumerate(sorted(ends.items())):
        if set(pair) != {"send", "recv"}:
            continue
        s, r = pair["send"], pair["recv"]
        out.append({"name": "message", "cat": "message", "ph": "s", "id": n, "pid": s["pid"],
                    "tid": s["tid"], "ts": s["ts"]})
        out.append({"name": "message", "cat": "message", "ph": "f", "bp": "e", "id": n,
                    "pid": r["pid"], "tid": r["tid"], "ts": max(r["ts"], s["ts"])})
    return out


def write(path: str, events: list, meta: Optional[dict] = None) -> None:
    """A trace file: ``{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": meta}``."""
    doc = {"traceEvents": events, "displayTimeUnit": "ns", "otherData": dict(meta or {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(_encode(doc))
    os.replace(tmp, path)


def _read_events(path: str) -> tuple:
    """The events of a rank's file and whether it was closed (its ``]``
    written at exit).  A file cut short -- its process aborted or killed --
    reads up to its last whole line."""
    with open(path) as f:
        text = f.read()
    if not text.startswith("[\n"):
        raise TraceError(f"{path} is not a rank's trace file: no '[' line first")
    text = text.rstrip()
    if text.endswith("]"):
        try:
            return json.loads(text), True
        except ValueError:
            pass
    for body in (text, text[:text.rfind("\n") + 1]):  # (its last line written in part)
        try:
            return json.loads(body + "]"), False
        except ValueError:
            pass
    raise TraceError(f"{path}: a broken line inside the file")


def _origin_ns(events: list) -> Optional[int]:
    """The origin a rank's file gives in its ``process_name`` event."""
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            origin = e.get("args", {}).get("origin_ns")
            if origin is not None:
                return origin
    return None


def _combine(parts: list) -> list:
    """One list of events from parts ``(origin_ns or None, events)`` whose
    times count from their own origins: times from the earliest origin,
    the complete events in order of time after the metadata (once each)."""
    base = min((start for start, _ in parts if start is not None), default=0)
    names, timed, seen = [], [], set()
    for start, events in parts:
        shift = ((base if start is None else start) - base) / 1e3
        for e in events:
            if e.get("ph") == "M":
                key = (e.get("name"), e.get("pid"), e.get("tid", 0))
                if key not in seen:
                    seen.add(key)
                    args = {k: v for k, v in e.get("args", {}).items() if k != "origin_ns"}
                    names.append(dict(e, args=args))
            elif e.get("ph") == "X":  # (flows are made again)
                e["ts"] += shift
                timed.append(e)
    timed.sort(key=lambda e: e["ts"])
    return names + timed


def _first(events: list) -> float:
    return min((e["ts"] for e in events if "ts" in e and e.get("ph") != "M"), default=0.0)


def _finish(events: list) -> list:
    """Times from the first event, and the flows."""
    origin = _first(events)
    for e in events:
        if "ts" in e:
            e["ts"] -= origin
    return events + _flows([e for e in events if e.get("ph") == "X"])


def collect(comm, path: str, meta: Optional[dict] = None) -> Optional[str]:
    """Collective over ``comm``: every rank's recorded events to rank 0,
    on rank 0's clock, written to ``path`` (one file for the run; the rank
    files they were read from are removed).  Returns the path on rank 0,
    None elsewhere."""
    from mpi4py import MPI

    from .context import exchange_objects
    from .engine import duplicate

    t = tracer()
    events = t.take() if t is not None else []
    origin = t.origin if t is not None else _now()
    what = "collecting the trace"
    own = duplicate(comm, what)  # the caller's messages never meet these
    try:
        offset = _offset_to_root(own, what)
        gathered = exchange_objects(own, (MPI.COMM_WORLD.Get_rank(), origin + offset, events), 0,
                                    what)
    finally:
        own.Free()
    if comm.Get_rank() != 0:
        return None
    out = _combine([(start, _process_names(rank) + raw) for rank, start, raw in gathered])
    info = {"ranks": [rank for rank, _, _ in gathered],
            "clock": "rank 0's wall clock: ranks on its host share it; ranks on other hosts "
                     f"moved by an offset from the quickest of {SYNC_ROUNDS} ping-pongs with "
                     "rank 0"}
    info.update(meta or {})
    write(path, _finish(out), info)
    return path


#: ping-pongs with rank 0 that estimate another host's clock offset
SYNC_ROUNDS = 8


def _offset_to_root(comm, what: str) -> int:
    """Nanoseconds to add to this rank's clock to read rank 0's: 0 on rank
    0's host (one clock); elsewhere from the ping-pong with the shortest
    round trip (the midpoint of its two ends, Cristian's way).  Every
    message is watched (``what`` names them in a report)."""
    import numpy as np
    from mpi4py import MPI

    from .context import exchange_objects
    from .engine import wait_for

    hosts = exchange_objects(comm, MPI.Get_processor_name(), None, what + ": the ranks' hosts")
    rank = comm.Get_rank()
    offset = 0
    ping, pong = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    for other in range(1, comm.Get_size()):
        if hosts[other] == hosts[0]:
            continue
        clocks = f"{what}: rank {other}'s clock against rank 0's"
        if rank == 0:
            for _ in range(SYNC_ROUNDS):
                wait_for([comm.Irecv(ping, source=other, tag=71)], clocks)
                pong[0] = _now()
                wait_for([comm.Isend(pong, dest=other, tag=72)], clocks)
        elif rank == other:
            best = None
            for _ in range(SYNC_ROUNDS):
                sent = _now()
                wait_for([comm.Isend(ping, dest=0, tag=71),
                          comm.Irecv(pong, source=0, tag=72)], clocks)
                back = _now()
                if best is None or back - sent < best[0]:
                    best = (back - sent, int(pong[0]) - (sent + back) // 2)
            offset = best[1]
    return offset
