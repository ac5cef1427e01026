"""One module per all-reduce algorithm.

Every algorithm is a class built once per :class:`~mpi_allreduce.plan.Plan`
(schedule and scratch prepared in ``__init__``) and called as
``algorithm(send, buf)``: ``send`` holds this rank's input and ``buf`` (1-D,
contiguous) receives the reduced vector; for an in-place call they are the
same array.  Out of place, the first reduction of each element reads
``send`` and writes ``buf`` directly, so no copy of the input is made.
All data moves through ``plan.sendrecv`` / ``plan.post``, and data to be
reduced in segments of at most ``plan.segment_size`` elements, each
reduced as it arrives (``plan.exchange`` does both for a step), so an
algorithm's scratch is a segment, never a copy of the vector.

A runner (an algorithm, or ``auto``'s watch around several) may also offer
``run``: the same call bound once, without the object's ``__call__`` in
between.  The short path of a repeated call takes :func:`entry`.
"""


def entry(runner):
    """What to call to run ``runner``: its bare ``run`` where it has one."""
    return getattr(runner, "run", runner)
