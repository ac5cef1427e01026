"""A call's identity: the spec every rank must agree on, its fingerprint,
and the tags its messages carry.  Pure: no MPI.

A :class:`CallSpec` is resolved once per call shape from the arguments and
the environment, after ``auto`` and the hierarchical options are decided:
everything that changes which messages a rank sends, how long they are, or
how the data is combined.  Its ``fingerprint`` is a digest
of all of it and is used twice:

* every message of the call carries a tag derived from it (see
  :class:`TagLayout`), so ranks that disagree about any field post
  messages that cannot match: they wait, and the watchdog reports them,
  instead of returning a wrong result or truncating a message;
* ``check=True`` exchanges the spec itself before the call and names the
  field that differs.

An op's identity in the spec is the same on every rank for the same
reduction (a predefined op's name; a Python callable's qualified name; for
a user ``MPI.Op`` only that it is one, and whether it commutes -- its
handle differs between ranks that created their ops in another order).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

__all__ = ["CallSpec", "TagLayout", "tag_layout"]


@dataclass(frozen=True)
class CallSpec:
    """What every rank of a call must agree on.

    ============ ===========================================================
    kind         "allreduce", "reduce_scatter", "allgather"
    algorithm    the algorithm that runs (``auto`` resolved)
    size         ranks of the communicator
    count        elements of the whole vector
    dtype        the element type (``ops.dtype_label``)
    op           the op's identity across ranks (see the module docstring)
    segment_size elements per message at most where data is reduced
    options      the algorithm's options (hierarchical: the resolved inner
                 algorithm and the node of every rank; recursive_multiplying
                 and knomial: the radix they run with; torus: its row size)
    blocks       every rank's block (reduce_scatter, allgather)
    salt         what a call made on behalf of another adds (a reproducible
                 sum's inner calls: the caller's dtype and op)
    ============ ===========================================================
    """

    kind: str
    algorithm: str
    size: int
    count: int
    dtype: str
    op: str
    segment_size: int
    options: tuple = ()
    blocks: tuple = ()
    salt: str = ""
    fingerprint: int = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        text = repr(tuple(getattr(self, name) for name in _FIELDS))
        object.__setattr__(self, "fingerprint", zlib.crc32(text.encode()))

    def fields(self) -> dict:
        """The spec as a plain dict (what ``check=True`` exchanges)."""
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = ("kind", "algorithm", "size", "count", "dtype", "op", "segment_size", "options",
           "blocks", "salt")


class TagLayout(NamedTuple):
    """How a communicator's tags are shared out (``MPI_TAG_UB`` + 1 = 2^bits;
    the MPI standard promises bits >= 15, Open MPI's wheel gives 31, MPICH
    29, Intel MPI 30):

    * the upper half, ``blocking + fingerprint % blocking``: blocking calls
      (one at a time per communicator and thread: they need no sequence);
    * the lower half, ``slot << fp_bits | fingerprint % 2^fp_bits``:
      non-blocking and persistent calls.  Slots ``[0, persistent)`` go to
      persistent requests in the order they are made (held until freed),
      slots ``[persistent, slots)`` to non-blocking calls in the order they
      start (held until complete); both counters advance alike on every
      rank, since every rank makes the same calls in the same order.  A
      slot still held on this rank when its turn comes round again is
      refused (:class:`~mpi_allreduce.errors.TagsExhausted`), never reused.
    """

    bits: int
    blocking: int
    fp_bits: int
    persistent: int
    slots: int

    def blocking_tag(self, fingerprint: int) -> int:
        return self.blocking + fingerprint % self.blocking

    def place(self, persistent: bool, number: int, fingerprint: int) -> tuple:
        """(slot, tag) of the ``number``-th (from 0) persistent or
        non-blocking call with ``fingerprint``."""
        if persistent:
            slot = number % self.persistent
        else:
            slot = self.persistent + number % (self.slots - self.persistent)
        return slot, slot << self.fp_bits | fingerprint % (1 << self.fp_bits)


def tag_layout(tag_ub: Optional[int]) -> TagLayout:
    """The layout for an MPI whose largest tag is ``tag_ub`` (at least 32767).

    Slots are few (8,192: 2,048 persistent requests alive, 6,144
    non-blocking calls in flight, where there are 18 bits or more) so that
    the fingerprint keeps many bits: two non-blocking calls whose specs
    differ share a tag with odds of 1 in 2^fp_bits (2^17 on Open MPI, 2^15
    on MPICH, 2^16 on Intel MPI, 2^4 at the standard's minimum)."""
    bits = max(15, min(31, (int(tag_ub or 32767) + 1).bit_length() - 1))
    slot_bits = min(13, bits - 1 - 4)
    fp_bits = bits - 1 - slot_bits
    slots = 1 << slot_bits
    return TagLayout(bits, 1 << (bits - 1), fp_bits, slots // 4, slots)
