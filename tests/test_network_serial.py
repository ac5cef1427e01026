"""The simulator's network (mpi_allreduce/network.py) and the check of
predictions against measured tables (mpi_allreduce/tools/measured.py): the
routes are minimal and connected, shared links queue, traffic is counted
on every link a message crosses, and a fit finds the machine that made a
table.  No MPI."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from mpi_allreduce.network import Network, hops, placement, route, traffic
from mpi_allreduce.simulate import Machine, simulate
from mpi_allreduce.tools import measured

TOPOLOGIES = {
    "torus-4x4": Network("torus", dims=(4, 4)),
    "torus-3x5": Network("torus", dims=(3, 5)),
    "mesh-3x3": Network("torus", dims=(3, 3), wrap=False),
    "torus-2x3x2": Network("torus", dims=(2, 3, 2)),
    "fat-tree-4x3": Network("fat_tree", leaf_nodes=3, nodes=12, taper=2.0),
    "dragonfly-3x2x2": Network("dragonfly", groups=3, routers=2, router_nodes=2),
    "dragonfly+-3x3x2": Network("dragonfly", groups=3, routers=3, router_nodes=2, plus=True,
                                spines=2),
}


def _torus_distance(network: Network, a: int, b: int) -> int:
    total = 0
    for extent in network.dims:
        a, ca = divmod(a, extent)
        b, cb = divmod(b, extent)
        delta = abs(ca - cb)
        total += min(delta, extent - delta) if network.wrap else delta
    return total


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_every_route_is_connected_from_node_to_node(name):
    network = TOPOLOGIES[name]
    for a, b in itertools.permutations(range(network.size), 2):
        links = route(network, a, b)
        assert links[0][:2] == ("nic", f"n{a}") and links[-1][0] == "nic" \
            and links[-1][2] == f"n{b}", links
        for first, second in zip(links, links[1:]):
            assert first[2] == second[1] or first[0] == "global" or second[0] == "global", \
                f"{name}: {a}->{b} jumps between {first} and {second}"
        assert len(set(links)) == len(links), f"{name}: {a}->{b} crosses a link twice"
    assert route(network, 0, 0) == ()


@pytest.mark.parametrize("name", [n for n in TOPOLOGIES if "torus" in n or "mesh" in n])
def test_torus_routes_are_minimal(name):
    network = TOPOLOGIES[name]
    for a, b in itertools.permutations(range(network.size), 2):
        assert hops(route(network, a, b)) == _torus_distance(network, a, b)


def test_fat_tree_and_dragonfly_hops():
    tree = TOPOLOGIES["fat-tree-4x3"]
    assert hops(route(tree, 0, 2)) == 0 and hops(route(tree, 0, 3)) == 2
    fly = TOPOLOGIES["dragonfly-3x2x2"]
    assert hops(route(fly, 0, 1)) == 0  # one router
    assert [link[0] for link in route(fly, 0, 2)] == ["nic", "local", "nic"]
    for a, b in itertools.product(range(4), range(4, 8)):  # group 0 to group 1
        classes = [link[0] for link in route(fly, a, b)]
        assert classes.count("global") == 1 and classes.count("local") <= 2
    # one global link joins two groups, whichever nodes talk
    assert len({link for a, b in itertools.product(range(4), range(4, 8))
                for link in route(fly, a, b) if link[0] == "global"}) == 1
    plus = TOPOLOGIES["dragonfly+-3x3x2"]
    assert [link[0] for link in route(plus, 0, 2)] == ["nic", "local", "local", "nic"]
    assert [link[0] for link in route(plus, 0, 6)] == ["nic", "local", "global", "local", "nic"]
    # Dragonfly+: spine s of a group holds a global link to spine s of every other
    # group, so two groups are joined by one global link a spine (2 here), a message
    # taking the spine of its destination node (D-mod-k) -- not all over one link
    between = {link for a, b in itertools.product(range(6), range(6, 12))
               for link in route(plus, a, b) if link[0] == "global"}
    assert between == {("global", "g0s0", "g1s0"), ("global", "g0s1", "g1s1")}
    for a, b in itertools.product(range(6), range(6, 12)):
        assert route(plus, a, b)[1:4] == (("local", f"g0r{a // 2}", f"g0s{b % 2}"),
                                          ("global", f"g0s{b % 2}", f"g1s{b % 2}"),
                                          ("local", f"g1s{b % 2}", f"g1r{b % 6 // 2}"))
    # and inside a group, the two nodes of a leaf are reached through both spines
    assert {route(plus, 0, b)[2][1] for b in (2, 3)} == {"g0s0", "g0s1"}


def test_link_speeds_taper_and_width():
    tree = Network("fat_tree", leaf_nodes=8, taper=4.0)
    assert tree.beta("global", 1.0) == pytest.approx(0.5)  # 8 links' worth over 4
    fly = Network("dragonfly", groups=2, routers=1, router_nodes=1, global_width=4,
                  link_speed={"local": 2.0})
    assert fly.beta("global", 1.0) == pytest.approx(0.25)
    assert fly.beta("local", 1.0) == pytest.approx(0.5)
    assert fly.beta("nic", 1.0) == 1.0
    # a node with two NICs: two of its messages at once, each at one NIC's speed
    assert Network("flat", link_speed={"nic": 2.0}).lanes("nic", 1.0) == (2, 1.0)
    assert fly.lanes("nic", 1.0) == (1, 1.0)


@pytest.mark.parametrize("bad", [
    {"topology": "hypercube"}, {"topology": "torus"}, {"topology": "torus", "dims": [4, 0]},
    {"topology": "fat_tree", "leaf_nodes": 4, "taper": 0.5},
    {"topology": "dragonfly", "groups": 0}, {"topology": "flat", "link_speed": {"intra": 1}},
    {"topology": "flat", "link_speed": {"nic": 0}},
    {"topology": "flat", "hop_latency": -1.0}, {"topology": "flat", "colour": "red"}])
def test_bad_networks_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        Network.from_json(bad)


def test_placements():
    assert placement("block", 6, 2) == (0, 0, 1, 1, 2, 2)
    assert placement("round_robin", 6, 2) == (0, 1, 2, 0, 1, 2)
    assert placement([3, 1], 2, 1) == (3, 1)
    with pytest.raises(ValueError):
        placement([0, 1, 2], 2, 1)
    with pytest.raises(ValueError):
        placement("block", 32, 1, Network("torus", dims=(4, 4)))  # 32 nodes on 16
    with pytest.raises(ValueError):
        placement("scatter", 4, 1)


def _on(network: Network, size: int, rpn: int = 1, **params) -> Machine:
    machine = Machine(**params, network=network)
    return machine.placed(placement("block", size, rpn, network))


def test_a_shared_link_carries_its_messages_one_after_another():
    """Recursive doubling on 4 nodes, 2 a leaf: its second step sends
    from both nodes of a leaf to the other leaf at once.  With uplinks
    worth one NIC (taper 2) the two messages queue there: the round takes
    one message's bytes longer than with uplinks worth two."""
    n, beta = 1 << 20, 1e-9
    times = {}
    for taper in (1.0, 2.0):
        tree = Network("fat_tree", leaf_nodes=2, nodes=4, taper=taper)
        out = simulate("recursive_doubling", 4, n // 4, "float32", data=False,
                       machine=_on(tree, 4, beta_inter=beta))
        times[taper] = out.seconds
    assert times[2.0] - times[1.0] == pytest.approx(n * beta, rel=1e-6)
    flat = simulate("recursive_doubling", 4, n // 4, "float32", data=False,
                    machine=_on(Network(), 4, beta_inter=beta))
    assert flat.seconds == pytest.approx(times[1.0], rel=1e-9)


