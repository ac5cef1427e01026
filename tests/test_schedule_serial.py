"""Every algorithm's schedule run through the simulator, without MPI: every
rank count from 1 to 64, a few up to 1024, uneven, empty and segmented
blocks, in place and not; and the simulator itself catches what MPI would
not complete (deadlocks, unmatched or mismatched messages, races)."""

from __future__ import annotations

import numpy as np
import pytest

from mpi_allreduce import registry
from mpi_allreduce.schedule import RECV, SCRATCH, SEND, Copy, Recv, Reduce, Ref, Schedule, Send
from mpi_allreduce.simulate import Machine, SimulationError, critical_path, simulate

ALL = list(registry.ALGORITHMS)


def options_for(algorithm: str, size: int) -> dict:
    """hierarchical on emulated nodes of 3 (the last one smaller), ring among leaders."""
    return {"ranks_per_node": 3, "inner": "ring"} if algorithm == "hierarchical" else {}


def check(outcome):
    assert outcome.wrong == 0, f"{outcome.wrong} wrong elements"
    assert outcome.differing_ranks == 0


#: the most ranks the algorithms whose messages grow as p^2 (simulate's
#: BY_NAME_ABOVE: naive, allgather_reduce) are checked at with 2-element
#: segments, p^3 messages: two minutes of the suite above it, for paths
#: the sizes up to 33 (powers of two and not) already take
TINY_SEGMENTS_UP_TO = 33


#: up to this many ranks every size runs both costly cases (an uneven count in
#: 2-element segments, a count below p); above it, where a simulation costs
#: about p^2 messages, each size runs one of them by its parity (even p the
#: first, odd p the second; a power of two, 64, both) and the empty call:
#: about a third less of this test's time, for cases the sizes up to 33 (every
#: residue of 2^5, powers of two and not) already take at every size
EVERY_CASE_UP_TO = 33


@pytest.mark.parametrize("algorithm", ALL)
def test_every_size_from_1_to_64(algorithm):
    """Counts below p (empty blocks), uneven counts, and 2-element segments."""
    from mpi_allreduce.simulate import BY_NAME_ABOVE

    for size in range(1, 65):
        tiny = algorithm not in BY_NAME_ABOVE or size <= TINY_SEGMENTS_UP_TO
        cases = [(size + 3, 2 if tiny else 1 << 20), (max(size - 1, 1), 1 << 20), (0, 4)]
        if size > EVERY_CASE_UP_TO and size & (size - 1):
            cases = [cases[size % 2], cases[2]]
        for count, segment in cases:
            check(simulate(algorithm, size, count, "float32", "sum", segment_size=segment,
                           options=options_for(algorithm, size)))


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("op,dtype", [("sum", "int64"), ("prod", "float64"), ("max", "int16"),
                                      ("avg", "float32"), ("lxor", "bool"), ("bxor", "uint8")])
@pytest.mark.parametrize("algorithm", ALL)
def test_ops_dtypes_and_in_place(algorithm, op, dtype, in_place):
    for size in (2, 3, 5, 7, 8):
        check(simulate(algorithm, size, 41, dtype, op, segment_size=4, in_place=in_place,
                       options=options_for(algorithm, size)))


@pytest.mark.parametrize("algorithm,size", [
    ("recursive_doubling", 1024), ("rabenseifner", 1024), ("driver", 1024),
    ("hierarchical", 1024), ("ring", 200), ("ring_pipelined", 129), ("rabenseifner", 1000),
    ("recursive_doubling", 1023), ("tree", 1024), ("tree", 1000), ("naive", 128),
    ("double_binary_tree", 1024), ("double_binary_tree", 999),
])
def test_large_communicators(algorithm, size):
    options = {"ranks_per_node": 16, "inner": "rabenseifner"} if algorithm == "hierarchical" else {}
    check(simulate(algorithm, size, 2 * size + 1, "int32", "sum", segment_size=300,
                   options=options))


