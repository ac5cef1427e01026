"""Expected results computed without MPI: every rank can generate every
rank's input (it is deterministic), so it reduces them locally in rank order."""

from __future__ import annotations

import numpy as np

from mpi_allreduce.ops import resolve_op
from mpi_allreduce.tools.verify import make_data

#: (label, algorithm, options): the hierarchical variants emulate nodes of 2 and 3 ranks
VARIANTS = [
    ("driver", "driver", {}),
    ("ring", "ring", {}),
    ("recursive_doubling", "recursive_doubling", {}),
    ("hierarchical", "hierarchical", {}),
    ("hierarchical-rpn2", "hierarchical", {"ranks_per_node": 2}),
    ("hierarchical-rpn3-ring", "hierarchical", {"ranks_per_node": 3, "inner": "ring"}),
    ("ring_pipelined", "ring_pipelined", {}),
    ("rabenseifner", "rabenseifner", {}),
    ("naive", "naive", {}),
    ("tree", "tree", {}),
    ("double_binary_tree", "double_binary_tree", {}),
]
VARIANT_IDS = [v[0] for v in VARIANTS]


def inputs(comm, dtype, op, count, kind="exact", seed=7):
    return [make_data(np.dtype(dtype), op, count, r, kind, seed) for r in range(comm.Get_size())]


def expected(comm, dtype, op, count, kind="exact", seed=7):
    data = inputs(comm, dtype, op, count, kind, seed)
    ours = resolve_op(op)
    out = data[0].copy()
    for x in data[1:]:
        ours.ufunc(out, x, out=out)
    if ours.finalize is not None:
        ours.finalize(out, comm.Get_size(), out=out)
    return out


def mine(comm, dtype, op, count, kind="exact", seed=7):
    return make_data(np.dtype(dtype), op, count, comm.Get_rank(), kind, seed)
