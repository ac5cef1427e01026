"""One schedule builder per all-reduce algorithm.

Each module offers ``build(rank, size, count, segment_size, options)``, a
pure function that returns this rank's :class:`~mpi_allreduce.schedule.Schedule`
(no MPI, no arrays), and ``NAME``.  Every message that carries data to be
reduced is at most ``segment_size`` elements (the scratch is then one
segment, two for the pipelined ring), reduced as it arrives.  Out of place,
the first reduction of each element reads the input (``SEND``) and writes
the result (``RECV``), so no copy of the input is made; in place the two
are one array and the same schedule serves.

``COMMUTATIVE`` says whether the algorithm needs a commutative op (it
combines some blocks in an order other than by rank).
"""
