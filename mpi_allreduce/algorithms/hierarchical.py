"""Hierarchical all-reduce: inside the node, across nodes, back inside.

Ranks that share a node (``Split_type(COMM_TYPE_SHARED)``, or consecutive
groups of ``ranks_per_node`` ranks to emulate nodes on one machine) form a
node communicator; local rank 0 of every node is its leader::

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
"""

from __future__ import annotations

from ..config import environment
from ..partition import block_bounds, ring_owned_block
from .ring import Ring, allgather, reduce_scatter

LEADER = 0


def ranks_per_node_setting(value):
    """The node-size override: the argument, else the environment, else None."""
    if value is None:
        value = environment().ranks_per_node
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"ranks_per_node must be a positive integer, got {value!r}")
    return value


def inner_setting(value) -> str:
    """The leaders' algorithm: the argument, else the environment, else auto."""
    from ..registry import check_name

    value = check_name(value or environment().inner or "auto")
    if value == "hierarchical":
        raise ValueError("inner algorithm of 'hierarchical' cannot be 'hierarchical'")
    return value


class Hierarchical:
    name = "hierarchical"

    def __init__(self, plan):
        from ..registry import build  # the inner algorithm comes from the registry

        self.plan = plan
        node, leaders = plan.context.node_comms(plan.options.get("ranks_per_node"))
        self.node_plan = plan.derive(node)
        self.node_ring = Ring(self.node_plan)
        q = node.Get_size()
        self.blocks = block_bounds(plan.count, q)
        self.owned = [self.blocks[ring_owned_block(i, q)] for i in range(q)]
        self.inner = None
        if leaders is not None:
            self.inner = build(plan.derive(leaders), plan.options.get("inner", "auto"))

    def __call__(self, send, buf) -> None:
        reduce_scatter(self.node_ring, send, buf)
        self._gather_to_leader(buf)
        if self.inner is not None:
            self.inner(buf, buf)
        self._scatter_from_leader(buf)
        allgather(self.node_ring, buf)

    def _gather_to_leader(self, buf) -> None:
        plan = self.node_plan
        if plan.rank != LEADER:
            mine = self.owned[plan.rank]
            plan.sendrecv(buf[mine.offset:mine.stop], LEADER, None, LEADER)
            return
        for local in range(1, plan.size):
            theirs = self.owned[local]
            plan.sendrecv(None, local, buf[theirs.offset:theirs.stop], local)

    def _scatter_from_leader(self, buf) -> None:
        plan = self.node_plan
        if plan.rank != LEADER:
            mine = self.owned[plan.rank]
            plan.sendrecv(None, LEADER, buf[mine.offset:mine.stop], LEADER)
            return
        for local in range(1, plan.size):
            theirs = self.owned[local]
            plan.sendrecv(buf[theirs.offset:theirs.stop], local, None, local)
