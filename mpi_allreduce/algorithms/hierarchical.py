"""Hierarchical all-reduce: inside the node, across nodes, back inside.

Ranks that share a node (``Split_type(COMM_TYPE_SHARED)``, or consecutive
groups of ``ranks_per_node`` ranks to emulate nodes on one machine) form a
node; the lowest rank of every node is its leader::

    phase               inside node (q local ranks)         across nodes (m leaders)
    1 reduce-scatter    ring, q-1 steps
    2 gather            local i sends its block to leader
    3 all-reduce                                             inner algorithm, whole vector
    4 scatter           leader sends block i to local i
    5 allgather         ring, q-1 steps

Phases 1-2 are a bandwidth-optimal reduce to the leader, 4-5 a
bandwidth-optimal broadcast (scatter + allgather), so the slow network
carries only the m leaders' vectors.  Nodes may hold different numbers of
ranks.  Cost: with intra-node (a_i, b_i) and inter-node (a_e, b_e) links,
4(q-1) a_i + 4 n (q-1)/q b_i + n (q-1)/q g + cost_inner(m, a_e, b_e).
Every rank gets the leader's bytes, so results are identical everywhere.
The inner all-reduce is another algorithm's schedule, built for the m
leaders and moved onto their ranks (:func:`~mpi_allreduce.schedule.remap`).

``options``: ``nodes``, the node of every rank (a tuple of length p), and
``inner``, the leaders' algorithm: a flat algorithm's name, resolved by the
caller (:func:`mpi_allreduce.selection.hierarchical_options` is the one
place that resolves it).
"""

from __future__ import annotations

from . import flat
from ..partition import block_bounds, ring_owned_block
from ..schedule import RECV, SEND, Builder, Recv, Ref, Send, remap
from .ring import allgather, reduce_scatter

NAME = "hierarchical"
COMMUTATIVE = True


def layout(nodes) -> tuple:
    """(members of each node in rank order, leaders in rank order)."""
    groups: dict = {}
    for r, node in enumerate(nodes):
        groups.setdefault(node, []).append(r)
    members = sorted(groups.values())
    return members, [m[0] for m in members]


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    options = options or {}
    nodes = options.get("nodes") or tuple(range(size))
    if len(nodes) != size:
        raise ValueError(f"nodes names {len(nodes)} ranks, the group has {size}")
    members, leaders = layout(nodes)
    node = next(m for m in members if rank in m)
    local, q = node.index(rank), len(node)
    blocks = block_bounds(count, q)
    owned = [blocks[ring_owned_block(i, q)] for i in range(q)]

    b = Builder()
    reduce_scatter(b, node, local, blocks, segment_size)
    _gather_to_leader(b, node, local, owned)
    if local == 0 and len(leaders) > 1:
        if "inner" not in options:
            raise ValueError("hierarchical needs options['inner'], the leaders' algorithm")
        part = flat(options["inner"]).build(leaders.index(rank), len(leaders), count,
                                            segment_size, {})
        b.extend(remap(part, leaders, {SEND: RECV}))
    _scatter_from_leader(b, node, local, owned)
    allgather(b, node, local, blocks, segment_size)
    return b.schedule(NAME, rank, size, count)


def _gather_to_leader(b: Builder, node: list, local: int, owned: list) -> None:
    _with_leader(b, node, local, owned, member=Send, leader=Recv)


def _scatter_from_leader(b: Builder, node: list, local: int, owned: list) -> None:
    _with_leader(b, node, local, owned, member=Recv, leader=Send)


def _with_leader(b: Builder, node: list, local: int, owned: list, member, leader) -> None:
    """Local rank i's block ``owned[i]`` of the result moves between it and
    the leader: a member posts ``member`` (Send or Recv) with the leader,
    the leader one ``leader`` per member, in local rank order."""
    if local:
        mine = owned[local]
        b.round(member(node[0], Ref(RECV, mine.offset, mine.length)))
        return
    for i in range(1, len(node)):
        b.round(leader(node[i], Ref(RECV, owned[i].offset, owned[i].length)))
