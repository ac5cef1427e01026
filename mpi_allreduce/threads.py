"""The library's own threads (the progress thread, the watchdog's monitor,
the trace writer) are started here, one way: a thread is kept -- recorded
as running -- only once it runs.

An interrupt (a ``KeyboardInterrupt`` from a signal handler, say) can land
inside ``Thread.start``.  Kept before it started, a thread that never ran
would be taken for a running one for the rest of the process: every call
handed to the progress thread, on any communicator, would wait for it.
Here an interrupt before the thread was launched keeps nothing (the next
caller starts one), and one after it was launched keeps the thread that
runs (lest a second one start); the interrupt is raised either way."""

from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["start_daemon"]

#: how long an interrupted start waits to learn whether its thread was launched
LAUNCH_SECONDS = 1.0


def start_daemon(target: Callable[[], None], name: str,
                 keep: Callable[[threading.Thread], None]) -> None:
    """Start a daemon thread ``name`` running ``target``, and hand it to
    ``keep`` once it runs (see the module's docstring)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    try:
        thread.start()
    finally:
        # (the new thread sets its ident first thing: launched, it has one
        # in a moment; an interrupt in start() may come before or after)
        deadline = time.monotonic() + LAUNCH_SECONDS
        while thread.ident is None and time.monotonic() < deadline:
            time.sleep(0.001)
        if thread.ident is not None:
            keep(thread)