def test_bytes_per_rank_match_the_algorithms():
    """The ring sends 2(p-1)/p of the vector per rank; recursive doubling
    the whole vector lg p times; the driver's root sends p-1 vectors."""
    p, n = 8, 8000
    ring = simulate("ring", p, n, "float64", segment_size=1 << 20)
    assert ring.bytes_sent == [2 * (p - 1) * n // p * 8] * p
    assert ring.messages == [2 * (p - 1)] * p
    rd = simulate("recursive_doubling", p, n, "float64", segment_size=1 << 20)
    assert rd.bytes_sent == [3 * n * 8] * p and rd.bytes_reduced == [3 * n * 8] * p
    driver = simulate("driver", p, n, "float64", segment_size=1 << 20)
    assert driver.bytes_sent[0] == (p - 1) * n * 8 and driver.bytes_sent[1] == n * 8


def test_critical_path_counts():
    """Unit machines give the messages, bytes and reduced bytes along the
    critical path: the ring's 2(p-1) steps, recursive doubling's lg p."""
    ring = critical_path("ring", 8, 800, "float32")
    assert ring["messages"] == 14 and ring["bytes"] == 14 * 100 * 4
    assert ring["reduced_bytes"] == 7 * 100 * 4
    rd = critical_path("recursive_doubling", 8, 800, "float32")
    assert rd["messages"] == 3 and rd["bytes"] == 3 * 800 * 4


def test_the_machine_charges_overhead_and_links():
    slow_across = Machine(alpha=1.0, alpha_inter=10.0, nodes=(0, 0, 2, 2))
    assert simulate("ring", 4, 4, machine=slow_across, data=False).seconds == 6 * 10.0
    assert simulate("ring", 4, 4, machine=Machine(overhead=1.0), data=False).seconds == 12.0


def test_the_machine_shares_ports_cores_and_ranks():
    """The shared resources of the machine model, each against its
    arithmetic: a node's port, a node's cores, a half-duplex rank, an
    eager send, the call's own software, a measured curve."""
    n = 1000  # float32 elements: 4000 bytes
    # recursive doubling on 2 nodes of 2: the step across sends 2 vectors
    # through each node's port, one after the other
    port = Machine(beta_inter=1.0, nodes=(0, 0, 1, 1))
    assert simulate("recursive_doubling", 4, n, machine=port, data=False).seconds == 2 * 4 * n
    # half duplex: each rank's two messages across (one each way) queue too
    half = Machine(alpha_inter=1.0, half_duplex=True, nodes=(0, 1))
    assert simulate("recursive_doubling", 2, n, machine=half, data=False).seconds == 2.0
    assert simulate("recursive_doubling", 2, n, machine=Machine(alpha_inter=1.0, nodes=(0, 1)),
                    data=False).seconds == 1.0
    # 4 busy ranks on 2 cores reduce at half speed; 2 on 2 at full
    shared = Machine(gamma=1.0, cores=2)
    assert simulate("recursive_doubling", 4, n, machine=shared, data=False).seconds == 2 * 2 * 4 * n
    assert simulate("recursive_doubling", 2, n, machine=shared, data=False).seconds == 4 * n
    # the driver's senders wait for the root's receives in turn, unless
    # eager: then only the root's one-at-a-time copying orders them
    wait = simulate("driver", 4, 1, machine=Machine(alpha=1.0, overhead=0.5), data=False)
    eager = simulate("driver", 4, 1, machine=Machine(alpha=1.0, overhead=0.5, eager_bytes=4),
                     data=False)
    assert (wait.seconds, eager.seconds) == (9.0, 7.0)
    assert simulate("ring", 2, 2, machine=Machine(call_overhead=3.0), data=False).seconds == 3.0
    curve = Machine(curve=((8, 1.0), (4096, 2.0), (8192, 10.0)))
    assert simulate("recursive_doubling", 2, 1024, machine=curve, data=False).seconds == 2.0
    assert simulate("recursive_doubling", 2, 4096, machine=curve, data=False).seconds == 26.0


# --- the simulator catches broken schedules --------------------------------

class _Fixed:
    """A fake algorithm whose schedules are given per rank."""

    COMMUTATIVE = False

    def __init__(self, name, rounds_of):
        self.NAME, self.rounds_of = name, rounds_of

    def build(self, rank, size, count, segment_size, options=None):
        return Schedule(self.NAME, rank, size, count, self.rounds_of(rank, count), count)


@pytest.fixture
def fake(monkeypatch):
    def register(rounds_of):
        monkeypatch.setitem(registry._ALGORITHMS, "fake", _Fixed("fake", rounds_of))
        return "fake"
    return register


def test_a_deadlock_is_reported_with_ranks_and_peers(fake):
    """Both ranks receive first: with no buffering, neither send is ever posted."""
    def rounds(rank, count):
        whole = Ref(RECV, 0, count)
        return ((Recv(1 - rank, whole),), (Send(1 - rank, Ref(SEND, 0, count)),))
    with pytest.raises(SimulationError, match=r"deadlock.*rank 0 in round 0"):
        simulate(fake(rounds), 2, 4)


def test_a_length_mismatch_is_reported(fake):
    def rounds(rank, count):
        if rank == 0:
            return ((Send(1, Ref(SEND, 0, count)),), (Copy(Ref(RECV, 0, count), Ref(SEND, 0, count)),))
        return ((Recv(0, Ref(RECV, 0, count - 1)),),)
    with pytest.raises(SimulationError, match="sends 4 elements to rank 1, which receives 3"):
        simulate(fake(rounds), 2, 4)


def test_a_local_action_racing_a_message_is_reported(fake):
    """Reducing into the range a message of the same round still receives into."""
    def rounds(rank, count):
        peer = 1 - rank
        return ((Send(peer, Ref(SEND, 0, count)), Recv(peer, Ref(SCRATCH, 0, count)),
                 Reduce(Ref(RECV, 0, count), Ref(SEND, 0, count), Ref(SCRATCH, 0, count))),)
    with pytest.raises(SimulationError, match="local action touches scratch"):
        simulate(fake(rounds), 2, 4)


def test_wrong_results_are_counted(fake):
    """Each rank keeps its own input: every element that differs from the
    sum is counted, on every rank."""
    from mpi_allreduce.simulate import inputs, reference

    def rounds(rank, count):
        return ((Copy(Ref(RECV, 0, count), Ref(SEND, 0, count)),),)
    outcome = simulate(fake(rounds), 3, 10, "int32")
    dtype = np.dtype("int32")
    want = sum(int(np.count_nonzero(inputs(dtype, "sum", r, 0, 10) != reference(dtype, "sum", 3, 10)))
               for r in range(3))
    assert outcome.wrong == want > 20 and outcome.differing_ranks == 2