def test_hops_cost_their_latency():
    ring = Network("torus", dims=(8,), hop_latency=1e-6)
    one = simulate("recursive_doubling", 8, 1, "float32", data=False,
                   machine=_on(ring, 8, alpha_inter=1e-6))
    # distances 1, 2 and 4 on a ring of 8: 1 + 2 + 4 hops after the three messages
    assert one.seconds == pytest.approx(3e-6 + 7e-6)


def test_traffic_counts_every_link_a_message_crosses():
    network = Network("torus", dims=(8,))
    count = 1 << 10
    out = simulate("ring", 8, count, "float32", data=False, machine=_on(network, 8))
    links = traffic(out.link_bytes)
    sent = sum(out.bytes_sent)
    # a ring's neighbours are one hop apart: every byte on two NIC links and one torus link
    assert links["nic"] == 2 * sent and links["torus"] == sent and links["global"] == 0
    rd = simulate("recursive_doubling", 8, count, "float32", data=False, machine=_on(network, 8))
    # distances 1, 2, 4: each step's whole vector on 1, 2 and 4 links
    assert traffic(rd.link_bytes)["torus"] == 8 * count * 4 * (1 + 2 + 4)
    fly = Network("dragonfly", groups=2, routers=2, router_nodes=2)
    out = simulate("recursive_doubling", 8, count, "float32", data=False, machine=_on(fly, 8))
    links = traffic(out.link_bytes)
    # only the last step (distance 4) leaves a group: 8 messages of the vector
    assert links["global"] == 8 * count * 4
    # group 0's global link carries its four nodes' vectors; its router
    # without that link sends two of them over a local link, besides the
    # two of the step at distance 2: as hot
    assert out.link_bytes[("global", "g0", "g1")] == 4 * count * 4
    assert links["hottest"][1] == 4 * count * 4
    assert out.link_bytes[("local", "g0r1", "g0r0")] == 4 * count * 4


