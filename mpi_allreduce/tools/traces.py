"""Reading traces: the per-rank files of ``MPI_ALLREDUCE_TRACE=DIR`` merged
into one (``python -m mpi_allreduce trace DIR``), a trace checked, broken
down into where its time went and drawn (``python -m mpi_allreduce
report``), and the simulator's predicted timeline of a call in the same
format (``python -m mpi_allreduce simulate --trace``).

The recording and the writing a traced run needs are in
:mod:`mpi_allreduce.trace` (the format of the files is described there);
a run never imports this module.  :func:`report` turns a trace into a
breakdown: time waiting for messages, reducing, copying, and the rest
(Python between the steps), per algorithm and kind of round.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

from ..trace import (BLOCKING_LANE, TraceError, _chrome, _combine, _finish, _names, _origin_ns,
                     _read_events, write)

__all__ = ["load", "check_events", "read", "merge", "validate", "breakdown", "report",
           "last_call", "simulated"]


def load(path: str) -> dict:
    """A trace file's contents: a merged or collected trace, or one rank's
    file (its ``otherData`` made from its events: ``ranks``, ``origin_ns``,
    and ``unfinished``, the file itself, where it lacks its closing ``]``).
    Raises :class:`~mpi_allreduce.trace.TraceError` for what is not a trace,
    every event checked for the fields the commands read
    (:func:`check_events`)."""
    try:
        with open(path) as f:
            first = f.readline().strip()
            if first == "[":
                events, closed = _read_events(path)
                check_events(events, path)
                return {"traceEvents": events, "displayTimeUnit": "ns",
                        "otherData": {"ranks": sorted({e["pid"] for e in events if "pid" in e}),
                                      "origin_ns": _origin_ns(events),
                                      "unfinished": [] if closed else [str(path)]}}
            f.seek(0)
            doc = json.load(f)
    except TraceError:
        raise
    except (OSError, ValueError) as exc:
        raise TraceError(f"cannot read the trace {path}: {exc}") from None
    if isinstance(doc, list):  # (the JSON array format, on one line)
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(f"{path} is not a trace: no 'traceEvents' list")
    check_events(doc["traceEvents"], path)
    if not isinstance(doc.get("otherData", {}), dict):
        raise TraceError(f"{path} is not a trace: its 'otherData' is not an object")
    return doc


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_events(events: list, path: str) -> None:
    """Refuse (:class:`~mpi_allreduce.trace.TraceError`) events that lack
    what merging, checking and reporting read: every event an object with
    ``name``, ``ph`` and a whole-number ``pid``, its ``args`` (where it has
    them) an object, a metadata event's ``origin_ns`` a number; every other
    event a numeric ``ts``; a complete event (``X``) also a numeric ``dur``,
    its ``cat`` (a name), ``tid`` and ``args``, and a message's ``args`` its
    ``key`` (a name).  A JSON file of other events is no trace of ours."""
    for e in events:
        if not isinstance(e, dict):
            raise TraceError(f"{path} is not a trace: its events are not all objects")
        missing = [k for k in ("name", "ph", "pid") if k not in e]
        if e.get("ph") == "X":
            missing += [k for k in ("dur", "cat", "tid", "args") if k not in e]
        if e.get("ph") != "M" and "ts" not in e:
            missing.append("ts")
        if missing:
            raise TraceError(f"{path} is not a trace: an event without "
                             f"{', '.join(map(repr, missing))}: {_short(e)}")
        if not isinstance(e["pid"], int) or isinstance(e["pid"], bool):
            raise TraceError(f"{path} is not a trace: an event whose 'pid' (its rank) is not "
                             f"a whole number: {_short(e)}")
        if not isinstance(e.get("args", {}), dict):
            raise TraceError(f"{path} is not a trace: an event whose 'args' is not an object: "
                             f"{_short(e)}")
        if e["ph"] == "M":
            if not _number(e.get("args", {}).get("origin_ns", 0)):
                raise TraceError(f"{path} is not a trace: an origin that is not a number: "
                                 f"{_short(e)}")
            continue
        if not _number(e["ts"]) or (e["ph"] == "X" and not _number(e["dur"])):
            raise TraceError(f"{path} is not a trace: an event whose time is not a number: "
                             f"{_short(e)}")
        if e["ph"] == "X" and not isinstance(e["cat"], str):
            raise TraceError(f"{path} is not a trace: an event whose 'cat' is not a name: "
                             f"{_short(e)}")
        if e["ph"] == "X" and e["cat"] == "message" and not isinstance(e["args"].get("key"), str):
            raise TraceError(f"{path} is not a trace: a message without its key: {_short(e)}")


def _short(event: dict) -> str:
    """An event for a message: its JSON, cut at 200 characters."""
    text = json.dumps(event)
    return text if len(text) <= 200 else text[:197] + "..."


def merge(sources, output: str) -> str:
    """Per-rank files (or a directory of ``rank-*.json``) merged into one,
    on the ranks' wall clocks.  Files cut short (their processes aborted or
    killed) are merged with everything they hold; the output names them in
    its ``otherData`` as ``unfinished``, and :func:`validate` lets their
    messages lack the other side."""
    paths = []
    for source in sources:
        p = Path(source)
        paths += sorted(p.glob("rank-*.json")) if p.is_dir() else [p]
    if not paths:
        raise TraceError(f"no rank-*.json trace files in {', '.join(map(str, sources))}")
    parts, ranks, unfinished = [], set(), []
    for p in paths:
        doc = load(str(p))
        other = doc.get("otherData", {})
        parts.append((other.get("origin_ns"), doc["traceEvents"]))
        ranks.update(other.get("ranks", []))
        unfinished += other.get("unfinished", [])
    meta = {"ranks": sorted(ranks), "clock": "each rank's wall clock",
            "merged": [str(p) for p in paths]}
    if unfinished:
        meta["unfinished"] = unfinished
    write(output, _finish(_combine(parts)), meta)
    return output


def validate(doc: dict) -> dict:
    """Check a trace this package wrote: required keys, every rank's call
    and round events in order, and every send with its receive -- but in a
    trace with ``unfinished`` files (:func:`merge`), where the other side
    may have been lost, messages without it are counted (``unpaired``).
    Returns counts; raises :class:`~mpi_allreduce.trace.TraceError`."""
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
    if lonely and doc.get("otherData", {}).get("unfinished"):
        counts["unpaired"] = len(lonely)
    elif lonely:
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


def read(path: str) -> dict:
    """A trace file loaded and checked (:func:`load`, :func:`validate`);
    :class:`~mpi_allreduce.trace.TraceError` names the file."""
    doc = load(path)
    try:
        validate(doc)
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None
    return doc


def report(path: str, png: Optional[str] = None, against: Optional[str] = None,
           docs: Optional[tuple] = None) -> str:
    """The breakdown of a trace as a table; with ``png``, also stacked bars
    and the timeline of its last call (beside the last call of ``against``,
    say the simulator's prediction of it).  ``docs``: the two traces as
    :func:`read` gave them, where the caller has read them (to tell which
    of the two a refusal is about)."""
    doc, other = docs or (read(path), None if against is None else read(against))
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

#: the links a simulated trace names as hottest, with their bytes
HOTTEST = 10


def simulated(algorithm: str, size: int, count: int, dtype, machine, segment_size: int,
              options: Optional[dict] = None, unit_us: float = 1e6) -> list:
    """Chrome events of the simulator's timeline of one call (``machine``
    times in seconds, shown at ``unit_us`` microseconds a unit): the same
    names and categories as a real trace, so the two open side by side.
    On a machine with a network, a message between nodes names the links
    of its route (``route``) and each rank's call the hottest links and
    their bytes (``hottest_links``)."""
    import numpy as np

    from ..network import hottest, link_name, route

    from ..schedule import Recv, Send
    from ..simulate import execute, schedules

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
            args = {}
            if machine.network is not None and machine.across(src, dst):
                args["route"] = [link_name(link) for link in
                                 route(machine.network, machine.nodes[src], machine.nodes[dst])]
            for rank, kind, peer, index in ((src, "send", dst, f["src_round"]),
                                            (dst, "recv", src, f["dst_round"])):
                raw.append((rank, {"ev": kind, "name": kind, "peer": peer, "t0": us(f["begin"]),
                                   "t1": us(f["end"]),
                                   "args": {"peer": peer, "bytes": f["elements"] * itemsize,
                                            "round": index, "key": key, **args}}))

    posted: dict = {}
    posts = defaultdict(int)
    for rank, s in enumerate(scheds):
        for k, actions in enumerate(s.rounds):
            posts[(rank, k)] = sum(1 for a in actions if isinstance(a, (Send, Recv)))
    link_bytes: dict = {}
    finish = execute(scheds, [None] * size, machine, np.add, itemsize,
                     f"{algorithm}, p={size}, count={count}", observe, link_bytes)
    hot = {}
    if machine.network is not None:
        hot = {"hottest_links": [list(item) for item in hottest(link_bytes, HOTTEST)]}
    for rank in range(size):
        raw.append((rank, {"ev": "call", "name": algorithm, "lane": 0, "t0": 0,
                           "t1": us(finish[rank]),
                           "args": {"algorithm": algorithm, "elements": count,
                                    "bytes": count * itemsize, "ranks": size, "call": 1,
                                    "kind": "simulated", **hot}}))
    events = [_chrome(rank, e) for rank, e in raw]
    for rank in range(size):
        events += _names(rank, [e for r, e in raw if r == rank])
    return _finish(events)
