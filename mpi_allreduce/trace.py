"""Traces: what every round of a call did, and when, in the Chrome trace
event format (JSON with ``traceEvents``; it opens in Perfetto and in
``chrome://tracing``), for real runs and for the simulator's predictions.

Real runs: with ``MPI_ALLREDUCE_TRACE=DIR`` every call bound from then on
is compiled with recording steps (:func:`instrument`; with the setting off
nothing is added, so an untraced call runs exactly the steps it ran
before).  Per call it records, on this rank's clock, the call, each round
-- its start, when its messages were posted, when they were done -- each
local reduction and copy with its bytes, and each message with its peer
and bytes.  The same stages serve blocking, non-blocking and persistent
calls, the halves and fusion, so they are all traced alike.

Each rank keeps its events in memory.  :func:`collect` (collective:
``bench --trace`` and ``verify --trace`` call it) gathers them to rank 0,
moves every rank's clock onto rank 0's (offsets taken after a barrier) and
writes one file for the run; otherwise each rank writes
``DIR/rank-R-PID.json`` at exit and ``python -m mpi_allreduce trace DIR``
merges them (wall clocks, as the ranks read them).

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
send to its receive.  :func:`report` turns a trace into a breakdown: time
waiting for messages, reducing, copying, and the rest (Python between the
steps), per algorithm and kind of round.
"""

from __future__ import annotations

import atexit
import bisect
import functools
import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

from .config import on_refresh

__all__ = ["Tracer", "tracer", "instrument", "collect", "merge", "write", "load", "validate",
           "report", "breakdown", "simulated", "TraceError"]

#: lane (``tid``) of blocking calls; non-blocking calls take 1, 2, ...
BLOCKING_LANE = 0
#: lanes of messages: to peer P, ``SEND_LANE + P``; from P, ``RECV_LANE + P``
SEND_LANE, RECV_LANE = 100000, 200000


class TraceError(ValueError):
    """A trace that is not one this module writes (or a broken one)."""


def _now() -> int:
    return time.time_ns()


class Tracer:
    """One rank's recorded events (raw: integer nanoseconds of the wall clock)."""

    def __init__(self, directory: str, rank: int):
        self.directory, self.rank = directory, rank
        self.events: list = []
        self.calls: dict = defaultdict(int)  # group -> calls started on it
        self.lanes: set = set()  # lanes of non-blocking calls in flight
        self.lock = threading.Lock()
        self.written: Optional[str] = None

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
        self.events.append(event)

    def take(self) -> list:
        with self.lock:
            events, self.events = self.events, []
            return events

    def flush(self) -> Optional[str]:
        """Write what is recorded to ``DIR/rank-R-PID.json`` (at exit)."""
        events = self.take()
        if not events:
            return None
        path = os.path.join(self.directory, f"rank-{self.rank}-{os.getpid()}.json")
        origin = min(e["t0"] for e in events)
        write(path, [_chrome(self.rank, e, 0, origin) for e in events] + _names(self.rank, events),
              {"ranks": [self.rank], "clock": "this rank's wall clock", "origin_ns": origin})
        self.written = path
        return path


@functools.lru_cache(maxsize=1)
def tracer() -> Optional[Tracer]:
    """This process's tracer, or None when ``MPI_ALLREDUCE_TRACE`` is unset."""
    from .config import environment

    directory = environment().trace
    if directory is None:
        return None
    from mpi4py import MPI

    t = Tracer(directory, MPI.COMM_WORLD.Get_rank())
    atexit.register(t.flush)
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


def _chrome(rank: int, e: dict, offset: int = 0, origin: int = 0) -> dict:
    """A raw event as a Chrome trace event (``ts``/``dur`` in microseconds)."""
    ts = (e["t0"] + offset - origin) / 1e3
    dur = max(0.0, (e["t1"] - e["t0"]) / 1e3)
    kind = e["ev"]
    if kind in ("send", "recv"):
        tid = (SEND_LANE if kind == "send" else RECV_LANE) + e["peer"]
        cat = "message"
    else:
        tid = e["lane"]
        cat = "local" if kind == "local" else kind
    return {"name": e["name"], "cat": cat, "ph": "X", "pid": rank, "tid": tid, "ts": ts,
            "dur": dur, "args": e["args"]}