def test_two_ranks_a_node_move_their_bytes_inside_it():
    out = simulate("ring", 4, 64, "float32", data=False,
                   machine=_on(Network("torus", dims=(2,)), 4, rpn=2))
    links = traffic(out.link_bytes)
    assert links["intra"] > 0 and links["intra"] + links["nic"] // 2 == sum(out.bytes_sent)


def test_a_machine_description_loads_with_its_network(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"name": "x", "params": {"alpha_inter": 1e-6},
                                "network": {"topology": "torus", "dims": [2, 2]}}))
    machine = Machine.load(path)
    assert machine.network == Network("torus", dims=(2, 2)) and machine.alpha_inter == 1e-6
    assert "network" not in machine.parameters()
    hash(machine)


TRUE = dict(alpha_inter=2e-6, beta_inter=1e-10, gamma=3e-10)


def _table(path, network: Network, algorithms, nodes=(4, 8), sizes=(64, 65536, 1 << 22)):
    """A table of 'measured' times made by the simulator itself on TRUE."""
    machine = Machine(**TRUE, network=network)
    lines = ["algorithm,nodes,ranks_per_node,bytes,microseconds,source"]
    for algorithm, p, nbytes in itertools.product(algorithms, nodes, sizes):
        placed = machine.placed(placement("block", p, 1, network))
        seconds = simulate(algorithm, p, nbytes // 4, "int32", segment_size=nbytes // 4,
                           machine=placed, data=False).seconds
        lines.append(f"{algorithm},{p},1,{nbytes},{seconds * 1e6!r},made here")
    lines.append("vendor_default,4,1,64,3.0,made here")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_fit_on_one_algorithm_finds_the_machine_that_made_the_table(tmp_path):
    network = Network("dragonfly", groups=2, routers=2, router_nodes=2, hop_latency=1e-7)
    table = _table(tmp_path / "t.csv", network,
                   ("recursive_doubling", "ring", "rabenseifner", "bine_bandwidth"))
    rows = measured.read_rows(table)
    start = Machine(alpha_inter=1e-3, beta_inter=1e-6, network=network)
    used = measured.check(start, rows, fit_on=("recursive_doubling", "ring"))
    for name, value in TRUE.items():
        assert getattr(used, name) == pytest.approx(value, rel=1e-3)
    judged = [row for row in rows if not row.status]
    assert len(judged) == 12 and all(row.ratio == pytest.approx(1.0, rel=1e-3) for row in judged)
    assert {row.status for row in rows} == {"", "fitted", "not modelled"}
    by_name = {entry[0]: entry for entry in measured.summary(rows)}
    assert by_name["all"][1:3] == (12, 12) and by_name["vendor_default"][4] == 1
    assert "recursive_doubling" in by_name and by_name["recursive_doubling"][1] == 0


