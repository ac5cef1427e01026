"""Shared fixtures.  MPI tests carry ``@pytest.mark.mpi`` and run under
``mpiexec -n N python -m pytest --with-mpi`` (``tests/test_launch.py`` does that
at the world sizes its docstring explains); a plain ``pytest`` run skips them."""

from __future__ import annotations

import contextlib
import os
import time

import pytest

# The suite checks the built-in decision table: a table `tune` measured on
# this machine is not read (the tests of that lookup name their own directory)
os.environ["MPI_ALLREDUCE_TUNING_DIR"] = "off"

SUBCOMM_KINDS = ("world", "reversed", "even", "minus1")

#: Under mpiexec, "world": only the MPI tests that do not take the ``comm``
#: fixture run (those on COMM_WORLD itself, or a duplicate or split of it);
#: "comm": only those that take it.  tests/test_launch.py runs each part at
#: the world sizes it needs (its docstring says which).
ONLY_ENV = "MPI_ALLREDUCE_TEST_ONLY"

#: Outside mpiexec, with pytest-xdist installed and no ``-n`` given, the test
#: files are shared among this many processes at most (one a core; a file
#: stays in one process: its tests share module fixtures, and the Slurm, the
#: emulated hosts' and the launches' files must not overlap with themselves)
WORKERS_AT_MOST = 4

#: Files of one long test after another (the launches: 10 minutes here;
#: torch's suite: 2), started first; the others fill the remaining processes
#: around them in their order
LONGEST_FIRST = ("test_launch.py", "test_torch_suite.py")

#: One algorithm (a label of tests/helpers.py's VARIANTS) per kind of round
#: the executor compiles on host memory (mpi_allreduce/executor.py): "ring"
#: one Sendrecv a round; "tree" a lone Send or Recv a round; "ring_pipelined"
#: the overlapped rounds (every message posted, reductions run while they
#: travel, then waited; the only host algorithm that has them);
#: "recursive_doubling" rounds of local actions only and the fold's lone
#: sends and receives (non-powers of two).  Matrices whose subject does not
#: depend on the algorithm -- dtypes (wire type, ufunc), ops (ufunc, min/max's
#: keyword form, avg's finalize), MPI.Op objects, pair types, np.matrix
#: buffers, the non-blocking calls' dtypes and ops -- run on these (bad input
#: and buffer kinds, read before any algorithm runs, on fewer: see their
#: files); the fake-device backend (every round posted) and the algorithm x
#: count, segment and in-place matrices keep every algorithm.  A subset of
#: the registry's algorithms, checked in tests/test_registry_serial.py.
PATH_VARIANTS = ("ring", "tree", "ring_pipelined", "recursive_doubling")


def make_subcomm(kind: str):
    """A communicator of the given kind, or MPI.COMM_NULL on ranks outside it.

    world    : a Dup of COMM_WORLD
    reversed : all ranks, numbered backwards
    even     : the even ranks
    minus1   : every rank but the last (empty on one rank)
    """
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if kind == "world":
        return world.Dup()
    if kind == "reversed":
        return world.Split(0, size - rank)
    if kind == "even":
        return world.Split(0 if rank % 2 == 0 else MPI.UNDEFINED, rank)
    if kind == "minus1":
        return world.Split(0 if rank < size - 1 else MPI.UNDEFINED, rank)
    raise ValueError(kind)


@pytest.fixture
def fresh():
    """A fresh duplicate of the world (a stalled call leaves its communicator
    unusable), set up on every rank (its first use is collective)."""
    from mpi4py import MPI

    import mpi_allreduce as mar

    comm = MPI.COMM_WORLD.Dup()
    mar.setup(comm)
    yield comm
    comm.Free()


@pytest.fixture
def watchdog(monkeypatch):
    """Set the watchdog: ``watchdog(seconds, action="raise")``; undone
    after the test."""
    from .helpers import restore_watchdog, set_watchdog

    yield lambda seconds, action="raise": set_watchdog(monkeypatch, seconds, action)
    restore_watchdog(monkeypatch)