def _names(rank: int, events: list) -> list:
    """Metadata events naming the rank's process and lanes."""
    out = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
            "args": {"name": f"rank {rank}"}},
           {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
            "args": {"sort_index": rank}}]
    lanes = set()
    for e in events:
        if e["ev"] in ("send", "recv"):
            lanes.add(((SEND_LANE if e["ev"] == "send" else RECV_LANE) + e["peer"],
                       f"{'send to' if e['ev'] == 'send' else 'recv from'} {e['peer']}"))
        else:
            lanes.add((e["lane"], "blocking calls" if e["lane"] == BLOCKING_LANE
                       else f"calls in flight {e['lane']}"))
    for tid, name in sorted(lanes):
        out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                    "args": {"name": name}})
    return out


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
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)


def load(path: str) -> dict:
    """A trace file's contents (raises :class:`TraceError` for what is not a trace)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise TraceError(f"cannot read the trace {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(f"{path} is not a trace: no 'traceEvents' list")
    return doc


def _origin(events: list) -> float:
    return min((e["ts"] for e in events if "ts" in e and e.get("ph") != "M"), default=0.0)


def _finish(events: list) -> list:
    """Times from the first event, and the flows."""
    origin = _origin(events)
    for e in events:
        if "ts" in e:
            e["ts"] -= origin
    return events + _flows([e for e in events if e.get("ph") == "X"])


def collect(comm, path: str, meta: Optional[dict] = None) -> Optional[str]:
    """Collective over ``comm``: every rank's recorded events to rank 0,
    on rank 0's clock, written to ``path`` (one file for the run).  Returns
    the path on rank 0, None elsewhere."""
    from mpi4py import MPI

    t = tracer()
    events = t.take() if t is not None else []
    own = comm.Dup()  # the caller's messages never meet these
    try:
        offset = _offset_to_root(own)
        gathered = own.gather((MPI.COMM_WORLD.Get_rank(), offset, events), root=0)
    finally:
        own.Free()
    if comm.Get_rank() != 0:
        return None
    origin = min((e["t0"] + offset for _, offset, raw in gathered for e in raw), default=0)
    out, ranks = [], []
    for rank, offset, raw in gathered:
        out += [_chrome(rank, e, offset, origin) for e in raw] + _names(rank, raw)
        ranks.append(rank)
    info = {"ranks": ranks, "clock": "rank 0's wall clock: ranks on its host share it; ranks "
                                    "on other hosts moved by an offset from the quickest of "
                                    f"{SYNC_ROUNDS} ping-pongs with rank 0"}
    info.update(meta or {})
    write(path, _finish(out), info)
    return path


#: ping-pongs with rank 0 that estimate another host's clock offset
SYNC_ROUNDS = 8


def _offset_to_root(comm) -> int:
    """Nanoseconds to add to this rank's clock to read rank 0's: 0 on rank
    0's host (one clock); elsewhere from the ping-pong with the shortest
    round trip (the midpoint of its two ends, Cristian's way)."""
    from mpi4py import MPI

    host = MPI.Get_processor_name()
    hosts = comm.allgather(host)
    rank = comm.Get_rank()
    offset = 0
    for other in range(1, comm.Get_size()):
        if hosts[other] == hosts[0]:
            continue
        if rank == 0:
            for _ in range(SYNC_ROUNDS):
                comm.recv(source=other, tag=71)
                comm.send(_now(), dest=other, tag=72)
        elif rank == other:
            best = None
            for _ in range(SYNC_ROUNDS):
                sent = _now()
                comm.send(None, dest=0, tag=71)
                theirs = comm.recv(source=0, tag=72)
                back = _now()
                if best is None or back - sent < best[0]:
                    best = (back - sent, theirs - (sent + back) // 2)
            offset = best[1]
    return offset


def merge(sources, output: str) -> str:
    """Per-rank files (or a directory of ``rank-*.json``) merged into one."""
    paths = []
    for source in sources:
        p = Path(source)
        paths += sorted(p.glob("rank-*.json")) if p.is_dir() else [p]
    if not paths:
        raise TraceError(f"no rank-*.json trace files in {', '.join(map(str, sources))}")
    docs = [load(str(p)) for p in paths]
    origins = [doc.get("otherData", {}).get("origin_ns", 0) for doc in docs]
    events, ranks = [], []
    for doc, origin in zip(docs, origins):
        shift = (origin - min(origins)) / 1e3
        for e in doc["traceEvents"]:
            if e.get("ph") == "X":
                events.append(dict(e, ts=e["ts"] + shift))
            elif e.get("ph") == "M":
                events.append(e)
        ranks += doc.get("otherData", {}).get("ranks", [])
    write(output, _finish(events), {"ranks": sorted(ranks), "clock": "each rank's wall clock",
                                    "merged": [str(p) for p in paths]})
    return output


def validate(doc: dict) -> dict:
    """Check a trace this module wrote: required keys, every rank's call
    and round events in order, and every send with its receive.  Returns
    counts; raises :class:`TraceError`."""
    events = doc["traceEvents"]
    counts: dict = defaultdict(int)
    last: dict = {}
    keys: dict = defaultdict(set)
    for e in events:
        for field in ("name", "ph", "pid"):
            if field not in e:
                raise TraceError(f"an event without {field!r}: {e}")
        if e["ph"] == "M":
            continue
        if "ts" not in e or (e["ph"] == "X" and "dur" not in e):
            raise TraceError(f"an event without its time: {e}")
        if e["ph"] != "X":
            counts["flows"] += 1
            continue
        if e["dur"] < 0:
            raise TraceError(f"an event with a negative duration: {e}")
        counts[e["cat"]] += 1
        if e["cat"] in ("call", "round") and e["tid"] == BLOCKING_LANE:
            track = (e["pid"], e["cat"])
            if track in last and e["ts"] < last[track] - 1e-3:
                raise TraceError(f"rank {e['pid']}: {e['cat']} events out of order at "
                                 f"{e['ts']} us (before {last[track]})")
            last[track] = e["ts"] + e["dur"]
        if e["cat"] == "message":
            keys[e["args"]["key"]].add(e["name"])
    lonely = [k for k, sides in keys.items() if sides != {"send", "recv"}]
    if lonely:
        raise TraceError(f"{len(lonely)} messages without their other side, e.g. {lonely[0]}")
    counts["messages"] = len(keys)
    return dict(counts)


# -- what the time went to --------------------------------------------------------------


def breakdown(doc: dict) -> list:
    """Per algorithm and kind of round (``messages``, ``messages + local``,
    ``local``): calls, rounds, and the time (us, summed over ranks) spent
    waiting for messages, reducing, copying and otherwise (Python between
    the steps).  Rows as dicts."""
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    locals_by: dict = defaultdict(list)  # (pid, tid) -> local events, by start
    for e in events:
        if e["cat"] == "local":
            locals_by[(e["pid"], e["tid"])].append(e)
    starts = {}
    for lane, found in locals_by.items():
        found.sort(key=lambda x: x["ts"])
        starts[lane] = [x["ts"] for x in found]
    rows: dict = {}
    for e in events:
        if e["cat"] != "round":
            continue
        start, end = e["ts"], e["ts"] + e["dur"]
        posted = start + e["args"].get("posted_us", 0.0)
        lane = (e["pid"], e["tid"])
        found = locals_by.get(lane, [])
        first = bisect.bisect_left(starts.get(lane, []), start - 1e-3)
        last = bisect.bisect_right(starts.get(lane, []), end + 1e-3)
        inside = [x for x in found[first:last] if x["ts"] + x["dur"] <= end + 1e-3]
        messages = e["args"].get("messages", 0)
        kind = "local" if not messages else "messages + local" if inside else "messages"
        key = (e["args"].get("algorithm", "?"), kind)
        row = rows.setdefault(key, {"algorithm": key[0], "round kind": kind, "rounds": 0,
                                    "time_us": 0.0, "reduce_us": 0.0, "copy_us": 0.0,
                                    "wait_us": 0.0, "other_us": 0.0})
        reduce = sum(x["dur"] for x in inside if x["name"] in ("reduce", "finalize"))
        copy = sum(x["dur"] for x in inside if x["name"] in ("copy", "synchronize"))
        overlapped = sum(x["dur"] for x in inside if x["ts"] >= posted - 1e-3)
        wait = max(0.0, end - posted - overlapped) if messages else 0.0
        row["rounds"] += 1
        row["time_us"] += e["dur"]
        row["reduce_us"] += reduce
        row["copy_us"] += copy
        row["wait_us"] += wait
        row["other_us"] += max(0.0, e["dur"] - reduce - copy - wait)
    calls: dict = defaultdict(int)
    for e in events:
        if e["cat"] == "call":
            calls[e["args"].get("algorithm", e["name"])] += 1
    out = sorted(rows.values(), key=lambda r: (r["algorithm"], r["round kind"]))
    for r in out:
        r["calls"] = calls.get(r["algorithm"], 0)
    return out


def report(path: str, png: Optional[str] = None, against: Optional[str] = None) -> str:
    """The breakdown of a trace as a table; with ``png``, also stacked bars
    and the timeline of its last call (beside the last call of ``against``,
    say the simulator's prediction of it)."""
    doc = load(path)
    validate(doc)
    other = None
    if against is not None:
        other = load(against)
        validate(other)
    rows = breakdown(doc)
    head = (f"{'algorithm':>20} {'round kind':>17} {'calls':>6} {'rounds':>7} {'time us':>11} "
            f"{'wait %':>7} {'reduce %':>9} {'copy %':>7} {'other %':>8}")
    lines = [f"# {path}: time summed over ranks; 'other' is Python between the steps", head]
    for r in rows:
        total = r["time_us"] or 1.0
        lines.append(f"{r['algorithm']:>20} {r['round kind']:>17} {r['calls']:>6} "
                     f"{r['rounds']:>7} {r['time_us']:>11.1f} "
                     f"{100 * r['wait_us'] / total:>7.1f} {100 * r['reduce_us'] / total:>9.1f} "
                     f"{100 * r['copy_us'] / total:>7.1f} {100 * r['other_us'] / total:>8.1f}")
    if png:
        _plot(rows, png, path, [(path, doc)] + ([(against, other)] if other else []))
    return "\n".join(lines)


def last_call(doc: dict) -> list:
    """The events of the trace's last call on its first communicator (the
    blocking lane), every rank's, times from that call's start."""
    x = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    calls = [e for e in x if e["cat"] == "call" and e["tid"] == BLOCKING_LANE]
    if not calls:
        return []
    number = max(e["args"].get("call", 0) for e in calls)
    chosen = {e["pid"]: e for e in calls if e["args"].get("call", 0) == number}
    start = min(e["ts"] for e in chosen.values())
    out = []
    for e in x:
        call = chosen.get(e["pid"])
        if call is None or not call["ts"] - 1e-3 <= e["ts"] <= call["ts"] + call["dur"] + 1e-3:
            continue
        if e["cat"] != "message" and e["tid"] != BLOCKING_LANE:
            continue
        out.append(dict(e, ts=e["ts"] - start))
    return out


def _draw_call(ax, events: list, title: str) -> None:
    colours = {"reduce": "tab:orange", "finalize": "tab:orange", "copy": "tab:green",
               "synchronize": "tab:green"}
    ranks = sorted({e["pid"] for e in events})
    for e in events:
        if e["cat"] == "round":
            shade = "0.85" if int(e["name"].split()[-1]) % 2 else "0.7"
            ax.barh(e["pid"], e["dur"], left=e["ts"], height=0.5, color=shade)
        elif e["cat"] == "local":
            ax.barh(e["pid"], max(e["dur"], 1e-3), left=e["ts"], height=0.3,
                    color=colours.get(e["name"], "tab:red"))
    sends = {e["args"]["key"]: e for e in events if e["cat"] == "message" and e["name"] == "send"}
    for e in events:
        if e["cat"] == "message" and e["name"] == "recv" and e["args"]["key"] in sends:
            s = sends[e["args"]["key"]]
            ax.annotate("", xy=(e["ts"] + e["dur"], e["pid"]), xytext=(s["ts"], s["pid"]),
                        arrowprops=dict(arrowstyle="->", color="tab:blue", lw=0.7))
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks], fontsize=7)
    ax.set_ylim(max(ranks, default=0) + 0.6, min(ranks, default=0) - 0.6)
    ax.set_xlabel("us from the call's start (grey: rounds; orange: reduce; green: copy; "
                  "blue: message, posted to done)", fontsize=7)
    ax.set_title(title, fontsize=9)


