"""The engine's progress thread without messages: what needs no MPI peers."""

from __future__ import annotations

import threading
import time

import pytest

from mpi_allreduce import engine


def test_two_threads_handing_over_at_once_start_one_progress_thread(monkeypatch):
    """Two threads whose first calls reach the engine at the same moment
    start one progress thread, not two (two ran each other's wake-ups and
    hung, or crashed inside MPI)."""
    fresh = engine._Engine()
    started = []

    def start():  # (a start that takes a while: the window two threads could share)
        started.append(threading.get_ident())
        time.sleep(0.05)
        fresh.thread = threading.main_thread()  # (one that runs)
    monkeypatch.setattr(fresh, "_start_thread", start)
    go = threading.Barrier(4)

    def hand():
        go.wait()
        fresh._hand("later", lambda: None)
    threads = [threading.Thread(target=hand) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(started) == 1 and len(fresh.later) == 4


@pytest.mark.parametrize("lands", ["before its launch", "after its launch"])
def test_an_interrupt_as_a_thread_starts_keeps_it_only_if_it_runs(monkeypatch, lands):
    """An interrupt inside ``Thread.start``: before the thread was launched
    nothing is kept (the next caller starts one); after, the thread records
    itself and runs (a second must not start); the interrupt is raised
    either way.  The engine's progress thread, the watchdog's monitor, the
    trace writer and the shelter all start this way."""
    from mpi_allreduce.threads import start_daemon

    real = threading.Thread.start

    def interrupted(thread):
        if lands == "after its launch":
            real(thread)
        raise KeyboardInterrupt(lands)
    monkeypatch.setattr(threading.Thread, "start", interrupted)
    stop, kept, worked = threading.Event(), [], threading.Event()

    def work():
        worked.set()
        stop.wait()
    with pytest.raises(KeyboardInterrupt, match=lands):
        start_daemon(work, "interrupted", kept.append, lambda: kept[-1] if kept else None)
    monkeypatch.undo()
    if lands == "before its launch":
        assert kept == [] and not worked.is_set()
    else:
        assert worked.wait(5)
        assert len(kept) == 1 and kept[0].name == "interrupted" and kept[0].is_alive()
    stop.set()
    for thread in kept:
        thread.join(5)


def test_of_two_threads_started_at_once_one_runs_its_work():
    """Two starters (two callers, or one an interrupt stopped and the next
    caller) start one worker between them: a new thread runs only where no
    other live one is recorded, and the record is made on the new thread,
    where no interrupt lands (before: an interrupt between the starter's
    record and its word to the thread left a recorded thread that never
    ran, and the next caller handed it work it never did)."""
    from mpi_allreduce.threads import start_daemon

    stop, kept, ran = threading.Event(), [], []

    def work():
        ran.append(threading.current_thread())
        stop.wait()
    for _ in range(3):
        start_daemon(work, "worker", kept.append, lambda: kept[-1] if kept else None)
    assert len(kept) == 1 and ran == kept
    stop.set()
    kept[0].join(5)
    start_daemon(work, "worker", kept.append, lambda: kept[-1] if kept else None)
    assert len(kept) == 2 and ran == kept  # (the recorded one ended: a new one runs)
    kept[1].join(5)


def test_a_progress_thread_that_never_ran_is_started_by_the_next_hand_over(monkeypatch):
    """The engine hands calls over only to a thread that runs: one recorded
    but not alive (one that ended) is started again by the next
    hand-over."""
    fresh = engine._Engine()
    fresh.thread = threading.Thread(target=lambda: None)  # (never started)
    started = []
    monkeypatch.setattr(fresh, "_start_thread", lambda: started.append(1))
    fresh._hand("later", lambda: None)
    assert started == [1] and len(fresh.later) == 1


def test_a_callback_run_at_once_has_its_exception_printed_not_raised(monkeypatch):
    """A callback added to a call already complete runs at once; what it
    raises is printed (``sys.excepthook``), as on the progress thread, and
    ``add_done_callback`` returns: whether a callback ran at once or on the
    thread is timing, and must not decide whether the caller sees its
    exception (a rank died where its peer printed it and went on)."""
    import sys

    import numpy as np
    from mpi4py import MPI

    import mpi_allreduce as mar

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *info: seen.append(info[0]))
    request = mar.iallreduce(np.ones(3), comm=MPI.COMM_SELF)

    def callback(done):
        raise ValueError("boom")
    request.add_done_callback(callback)
    assert seen == [ValueError]
    assert request.wait().tolist() == [1.0, 1.0, 1.0]