def test_a_wrong_machine_is_reported_wrong(tmp_path):
    network = Network("torus", dims=(4, 2))
    table = _table(tmp_path / "t.csv", network, ("ring",), nodes=(8,))
    rows = measured.read_rows(table)
    measured.check(Machine(alpha_inter=2 * TRUE["alpha_inter"], beta_inter=3 * TRUE["beta_inter"],
                           gamma=TRUE["gamma"], network=network), rows)
    ring = [entry for entry in measured.summary(rows) if entry[0] == "ring"][0]
    assert ring[1] == 3 and ring[2] < 3 and ring[3] > 1.25


def test_a_job_spread_over_groups():
    assert measured.spread(5, 2, 4) == (0, 1, 2, 4, 5)
    with pytest.raises(ValueError):
        measured.spread(9, 2, 4)
    network = Network("dragonfly", groups=2, routers=2, router_nodes=2)
    # 4 nodes in one group, then over two; 8 nodes cannot be in one group of 4
    rows = [measured.Row("recursive_doubling", 4, 1, 4096, 1.0, "x", groups=g) for g in (1, 2)]
    rows.append(measured.Row("recursive_doubling", 8, 1, 4096, 1.0, "x", groups=1))
    measured.check(Machine(beta_inter=1e-9, network=network), rows)
    assert rows[0].traffic["global"] == 0 and rows[1].traffic["global"] > 0
    assert rows[2].status.startswith("not placed")


def test_bad_tables_are_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("algorithm,nodes,bytes,microseconds,source\nring,2,8,1.0,x\n")
    with pytest.raises(ValueError, match="ranks_per_node"):
        measured.read_rows(path)
    path.write_text("algorithm,nodes,ranks_per_node,bytes,microseconds,source\nring,2,1,8,x,y\n")
    with pytest.raises(ValueError, match="line 2"):
        measured.read_rows(path)
    path.write_text("algorithm,nodes,ranks_per_node,bytes,microseconds,source\nring,0,1,8,1,y\n")
    with pytest.raises(ValueError, match="line 2"):
        measured.read_rows(path)
    path.write_text("algorithm,nodes,ranks_per_node,bytes,microseconds,source,groups\n"
                    "ring,2,1,8,1,y,3\n")
    with pytest.raises(ValueError, match="groups"):
        measured.read_rows(path)


