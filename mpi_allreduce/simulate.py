"""Run the schedules of all p ranks in one process, without MPI.

:func:`simulate` builds every rank's schedule and runs them against each
other the way MPI would, with the strictest semantics it allows: a send
completes only when a receive has matched it (no eager buffering), so a
schedule that relies on buffering deadlocks here.  Messages between a pair
of ranks match in the order they are posted.  It checks

* that every send meets exactly one receive of the same length, and
  nothing is left unmatched or stuck (a deadlock names the ranks, their
  rounds and the peers they wait for);
* that no local action of a round touches a range one of the round's
  messages is using, and that no two messages of a round overlap where one
  writes;
* every element of every rank's result against a reduction of all inputs
  in rank order with numpy (inputs chosen so that any order of combination
  gives the exact same bits; the reference is taken in rank order).

With a :class:`Machine` it also times the schedules (LogGP-style): a message
of n bytes posted at times s (sender) and r (receiver) arrives at
``max(s, r) + alpha + n beta`` (or the machine's measured curve at n bytes);
posting costs ``overhead``, reducing n bytes ``n gamma``; a round ends when
its last message has arrived.  The time of the all-reduce is the latest
rank's.  The machine's shared parts queue what uses them at once:

* with ``nodes``, messages between nodes take ``alpha_inter`` and
  ``beta_inter``, and each node has one network port, as in LogGOPSim: the
  bytes of its ranks leave (and enter) it one message after another, so q
  ranks sending n bytes across at once take ``alpha_inter + q n beta_inter``;
  with a ``network`` (:mod:`mpi_allreduce.network`: torus, fat tree,
  Dragonfly) a message also crosses the links of its route between the
  nodes' ports, each link shared the same way, and pays each hop's latency;
* inside a node a rank sends (and receives) one message at a time, its CPU
  doing the copy (and across nodes too, in both directions together, on a
  ``half_duplex`` machine);
* with ``cores``, the busy ranks of a node share its cores.

Ranks are taken in the order of their clocks, so these queues serve
messages about in the order they are posted.  ``eager_bytes`` lets short
sends complete once posted (timing only).  Unit machines (``alpha=1`` and
the rest 0, and so on) give the messages, bytes on the wire and bytes
reduced along the critical path.

What a run holds is known before it starts, from a few ranks' schedules
(:func:`footprint`, :func:`memory_needed`): ``python -m mpi_allreduce
simulate`` says it, and refuses a run above what the machine has free;
its default leaves out the algorithms whose memory grows as p^2 above
:data:`BY_NAME_ABOVE` ranks (:func:`default_algorithms`).
"""

from __future__ import annotations

import heapq
import json
import math
import sys
from collections import defaultdict, deque
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple, Optional

import numpy as np

from . import registry
from .network import Network, hops, route
from .ops import resolve_op
from .schedule import BUFFER_NAMES, RECV, SCRATCH, SEND, Copy, Recv, Reduce, Ref, Send

__all__ = ["simulate", "execute", "schedules", "Machine", "Outcome", "SimulationError", "inputs",
           "curve_time", "Footprint", "footprint", "tally", "memory_needed", "available_memory",
           "check_memory", "memory_text", "BY_NAME_ABOVE", "default_algorithms"]


class SimulationError(RuntimeError):
    """A schedule that would fail under MPI: unmatched, mismatched, racing or deadlocked."""