@pytest.fixture(scope="session")
def subcomms():
    from mpi4py import MPI

    comms = {kind: make_subcomm(kind) for kind in SUBCOMM_KINDS}
    yield comms
    for comm in comms.values():
        if comm != MPI.COMM_NULL:
            comm.Free()


@pytest.fixture(params=SUBCOMM_KINDS)
def comm(request, subcomms):
    """Each MPI test runs on every kind of sub-communicator; ranks outside
    the sub-communicator skip (they take no part in its messages)."""
    from mpi4py import MPI

    c = subcomms[request.param]
    if c == MPI.COMM_NULL:
        pytest.skip(f"this rank is not in the {request.param!r} communicator")
    return c


#: seconds one test may take under mpiexec before the whole job is aborted: a
#: guard against a hang, with room for the slowest tests (70 s here at 8 ranks)
#: slowed further by the oversubscribed launches beside them (a test marked
#: ``mpi_timeout(seconds)`` may take that long)
TEST_TIMEOUT = float(__import__("os").environ.get("MPI_ALLREDUCE_TEST_TIMEOUT", "300"))

#: seconds a rank whose test ran out of time waits, after printing its
#: threads, before it aborts the job: the ranks' timers start within seconds
#: of each other, so each stuck rank prints where it is, not only the first
DUMP_GRACE = 20.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under mpiexec, a test that fails on one rank can leave the others
    waiting in a message forever.  A watchdog aborts the whole job instead
    (MPI is initialised with thread support, so Abort may come from a thread)."""
    if not item.config.getoption("--with-mpi", default=False):
        yield
        return
    import sys
    import threading

    from mpi4py import MPI

    marker = item.get_closest_marker("mpi_timeout")
    seconds = max(TEST_TIMEOUT, marker.args[0]) if marker else TEST_TIMEOUT

    def abort():
        import faulthandler
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:  # (else the report dies with the captured output)
            capture.suspend_global_capture(in_=True)
        sys.stderr.write(f"\n{item.nodeid}: not done after {seconds:.0f} s on rank "
                         f"{MPI.COMM_WORLD.Get_rank()}; aborting the job; its threads:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        sys.stderr.flush()
        time.sleep(DUMP_GRACE)  # (the other ranks' timers fire too: all dump)
        MPI.COMM_WORLD.Abort(3)

    timer = threading.Timer(seconds, abort)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


#: each launch's summary lines ("np3: 3 ranks reported; ...") that
#: tests/test_launch.py records (SUMMARY_PROPERTY) and the session prints
MPI_RUN_SUMMARIES: list = []


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The serial session shares its files among processes (pytest-xdist,
    ``--dist loadfile``) where xdist is installed and neither ``-n`` nor
    ``-p no:xdist`` is given; an ``mpiexec`` run of the MPI tests never does
    (its ranks are the processes), nor does an xdist worker itself."""
    option = config.option
    if (not hasattr(option, "numprocesses") or option.numprocesses is not None
            or hasattr(config, "workerinput") or config.getoption("--with-mpi", default=False)
            or getattr(option, "collectonly", False)):
        return
    workers = min(WORKERS_AT_MOST, len(os.sched_getaffinity(0)) if hasattr(
        os, "sched_getaffinity") else os.cpu_count() or 1)
    if workers > 1:
        option.numprocesses = workers
        if option.dist == "no":
            option.dist = "loadfile"
            # (files in the collection's order, LONGEST_FIRST first, not
            # xdist's largest number of tests first)
            option.loadscopereorder = False