def _plot(rows: list, png: str, title: str, timelines: list = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['algorithm']}\n{r['round kind']}" for r in rows]
    shown = [(name, last_call(doc)) for name, doc in timelines]
    shown = [(name, events) for name, events in shown if events]
    fig = plt.figure(figsize=(max(7, 1.3 * len(rows), 6.5 * len(shown)),
                              4.5 + (3.5 if shown else 0)))
    grid = fig.add_gridspec(2 if shown else 1, max(1, len(shown)))
    ax = fig.add_subplot(grid[0, :])
    for i, (name, events) in enumerate(shown):
        kind = "simulated" if any(e["args"].get("kind") == "simulated" for e in events
                                  if e["cat"] == "call") else "measured"
        _draw_call(fig.add_subplot(grid[1, i]), events, f"last call, {kind}: {Path(name).name}")
    bottom = [0.0] * len(rows)
    for part, colour in (("wait_us", "tab:blue"), ("reduce_us", "tab:orange"),
                         ("copy_us", "tab:green"), ("other_us", "tab:gray")):
        values = [r[part] / max(r["rounds"], 1) for r in rows]
        ax.bar(labels, values, bottom=bottom, color=colour, label=part[:-3])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("us per round (summed over ranks)")
    ax.set_title(f"where the time goes: {Path(title).name}", fontsize=10)
    ax.legend()
    plt.setp(ax.get_xticklabels(), fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# -- the simulator's prediction ---------------------------------------------------------


def simulated(algorithm: str, size: int, count: int, dtype, machine, segment_size: int,
              options: Optional[dict] = None, unit_us: float = 1e6) -> list:
    """Chrome events of the simulator's timeline of one call (``machine``
    times in seconds, shown at ``unit_us`` microseconds a unit): the same
    names and categories as a real trace, so the two open side by side."""
    import numpy as np

    from .schedule import Recv, Send
    from .simulate import execute, schedules

    itemsize = np.dtype(dtype).itemsize
    scheds = schedules(algorithm, size, count, segment_size, options)
    raw: list = []
    lanes_used: dict = defaultdict(int)
    group = tuple(range(size))

    def us(t: float) -> int:
        return int(round(t * unit_us * 1e3))  # nanoseconds, as the real records

    def observe(event: str, **f) -> None:
        if event == "post":
            posted[(f["rank"], f["round"])] = f["at"]
        elif event == "end":
            at = posted.get((f["rank"], f["round"]), f["start"])
            raw.append((f["rank"], {"ev": "round", "name": f"round {f['round']}", "lane": 0,
                                    "t0": us(f["start"]), "t1": us(f["end"]),
                                    "args": {"posted_us": (us(at) - us(f["start"])) / 1e3,
                                             "algorithm": algorithm,
                                             "messages": posts[(f["rank"], f["round"])]}}))
        elif event == "local":
            raw.append((f["rank"], {"ev": "local", "name": f["kind"], "lane": 0,
                                    "t0": us(f["start"]), "t1": us(f["end"]),
                                    "args": {"bytes": f["elements"] * itemsize,
                                             "round": f["round"]}}))
        elif event == "message":
            src, dst = f["src"], f["dst"]
            lanes_used[(src, dst)] += 1
            key = f"{group}/1/{src}>{dst}/{lanes_used[(src, dst)]}"
            for rank, kind, peer, index in ((src, "send", dst, f["src_round"]),
                                            (dst, "recv", src, f["dst_round"])):
                raw.append((rank, {"ev": kind, "name": kind, "peer": peer, "t0": us(f["begin"]),
                                   "t1": us(f["end"]),
                                   "args": {"peer": peer, "bytes": f["elements"] * itemsize,
                                            "round": index, "key": key}}))

    posted: dict = {}
    posts = defaultdict(int)
    for rank, s in enumerate(scheds):
        for k, actions in enumerate(s.rounds):
            posts[(rank, k)] = sum(1 for a in actions if isinstance(a, (Send, Recv)))
    finish = execute(scheds, [None] * size, machine, np.add, itemsize,
                     f"{algorithm}, p={size}, count={count}", observe)
    for rank in range(size):
        raw.append((rank, {"ev": "call", "name": algorithm, "lane": 0, "t0": 0,
                           "t1": us(finish[rank]),
                           "args": {"algorithm": algorithm, "elements": count,
                                    "bytes": count * itemsize, "ranks": size, "call": 1,
                                    "kind": "simulated"}}))
    events = [_chrome(rank, e) for rank, e in raw]
    for rank in range(size):
        events += _names(rank, [e for r, e in raw if r == rank])
    return _finish(events)