@dataclass(frozen=True)
class Machine:
    """The one model of the machine: what the simulator times schedules
    on, what ``python -m mpi_allreduce model`` fits (the ``params`` of its
    JSON: :meth:`Machine.load`, :meth:`Machine.parameters`) and what the
    closed forms of ``tools/scale.py`` read.

    Costs in seconds: per message on the wire, per byte on the wire, per
    byte reduced (and copied), per message posted (each side: the
    software's overhead), per local action (a ufunc call's fixed cost).
    With ``nodes`` (the node of every rank), messages between nodes cost
    ``alpha_inter`` and ``beta_inter`` instead, and the bytes of one node's
    messages to other nodes share its one port (``beta_inter`` is the
    port's time per byte).  The fields are in the order of the fitted
    file's ``params``; ``nodes``, where the ranks are placed, is no fitted
    parameter and comes last."""

    alpha: float = 0.0
    beta: float = 0.0
    gamma: float = 0.0
    #: across nodes (None: the same link as inside)
    alpha_inter: Optional[float] = None
    beta_inter: Optional[float] = None
    overhead: float = 0.0
    op_overhead: float = 0.0
    #: measured time of a message against its size, ``((bytes, seconds), ...)``,
    #: inside a node and across: when given, it replaces ``alpha + n beta``
    #: (PLogP: MPI's protocols make that time no straight line)
    curve: Optional[tuple] = None
    curve_inter: Optional[tuple] = None
    #: the cores of a node; with more ranks busy on a node than it has cores,
    #: their software, reductions and copies inside the node run slower by
    #: that ratio (processor sharing; ranks waiting for a peer yield)
    cores: Optional[int] = None
    #: inside a node, the time of a message its sender wrote during the
    #: call (a reduced or received block, not the untouched input): Open
    #: MPI's single-copy path can make such messages several times slower
    curve_fresh: Optional[tuple] = None
    #: sends of at most this many bytes are eager (timing only, no data):
    #: done once posted, the receive completing when the bytes arrive
    #: (MPI libraries buffer short messages); None: every send waits for
    #: its receive, the strictest semantics (see the module docstring)
    eager_bytes: Optional[int] = None
    #: software of a call before its first round, on every rank
    call_overhead: float = 0.0
    #: a rank moves one message across nodes at a time, sent or received
    #: (where its CPU runs the network stack for both directions), instead
    #: of one each way at once
    half_duplex: bool = False
    #: the node of every rank (None: all on one node)
    nodes: Optional[tuple] = None
    #: the network between the nodes (:mod:`mpi_allreduce.network`; None:
    #: one port per node and nothing beyond, the ``flat`` topology); with
    #: one, ``nodes`` are its nodes' numbers
    network: Optional[Network] = None

    def __post_init__(self):
        # from JSON the curves and nodes are lists: kept as tuples, so that
        # a machine is hashable (the model's predictions are cached by it)
        for name in ("curve", "curve_inter", "curve_fresh"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(tuple(map(float, pt)) for pt in value))
        if self.nodes is not None:
            object.__setattr__(self, "nodes", tuple(self.nodes))
        if isinstance(self.network, dict):
            object.__setattr__(self, "network", Network.from_json(self.network))

    @classmethod
    def load(cls, path) -> "Machine":
        """The machine a ``model --json`` file or a machine description
        describes: its ``params`` (a field missing from an older file takes
        its default) and, in a description, its ``network``
        (:class:`~mpi_allreduce.network.Network`).  An unknown field is a
        TypeError, a malformed file a ValueError or KeyError."""
        with open(path) as f:
            return cls.described(json.load(f), path)

    @classmethod
    def described(cls, description, where="the description") -> "Machine":
        """The machine of a ``model --json`` file's or a machine
        description's JSON, already read (``where`` names it in errors):
        as :meth:`load`."""
        if not isinstance(description, dict):
            raise ValueError(f"{where}: a JSON object with params (and a network), not "
                             f"{type(description).__name__}")
        network = description.get("network")
        return cls(**description["params"],
                   network=None if network is None else Network.from_json(network))

    def parameters(self) -> dict:
        """The fitted parameters, every field but ``nodes`` and ``network``:
        the ``params`` object of a ``model --json`` file, which
        :meth:`Machine.load` reads back."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("nodes", "network")}

    def placed(self, nodes: Optional[tuple]) -> "Machine":
        """This machine with its ranks on ``nodes`` (the node of every
        rank; None: all on one node)."""
        return replace(self, nodes=nodes)

    def across(self, src: int, dst: int) -> bool:
        return self.nodes is not None and self.nodes[src] != self.nodes[dst]

    def link(self, across: bool) -> tuple:
        """(alpha, beta) of a message inside a node or across."""
        if across:
            return (self.alpha if self.alpha_inter is None else self.alpha_inter,
                    self.beta if self.beta_inter is None else self.beta_inter)
        return self.alpha, self.beta

    def message_time(self, across: bool, nbytes: float, fresh: bool = False) -> float:
        """Seconds of an ``nbytes`` message inside a node or across, once
        both sides have posted it (``fresh``: written by its sender in this
        call): the measured curve where there is one, else alpha + n beta."""
        curve = self.curve_fresh if fresh and self.curve_fresh is not None else self.curve
        if across and self.curve_inter is not None:
            curve = self.curve_inter
        elif across and self.alpha_inter is not None:
            curve = None  # a straight line across
        if curve is not None:
            return curve_time(curve, nbytes)
        alpha, beta = self.link(across)
        return alpha + nbytes * beta


def curve_time(curve: tuple, nbytes: float) -> float:
    """``curve`` (``(bytes, seconds)`` points, sizes ascending) at
    ``nbytes``: straight lines between the points, the last two points'
    slope beyond the last, the first point's time below the first."""
    sizes = [point[0] for point in curve]
    times = [point[1] for point in curve]
    if nbytes <= sizes[-1] or len(curve) < 2:
        return float(np.interp(nbytes, sizes, times))
    slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
    return times[-1] + (nbytes - sizes[-1]) * slope


@dataclass
class Outcome:
    algorithm: str
    size: int
    count: int
    dtype: str
    op: str
    in_place: bool
    wrong: int  # (rank, element) pairs that differ from the reference
    differing_ranks: int  # ranks whose bytes differ from rank 0's
    messages: list  # sent per rank
    bytes_sent: list
    bytes_reduced: list
    scratch_bytes: list
    rounds: list
    seconds: Optional[float] = None  # with a machine: the latest rank's finish
    finish: list = field(default_factory=list)
    #: bytes per link (``(class, from, to)``: :mod:`mpi_allreduce.network`),
    #: every message counted on every link of its route; ``intra`` for the
    #: bytes moved inside a node
    link_bytes: dict = field(default_factory=dict)


