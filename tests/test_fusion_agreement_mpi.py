"""Fusion's buckets where the ranks' buckets differ: every bucket is the same
bucket on every rank or its call stalls and is reported, never a sum of
misaligned or foreign arrays; and what a fusion holds stays bounded however
often ``empty_like`` is called.  Before a bucket's identity (its arrays'
sizes, and which bucket it is) went into its call's spec and the homes'
calls were made in ``empty_like``, sizes [3, 5] against [5, 3] were summed
misaligned, buckets first started in another order on another rank, or a
rebound array's bucket, met other buckets' messages, and ``empty_like``
every step grew without bound."""

from __future__ import annotations

import numpy as np
import pytest

import mpi_allreduce as mar
from mpi_allreduce.context import context_for
from mpi_allreduce.fusion import MAX_HOMES, MAX_KEPT, Fusion

from .helpers import raise_mode, restore_watchdog, set_watchdog

pytestmark = pytest.mark.mpi

#: the watchdog's limit in the cases that may stall (seconds)
STALL = 1.0


@pytest.fixture(params=["world", "reversed"])
def fresh(request, subcomms):
    """A duplicate of the world or the world reversed, of its own (a
    stalled call leaves its communicator unusable), set up on every rank
    (collective).  (The other sizes come from the other launches: each
    stall costs its watchdog limit, once per communicator.)"""
    dup = subcomms[request.param].Dup()
    mar.setup(dup)
    yield dup
    dup.Free()


@pytest.fixture
def watchdog(monkeypatch):
    """Raise mode with a short limit, for the cases that may stall."""
    yield from raise_mode(monkeypatch, STALL)


@pytest.fixture
def patient(monkeypatch):
    """Raise mode with a long limit, for the cases that must sum right: a
    hang fails the test, a peer late on a loaded machine does not."""
    yield from raise_mode(monkeypatch, 60)


def _need(comm, ranks: int = 2):
    if comm.Get_size() < ranks:
        pytest.skip(f"needs {ranks} ranks")


def _values(comm, k: int, n: int) -> np.ndarray:
    """Array ``k``'s values on this rank: every array and rank its own."""
    return 1000.0 * (k + 1) + 10.0 * comm.Get_rank() + np.arange(n)