def test_the_command_prints_every_row_and_the_share(tmp_path):
    network = Network("torus", dims=(4, 2))
    table = _table(tmp_path / "t.csv", network, ("recursive_doubling", "ring", "rabenseifner"),
                   nodes=(8,))
    description = tmp_path / "m.json"
    description.write_text(json.dumps({"name": "toy", "params": {"alpha_inter": 1e-5},
                                       "network": {"topology": "torus", "dims": [4, 2]}}))
    command = [sys.executable, "-m", "mpi_allreduce", "simulate", "--params", str(description),
               "--measured", str(table), "-d", "int32"]
    written = tmp_path / "fitted.json"
    out = subprocess.run(command + ["--fit-on", "recursive_doubling,ring", "--json", str(written)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # the JSON is a machine description of the fitted machine, with the rows
    fitted = Machine.load(written)
    assert fitted.alpha_inter == pytest.approx(TRUE["alpha_inter"], rel=1e-3)
    assert fitted.network == network
    assert len(json.loads(written.read_text())["rows"]) == 10
    lines = out.stdout.splitlines()
    assert sum(line.endswith("  fitted") for line in lines) == 6
    summary = [line.split() for line in lines if line.split()[:1] == ["all"]]
    assert summary == [["all", "3", "3", "100%", "1.00", "1", "0"]]
    refused = subprocess.run(command[:-2] + ["--fit-on", "ring", "--predict"],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--measured" in refused.stderr


def test_a_simulated_trace_names_routes_and_hot_links():
    from mpi_allreduce.tools.traces import simulated

    network = Network("torus", dims=(4,))
    events = simulated("recursive_doubling", 4, 64, "float32", _on(network, 4, beta_inter=1e-9),
                       64)
    sends = [e["args"] for e in events if e.get("name") == "send"]
    # distance 2 on a ring of 4: two torus hops
    assert any(len(a["route"]) == 4 for a in sends) and all("route" in a for a in sends)
    calls = [e["args"] for e in events if e.get("name") == "recursive_doubling" and "args" in e]
    hottest = calls[0]["hottest_links"]
    assert hottest[0][1] == max(b for _, b in hottest) and len(hottest) == 10


def test_a_floor_keeps_a_fitted_link_no_faster_than_documented(tmp_path):
    network = Network("torus", dims=(4, 2))
    rows = measured.read_rows(_table(tmp_path / "t.csv", network,
                                     ("recursive_doubling", "ring"), nodes=(8,)))
    used = measured.check(Machine(network=network), rows, fit_on=("recursive_doubling", "ring"),
                          floors={"beta_inter": 2 * TRUE["beta_inter"]})
    assert used.beta_inter == pytest.approx(2 * TRUE["beta_inter"])
    assert used.alpha_inter >= 0 and used.gamma >= 0
    with pytest.raises(ValueError, match="floors"):
        measured.fit(Machine(network=network), rows[:3], floors={"alpha": 1.0})


@pytest.mark.parametrize("text, why", [
    ("\ufeffalgorithm ,nodes,ranks_per_node,bytes,microseconds,source\n\n# note\n"
     "ring,2,1,8,1.5,x\n", None),
    ("algorithm,nodes,ranks_per_node,bytes,microseconds,source\nring,2,1,8,inf,x\n", "line 2"),
    ("algorithm,nodes,ranks_per_node,bytes,microseconds,source\n# c\n\nring,2,1\n", "line 4"),
])
def test_tables_as_people_write_them(tmp_path, text, why):
    path = tmp_path / "t.csv"
    path.write_text(text, encoding="utf-8")
    if why is None:
        [row] = measured.read_rows(path)
        assert (row.algorithm, row.microseconds) == ("ring", 1.5)
    else:
        with pytest.raises(ValueError, match=why):
            measured.read_rows(path)


@pytest.mark.parametrize("description", [
    [], {"params": {}, "network": {"topology": "torus", "dims": [2.5, 2]}},
    {"params": {}, "network": {"topology": "torus", "dims": [2, 2], "wrap": "false"}},
    {"params": {}, "network": {"topology": "fat_tree", "leaf_nodes": 2, "nodes": "x"}},
    {"params": {}, "placement": "cyclic"}, {"params": {}, "floors": {"beta_inter": -1.0}},
    {"params": {}, "floors": [1]}, {"params": {}, "floors": {"alpha": 1e-6}}])
def test_bad_descriptions_are_refused_with_a_message(tmp_path, description):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(description))
    table = tmp_path / "t.csv"
    table.write_text("algorithm,nodes,ranks_per_node,bytes,microseconds,source\n"
                     "ring,2,1,8,1.0,x\n")
    out = subprocess.run([sys.executable, "-m", "mpi_allreduce", "simulate", "--params",
                          str(path), "--measured", str(table)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "--params" in out.stderr