def schedules(algorithm: str, size: int, count: int, segment_size: int,
              options: Optional[dict] = None) -> list:
    """Every rank's schedule (``hierarchical`` takes ``nodes`` or
    ``ranks_per_node``, and ``inner``, whose default is resolved as a live
    call's is: :func:`~mpi_allreduce.selection.hierarchical_options` with
    the built-in decision table, for float64 elements)."""
    build, options = _builder(algorithm, size, count, options)
    return [build(rank, size, count, segment_size, options) for rank in range(size)]


def _builder(algorithm: str, size: int, count: int, options: Optional[dict]) -> tuple:
    """(``build``, its options) of :func:`schedules`: hierarchical's resolved."""
    options = dict(options or {})
    if algorithm == "hierarchical":
        from .selection import BUILT_IN_TABLE, hierarchical_options

        rpn = options.pop("ranks_per_node", None) or size
        nodes = options.get("nodes") or tuple((r // rpn) * rpn for r in range(size))
        options = dict(hierarchical_options(tuple(nodes), options.get("inner"), count * 8,
                                            tuning=BUILT_IN_TABLE))
    return registry.builder(algorithm), options


def inputs(dtype: np.dtype, op, rank: int, start: int, stop: int) -> np.ndarray:
    """Rank ``rank``'s input, elements ``[start, stop)``: values whose
    reduction is exact in any order (small integers; +-1 and 2 for
    products; 0/1 for the logical ops), different on every rank."""
    op = resolve_op(op)
    i = np.arange(start, stop, dtype=np.int64)
    h = (i * 40503 + rank * 2654435761 + 12345) % 1000003
    if dtype == np.bool_ or op.name in ("land", "lor", "lxor"):
        return (h % 3 != 0).astype(dtype)
    if op.name == "prod":
        return np.where(h % 7 == 0, 2, np.where(h % 2 == 0, 1, -1)).astype(dtype) \
            if np.dtype(dtype).kind != "u" else np.where(h % 7 == 0, 2, 1).astype(dtype)
    if np.dtype(dtype).kind == "u":
        return (h % 9).astype(dtype)
    return (h % 9 - 4).astype(dtype)


def reference(dtype, op, size: int, count: int) -> np.ndarray:
    """All inputs reduced in rank order."""
    op = resolve_op(op)
    out = inputs(dtype, op, 0, 0, count)
    for rank in range(1, size):
        op.ufunc(out, inputs(dtype, op, rank, 0, count), out=out)
    if op.finalize is not None:
        op.finalize(out, size, out=out)
    return out


class _Rank:
    __slots__ = ("rounds", "index", "open", "clock", "until", "began", "arrays", "done")

    def __init__(self, rounds, arrays):
        self.rounds, self.index, self.open, self.clock = rounds, 0, 0, 0.0
        self.began = 0.0  # when the current round started
        self.until = 0.0  # when the last message of the current round is done
        self.arrays = arrays
        self.done = not rounds


def _overlaps(a: Ref, b: Ref, arrays) -> bool:
    if not a.length or not b.length:
        return False
    if arrays is None:
        same = a.buf == b.buf
    else:
        same = arrays[a.buf] is arrays[b.buf] or (a.buf != SCRATCH and b.buf != SCRATCH
                                                 and arrays[SEND] is arrays[RECV])
    return same and a.offset < b.stop and b.offset < a.stop


def simulate(algorithm: str, size: int, count: int, dtype="float32", op="sum", *,
             segment_size: int = 1 << 18, in_place: bool = False,
             options: Optional[dict] = None, machine: Optional[Machine] = None,
             data: bool = True) -> Outcome:
    """Run ``algorithm`` for ``size`` virtual ranks; see the module docstring.
    Raises :class:`SimulationError` for a schedule MPI would not complete."""
    dtype, op = np.dtype(dtype), resolve_op(op)
    scheds = schedules(algorithm, size, count, segment_size, options)
    itemsize = dtype.itemsize
    if data:  # (the schedules are made: what is left to make is the buffers)
        buffers = Footprint(size, scratch=sum(max(s.scratch, 1) for s in scheds))
        check_memory(buffers.bytes(count, dtype), f"{algorithm}, p={size}, count={count}")
    combine = op.ufunc

    result = np.empty((size, count), dtype) if data else None
    arrays = []
    for rank, sched in enumerate(scheds):
        if data:
            recv = result[rank]
            if in_place:
                recv[...] = inputs(dtype, op, rank, 0, count)
                send = recv
            else:
                send = _LazyInput(dtype, op, rank)
            arrays.append((send, recv, np.zeros(max(sched.scratch, 1), dtype)))
        else:
            arrays.append(None)
    link_bytes: dict = {}
    finish = execute(scheds, arrays, machine, combine, itemsize,
                     f"{algorithm}, p={size}, count={count}", link_bytes=link_bytes)

    wrong = differing = 0
    if data and count:
        if op.finalize is not None:
            op.finalize(result, size, out=result)
        expected = reference(dtype, op, size, count)
        wrong = int(np.count_nonzero(result != expected[None, :]))
        as_bytes = result.view(np.uint8).reshape(size, -1)
        differing = int(np.count_nonzero((as_bytes != as_bytes[0]).any(axis=1)))

    return Outcome(
        algorithm, size, count, dtype.name, op.name, in_place, wrong, differing,
        [s.messages for s in scheds], [s.sent() * itemsize for s in scheds],
        [s.reduced() * itemsize for s in scheds], [s.scratch * itemsize for s in scheds],
        [len(s.rounds) for s in scheds],
        max(finish) if finish else 0.0, finish, link_bytes)


#: how many actions :func:`footprint` counts: rank 0's schedule at counts
#: doubling up to the whole, until one holds the first (past it, the count
#: where it got there stands for the whole); then the other ranks, until
#: they hold the second (past it, the largest of those counted stands for
#: the rest).  Counting a million actions takes about a second.
FOOTPRINT_BUDGET = (1_000_000, 50_000)
#: ranks besides rank 0 counted at least (past the budget), and at most
FOOTPRINT_SPREAD = (3, 64)

#: the algorithms whose memory grows as p^2 and faster, and the most
#: ranks ``simulate`` runs each on when none is named (named with ``-a``,
#: at any p): ``naive`` keeps every rank's vector on every rank (p^2 n
#: elements) and posts p-1 messages a rank; ``allgather_reduce`` gathers
#: pieces of segment / p elements, so p-1 messages and p actions per piece
#: and p^2 n / segment pieces in all.  Chosen from :func:`memory_needed`
#: at the default 4099 float32 elements, where each alone passes about
#: 1 GB: naive 1.1 GB at 256 ranks, 4.5 GB at 512, 18 GB at 1024;
#: allgather_reduce 0.4, 1.6 and 7.5 GB.
BY_NAME_ABOVE = {"naive": 256, "allgather_reduce": 256}


def default_algorithms(size: int) -> tuple:
    """(the algorithms ``simulate`` runs on ``size`` ranks when none is
    named, those of :data:`BY_NAME_ABOVE` it leaves out there)."""
    out = tuple(a for a in registry.ALGORITHMS if size > BY_NAME_ABOVE.get(a, size))
    return tuple(a for a in registry.ALGORITHMS if a not in out), out


def _allocated(nbytes: int) -> int:
    """``nbytes`` as CPython's allocator hands them out (16-byte blocks)."""
    return -(-nbytes // 16) * 16


#: bytes of the objects of a schedule, as :func:`sys.getsizeof` gives
#: them (the garbage collector's header included) in 16-byte blocks
_ACTION_BYTES = {kind: _allocated(sys.getsizeof(kind(*(0,) * len(kind._fields))))
                 for kind in (Send, Recv, Reduce, Copy)}
_REF_BYTES = _allocated(sys.getsizeof(Ref(0, 0, 0)))
_INT_BYTES = _allocated(sys.getsizeof(1 << 40))  # (an int past CPython's cached -5 .. 256)
_FLOAT_BYTES = _allocated(sys.getsizeof(0.0))
#: a dict's item: at most three slots of 24 bytes and their 8-byte index
#: (a dict is at least a third full)
_ITEM_BYTES = 3 * (24 + 8)
#: what :func:`execute` and :class:`Outcome` keep per rank: its ``_Rank``
#: and three clocks, its entry in the ready heap, ``busy_until``, two
#: entries of ``copy_free`` (key and clock), six numbers of the outcome
_RANK_BYTES = (_allocated(sys.getsizeof(object.__new__(_Rank)))
               + 3 * _FLOAT_BYTES + _allocated(sys.getsizeof((0.0, 0))) + _FLOAT_BYTES
               + 2 * (_allocated(sys.getsizeof((0, "out"))) + _FLOAT_BYTES + _ITEM_BYTES)
               + 6 * (8 + _INT_BYTES))
#: a message posted and not yet matched: its entry in its pair's queue
#: (range, clock, eager?, round; and its slot in the deque)
_OPEN_BYTES = _allocated(sys.getsizeof((Ref(0, 0, 0), 0.0, False, 0))) + _FLOAT_BYTES + 8
#: a pair of ranks with messages open one way: its queue (a deque of one
#: block, in a dict under the pair)
_QUEUE_BYTES = (_allocated(sys.getsizeof(deque())) + _allocated(sys.getsizeof((0, 0)))
                + 2 * _INT_BYTES + _ITEM_BYTES)


def _int_bytes(value: int, cached: bool = True) -> int:
    """An int's own bytes: none for one CPython keeps cached (``cached``)."""
    return 0 if cached and -5 <= value <= 256 else _INT_BYTES


class _Cost(NamedTuple):
    """One rank's schedule: bytes of its objects, actions, elements of
    scratch (one at least, as :func:`simulate` makes it), the most
    messages one of its rounds posts, and the most queues of
    :func:`execute` they go into (sends to a peer, receives from a peer);
    its rounds, messages sent and elements reduced."""

    bytes: int
    actions: int
    scratch: int
    in_flight: int
    queues: int
    rounds: int
    messages: int
    reduced: int


def _cost(schedule, cached: bool = True) -> _Cost:
    """What :class:`_Cost` says of ``schedule``: its tuples, ranges and
    ints past the cached ones (all, without ``cached``: a schedule at more
    elements has larger offsets), each counted (an int or range two
    actions share counts twice: an upper bound)."""
    total = _allocated(sys.getsizeof(schedule)) + _allocated(sys.getsizeof(schedule.rounds))
    actions = in_flight = queues = sent = reduced = 0
    for actions_of_round in schedule.rounds:
        total += _allocated(sys.getsizeof(actions_of_round))
        actions += len(actions_of_round)
        messages = []
        for action in actions_of_round:
            total += _ACTION_BYTES[type(action)]
            if type(action) in (Send, Recv):
                messages.append((type(action), action[0]))
                sent += type(action) is Send
                total += _int_bytes(action[0], cached)
                refs = action[1:]
            else:
                refs = action
                reduced += action[0].length if type(action) is Reduce else 0
            for ref in refs:
                total += (_REF_BYTES + _int_bytes(ref.offset, cached)
                          + _int_bytes(ref.length, cached))
        in_flight = max(in_flight, len(messages))
        queues = max(queues, len(set(messages)) if len(messages) > 2 else len(messages))
    return _Cost(total, actions, max(schedule.scratch, 1), in_flight, queues,
                 len(schedule.rounds), sent, reduced)


class Footprint(NamedTuple):
    """What the schedules of one algorithm's run hold, all ranks together:
    bytes of their objects, elements of scratch, and the most messages
    (and queues of them) one rank posts in a round; rounds, messages and
    elements reduced, and the most rounds of one rank; ``exact`` where
    every rank's schedule was counted whole (else an upper bound:
    :func:`footprint`)."""

    ranks: int
    schedule_bytes: int = 0
    scratch: int = 0
    in_flight: int = 0
    queues: int = 0
    rounds: int = 0
    messages: int = 0
    reduced: int = 0
    longest: int = 0
    exact: bool = True

    def bytes(self, count: int, dtype, data: bool = True) -> int:
        """Bytes :func:`simulate` holds at its peak on ``count`` elements of
        ``dtype``: the schedules, what :func:`execute` keeps per rank and
        per message open (every rank's round open at once, at most), and
        with data every rank's scratch and result, the comparison with the
        reference (a flag and a byte-wise flag per element), and the
        reference and an input being made (int64 temporaries)."""
        need = self.schedule_bytes + self.ranks * (_RANK_BYTES + self.in_flight * _OPEN_BYTES
                                                   + self.queues * _QUEUE_BYTES)
        if data:
            itemsize = np.dtype(dtype).itemsize
            need += (self.scratch * itemsize + self.ranks * count * (2 * itemsize + 1)
                     + count * (2 * itemsize + 4 * 8))
        return need


def tally(scheds: list) -> Footprint:
    """The exact :class:`Footprint` of schedules already built."""
    return _summed([_cost(s) for s in scheds], 0, 1, True)


def _summed(costs: list, left: int, times: int, exact: bool) -> Footprint:
    """The :class:`Footprint` of ranks of ``costs``, and ``left`` more
    each as the largest of ``costs[1:]``, all ``times`` over."""
    def total(field: str) -> int:
        values = [getattr(c, field) for c in costs]
        return times * (sum(values) + left * max(values[1:], default=0))

    def most(field: str) -> int:
        return max((getattr(c, field) for c in costs), default=0)

    return Footprint(len(costs) + left, total("bytes"), total("scratch"), most("in_flight"),
                     most("queues"), total("rounds"), total("messages"), total("reduced"),
                     times * most("rounds"), exact)


def _spread(size: int):
    """Ranks 1 .. size-1 spread out: ``i k mod size`` for i = 1, 2, ...,
    with ``k`` the first number from ``0.618 size`` on without a factor
    in common with ``size`` (the golden ratio's stride), so that those
    taken first fall evenly over the ranks at any number taken and over
    every residue (a fold's pairs, a radix's groups, a node's leader and
    the others)."""
    stride = max(1, int(0.618 * size))
    while math.gcd(stride, size) != 1:
        stride += 1
    for i in range(1, size):
        yield i * stride % size


def footprint(algorithm: str, size: int, count: int, segment_size: int,
              options: Optional[dict] = None, budget: tuple = FOOTPRINT_BUDGET) -> Footprint:
    """The :class:`Footprint` of ``algorithm``'s schedules for ``size``
    ranks, from a few of them, so that knowing it costs little whatever
    the run would hold:

    * rank 0's schedule is built at ``count`` elements, or (where that
      passes ``budget[0]`` actions) at the count ``c`` where doubling from
      ``segment_size // size`` passed it (at once at ``count`` where the
      last two counts' actions in a line stay within it there), and its
      objects counted; then other ranks, spread out (``_spread``),
      until ``budget[1]`` actions are counted or as many ranks as
      ``FOOTPRINT_SPREAD`` allows;
    * every rank not counted is taken as the largest of those counted
      (rank 0 apart: the root of the trees and the driver, a leader of
      hierarchical, a rank of the fold where p is no power of two);
    * at ``c`` below ``count`` everything is taken ``ceil(count / c)``
      times: a range a times as long takes at most a times the segments
      (pieces, slots of scratch).

    Exact (``exact``) when every rank was counted at ``count``; else an
    upper bound, unless a rank left out holds more than every one counted.
    """
    build, options = _builder(algorithm, size, count, options)
    probe = min(count, max(1, segment_size // size))
    first = _cost(build(0, size, probe, segment_size, options))
    while probe < count and first.actions <= budget[0]:
        last, probe = first, min(count, 2 * probe)
        first = _cost(build(0, size, probe, segment_size, options))
        # where the actions grow slowly enough to stay within the budget
        # at the whole count (in a straight line from the last two counts)
        # it is taken at once
        if probe < count and first.actions + 2 * (first.actions - last.actions) * (
                count - probe) / probe <= budget[0]:
            probe = count
            first = _cost(build(0, size, probe, segment_size, options))
    whole = probe == count  # (else every int is counted, as at the whole count)
    if not whole:
        first = _cost(build(0, size, probe, segment_size, options), cached=False)
    others = []
    least, most = FOOTPRINT_SPREAD
    for rank in _spread(size):
        if len(others) >= most or (len(others) >= least
                                   and sum(c.actions for c in others) >= budget[1]):
            break
        others.append(_cost(build(rank, size, probe, segment_size, options), cached=whole))
    left = size - 1 - len(others)
    return _summed([first] + others, left, -(-count // probe) if probe else 1,
                   left == 0 and whole)


def memory_needed(algorithm: str, size: int, count: int, dtype="float32",
                  segment_size: int = 1 << 18, options: Optional[dict] = None,
                  data: bool = True) -> int:
    """Bytes :func:`simulate` with these arguments holds at its peak,
    known before it builds the schedules (:func:`footprint`)."""
    return footprint(algorithm, size, count, segment_size, options).bytes(count, dtype, data)


def available_memory() -> Optional[int]:
    """Bytes the kernel says can be had without swapping (``MemAvailable``),
    or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_text(nbytes: float) -> str:
    """``nbytes`` as the memory checks say it: ``1.3 GB``, ``84 MB``, ``0.4 MB``."""
    if nbytes >= 1e8:
        return f"{nbytes / 1e9:.1f} GB"
    return f"{nbytes / 1e6:.{0 if nbytes >= 1e6 else 1}f} MB"


def check_memory(need: int, label: str = "") -> None:
    """Refuse, with a :class:`MemoryError` that says how much, a run of
    ``need`` bytes that would not fit in the memory available now (instead
    of being killed by the kernel without a word)."""
    have = available_memory()
    if have is not None and need > have:
        raise MemoryError(
            f"simulating {label} holds every rank's buffers in this process: about "
            f"{memory_text(need)}, and {memory_text(have)} is available; use fewer ranks (-p) or "
            "elements (--count)")


def execute(scheds: list, arrays: list, machine: Optional["Machine"] = None, combine=np.add,
            itemsize: int = 1, label: str = "", observe=None,
            link_bytes: Optional[dict] = None) -> list:
    """Run the ranks' schedules against each other on ``arrays`` (per rank
    ``(send, recv, scratch)``, or None to time only); every rank's finish
    time.  Raises :class:`SimulationError` as :func:`simulate` does
    (``label`` names the case in its messages).

    ``observe(event, **fields)``, when given, is told of every step on the
    machine's clock (what pictures and simulated traces are drawn from):

    * ``"post"``: ``rank``, ``round``, ``at`` -- the round's leading local
      actions are done and its messages are about to be posted (or, in a
      round without messages, its local actions are done);
    * ``"local"``: ``rank``, ``round``, ``kind`` (``"reduce"`` or
      ``"copy"``), ``start``, ``end``, ``elements``;
    * ``"message"``: ``src``, ``dst``, ``src_round``, ``dst_round``,
      ``src_ref``, ``dst_ref``, ``begin``, ``end``, ``elements``;
    * ``"end"``: ``rank``, ``round``, ``start``, ``end`` -- the round is
      over (its messages are done).

    ``link_bytes``, when given, gets the bytes of every link messages
    crossed (see :attr:`Outcome.link_bytes`).
    """
    machine = machine or Machine()
    size = len(scheds)
    data = any(a is not None for a in arrays)
    ranks = [_Rank(sched.rounds, a) for sched, a in zip(scheds, arrays)]
    for r in ranks:
        r.clock = machine.call_overhead

    # per ordered pair (src, dst): posted, unmatched sends and receives,
    # each (ref, post time, ...); a pair's queue goes once empty (naive's
    # p^2 pairs would otherwise each keep one)
    sends: dict = defaultdict(deque)
    recvs: dict = defaultdict(deque)
    ready = [(r.clock, rank) for rank, r in enumerate(ranks)]  # (clock, rank), a heap
    # the links between nodes (:func:`~mpi_allreduce.network.route`; a
    # node's port is its ``nic`` links), each known by its number here:
    # when each of its lanes is free, and the bytes it carried
    links_known: list = []
    link_number: dict = {}
    link_free: list = []
    carried: list = []
    # (node, node) -> (its links' numbers, slowest seconds per byte, hops'
    # latency): numbers, not the links, so that a pair costs a few bytes a
    # link (a torus of thousands of nodes has routes of dozens of links)
    paths: dict = {}
    lanes_of: dict = {}  # a class of links -> (lanes, seconds per byte of each)
    flat = Network()
    # (rank, "out" / "in" inside a node, "net" across on a half-duplex
    # machine) -> when the rank is free to move its next message
    copy_free: dict = defaultdict(float)
    # with ``cores``: until when each rank has work (software, a reduction,
    # a copy of a matched message), and who shares its node
    busy_until = [0.0] * size
    node_of = machine.nodes or (0,) * size
    members: dict = defaultdict(list)
    for rank_, node in enumerate(node_of):
        members[node].append(rank_)

    def slowdown(rank: int, at: float) -> float:
        """How much slower work of ``rank`` starting at ``at`` runs: the
        ranks of its node with work then, over its cores (at least 1)."""
        if machine.cores is None:
            return 1.0
        busy = 1 + sum(1 for other in members[node_of[rank]]
                       if other != rank and busy_until[other] > at)
        return max(1.0, busy / machine.cores)

    def view(r: _Rank, ref: Ref):
        return r.arrays[ref.buf][ref.offset:ref.stop]

    def path(a: int, b: int) -> tuple:
        """The route between nodes ``a`` and ``b``, its slowest link's
        seconds per byte and its hops between routers."""
        known = paths.get((a, b))
        if known is None:
            network = machine.network or flat
            links = route(network, a, b)
            lanes = [lanes_of.get(link[0]) or lanes_of.setdefault(
                         link[0], network.lanes(link[0], machine.link(True)[1]))
                     for link in links]
            numbers = []
            for link, (count, _) in zip(links, lanes):
                number = link_number.get(link)
                if number is None:
                    number = link_number[link] = len(links_known)
                    links_known.append(link)
                    link_free.append([0.0] * count)
                    carried.append(0)
                numbers.append(number)
            known = paths[(a, b)] = (tuple(numbers), max(beta for _, beta in lanes),
                                     hops(links) * network.hop_latency)
        return known

    def complete(rank: int, at: float) -> None:
        r = ranks[rank]
        r.open -= 1
        r.until = max(r.until, at)
        if r.open == 0:
            r.clock = max(r.clock, r.until)
            if observe is not None:
                observe("end", rank=rank, round=r.index, start=r.began, end=r.clock)
            r.index += 1
            heapq.heappush(ready, (r.clock, rank))

    def match(src: int, dst: int, sref: Ref, stime: float, rref: Ref, rtime: float,
              eager: bool = False, rounds: tuple = (0, 0)) -> None:
        if sref.length != rref.length:
            raise SimulationError(
                f"rank {src} sends {sref.length} elements to rank {dst}, which receives "
                f"{rref.length} ({label})")
        if data:
            view(ranks[dst], rref)[...] = view(ranks[src], sref)
        nbytes = sref.length * itemsize
        begin = stime if eager else max(stime, rtime)
        if machine.across(src, dst):
            links, slowest, latency = path(machine.nodes[src], machine.nodes[dst])
            taken = []  # the lane of each link free first
            for link in links:
                lanes = link_free[link]
                lane = min(range(len(lanes)), key=lanes.__getitem__) if len(lanes) > 1 else 0
                taken.append(lane)
                begin = max(begin, lanes[lane])
            if machine.half_duplex:
                begin = max(begin, copy_free[(src, "net")], copy_free[(dst, "net")])
            for link, lane in zip(links, taken):
                link_free[link][lane] = begin + nbytes * slowest
                carried[link] += nbytes
            at = (begin + machine.message_time(True, nbytes) + latency
                  + nbytes * max(0.0, slowest - machine.link(True)[1]))
            if machine.half_duplex:
                copy_free[(src, "net")] = copy_free[(dst, "net")] = at
        else:  # inside a node the ranks' CPUs copy it, one message at a time each way
            out, into = (src, "out"), (dst, "in")
            begin = max(begin, copy_free[out], copy_free[into])
            fresh = sref.buf != SEND
            at = begin + machine.message_time(False, nbytes, fresh) * max(slowdown(src, begin),
                                                                           slowdown(dst, begin))
            copy_free[out] = copy_free[into] = at
            if link_bytes is not None:
                key = ("intra", node_of[src], node_of[dst])
                link_bytes[key] = link_bytes.get(key, 0) + nbytes
        busy_until[src] = max(busy_until[src], at)
        busy_until[dst] = max(busy_until[dst], at)
        if observe is not None:
            observe("message", src=src, dst=dst, src_round=rounds[0], dst_round=rounds[1],
                    src_ref=sref, dst_ref=rref, begin=begin, end=at, elements=sref.length)
        if eager:  # the sender went on at once
            complete(dst, max(at, rtime))
            return
        complete(src, at)
        complete(dst, at)

    def start(rank: int) -> None:
        r = ranks[rank]
        actions = r.rounds[r.index]
        posted = []  # (ref, writes) of this round's messages
        r.open = 1  # held open while posting
        r.until = r.began = r.clock
        slow = slowdown(rank, r.clock)
        posting = False
        for action in actions:
            if isinstance(action, (Send, Recv)):
                if observe is not None and not posting:
                    observe("post", rank=rank, round=r.index, at=r.clock)
                posting = True
                ref = action.src if isinstance(action, Send) else action.dst
                writes = isinstance(action, Recv)
                for other, other_writes in posted:
                    if (writes or other_writes) and _overlaps(ref, other, r.arrays):
                        raise SimulationError(
                            f"rank {rank}, round {r.index}: two messages of one round overlap "
                            f"in {BUFFER_NAMES[ref.buf]} ({label})")
                posted.append((ref, writes))
                r.clock += machine.overhead * slow
                # an eager send is done once posted; the receive waits for its bytes
                eager = (not writes and not data and machine.eager_bytes is not None
                         and ref.length * itemsize <= machine.eager_bytes)
                r.open += not eager
                if writes:
                    pair = (action.peer, rank)
                    queue = sends.get(pair)
                    if queue:
                        src_ref, stime, was_eager, src_round = queue.popleft()
                        if not queue:
                            del sends[pair]
                        match(action.peer, rank, src_ref, stime, ref, r.clock, was_eager,
                              (src_round, r.index))
                    else:
                        recvs[pair].append((ref, r.clock, r.index))
                else:
                    pair = (rank, action.peer)
                    queue = recvs.get(pair)
                    if queue:
                        dst_ref, rtime, dst_round = queue.popleft()
                        if not queue:
                            del recvs[pair]
                        match(rank, action.peer, ref, r.clock, dst_ref, rtime, eager,
                              (r.index, dst_round))
                    else:
                        sends[pair].append((ref, r.clock, eager, r.index))
                continue
            touched = [(action.out, True), (action.first, False), (action.second, False)] \
                if isinstance(action, Reduce) else [(action.dst, True), (action.src, False)]
            for ref, writes in touched:
                for other, other_writes in posted:
                    if (writes or other_writes) and _overlaps(ref, other, r.arrays):
                        raise SimulationError(
                            f"rank {rank}, round {r.index}: a local action touches "
                            f"{BUFFER_NAMES[ref.buf]}[{ref.offset}:{ref.stop}] while a message "
                            f"of its round uses it ({label})")
            if data:
                if isinstance(action, Reduce):
                    combine(view(r, action.first), view(r, action.second),
                            out=view(r, action.out))
                else:
                    view(r, action.dst)[...] = view(r, action.src)
            began = r.clock
            r.clock += (machine.op_overhead + action[0].length * itemsize * machine.gamma) * slow
            if observe is not None:
                observe("local", rank=rank, round=r.index,
                        kind="reduce" if isinstance(action, Reduce) else "copy",
                        start=began, end=r.clock, elements=action[0].length)
        if observe is not None and not posting:
            observe("post", rank=rank, round=r.index, at=r.clock)
        busy_until[rank] = max(busy_until[rank], r.clock)
        complete(rank, r.clock)  # releases the hold; advances if nothing is open

    while ready:
        rank = heapq.heappop(ready)[1]
        r = ranks[rank]
        if r.index >= len(r.rounds):
            r.done = True
            continue
        start(rank)

    stuck = [rank for rank, r in enumerate(ranks) if not r.done]
    if stuck:
        waits = []
        for rank in stuck[:8]:
            peers = sorted({s for (s, d), q in recvs.items() if d == rank and q} |
                           {d for (s, d), q in sends.items() if s == rank and q})
            waits.append(f"rank {rank} in round {ranks[rank].index} waits for {peers}")
        raise SimulationError(f"deadlock ({label}): "
                              + "; ".join(waits) + (" ..." if len(stuck) > 8 else ""))
    leftover = [pair for pair, q in list(sends.items()) + list(recvs.items()) if q]
    if leftover:
        raise SimulationError(f"unmatched messages between {leftover[:8]} ({label})")
    if link_bytes is not None:
        for link, nbytes in zip(links_known, carried):
            link_bytes[link] = link_bytes.get(link, 0) + nbytes
    return [r.clock for r in ranks]


class _LazyInput:
    """A rank's input, made when a range of it is read (so that p inputs of
    a long vector need not all be in memory at once)."""

    def __init__(self, dtype, op, rank):
        self.dtype, self.op, self.rank = dtype, op, rank

    def __getitem__(self, index: slice) -> np.ndarray:
        return inputs(self.dtype, self.op, self.rank, index.start, index.stop)


def critical_path(algorithm: str, size: int, count: int, dtype="float32",
                  segment_size: int = 1 << 18, options: Optional[dict] = None) -> dict:
    """Messages, bytes on the wire and bytes reduced along the critical path
    (each the longest path of its own: unit machines, no data)."""
    out = {}
    for name, machine in (("messages", Machine(alpha=1.0)), ("bytes", Machine(beta=1.0)),
                          ("reduced_bytes", Machine(gamma=1.0))):
        out[name] = simulate(algorithm, size, count, dtype, "sum", segment_size=segment_size,
                             options=options, machine=machine, data=False).seconds
    return out