def pytest_configure(config):
    """Under mpiexec only rank 0 prints the slowest tests (``--durations``):
    the ranks' lists would interleave.  Outside it, each mpiexec the suite
    starts is shown as it starts and ends (world size, program, time, tests),
    so that a launch of minutes does not look hung."""
    if not config.getoption("--with-mpi", default=False):
        from mpi_allreduce import launch

        def announce(line: str) -> None:
            # (the terminal reporter is looked up when a launch starts: it
            # may be registered after this hook has run; and the test's
            # output capture is suspended, or the line would wait for the
            # test's end and show only if it failed.  An xdist worker's
            # reporter writes nowhere: it writes to the standard error it
            # shares with the session's terminal)
            stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
            reporter = config.pluginmanager.get_plugin("terminalreporter")
            capture = config.pluginmanager.get_plugin("capturemanager")
            with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
                if hasattr(config, "workerinput"):
                    os.write(2, f"\n{stamped}\n".encode())
                elif reporter is not None:
                    reporter.write_line(stamped)

        launch.announce = announce
        return
    from mpi_allreduce import config as settings

    if settings.WATCHDOG_ENV not in os.environ:
        # a call that stalls (a rank that refused it, its peers in it) is
        # reported by the library's watchdog, which then aborts the job (the
        # default action: the raise mode would take other paths, and the
        # tests are of the default ones), before the test's time limit aborts
        # it with the ranks' stacks alone (the default deadline, 600 s, is
        # longer than that limit)
        os.environ[settings.WATCHDOG_ENV] = str(0.8 * TEST_TIMEOUT)
        settings.refresh()
    if getattr(config.option, "durations", None):
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() != 0:
            config.option.durations = None


#: the kinds of sub-communicator that the per-algorithm matrices run on for
#: an algorithm outside PATH_VARIANTS: their sizes (p and p-1 at the world
#: sizes 1, 3, 5, 8 of tests/test_launch.py) are every size the other kinds
#: reach.  What "reversed" and "even" add -- ranks of the world in another
#: order, or strided -- is the executor's and MPI's (a schedule sees ranks 0
#: .. p-1 whatever they are in the world), so the PATH_VARIANTS carry it;
#: each schedule itself is checked rank by rank in the simulator for every p
#: up to 64 and more (tests/test_schedule_serial.py and each algorithm's own
#: serial tests).
ALGORITHM_SUBCOMM_KINDS = ("world", "minus1")


def _label(item):
    """The variant label of a per-algorithm test (None for others)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    variant = params.get("variant")
    if isinstance(variant, tuple):
        return variant[0]
    return params.get("algorithm")


def _another_order_only(item) -> bool:
    """A per-algorithm test of an algorithm outside PATH_VARIANTS on a kind
    of sub-communicator that adds only a rank order (see
    ALGORITHM_SUBCOMM_KINDS)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    label = _label(item)
    return (params.get("comm") not in (None,) + ALGORITHM_SUBCOMM_KINDS
            and label is not None and label not in PATH_VARIANTS + ("auto",))


#: the kinds of the comm fixture run at a world size where the others add
#: nothing: at one rank every kind is a communicator of one; at 5 and 8
#: ranks "reversed" is the world's size again in another order and "even"
#: is 3 or 4 ranks, a size that the world or the world minus one of another
#: launch gives (tests/test_launch.py).  Rank orders, reversed and strided,
#: run at 3 ranks: a schedule sees ranks 0 .. p-1 whatever they are in the
#: world (see ALGORITHM_SUBCOMM_KINDS), so what another order adds is the
#: executor's and MPI's, the same at 3 ranks as at 8
SUBCOMM_KINDS_AT = {1: ("world",), 5: ("world", "minus1"), 8: ("world", "minus1")}

#: the one world size at which the long loops (tests on the ``trio``
#: fixture, or marked ``long_loop``) run: what thousands of calls leave
#: behind does not depend on the world size, only on there being peers.
#: Those on COMM_WORLD run at 2 ranks (one a core, the fastest launch with
#: peers, and the one the other MPI wheels' legs of .ci/run make too),
#: those on the ``comm`` fixture at 3, the smallest launch that runs it
#: with peers (the launch at 2 runs the world's tests only)
LONG_LOOP_WORLD = {"world": 2, "comm": 3}