def _sum(comm, k: int, n: int) -> np.ndarray:
    p = comm.Get_size()
    return 1000.0 * (k + 1) * p + 10.0 * (p * (p - 1) // 2) + p * np.arange(n)


def _right_or_stalled(comm, fusion, arrays: dict, order: list) -> bool:
    """Add ``arrays`` (name -> (k, array)) in ``order`` and wait.  Either
    every array holds its sum, or the wait raised Stalled and every array
    of memory of its own (not from empty_like: packed, never reduced in
    place) holds its sum or its own values still: never another array's
    values.  Whether it stalled."""
    before = {name: a.copy() for name, (_, a) in arrays.items()}
    try:
        for name in order:
            fusion.add(arrays[name][1])
        fusion.wait()
    except mar.Stalled:
        for name, (k, a) in arrays.items():
            if a.base is None:
                sums = _sum(comm, k, a.size)
                assert np.array_equal(a, before[name]) or np.array_equal(a, sums), \
                    f"{name} holds neither its own values nor its sum: {a}"
        return True
    for name, (k, a) in arrays.items():
        np.testing.assert_array_equal(a, _sum(comm, k, a.size), err_msg=name)
    return False


# --- the sizes in a bucket ----------------------------------------------------------------

@pytest.mark.parametrize("own", [False, True], ids=["packed", "in_their_buckets"])
def test_sizes_3_5_against_5_3_stall_instead_of_summing_misaligned(fresh, watchdog, own):
    """Rank 0's bucket holds arrays of 3 and 5 elements, the others' 5 and 3:
    the same dtype and total.  There is no right sum: every rank must stall
    (before: the spec held only the total, and each rank got the other's
    elements summed into its arrays)."""
    _need(fresh)
    sizes = [3, 5] if fresh.Get_rank() == 0 else [5, 3]
    fusion = Fusion(fresh, op="sum", bucket_bytes=1 << 20)
    arrays = fusion.empty_like([np.empty(n) for n in sizes]) if own else \
        [np.empty(n) for n in sizes]
    for k, a in enumerate(arrays):
        a[...] = _values(fresh, k, a.size)
    try:
        with pytest.raises(mar.Stalled):
            fusion.allreduce(arrays)
    finally:
        fusion.free()


def test_a_bucket_of_other_sizes_among_agreeing_buckets_stalls_alone(fresh, watchdog):
    """Three packed buckets; the middle one's sizes differ on rank 0 only:
    the first bucket is summed right on every rank, the middle one stalls,
    and no array ever holds another's values."""
    _need(fresh)
    middle = [2, 6] if fresh.Get_rank() == 0 else [6, 2]
    shapes = {"a": 4, "b": 4, "c": middle[0], "d": middle[1], "e": 4, "f": 4}
    arrays = {name: (100 + k, _values(fresh, 100 + k, n))
              for k, (name, n) in enumerate(shapes.items())}
    fusion = Fusion(fresh, op="sum", bucket_bytes=64)  # buckets of 8 float64s
    try:
        assert _right_or_stalled(fresh, fusion, arrays, list(shapes)), \
            "buckets of other sizes on rank 0 returned"
        a, b = arrays["a"][1], arrays["b"][1]
        np.testing.assert_array_equal(a, _sum(fresh, 100, 4))
        np.testing.assert_array_equal(b, _sum(fresh, 101, 4))
    finally:
        fusion.free()


@pytest.mark.parametrize("how", ["packed", "empty_like"])
def test_a_step_of_no_arrays_on_one_rank_stalls_never_shifts_the_next(fresh, watchdog, how):
    """Rank 0's first step adds nothing where its peers add two arrays, then
    every rank makes two more steps alike: no rank ever holds a wrong sum
    (before: an empty wait() returned at once on rank 0, whose next step
    then met its peers' first, a wrong sum on both); the mismatched step
    stalls, and a step that every rank leaves empty completes."""
    _need(fresh)
    rank = fresh.Get_rank()
    fusion = Fusion(fresh, op="sum", bucket_bytes=1 << 20)
    fusion.wait()  # (every rank empty: completes)
    arrays = fusion.empty_like([np.empty(4), np.empty(4)]) if how == "empty_like" else \
        [np.empty(4), np.empty(4)]
    outcomes = []
    for step in range(3):
        for k, a in enumerate(arrays):
            a[...] = _values(fresh, 10 * step + k, 4)
        try:
            if rank or step:
                for a in arrays:
                    fusion.add(a)
            fusion.wait()
            right = all(np.array_equal(a, _sum(fresh, 10 * step + k, 4))
                        for k, a in enumerate(arrays)) or (rank == 0 and step == 0)
            outcomes.append("right" if right else "WRONG")
        except mar.Broken as exc:  # (Stalled is a Broken)
            outcomes.append(type(exc).__name__)
            break
    everyone = fresh.allgather(outcomes)  # (MPI's own: the library's copy may be broken)
    assert not any("WRONG" in o for o in everyone), everyone
    assert all(o and o[-1] in ("Stalled", "Broken") for o in everyone), everyone


# --- the order in which buckets are touched -----------------------------------------------

@pytest.mark.parametrize("sizes, buckets", [
    ([4, 4, 4, 4, 2, 6], [[0, 1], [2, 3], [4, 5]]),
    ([8, 8, 8], [[0], [1], [2]]),
    ([0, 16, 0, 16, 0, 16], [[0, 1], [2, 3], [4, 5]]),
], ids=["pairs", "alone", "empty_first"])
def test_homes_touched_in_other_orders_give_their_own_sums(fresh, patient, sizes, buckets):
    """Arrays from empty_like in three buckets, two of them of the same
    sizes ([4, 4], [4, 4], [2, 6]; or three buckets of one array of 8
    each); odd ranks add the buckets last first.  Each bucket's call was
    made in empty_like, alike on every rank, so every array gets its own
    sum from the first step on (before: the calls were made as the buckets
    first started, and the odd ranks' first bucket met the even ranks'
    first; a bucket of one array was reduced by a call that did not say
    which bucket it was: each rank got its own array plus another's; and
    add closed a bucket of an empty array alone, where empty_like's home
    held it with the next: no home was used)."""
    fusion = Fusion(fresh, op="sum", bucket_bytes=64)
    views = fusion.empty_like([np.empty(n) for n in sizes])
    assert fusion.held["homes"] == 3
    buckets = [list(bucket) for bucket in buckets]
    if fresh.Get_rank() % 2:
        buckets.reverse()
    order = [i for bucket in buckets for i in bucket]

    def refuse(*args):
        raise AssertionError("an array of its own bucket was packed")
    for step in range(3):
        for k, v in enumerate(views):
            v[...] = _values(fresh, k + step, v.size)
        fusion._reusable, kept = refuse, fusion._reusable
        for i in order:
            fusion.add(views[i])
        fusion.wait()
        fusion._reusable = kept
        for k, v in enumerate(views):
            np.testing.assert_array_equal(v, _sum(fresh, k + step, v.size),
                                          err_msg=f"array {k}, step {step}")
    fusion.free()


def test_packed_buckets_touched_in_other_orders_stall_never_mix(fresh, watchdog):
    """Packed buckets of sizes [3, 5] and [2, 6]; odd ranks add the second
    bucket's arrays first.  The ranks' first buckets are different buckets:
    their calls cannot match, so the ranks stall (or sum right), and no
    array holds another's values."""
    _need(fresh)
    shapes = {"x": 3, "y": 5, "z": 2, "w": 6}
    arrays = {name: (100 + k, _values(fresh, 100 + k, n))
              for k, (name, n) in enumerate(shapes.items())}
    order = ["z", "w", "x", "y"] if fresh.Get_rank() % 2 else ["x", "y", "z", "w"]
    fusion = Fusion(fresh, op="sum", bucket_bytes=64)
    try:
        stalled = _right_or_stalled(fresh, fusion, arrays, order)
        assert fresh.allreduce(int(stalled)) in (0, fresh.Get_size())
    finally:
        fusion.free()


# --- rebinding an array on one rank ---------------------------------------------------------

def _homed(fresh, sizes, bucket_bytes=64):
    fusion = Fusion(fresh, op="sum", bucket_bytes=bucket_bytes)
    views = fusion.empty_like([np.empty(n) for n in sizes])
    for k, v in enumerate(views):
        v[...] = _values(fresh, k, v.size)
    return fusion, views


def test_an_array_rebound_on_one_rank_still_gets_its_sum(fresh, patient):
    """Rank 0 replaces one empty_like array (of a bucket of three) with a new
    array and drops the old one: its bucket is copied into the old one's
    place in the bucket's memory and reduced by the same call as on the
    other ranks, so every rank gets the sums, step after step (before: rank
    0 made a call of its own, and stalled)."""
    fusion, views = _homed(fresh, [3, 3, 2])
    if fresh.Get_rank() == 0:
        views[1] = np.empty(3)  # the old array goes
    for step in range(3):
        for k, v in enumerate(views):
            v[...] = _values(fresh, k + step, v.size)

        def refuse(*args):
            raise AssertionError("the bucket of a rebound array was packed")
        fusion._reusable, kept = refuse, fusion._reusable
        fusion.allreduce(views)
        fusion._reusable = kept
        for k, v in enumerate(views):
            np.testing.assert_array_equal(v, _sum(fresh, k + step, v.size),
                                          err_msg=f"array {k}, step {step}")
    fusion.free()


@pytest.mark.parametrize("how", ["old_kept", "all_rebound"])
def test_rebinding_on_one_rank_stalls_or_sums_never_mixes(fresh, watchdog, how):
    """A bucket of empty_like arrays and a packed bucket of the same sizes,
    summed once by every rank; then rank 0 rebinds an array of the first
    but still holds the old one (its place is not free), or rebinds them
    all (its bucket is then an ordinary packed one).  Its bucket can then
    not be the others' bucket: it stalls, or sums right, and never meets
    the packed bucket (before: rank 0 packed it into the packed bucket's
    kept call, which the others used for the packed bucket)."""
    _need(fresh)
    fusion, views = _homed(fresh, [4, 4])
    x, y = np.empty(4), np.empty(4)
    for step in range(2):
        held = []
        if step == 1 and fresh.Get_rank() == 0:
            if how == "old_kept":
                held.append(views[0])
                views[0] = np.empty(4)
            else:
                views = [np.empty(4), np.empty(4)]
        arrays = {"a": (0, views[0]), "b": (1, views[1]), "x": (100, x), "y": (101, y)}
        for name, (k, a) in arrays.items():
            a[...] = _values(fresh, k, a.size)
        if held:
            held[0][...] = -1.0
        try:
            stalled = _right_or_stalled(fresh, fusion, arrays, ["a", "b", "x", "y"])
            assert step == 1 or not stalled, "every rank agrees in step 0"
            if held:
                assert np.all(held[0] == -1.0), "the old array was written"
        except BaseException:
            fusion.free()
            raise
    fusion.free()


# --- what a fusion holds ------------------------------------------------------------------

def _sum_and_check(comm, fusion, arrays: list, step: int) -> None:
    """Fill, all-reduce and check ``arrays`` (a function of its own: a loop
    variable left behind would keep an array alive)."""
    for k, a in enumerate(arrays):
        a[...] = _values(comm, k + step, a.size)
    fusion.allreduce(arrays)
    for k, a in enumerate(arrays):
        np.testing.assert_array_equal(a, _sum(comm, k + step, a.size),
                                      err_msg=f"array {k}, step {step}")


@pytest.mark.long_loop
def test_empty_like_every_step_holds_what_the_caller_holds(fresh):
    """empty_like each training step, 2,000 times, the last step's arrays
    dropped: the fusion holds the homes of the arrays alive (two calls'
    worth at most) and their persistent calls' tags, however many steps
    (before: every home ever made, +189 MiB over 1,400 steps)."""
    params = [np.empty(n, np.float32) for n in (40, 24, 100, 7, 7)]
    fusion = Fusion(fresh, op="sum", bucket_bytes=256)
    per_call = None
    holders = []
    for step in range(2000):
        grads = fusion.empty_like(params)
        held = fusion.held
        per_call = per_call or held["homes"]
        assert held["homes"] <= 2 * per_call, (step, held)
        if step % 50 == 0:
            _sum_and_check(fresh, fusion, grads, step)
            holders.append(len(context_for(fresh).holders) if fresh.Get_size() > 1 else 0)
    assert per_call == 3  # ([40, 24], [100] alone, [7, 7])
    del grads
    fusion.wait()
    assert fusion.held == {"homes": 0, "kept": 0, "bytes": 0}
    assert max(holders) <= 10, f"tags held: {holders}"


@pytest.mark.long_loop
def test_empty_like_arrays_kept_by_the_caller_keep_at_most_max_homes_calls(fresh):
    """The caller keeps every array of 300 empty_like calls: the fusion keeps
    the calls of the latest MAX_HOMES buckets only (the same ones on every
    rank); older arrays are packed when added, and still summed right."""
    params = [np.empty(n) for n in (3, 5)]
    fusion = Fusion(fresh, op="sum", bucket_bytes=1 << 20)
    kept = []
    for _ in range(300):
        kept.append(fusion.empty_like(params))
        assert fusion.held["homes"] <= MAX_HOMES
    assert fusion.held["homes"] == MAX_HOMES
    if fresh.Get_size() > 1:
        assert len(context_for(fresh).holders) <= MAX_HOMES + 10
    for step, arrays in enumerate((kept[0], kept[-1])):
        _sum_and_check(fresh, fusion, arrays, step)
    fusion.free()
    assert fusion.held == {"homes": 0, "kept": 0, "bytes": 0}


@pytest.mark.long_loop
def test_packed_buckets_of_ever_new_sizes_keep_at_most_max_kept(fresh):
    """A packed bucket of other sizes every step: at most MAX_KEPT are kept."""
    fusion = Fusion(fresh, op="sum", bucket_bytes=1 << 20)
    for step in range(MAX_KEPT + 20):
        arrays = [_values(fresh, 0, 2 + step), _values(fresh, 1, 3)]
        fusion.allreduce(arrays)
        np.testing.assert_array_equal(arrays[0], _sum(fresh, 0, 2 + step))
        assert fusion.held["kept"] <= MAX_KEPT
    assert fusion.held["kept"] == MAX_KEPT
    if fresh.Get_size() > 1:
        assert len(context_for(fresh).holders) <= MAX_KEPT + 10
    fusion.free()


@pytest.mark.long_loop
def test_a_step_of_more_packed_buckets_than_max_kept_builds_nothing_again(fresh):
    """A step of MAX_KEPT + 10 packed buckets of one size: the next steps
    reuse every bucket's call (none is evicted and built again each step),
    and the sums are right."""
    n = MAX_KEPT + 10
    fusion = Fusion(fresh, op="sum", bucket_bytes=64)  # two arrays of 4 float64s a bucket
    calls = None
    for step in range(3):
        arrays = [np.empty(4) for _ in range(2 * n)]
        _sum_and_check(fresh, fusion, arrays, step)
        now = {id(request) for _, request in fusion._kept.values()}
        assert len(now) == n, (step, len(now))
        assert calls is None or now == calls, f"step {step} built calls again"
        calls = now
    fusion.free()


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
def test_a_bucket_given_up_in_flight_is_never_packed_again(fresh, watchdog, algorithm):
    """Rank 0's wait stalls (its peers come late) and it goes on to its next
    step: that step is refused before anything is packed, so the peers,
    coming, read the first step's data from the bucket rank 0 still sends
    (1 MiB: read as the peer matches it): the right sum or a stall, never
    rank 0's next arrays (before: the next step was packed into the bucket
    before its start was refused, and the peers summed rank 0's next data,
    silently, where the first exchange is posted at the start)."""
    import time

    _need(fresh)
    rank, n = fresh.Get_rank(), 1 << 16
    fusion = Fusion(fresh, op="sum", bucket_bytes=2 * n * 8, algorithm=algorithm)
    for step in range(2):
        if rank != 0 and step == 0:
            time.sleep(2.5 * STALL)
        a, b = _values(fresh, step, n), _values(fresh, step + 2, n)
        try:
            fusion.add(a)
            fusion.add(b)
            fusion.wait()
        except (mar.Stalled, mar.Broken):
            continue
        np.testing.assert_array_equal(a, _sum(fresh, step, n), err_msg=f"step {step}")
        np.testing.assert_array_equal(b, _sum(fresh, step + 2, n), err_msg=f"step {step}")
    fresh.Barrier()


# --- an interrupt inside a step ---------------------------------------------------------

#: where rank 0 is interrupted (once) in a step of four arrays, two per
#: bucket (the step is lost wherever it lands, the communicator broken: an
#: interrupted add too -- a rank may go on without the array as well as add
#: it again, and its peers cannot tell)
INTERRUPTS = {
    "before its bucket starts": ("Fusion._start", "before"),
    "as its bucket is packed": ("Fusion._reusable", "before"),
    "once its bucket started": ("PersistentRequest.start", "after"),
    "as a bucket is unpacked": ("fusion._finish", "before"),
    "as a home is made": ("fusion._persistent", "after"),
    # (before its first home: this rank made none where its peers made theirs)
    "before a home is made": ("fusion._persistent", "before"),
}


@pytest.mark.parametrize("where", list(INTERRUPTS))
def test_an_interrupt_inside_a_step_breaks_the_communicator(
        fresh, monkeypatch, where):
    """A KeyboardInterrupt lands on rank 0 inside a ``Fusion`` step; rank 0
    retries what raised.  The step cannot be taken again: the communicator
    is broken there (the retry raises Broken) and the peers stall or finish
    what they had -- never a wrong sum (before: the retry lost or repeated a
    bucket, or a home's number was one ahead of the peers'; and a rank that
    went on without an array interrupted before its bucket started met its
    peers' buckets shifted by one; and one interrupted in empty_like before
    its first home went on as if it had made none, its next homes meeting
    the peers' earlier ones)."""
    from mpi_allreduce import fusion as fusion_module
    from mpi_allreduce import progress

    _need(fresh)
    rank = fresh.Get_rank()
    name, when = INTERRUPTS[where]
    owner, attribute = name.split(".")
    module = {"Fusion": Fusion, "PersistentRequest": progress.PersistentRequest,
              "fusion": fusion_module}[owner]
    real = getattr(module, attribute)
    armed = [False]

    def interrupted(*args, **kwargs):
        fire = armed[0]
        armed[0] = False
        if fire and when == "before":
            raise KeyboardInterrupt(f"lands before {name}")
        value = real(*args, **kwargs)
        if fire:
            raise KeyboardInterrupt(f"lands after {name}")
        return value
    if rank == 0:
        monkeypatch.setattr(module, attribute, interrupted)
    # (patient on rank 0, which must reach its interrupt on a loaded machine)
    set_watchdog(monkeypatch, 30 if rank == 0 else 1)
    fusion = Fusion(fresh, op="sum", bucket_bytes=64)  # (two arrays of 4 float64 a bucket)

    def retried(call, *args):
        for _ in range(2):
            try:
                return call(*args)
            except KeyboardInterrupt:
                outcomes.append("interrupted")
        raise AssertionError("interrupted twice")
    outcomes: list = []
    try:
        homes = name == "fusion._persistent"
        armed[0] = homes
        arrays = retried(fusion.empty_like, [np.empty(4)] * 4) if homes \
            else [np.empty(4) for _ in range(4)]
        for step in range(2):
            for k, a in enumerate(arrays):
                a[...] = _values(fresh, 10 * step + k, 4)
            armed[0] = step == 0 and not homes
            for a in arrays:
                retried(fusion.add, a)
            retried(fusion.wait)
            exact = all(np.array_equal(a, _sum(fresh, 10 * step + k, 4))
                        for k, a in enumerate(arrays))
            outcomes.append("exact" if exact else "WRONG")
    except mar.Broken as exc:  # (Stalled is a Broken)
        outcomes.append(type(exc).__name__)
    finally:
        restore_watchdog(monkeypatch)
    everyone = fresh.allgather(outcomes)  # (MPI's own: the library's copy may be broken)
    assert not any("WRONG" in o for o in everyone), everyone
    assert everyone[0] == ["interrupted", "Broken"], everyone
    assert all(o[-1] in ("Stalled", "Broken") for o in everyone[1:]), everyone


@pytest.mark.filterwarnings("ignore:Setting the strides:DeprecationWarning")
def test_a_home_array_whose_strides_one_rank_assigns_is_packed_there(fresh, watchdog):
    """Rank 0 assigns a home array's ``strides`` in place (Fortran order,
    the same memory): its values no longer lie in the home's order, so it
    is packed there, in its logical order, and its bucket is another
    bucket than its peers' home: the step stalls and is reported, never
    sums rank 0's memory order with the peers' (before: a wrong sum on
    every rank)."""
    _need(fresh)
    rank = fresh.Get_rank()
    fusion = Fusion(fresh, op="sum", bucket_bytes=1 << 20)
    a, b = fusion.empty_like([np.empty((2, 4)), np.empty(4)])
    outcomes = []
    for step in range(2):
        if step == 1 and rank == 0:
            a.strides = (8, 16)
        a[...] = _values(fresh, 10 * step, 8).reshape(2, 4)
        b[...] = _values(fresh, 10 * step + 1, 4)
        try:
            fusion.add(a)
            fusion.add(b)
            fusion.wait()
            right = np.array_equal(a, _sum(fresh, 10 * step, 8).reshape(2, 4)) and \
                np.array_equal(b, _sum(fresh, 10 * step + 1, 4))
            outcomes.append("right" if right else "WRONG")
        except mar.Stalled:
            outcomes.append("Stalled")
            break
    everyone = fresh.allgather(outcomes)  # (MPI's own: the library's copy is broken)
    assert not any("WRONG" in o for o in everyone), everyone
    assert all(o[0] == "right" and o[-1] == "Stalled" for o in everyone), everyone
