"""The network between nodes, for the simulator: torus, fat tree, Dragonfly (no MPI).

Vocabulary.  A *node* is a host: its ranks share its NIC.  A *router* is a
switch (on a torus every node is its own router).  A *link* is one
direction of one cable (or of a bundle of cables used as one), and has a
*class*:

* ``nic``    a node to its router and back (the node's port);
* ``torus``  a torus's neighbour links;
* ``local``  between the routers of one Dragonfly group (or a leaf and a
  spine inside a Dragonfly+ group);
* ``global`` between Dragonfly groups, or between a fat tree's leaves and
  its spine (the level a taper thins out).

Routing is minimal and deterministic (no adaptive routing):

* **torus**: dimension order, each dimension the shorter way round (a tie
  goes upwards), one ``torus`` link per step;
* **fat tree** (two levels): node -> leaf -> (if the other node is on
  another leaf) the leaf's uplink bundle -> the other leaf's downlink
  bundle -> node.  A leaf of ``leaf_nodes`` nodes has uplinks worth
  ``leaf_nodes / taper`` NICs, taken as one link;
* **Dragonfly**: ``groups`` groups of ``routers`` routers with
  ``router_nodes`` nodes each, the routers of a group all to all, and every
  two groups joined by one global link (a bundle of ``global_width``
  cables) held by router ``k mod routers`` of the group, ``k`` the other
  group's place among the group's peers.  A message goes node -> router ->
  (local) the router holding the global link -> (global) -> (local) the
  other node's router -> node, skipping the hops it does not need;
* **Dragonfly+** (``plus``): each group a two-level fat tree of leaves
  (``routers`` of them, nodes on them) and ``spines`` spines, every leaf
  joined to every spine; spine s of each group holds a global link (a
  bundle of ``global_width`` cables) to spine s of every other group, so
  two groups are joined by ``spines`` global links (Dragonfly+ as Shpiner
  et al. define it, 2017).  A message takes the spine ``destination node
  mod spines`` (InfiniBand's D-mod-k: the destination's address picks the
  up-port): inside a group leaf -> spine -> leaf, across groups leaf ->
  spine s -> (global) -> spine s of the other group -> leaf.

Time.  A message of n bytes between two nodes takes the machine's time
across nodes (``alpha_inter + n beta_inter``, or its measured curve: two
nodes on one router, as point-to-point benchmarks measure them), plus
``hop_latency`` per link between routers on its route, plus ``n`` times
how much slower per byte than the NIC its slowest link is.  Links are
shared: a link worth c NICs (a bundle of cables, a fat tree's uplinks)
has ``max(1, floor(c))`` lanes, and each lane carries the messages that
take it one after another, in the order they start (FIFO), each message
taking the lane free first.  So q messages of n bytes that start together
on a one-lane link end by ``q n beta_link`` after they start; that is when
fair sharing ends them all, and the time of a round, which waits for its
last message, is the same (each message alone gets its own time sooner
than fair sharing would give it: ranks that go on with their next round
earlier are the model's error there).

A :class:`Network` is a frozen value (the simulator's machine stays
hashable); :func:`route` and the rest are pure functions of it, and
:func:`placement` the ranks' nodes as launchers place them.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["Network", "route", "hops", "placement", "traffic", "hottest", "link_name",
           "PLACEMENTS",
           "LINK_CLASSES", "TOPOLOGIES"]

#: the classes of links, in the order traffic is reported
LINK_CLASSES = ("intra", "nic", "torus", "local", "global")
#: how ranks are laid on nodes: ``block`` (ranks_per_node consecutive
#: ranks a node: Slurm's and mpiexec's default) or ``round_robin`` (rank r
#: on node r mod nodes)
PLACEMENTS = ("block", "round_robin")
TOPOLOGIES = ("flat", "torus", "fat_tree", "dragonfly")


@dataclass(frozen=True)
class Network:
    """A topology, its link speeds and its per-hop latency.

    ``topology`` is one of ``flat`` (today's model: one port per node, no
    network beyond it), ``torus`` (``dims``, ``wrap``), ``fat_tree``
    (``leaf_nodes``, ``taper``), ``dragonfly`` (``groups``, ``routers``,
    ``router_nodes``, ``global_width``; ``plus`` and ``spines`` for
    Dragonfly+).  ``link_speed`` gives the bandwidth of a class of links
    (``torus``, ``local``, ``global``) as a multiple of the NIC's (the
    machine's ``beta_inter``, between two nodes): a class it leaves out runs
    at the NIC's speed, so fitting ``beta_inter`` scales every link alike.
    ``nic``, a node's link to the network, worth c gives it ``floor(c)``
    ports: as many of its messages at once, each at the NIC's speed (a
    node with two NICs).  ``nodes``:
    the machine's nodes in all (given by the shape except for ``flat``
    and ``fat_tree``)."""

    topology: str = "flat"
    dims: tuple = ()
    wrap: bool = True
    leaf_nodes: int = 1
    taper: float = 1.0
    groups: int = 1
    routers: int = 1
    router_nodes: int = 1
    global_width: int = 1
    plus: bool = False
    spines: int = 1
    hop_latency: float = 0.0
    link_speed: tuple = ()  # ((class, multiple of the NIC's bandwidth), ...)
    nodes: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.link_speed, dict):
            object.__setattr__(self, "link_speed", tuple(sorted(self.link_speed.items())))
        object.__setattr__(self, "link_speed", tuple(tuple(item) for item in self.link_speed))
        if not isinstance(self.dims, (tuple, list)):
            raise ValueError(f"dims: a list of whole numbers, not {self.dims!r}")
        object.__setattr__(self, "dims", tuple(self.dims))
        for name in ("wrap", "plus"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: true or false, not {getattr(self, name)!r}")
        if self.nodes is not None and (self.topology in ("torus", "dragonfly") or not (
                _whole(self.nodes))):
            raise ValueError(f"nodes {self.nodes!r}: a whole number from 1, for flat and "
                             "fat_tree only (a torus's and a Dragonfly's follow from their shape)")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology {self.topology!r}: one of {', '.join(TOPOLOGIES)}")
        positive = {"torus": ("dims",), "fat_tree": ("leaf_nodes",),
                    "dragonfly": ("groups", "routers", "router_nodes", "global_width",
                                  "spines")}.get(self.topology, ())
        for name in positive:
            values = getattr(self, name)
            for value in (values if isinstance(values, tuple) else (values,)):
                if not _whole(value):
                    raise ValueError(f"{self.topology}: {name} must be whole numbers from 1, "
                                     f"not {values!r}")
        if self.topology == "torus" and not self.dims:
            raise ValueError("torus: dims, the nodes along each dimension, e.g. [8, 8]")
        if not self.taper >= 1.0:
            raise ValueError(f"taper is the oversubscription ratio, 1 or more, not {self.taper}")
        for name, speed in self.link_speed:
            if name not in ("nic", "torus", "local", "global") or not (
                    isinstance(speed, (int, float)) and speed > 0):
                raise ValueError(f"link_speed: {name!r}: {speed!r}: the classes nic, torus, "
                                 "local, global, each a multiple of the NIC's bandwidth, "
                                 "above 0")
        if self.hop_latency < 0:
            raise ValueError(f"hop_latency {self.hop_latency}: seconds, 0 or more")

    @property
    def size(self) -> Optional[int]:
        """The machine's nodes (None: as many as placed, for ``flat`` and
        ``fat_tree`` without ``nodes``)."""
        if self.topology == "torus":
            return math.prod(self.dims)
        if self.topology == "dragonfly":
            return self.groups * self.routers * self.router_nodes
        return self.nodes

    def worth(self, link_class: str) -> float:
        """How many NICs' bandwidth a link of ``link_class`` carries: its
        ``link_speed`` (1 where none is given), times ``leaf_nodes / taper``
        for a fat tree's uplinks and ``global_width`` for a Dragonfly's
        global link."""
        worth = float(dict(self.link_speed).get(link_class, 1.0))
        if link_class == "global" and self.topology == "fat_tree":
            return worth * self.leaf_nodes / self.taper
        if link_class == "global" and self.topology == "dragonfly":
            return worth * self.global_width
        return worth

    def beta(self, link_class: str, nic_beta: float) -> float:
        """Seconds per byte of a link of ``link_class``, the NIC's being ``nic_beta``."""
        return nic_beta / self.worth(link_class)

    def lanes(self, link_class: str, nic_beta: float) -> tuple:
        """(lanes, seconds per byte of each) of a link of ``link_class``:
        a link worth c NICs carries ``max(1, floor(c))`` messages at once,
        each at c / lanes NICs' speed."""
        worth = self.worth(link_class)
        lanes = max(1, int(worth + 1e-9))
        return lanes, nic_beta * lanes / worth

    @classmethod
    def from_json(cls, description: dict) -> "Network":
        """A network from a machine description's ``network`` object
        (unknown keys are a TypeError, bad values a ValueError)."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(description) - known)
        if unknown:
            raise TypeError(f"network: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**description)


def _whole(value) -> bool:
    """A whole number from 1 (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def link_name(link: tuple) -> str:
    """A link as the traffic report names it, e.g. ``global g0->g3``."""
    kind, a, b = link
    return f"{kind} {a}->{b}"


@functools.lru_cache(maxsize=4096)
def route(network: Network, a: int, b: int) -> tuple:
    """The links from node ``a`` to node ``b``, each ``(class, from,
    to)``, NIC links included; ``()`` for a == b."""
    if a == b:
        return ()
    _check_node(network, a)
    _check_node(network, b)
    if network.topology == "flat":
        return (("nic", f"n{a}", "net"), ("nic", "net", f"n{b}"))
    if network.topology == "torus":
        return _torus(network, a, b)
    if network.topology == "fat_tree":
        la, lb = a // network.leaf_nodes, b // network.leaf_nodes
        up = (("nic", f"n{a}", f"l{la}"),)
        down = (("nic", f"l{lb}", f"n{b}"),)
        if la == lb:
            return up + down
        return up + (("global", f"l{la}", "spine"), ("global", "spine", f"l{lb}")) + down
    return _dragonfly(network, a, b)


def hops(links: tuple) -> int:
    """Links between routers on a route (those ``hop_latency`` is paid on)."""
    return sum(1 for link in links if link[0] != "nic")


def _check_node(network: Network, node: int) -> None:
    size = network.size
    if size is not None and not 0 <= node < size:
        raise ValueError(f"node {node} is not on this {network.topology} of {size} nodes")


def _torus(network: Network, a: int, b: int) -> tuple:
    coords_a, coords_b = _coords(network.dims, a), _coords(network.dims, b)
    links = [("nic", f"n{a}", f"r{a}")]
    here, stride = a, 1
    for extent, ca, cb in zip(network.dims, coords_a, coords_b):
        delta = (cb - ca) % extent
        if network.wrap:
            step = 1 if delta <= extent - delta else -1
            steps = delta if step == 1 else extent - delta
        else:
            step = 1 if cb >= ca else -1
            steps = abs(cb - ca)
        c = ca
        for _ in range(steps):
            after = (c + step) % extent
            there = here + (after - c) * stride
            links.append(("torus", f"r{here}", f"r{there}"))
            here, c = there, after
        stride *= extent
    links.append(("nic", f"r{b}", f"n{b}"))
    return tuple(links)


def _coords(dims: tuple, node: int) -> tuple:
    out = []
    for extent in dims:
        node, c = divmod(node, extent)
        out.append(c)
    return tuple(out)


def _dragonfly(network: Network, a: int, b: int) -> tuple:
    per_group = network.routers * network.router_nodes
    ga, gb = a // per_group, b // per_group
    ra, rb = (a % per_group) // network.router_nodes, (b % per_group) // network.router_nodes
    router_a, router_b = f"g{ga}r{ra}", f"g{gb}r{rb}"
    links = [("nic", f"n{a}", router_a)]
    if network.plus:
        # leaves are the routers; spines hold the global links
        if ga == gb:
            if ra != rb:
                spine = f"g{ga}s{b % network.spines}"
                links += [("local", router_a, spine), ("local", spine, router_b)]
        else:  # (spine s of each group holds a global link to spine s of every other)
            spine = b % network.spines
            out_spine, in_spine = f"g{ga}s{spine}", f"g{gb}s{spine}"
            links += [("local", router_a, out_spine), ("global", out_spine, in_spine),
                      ("local", in_spine, router_b)]
    elif ga == gb:
        if ra != rb:
            links.append(("local", router_a, router_b))
    else:
        out_router = f"g{ga}r{_holder(ga, gb, network.routers)}"
        in_router = f"g{gb}r{_holder(gb, ga, network.routers)}"
        if out_router != router_a:
            links.append(("local", router_a, out_router))
        links.append(("global", f"g{ga}", f"g{gb}"))
        if in_router != router_b:
            links.append(("local", in_router, router_b))
    links.append(("nic", router_b, f"n{b}"))
    return tuple(links)


def _holder(group: int, other: int, routers: int) -> int:
    """The router of ``group`` that holds its global link to ``other`` (a
    Dragonfly's): the other group's place among its peers, mod ``routers``."""
    return (other if other < group else other - 1) % routers


def placement(kind, ranks: int, ranks_per_node: int, network: Optional[Network] = None) -> tuple:
    """The node of every rank: ``block`` or ``round_robin`` over
    ``ceil(ranks / ranks_per_node)`` nodes (the machine's first nodes), or
    ``kind`` a sequence giving every rank's node (as a Slurm allocation
    places them; a file of them read by the caller)."""
    if not isinstance(kind, str):
        nodes = tuple(int(n) for n in kind)
        if len(nodes) != ranks:
            raise ValueError(f"the placement names {len(nodes)} ranks' nodes, and there are "
                             f"{ranks} ranks")
    else:
        if kind not in PLACEMENTS:
            raise ValueError(f"placement {kind!r}: one of {', '.join(PLACEMENTS)}, or a file")
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node {ranks_per_node}: 1 or more")
        used = -(-ranks // ranks_per_node)
        nodes = tuple(r // ranks_per_node if kind == "block" else r % used
                      for r in range(ranks))
    if network is not None:
        for node in set(nodes):
            _check_node(network, node)
    return nodes


def hottest(link_bytes: dict, k: int) -> list:
    """The ``k`` links between nodes (``intra`` left out) that carried the
    most bytes, from bytes per link: ``[(name, bytes), ...]``, most first
    (of links that carried as many, the first counted)."""
    top = heapq.nlargest(k, ((link, nbytes) for link, nbytes in link_bytes.items()
                             if link[0] != "intra"), key=lambda item: item[1])
    return [(link_name(link), nbytes) for link, nbytes in top]


def traffic(link_bytes: dict) -> dict:
    """Bytes per link class (``LINK_CLASSES``) and the hottest link, from
    bytes per link: ``{"intra": .., "nic": .., ..., "hottest": (name,
    bytes)}`` (``("", 0)`` where no link between nodes carried any)."""
    out = dict.fromkeys(LINK_CLASSES, 0)
    for link, nbytes in link_bytes.items():
        out[link[0]] += nbytes
    top = [item for item in hottest(link_bytes, 1) if item[1] > 0]
    out["hottest"] = top[0] if top else ("", 0)
    return out