def _not_at_this_world_size(item, size: int) -> bool:
    """A test that the launch at this world size leaves to the others (see
    SUBCOMM_KINDS_AT and LONG_LOOP_WORLD)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "comm" in params and params["comm"] not in SUBCOMM_KINDS_AT.get(size, SUBCOMM_KINDS):
        return True
    long_loop = ("trio" in getattr(item, "fixturenames", ())
                 or item.get_closest_marker("long_loop") is not None)
    return long_loop and size != LONG_LOOP_WORLD["comm" if "comm" in params else "world"]


def _another_kind_than_marked(item) -> bool:
    """A test marked ``comm_kinds(...)`` on a kind of sub-communicator it
    does not name: a test of what many calls leave behind (buffers,
    wrappers, a race's window) gains nothing from another rank order, and
    the world's size at each launch covers its sizes."""
    marker = item.get_closest_marker("comm_kinds")
    params = getattr(getattr(item, "callspec", None), "params", {})
    return marker is not None and "comm" in params and params["comm"] not in marker.args


def pytest_collection_modifyitems(config, items):
    """Outside mpiexec the MPI tests do not run here: test_launch.py runs them
    under mpiexec.  Deselect them instead of skipping, and put LONGEST_FIRST's
    files first.  Under mpiexec, deselect the part ONLY_ENV leaves out, and
    the per-algorithm tests of algorithms outside PATH_VARIANTS on the kinds
    of sub-communicator outside ALGORITHM_SUBCOMM_KINDS, those marked
    ``comm_kinds`` on the kinds they do not name, and those this world size
    leaves to the other launches (SUBCOMM_KINDS_AT, the long loops)."""
    if config.getoption("--with-mpi", default=False):
        only = os.environ.get(ONLY_ENV, "")
        if only not in ("", "world", "comm"):
            raise pytest.UsageError(f"{ONLY_ENV}={only!r}: 'world', 'comm' or unset")

        from mpi4py import MPI

        size = MPI.COMM_WORLD.Get_size()

        def dropped_if(item):
            on_comm = "comm" in getattr(item, "fixturenames", ())
            return ((only == "world" and on_comm) or (only == "comm" and not on_comm)
                    or _another_order_only(item) or _another_kind_than_marked(item)
                    or _not_at_this_world_size(item, size))
    else:
        def dropped_if(item):
            return item.get_closest_marker("mpi") is not None
        # (stable: within a file, and among the other files, the order stays)
        items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)
    keep = [item for item in items if not dropped_if(item)]
    dropped = [item for item in items if dropped_if(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


#: the user property under which tests/test_launch.py hands its launch's
#: summary lines to the session (they reach it from an xdist worker too)
SUMMARY_PROPERTY = "mpi_run_summary"


def pytest_runtest_logreport(report):
    """Under mpiexec print a failure at once, with the rank: if the job is
    aborted later, the summary at the end is never printed.  Outside it,
    keep each launch's summary lines for the end of the session."""
    if "MPI_ALLREDUCE_UNDER_MPIEXEC" not in os.environ:
        if report.when == "call":
            MPI_RUN_SUMMARIES.extend(line for name, lines in report.user_properties
                                     if name == SUMMARY_PROPERTY for line in lines)
        return
    if report.failed and report.when == "call":
        import sys

        from mpi4py import MPI

        sys.stderr.write(f"\n[rank {MPI.COMM_WORLD.Get_rank()}] FAILED {report.nodeid}\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()


def pytest_terminal_summary(terminalreporter):
    if MPI_RUN_SUMMARIES:
        terminalreporter.section("MPI test runs (rank 0 of each mpiexec)")
        for line in MPI_RUN_SUMMARIES:
            terminalreporter.write_line(line)
