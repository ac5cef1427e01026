"""One module per all-reduce algorithm.

Every algorithm is a class built once per :class:`~mpi_allreduce.plan.Plan`
(schedule and scratch prepared in ``__init__``) and called with the 1-D,
contiguous receive buffer, which holds this rank's input on entry and the
reduced vector on return.  All data moves through ``plan.sendrecv``.
"""
