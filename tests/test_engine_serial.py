"""The engine's progress thread without messages: what needs no MPI peers."""

from __future__ import annotations

import threading
import time

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
        fresh.thread = object()
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
