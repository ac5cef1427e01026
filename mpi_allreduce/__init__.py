"""All-reduce algorithms written by hand on MPI point-to-point messages.

>>> import mpi_allreduce as mar
>>> y = mar.allreduce(x, op=MPI.SUM, algorithm="ring")
"""

from .api import allreduce, allreduce_init, iallreduce, setup
from .collectives import allgather, reduce_scatter
from .comm import Comm
from .config import SettingError
from .errors import ArgumentMismatch, Broken, ConcurrentCall, RequestError, Stalled, TagsExhausted
from .fusion import Fusion
from .progress import PersistentRequest, Request, waitall
from .ops import user_op
from .registry import ALGORITHMS

__all__ = ["allreduce", "iallreduce", "allreduce_init", "waitall", "reduce_scatter", "allgather",
           "Fusion", "Request", "PersistentRequest", "RequestError", "ALGORITHMS",
           "ArgumentMismatch", "Broken", "Stalled", "ConcurrentCall", "TagsExhausted", "SettingError",
           "setup", "Comm", "user_op"]
__version__ = "0.1.0"