def test_an_interrupt_in_a_callback_on_the_callers_thread_is_the_callers(monkeypatch):
    """An interrupt (not an ``Exception``: a signal handler's
    ``KeyboardInterrupt``) that lands while a callback runs on the caller's
    thread is raised there, not printed and dropped: a Ctrl-C during a
    callback would otherwise be lost.  The call is complete all the same."""
    import sys

    import numpy as np
    from mpi4py import MPI

    import mpi_allreduce as mar

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *info: seen.append(info[0]))
    request = mar.iallreduce(np.ones(3), comm=MPI.COMM_SELF)

    def callback(done):
        raise KeyboardInterrupt("Ctrl-C")
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C"):
        request.add_done_callback(callback)
    assert seen == []
    assert request.wait().tolist() == [1.0, 1.0, 1.0]


def test_a_watchdog_monitor_that_never_ran_is_started_by_the_next_watch(monkeypatch):
    """The watchdog's monitor, like the progress thread: one recorded but
    not alive (one that ended) is replaced by the next thing watched, and
    the new one runs; before, no later stall of the process would have
    been reported."""
    from mpi_allreduce import watchdog

    fresh = watchdog._Watch()
    dead = threading.Thread(target=lambda: None, name="dead monitor")
    dead.start()
    dead.join()
    fresh._thread = dead
    ran = threading.Event()
    monkeypatch.setattr(fresh, "_monitor", ran.set)
    cell = watchdog.Cell("a caller")
    fresh.watch(cell)
    assert fresh._thread is not dead and fresh._thread.name == "mpi_allreduce-watchdog"
    assert ran.wait(5)
    fresh._thread.join(5)
    # (one alive is kept: a second watch starts none)
    alive = threading.Event()
    monkeypatch.setattr(fresh, "_monitor", alive.wait)
    fresh._thread = None
    fresh.watch(cell)
    first = fresh._thread
    fresh.watch(watchdog.Cell("another caller"))
    assert fresh._thread is first and first.is_alive()
    alive.set()
    first.join(5)


def test_a_trace_writer_that_never_ran_is_started_by_the_next_tracer(monkeypatch):
    """The trace writer: a recorded writer that is not alive is replaced
    when the next tracer is kept, so traces are still written as a job
    runs (a job its watchdog aborts keeps what was written)."""
    from mpi_allreduce import trace

    dead = threading.Thread(target=lambda: None, name="dead writer")
    dead.start()
    dead.join()
    monkeypatch.setattr(trace, "_WRITER", [dead])
    monkeypatch.setattr(trace, "_TRACERS", [object()])  # (atexit registered already)
    ran = threading.Event()
    monkeypatch.setattr(trace, "_write_now_and_then", ran.set)
    tracer = object()
    trace._keep(tracer)
    assert trace._WRITER[-1] is not dead and trace._WRITER[-1].name == "mpi_allreduce-trace"
    assert ran.wait(5) and trace._TRACERS[-1] is tracer


def test_a_sheltered_function_finishes_before_an_interrupt_is_raised():
    """``threads.sheltered`` runs a function off the main thread, where no
    signal handler runs: a handler's KeyboardInterrupt that lands while it
    runs is raised once it has returned (its work done, its result
    dropped); its own error is raised as it is; off the main thread it runs
    in place."""
    import os
    import signal
    import threading
    import time

    from mpi4py import MPI

    from mpi_allreduce.threads import sheltered

    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        pytest.skip("MPI runs no threads here: the function runs in place")

    def interrupt(signum, frame):
        raise KeyboardInterrupt("signal")
    previous = signal.signal(signal.SIGUSR1, interrupt)
    where, steps = [], []

    def work():
        where.append(threading.current_thread())
        os.kill(os.getpid(), signal.SIGUSR1)
        for step in range(10):
            time.sleep(0.01)
            steps.append(step)
        return "done"
    try:
        with pytest.raises(KeyboardInterrupt, match="signal"):
            sheltered(work)
        assert steps == list(range(10)) and where[0] is not threading.main_thread()
        assert sheltered(lambda a, b: a + b, 2, 3) == 5

        def fails():
            raise ValueError("its own")
        with pytest.raises(ValueError, match="its own"):
            sheltered(fails)
        inside = []
        thread = threading.Thread(target=lambda: inside.append(
            sheltered(threading.current_thread)))
        thread.start()
        thread.join()
        assert inside == [thread]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_report_of_a_non_blocking_call_names_the_thread_that_advances_it():
    """The watchdog's report of a non-blocking or persistent call names the
    thread that advances it (before: "thread 'any'")."""
    import threading
    from types import SimpleNamespace

    from mpi_allreduce.watchdog import _thread_of

    mine = SimpleNamespace(threaded=False, owner=threading.get_ident())
    assert _thread_of(mine) == threading.current_thread().name
    assert _thread_of(SimpleNamespace(threaded=True, owner=0)) == "the progress thread"
