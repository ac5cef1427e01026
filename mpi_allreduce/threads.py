"""The library's own threads (the progress thread, the watchdog's monitor,
the trace writer) are started here, one way: a thread is kept -- recorded
as running -- only once it runs.

An interrupt (a ``KeyboardInterrupt`` from a signal handler, say) can land
inside ``Thread.start``.  Kept before it started, a thread that never ran
would be taken for a running one for the rest of the process: every call
handed to the progress thread, on any communicator, would wait for it.
Here a thread runs its work only once its starter has kept it: an
interrupt before the launch keeps nothing (the next caller starts one), one
after it keeps the thread that runs (lest a second one start), and a thread
kept that never gets to its work ends, which its keeper sees
(``is_alive()``); the interrupt is raised either way."""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["start_daemon"]

#: how long an interrupted start waits to learn whether its thread was launched
LAUNCH_SECONDS = 1.0
#: how long a new thread waits for its starter's verdict (given at once,
#: unless an interrupt kept the starter from giving it: then it does nothing)
VERDICT_SECONDS = 60.0


def start_daemon(target: Callable[[], None], name: str,
                 keep: Callable[[threading.Thread], None]) -> None:
    """Start a daemon thread ``name`` that runs ``target`` if, and only if,
    it was handed to ``keep`` (see the module's docstring).

    The new thread waits for its starter's verdict before ``target``: kept
    once it runs (where ``is_alive()`` is true until it ends), or not (an
    interrupt before its launch, or one that kept the starter from seeing
    it run).  However an interrupt falls, a thread that runs ``target`` has
    been kept, and one kept that does not run ends at once: its keeper
    sees it dead (``is_alive()``) and starts another."""
    ran, verdict = threading.Event(), threading.Event()
    kept: list = []

    def run() -> None:
        ran.set()
        verdict.wait(VERDICT_SECONDS)
        if kept:
            target()
    thread = threading.Thread(target=run, name=name, daemon=True)
    launched = False
    try:
        thread.start()
        launched = True
    finally:
        try:
            # (started, it runs however long a loaded machine takes to get
            # to it; interrupted, it may never have been launched)
            if ran.wait(None if launched else LAUNCH_SECONDS):
                keep(thread)
                kept.append(thread)
        finally:
            verdict.set()
