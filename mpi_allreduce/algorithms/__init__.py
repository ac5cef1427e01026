"""One schedule builder per all-reduce algorithm.

Each module offers ``build(rank, size, count, segment_size, options)``, a
pure function that returns this rank's :class:`~mpi_allreduce.schedule.Schedule`
(no MPI, no arrays), and ``NAME``.  Every message that carries data to be
reduced is at most ``segment_size`` elements (the scratch is then one
segment, two for the pipelined ring, k-1 for the radix-k algorithms, which
receive from k-1 peers at once), reduced as it arrives.  Out of place,
the first reduction of each element reads the input (``SEND``) and writes
the result (``RECV``), so no copy of the input is made; in place the two
are one array and the same schedule serves.

``COMMUTATIVE`` says whether the algorithm needs a commutative op (it
combines some blocks in an order other than by rank).

The flat algorithms are registered here (``FLAT``); ``hierarchical``
composes one of them across node leaders and is registered above them, in
``mpi_allreduce.registry``.
"""

from . import (allgather_reduce, double_binary_tree, driver, knomial, naive, rabenseifner,
               recursive_doubling, recursive_multiplying, ring, ring_pipelined, torus, tree)
from . import bine_bandwidth, bine_latency, swing_bandwidth, swing_latency

#: name -> module of every flat algorithm (one level: no algorithm inside)
FLAT = {module.NAME: module for module in (driver, ring, recursive_doubling, ring_pipelined,
                                           rabenseifner, naive, tree, double_binary_tree,
                                           recursive_multiplying, knomial, torus,
                                           allgather_reduce, swing_latency, swing_bandwidth,
                                           bine_latency, bine_bandwidth)}


def flat(name: str):
    """The flat algorithm ``name``'s module (ValueError names the choices)."""
    try:
        return FLAT[name]
    except KeyError:
        raise ValueError(f"unknown flat algorithm {name!r}; choose one of: "
                         f"{', '.join(FLAT)}") from None
