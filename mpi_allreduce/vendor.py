"""The vendor MPI's own all-reduce algorithms: which ones the running library
has, how each is forced through the library's documented controls, and the
library's own tuning file.

Vocabulary:

* **library**: Open MPI (``openmpi``), MPICH (``mpich``) or Intel MPI
  (``impi``), told apart by ``MPI.Get_library_version()``.  Any other MPI is
  "not known" (:class:`UnknownVendor`).
* **algorithm**: one of the library's own, by its own name and the value its
  control takes (Open MPI's ``coll_tuned_allreduce_algorithm`` = 4 is
  ``ring``).  Bench rows of a forced algorithm are labelled ``mpi:<name>``.
* **control**: the documented setting that forces one algorithm:

  =========  ====================================================  ==========
  library    control                                               in-process
  =========  ====================================================  ==========
  Open MPI   ``coll_tuned_use_dynamic_rules=1`` and                yes: read
             ``coll_tuned_allreduce_algorithm=<n>`` (MCA)          when a
                                                                   communicator
                                                                   is made
  MPICH      ``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=<name>``        yes: read
                                                                   at each call
  Intel MPI  ``I_MPI_ADJUST_ALLREDUCE=<id>`` (a preset), or         no: read at
             ``I_MPI_TUNING=<JSON file>`` naming a composition     start-up
  =========  ====================================================  ==========

  Where the library reads its control again after start-up, ``bench
  --vendor-algorithms`` forces each algorithm in one run through MPI's
  tool interface (``MPI_T_cvar_write``, the standard way to set a
  library's control variables from a program), and reads the value back:
  a value the library refuses is an error before any timing.  Intel MPI
  takes ``I_MPI_ADJUST_ALLREDUCE`` at start-up only (a value written
  through MPI_T later changed nothing we could measure: 4 MiB on 2 ranks
  took the same time under ids 3 and 8, 550 and 345 us when set at
  launch), so there each algorithm needs a launch of its own; bench names
  its vendor row after the id in force (:func:`in_force`).
* **tuning file**: the library's own way to say which algorithm to run at
  which size: Open MPI's dynamic rules file
  (``coll_tuned_dynamic_rules_filename``), MPICH's JSON selection file
  (``MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE``), Intel MPI's JSON
  tuning file (``I_MPI_TUNING``).  :meth:`Library.export`
  writes it from ``[(from bytes, algorithm)]`` and :meth:`Library.read`
  reads it back (the same parser checks a file named in the environment
  before a bench times anything).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Optional

from mpi4py import MPI

from .engine import duplicate

#: the vendor's own all-reduce in bench's tables
VENDOR = "mpi"
#: the label of the vendor's rows when a tuning file is in force
TUNED = "tuned"
TUNED_LABEL = f"{VENDOR}:{TUNED}"


class UnknownVendor(ValueError):
    """The running MPI is none of those whose algorithms we know."""


class VendorSettingError(ValueError):
    """A vendor control or tuning file the library would refuse or ignore."""


@dataclass(frozen=True)
class Algorithm:
    """One of the library's own all-reduce algorithms."""
    name: str
    value: int  # what the control takes (MPICH: its position in the choices)

    @property
    def label(self) -> str:
        return f"{VENDOR}:{self.name}"


# --- MPI's tool interface (MPI_T), through the loaded libmpi ----------------

class _Tool:
    """Control variables of the loaded MPI library (MPI_T_cvar_*)."""

    def __init__(self, lib):
        self.lib = lib
        provided = ctypes.c_int()
        if lib.MPI_T_init_thread(0, ctypes.byref(provided)) != 0:
            raise OSError("MPI_T_init_thread failed")

    def index(self, name: str) -> Optional[int]:
        idx = ctypes.c_int()
        if self.lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(idx)) != 0:
            return None
        return idx.value

    def describe(self, index: int) -> tuple[str, Optional[list]]:
        """(description, [(value, name)] of its MPI_T enumeration or None)."""
        name, desc = ctypes.create_string_buffer(256), ctypes.create_string_buffer(16384)
        name_len, desc_len = ctypes.c_int(256), ctypes.c_int(16384)
        verbosity, bind, scope = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        datatype, enum = ctypes.c_int64(), ctypes.c_void_p()
        if self.lib.MPI_T_cvar_get_info(index, name, ctypes.byref(name_len),
                                        ctypes.byref(verbosity), ctypes.byref(datatype),
                                        ctypes.byref(enum), desc, ctypes.byref(desc_len),
                                        ctypes.byref(bind), ctypes.byref(scope)) != 0:
            return "", None
        items = None
        if enum.value:
            count, ename, elen = ctypes.c_int(), ctypes.create_string_buffer(256), ctypes.c_int(256)
            self.lib.MPI_T_enum_get_info(enum, ctypes.byref(count), ename, ctypes.byref(elen))
            items = []
            for k in range(count.value):
                value, item = ctypes.c_int(), ctypes.create_string_buffer(256)
                ilen = ctypes.c_int(256)
                self.lib.MPI_T_enum_get_item(enum, k, ctypes.byref(value), item, ctypes.byref(ilen))
                items.append((value.value, item.value.decode(errors="replace")))
        return desc.value.decode(errors="replace"), items

    def _handle(self, name: str):
        index = self.index(name)
        if index is None:
            raise VendorSettingError(f"the MPI library has no control variable {name}")
        handle, count = ctypes.c_void_p(), ctypes.c_int()
        if self.lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle),
                                            ctypes.byref(count)) != 0:
            raise VendorSettingError(f"cannot open the control variable {name}")
        return handle, count.value

    def _free(self, handle) -> None:
        self.lib.MPI_T_cvar_handle_free(ctypes.byref(handle))

    def read(self, name: str):
        """An int variable's value, or a string variable's text."""
        handle, count = self._handle(name)
        try:
            buf = ctypes.create_string_buffer(max(8, count + 1))
            if self.lib.MPI_T_cvar_read(handle, buf) != 0:
                raise VendorSettingError(f"cannot read the control variable {name}")
            if count > 1:
                return buf.value.decode(errors="replace")
            return ctypes.c_int.from_buffer(buf).value
        finally:
            self._free(handle)

    def write(self, name: str, value: int) -> None:
        """Set an int variable and read it back: VendorSettingError where the
        library refuses the value (or keeps another)."""
        handle, _ = self._handle(name)
        try:
            rc = self.lib.MPI_T_cvar_write(handle, ctypes.byref(ctypes.c_int(value)))
            got = ctypes.c_int(-1)
            self.lib.MPI_T_cvar_read(handle, ctypes.byref(got))
        finally:
            self._free(handle)
        # (a bool is stored in its first byte)
        if rc != 0 or (got.value & 0xFF) != (value & 0xFF):
            raise VendorSettingError(f"the MPI library refused {name}={value} "
                                     f"(MPI_T_cvar_write returned {rc})")


@functools.lru_cache(maxsize=1)
def tool() -> Optional[_Tool]:
    """The loaded library's MPI_T, or None where it has none."""
    from .backend import _libmpi_candidates

    for name in _libmpi_candidates():
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(lib, "MPI_T_init_thread") and hasattr(lib, "MPI_T_cvar_write"):
            try:
                return _Tool(lib)
            except OSError:
                return None
    return None


def _tool_to_force(library: "Library") -> _Tool:
    """MPI_T, which forcing an algorithm in-process needs."""
    t = tool()
    if t is None:
        raise VendorSettingError(f"this {library.title} has no MPI_T interface to force "
                                 "algorithms")
    return t


def _file_setting(t: _Tool, name: str, env: str) -> str:
    """A tuning file's path as the library holds it (MPI_T), else as the
    environment gave it (a string variable MPI_T does not read back)."""
    return (t.read(name) if t.index(name) is not None else "") or os.environ.get(env, "")


def _ranges(choices: list):
    """(from bytes, to bytes or None for no end, algorithm) of each of
    ``choices`` [(from bytes, algorithm)]."""
    starts = [size for size, _ in choices[1:]] + [None]
    return [(size, None if end is None else end - 1, algorithm)
            for (size, algorithm), end in zip(choices, starts)]


# --- the libraries ------------------------------------------------------------

class Library:
    """What we know of one MPI library's all-reduce algorithms."""
    key = ""
    title = ""
    #: whether a forced algorithm can change after start-up (MPI_T)
    in_process = False
    #: the tuning file's suffix
    suffix = ".txt"
    #: whether the tuning file can leave a size to the library's own choice
    own_choice_in_file = False

    def control_env(self) -> dict:
        """The environment that switches the library's tuning path on with no
        algorithm chosen: what any tuning file costs by being read at all
        (benchmarks/vendors.py times it beside the default and the file)."""
        return {}

    def algorithms(self) -> list[Algorithm]:
        raise NotImplementedError

    def usable(self, algorithm: str, nbytes: int, ranks: int) -> bool:
        """Whether the tuning file may name ``algorithm`` for ``nbytes`` a rank."""
        return True

    def require_in_process(self) -> None:
        """VendorSettingError saying how to force the algorithms of a library
        that reads its control at start-up only."""

    def numbered(self, algorithm: Algorithm) -> bool:
        """Whether ``algorithm`` is also found by its number (its value)."""
        return True

    def algorithm(self, text: str) -> Algorithm:
        """An algorithm by its name or (:meth:`numbered`) number;
        VendorSettingError naming the library's choices for any other."""
        for a in self.algorithms():
            if text == a.name or (text == str(a.value) and self.numbered(a)):
                return a
        raise VendorSettingError(
            f"{self.title} has no all-reduce algorithm {text!r}; its algorithms: "
            + ", ".join(f"{a.value} {a.name}" for a in self.algorithms()))

    def force_env(self, algorithm: Algorithm, directory: Optional[str] = None) -> dict:
        """The environment that forces ``algorithm`` at start-up (a library
        that forces some through a file writes it in ``directory``, the
        working directory if None)."""
        raise NotImplementedError

    def tuned_env(self, path: str) -> dict:
        raise NotImplementedError

    def export(self, choices: list, ranks: int) -> str:
        """The tuning file's text: ``choices`` [(from bytes, Algorithm or
        None for the library's own choice)] sorted by size, for
        communicators of ``ranks`` ranks."""
        raise NotImplementedError

    def read(self, text: str) -> list:
        """[(comm size, from bytes, algorithm value)] of a tuning file's text;
        VendorSettingError for one the library could not use."""
        raise NotImplementedError

    def in_force(self) -> str:
        """The vendor row's label for the settings this process started with:
        ``mpi``, ``mpi:<algorithm>`` or ``mpi:tuned``; VendorSettingError for
        a setting the library would refuse, ignore, or a file it cannot read."""
        raise NotImplementedError

    def forcing(self, comm, algorithm: Algorithm):
        """(the communicator to call ``Allreduce`` on with ``algorithm`` in
        force, a function that puts the control in force before each batch
        of calls, one that takes it out after); collective."""
        raise NotImplementedError

    def check_file(self, path: str) -> list:
        """:meth:`read` of the file at ``path``, naming it in any error."""
        try:
            with open(path) as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise VendorSettingError(f"{self.title} could not read its tuning file {path}: "
                                     f"{exc}") from None
        try:
            return self.read(text)
        except VendorSettingError as exc:
            raise VendorSettingError(f"{path}: {exc}") from None


class OpenMPI(Library):
    """Open MPI's coll/tuned component."""
    key, title = "openmpi", "Open MPI"
    in_process = True
    suffix = ".rules"
    own_choice_in_file = True  # (algorithm 0)
    ALGORITHM = "coll_tuned_allreduce_algorithm"
    DYNAMIC = "coll_tuned_use_dynamic_rules"
    FILE = "coll_tuned_dynamic_rules_filename"
    #: Open MPI 5.0's list, where MPI_T does not give it
    KNOWN = ((1, "basic_linear"), (2, "nonoverlapping"), (3, "recursive_doubling"),
             (4, "ring"), (5, "segmented_ring"), (6, "rabenseifner"))
    #: ALLREDUCE in coll/base's list of collectives (the rules file's collective id)
    COLLECTIVE_ID = 2

    @functools.lru_cache(maxsize=1)
    def algorithms(self) -> list[Algorithm]:
        t = tool()
        index = t.index(self.ALGORITHM) if t else None
        items = t.describe(index)[1] if index is not None else None
        pairs = [(v, n) for v, n in items if v != 0] if items else self.KNOWN
        return [Algorithm(n, v) for v, n in pairs]

    def force_env(self, algorithm, directory=None):
        return {f"OMPI_MCA_{self.DYNAMIC}": "1", f"OMPI_MCA_{self.ALGORITHM}": str(algorithm.value)}

    def control_env(self):
        return {f"OMPI_MCA_{self.DYNAMIC}": "1"}

    def tuned_env(self, path):
        return {**self.control_env(), f"OMPI_MCA_{self.FILE}": os.path.abspath(path)}

    def export(self, choices, ranks):
        lines = ["1  # collectives", f"{self.COLLECTIVE_ID}  # all-reduce",
                 "1  # communicator sizes", f"{ranks}  # ranks", f"{len(choices)}  # sizes"]
        lines += [f"{int(size)} {0 if a is None else a.value} 0 0  # from {size} B: "
                  + ("Open MPI's own choice" if a is None else a.name) for size, a in choices]
        return "\n".join(lines) + "\n"

    def read(self, text):
        words = []
        for line in text.splitlines():
            words += line.split("#", 1)[0].split()
        try:
            numbers = [int(w) for w in words]
        except ValueError:
            raise VendorSettingError("an Open MPI rules file holds whole numbers only") from None
        valid = {a.value for a in self.algorithms()} | {0}
        rules, at = [], 0

        def take():
            nonlocal at
            if at >= len(numbers):
                raise VendorSettingError("the rules file ends early")
            at += 1
            return numbers[at - 1]

        for _ in range(take()):
            collective = take()
            for _ in range(take()):
                comm_size = take()
                for _ in range(take()):
                    size, alg = take(), take()
                    take(), take()  # (fan-in/out and segment size)
                    if collective == self.COLLECTIVE_ID:
                        if alg not in valid:
                            raise VendorSettingError(
                                f"all-reduce algorithm {alg} is not one of {self.title}'s "
                                f"({', '.join(map(str, sorted(valid)))})")
                        rules.append((comm_size, size, alg))
        if at != len(numbers):
            raise VendorSettingError(f"{len(numbers) - at} numbers after the last rule")
        return rules

    def in_force(self):
        t = tool()
        if t is None:
            return VENDOR
        dynamic = t.read(self.DYNAMIC) & 0xFF
        forced = t.read(self.ALGORITHM)
        path = _file_setting(t, self.FILE, f"OMPI_MCA_{self.FILE}")
        if not dynamic:
            if forced:
                raise VendorSettingError(
                    f"{self.ALGORITHM}={forced} is ignored by Open MPI without "
                    f"{self.DYNAMIC}=1 (OMPI_MCA_{self.DYNAMIC}=1)")
            return VENDOR
        if path:
            self.check_file(path)
            return TUNED_LABEL
        if forced:
            return self.algorithm(str(forced)).label
        return VENDOR

    def forcing(self, comm, algorithm):
        t = _tool_to_force(self)
        before = (t.read(self.DYNAMIC) & 0xFF, t.read(self.ALGORITHM))
        try:
            t.write(self.DYNAMIC, 1)
            t.write(self.ALGORITHM, algorithm.value)
            # (coll/tuned takes the forced algorithm as the duplicate is made)
            forced = duplicate(comm, f"forcing the vendor's all-reduce algorithm "
                                     f"{algorithm.label}: MPI_Comm_idup")
        finally:
            t.write(self.ALGORITHM, before[1])
            t.write(self.DYNAMIC, before[0])
        return forced, None, None


class MPICH(Library):
    """MPICH's MPIR-level all-reduce algorithms."""
    key, title = "mpich", "MPICH"
    in_process = True
    suffix = ".json"
    ALGORITHM = "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"
    FILE = "MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE"
    #: on, the CH4 device's own selection (a shared-memory algorithm within a
    #: node) comes before the MPIR algorithms and their selection file
    DEVICE = "MPIR_CVAR_ALLREDUCE_DEVICE_COLLECTIVE"
    #: choices the selection file does not name: smp needs a parent communicator;
    #: nb stalled here when a file named it; and the ones with parameters (k, tree
    #: type, chunk size) take them from the file, where one without them leaves
    #: them at 0 (recursive_multiplying stalled here): the file names the others
    NOT_IN_FILES = ("smp", "nb", "recursive_multiplying", "tree", "recexch",
                    "k_reduce_scatter_allgather")
    #: choices that need at least a power of two of elements (MPICH's
    #: restriction size-ge-pof2): not named for sizes below 8 bytes a rank
    POF2_COUNT = ("reduce_scatter_allgather", "k_reduce_scatter_allgather")
    #: MPICH 4-5's choices in their order (the value is the position); auto is 0
    KNOWN = ("auto", "nb", "smp", "recursive_doubling", "recursive_multiplying",
             "reduce_scatter_allgather", "tree", "recexch", "ring",
             "k_reduce_scatter_allgather", "ccl")
    #: choices that are not an algorithm of their own here (ccl: NCCL/RCCL)
    NOT_ALGORITHMS = ("auto", "ccl")
    #: the selection file's name of each choice
    LEAF = {"nb": "MPIR_Allreduce_allcomm_nb", "smp": "MPIR_Allreduce_intra_smp",
            "recursive_doubling": "MPIR_Allreduce_intra_recursive_doubling",
            "recursive_multiplying": "MPIR_Allreduce_intra_recursive_multiplying",
            "reduce_scatter_allgather": "MPIR_Allreduce_intra_reduce_scatter_allgather",
            "tree": "MPIR_Allreduce_intra_tree",
            "recexch": "MPIR_Allreduce_intra_recexch",
            "ring": "MPIR_Allreduce_intra_ring",
            "k_reduce_scatter_allgather": "MPIR_Allreduce_intra_k_reduce_scatter_allgather"}

    def choices(self) -> list[str]:
        """The control's choices in order, from the library's own
        description where it gives them."""
        t = tool()
        index = t.index(self.ALGORITHM) if t else None
        if index is None:
            return list(self.KNOWN)
        names = re.findall(r"^\s*([a-z_]+)\s+- ", t.describe(index)[0], flags=re.M)
        return names if names and names[0] == "auto" else list(self.KNOWN)

    def algorithms(self):
        return [Algorithm(n, v) for v, n in enumerate(self.choices())
                if n not in self.NOT_ALGORITHMS]

    def force_env(self, algorithm, directory=None):
        return {self.DEVICE: "0", self.ALGORITHM: algorithm.name}

    def control_env(self):
        return {self.DEVICE: "0", self.ALGORITHM: "auto"}

    def tuned_env(self, path):
        return {**self.control_env(), self.FILE: os.path.abspath(path)}

    def usable(self, algorithm: str, nbytes: int, ranks: int) -> bool:
        """Whether the selection file may name ``algorithm`` for ``nbytes`` a rank."""
        if algorithm in self.NOT_IN_FILES:
            return False
        return algorithm not in self.POF2_COUNT or nbytes >= 8 * ranks

    def builtin_selection(self) -> dict:
        """The library's own MPIR-level selection (compiled into libmpi as
        JSON), which a selection file replaces as a whole: the file we write
        is that selection with its all-reduce part changed."""
        from .backend import _libmpi_candidates

        for path in filter(None, _libmpi_candidates()):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            for m in re.finditer(rb'\{"collective=[^\x00]*', data):
                if b'"algorithm=MPIR_Allreduce_intra' in m.group(0):
                    try:
                        return json.loads(m.group(0).decode())
                    except ValueError:
                        continue
        raise VendorSettingError(
            "cannot find MPICH's built-in selection in the loaded libmpi; a selection file "
            "replaces it as a whole, so none is written (run under the MPICH to tune)")

    def export(self, choices, ranks):
        if any(a is None for _, a in choices):
            raise VendorSettingError("an MPICH selection file names an algorithm at every size")
        by_size = {"avg_msg_size=any" if end is None else f"avg_msg_size<={end}":
                   {f"algorithm={self.LEAF[algorithm.name]}": {}}
                   for _, end, algorithm in _ranges(choices)}
        table = self.builtin_selection()
        own = table["collective=allreduce"]["comm_type=intra"]
        # (an algorithm a file names runs unchecked: ours only for built-in
        # commutative ops, which all of them take)
        guarded = {"is_op_built_in=yes": {"is_commutative=yes": by_size,
                                          "is_commutative=no": own},
                   "is_op_built_in=no": own}
        table["collective=allreduce"]["comm_type=intra"] = {
            **({f"comm_size<{ranks}": own} if ranks > 1 else {}),
            f"comm_size<={ranks}": guarded, "any": own}
        return json.dumps(table, indent=1) + "\n"

    def read(self, text):
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise VendorSettingError(f"not JSON: {exc}") from None
        leaves = set(self.LEAF.values())
        rules = []

        def walk(node, comm_size, size):
            if not isinstance(node, dict):
                raise VendorSettingError("every level of a selection file is a JSON object")
            for key, child in node.items():
                if key.startswith("algorithm="):
                    if comm_size is not None and key[10:].startswith("MPIR_Allreduce"):
                        if key[10:] not in leaves:
                            raise VendorSettingError(f"{key[10:]} is not an MPICH all-reduce "
                                                     "algorithm")
                        rules.append((comm_size, size, key[10:]))
                    continue
                m = re.fullmatch(r"(comm_size|avg_msg_size|total_msg_size)(<=|<)(\d+)", key)
                if key.startswith("comm_size") and m:
                    walk(child, int(m.group(3)), size)
                elif m:
                    walk(child, comm_size, int(m.group(3)))
                elif key == "any":
                    walk(child, comm_size if comm_size is not None else 0, None)
                else:
                    walk(child, comm_size, size)

        walk(doc, None, None)
        return rules

    def in_force(self):
        t = tool()
        if t is None:
            return VENDOR
        forced = t.read(self.ALGORITHM)
        path = _file_setting(t, self.FILE, self.FILE)
        names = self.choices()
        if forced and 0 <= forced < len(names):
            return self.algorithm(names[forced]).label
        if path:
            self.check_file(path)
            return TUNED_LABEL
        return VENDOR

    def forcing(self, comm, algorithm):
        t = _tool_to_force(self)
        device = t.index(self.DEVICE) is not None
        before = (t.read(self.ALGORITHM), t.read(self.DEVICE) if device else None)

        def enter():
            if device:
                t.write(self.DEVICE, 0)
            t.write(self.ALGORITHM, algorithm.value)

        def leave():
            t.write(self.ALGORITHM, before[0])
            if device:
                t.write(self.DEVICE, before[1])

        enter()  # (checks that the library takes it)
        leave()
        return comm, enter, leave


class IntelMPI(Library):
    """Intel MPI's all-reduce presets and compositions."""
    key, title = "impi", "Intel MPI"
    in_process = False
    suffix = ".json"
    # (the tuning file names a preset or a composition at every size: it
    # replaces Intel's all-reduce table, and no key of it says "Intel's own
    # choice"; Intel's own table chooses among compositions, which the file
    # can name, so the file can make Intel's choices where they are fastest)
    own_choice_in_file = False
    CONTROL = "I_MPI_ADJUST_ALLREDUCE"
    #: a JSON tuning file (Intel's developer reference: "load tuning settings
    #: in a JSON format"); it must be an absolute path
    FILE = "I_MPI_TUNING"
    #: the developer reference's numbered list (2019-2021 pages; from 2021.13 on it
    #: says that presets outnumber algorithms, so a later id may mean a variant)
    KNOWN = ((1, "recursive_doubling"), (2, "rabenseifner"), (3, "reduce_bcast"),
             (4, "topo_reduce_bcast"), (5, "binomial_gather_scatter"),
             (6, "topo_binomial_gather_scatter"), (7, "shumilin_ring"), (8, "ring"),
             (9, "knomial"), (10, "topo_shm_flat"), (11, "topo_shm_knomial"),
             (12, "topo_shm_knary"))
    #: compositions, the level above the presets where Intel's own table
    #: chooses: which node-level and network-level steps make the call, each
    #: then chosen by Intel's lower tables as by default (on 2 ranks here its
    #: table names composition 3 up to 42780 B, whose shared-memory gather and
    #: release at 8 B no preset reaches: every preset ran slower there); only a
    #: JSON tuning file names them, as ``ALLREDUCE_COMPOSITION=<c>``
    COMPOSITIONS = tuple(range(11))
    PRESET, COMPOSITION = "ALLREDUCE", "ALLREDUCE_COMPOSITION"
    COLLECTIVE = "coll=Allreduce"

    def algorithms(self):
        return [Algorithm(n, v) for v, n in self.KNOWN] + \
            [Algorithm(f"composition{c}", c) for c in self.COMPOSITIONS]

    @staticmethod
    def composition(algorithm: Algorithm) -> bool:
        return algorithm.name.startswith("composition")

    def numbered(self, algorithm):
        # (a number is a preset id, as I_MPI_ADJUST_ALLREDUCE takes it; a
        # composition goes by its name)
        return not self.composition(algorithm)

    def _leaf(self, algorithm: Algorithm) -> str:
        return f"{self.COMPOSITION if self.composition(algorithm) else self.PRESET}=" \
               f"{algorithm.value}"

    def _file(self, choices: list, ranks: int) -> str:
        # (one entry of processes a node and communicator size, which Intel
        # applies where its file has none closer: a 3-rank launch took a
        # file's 4-rank entry; message sizes are inclusive upper bounds, -1
        # the rest)
        sizes = {f"msg_size={-1 if end is None else end}": {self._leaf(algorithm): {}}
                 for _, end, algorithm in _ranges(choices)}
        doc = {self.COLLECTIVE: {f"ppn={ranks}": {f"comm_size={ranks}": {"comm_id=-1": sizes}}}}
        return json.dumps(doc, indent=1) + "\n"

    def force_env(self, algorithm, directory=None):
        if not self.composition(algorithm):
            return {self.CONTROL: str(algorithm.value)}
        path = os.path.join(directory or ".", f"impi-{algorithm.name}.json")
        with open(path, "w") as f:
            f.write(self._file([(0, algorithm)], 1))
        return self.tuned_env(path)

    def tuned_env(self, path):
        return {self.FILE: os.path.abspath(path)}

    def export(self, choices, ranks):
        if any(algorithm is None for _, algorithm in choices):
            raise VendorSettingError("Intel MPI's tuning file names an algorithm at every size "
                                     "(no key of it keeps Intel's own choice)")
        return self._file(choices, ranks)

    def read(self, text):
        """[(comm size, from bytes, preset id or ``composition<c>``)] of a
        JSON tuning file's all-reduce entries (none: [])."""
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise VendorSettingError(f"not JSON ({exc}); Intel MPI ignores such a file "
                                     "without a word") from None
        if not isinstance(doc, dict):
            raise VendorSettingError("an Intel MPI tuning file is a JSON object")
        presets = {a.value for a in self.algorithms() if not self.composition(a)}
        rules = []

        def level(node, prefix: str) -> list:
            if not isinstance(node, dict) or not node:
                raise VendorSettingError(f"expected {prefix}<n> keys, found {node!r}")
            out = []
            for key, value in node.items():
                m = re.fullmatch(re.escape(prefix) + r"(-?\d+)", key)
                if not m:
                    raise VendorSettingError(f"{key!r} is not '{prefix}<n>'")
                out.append((int(m.group(1)), value))
            return out

        if self.COLLECTIVE not in doc:
            return rules
        for _, comms in level(doc[self.COLLECTIVE], "ppn="):
            for comm_size, ids in level(comms, "comm_size="):
                for _, sizes in level(ids, "comm_id="):
                    bounds = sorted(level(sizes, "msg_size="),
                                    key=lambda item: (item[0] < 0, item[0]))
                    start = 0
                    for end, leaf in bounds:
                        if not isinstance(leaf, dict) or len(leaf) != 1:
                            raise VendorSettingError(
                                f"msg_size={end}: one algorithm key, found {leaf!r}")
                        (key,) = leaf
                        m = re.fullmatch(r"(ALLREDUCE|ALLREDUCE_COMPOSITION)=(\d+)", key)
                        if not m:
                            raise VendorSettingError(
                                f"{key!r} is not ALLREDUCE=<id> or ALLREDUCE_COMPOSITION=<c>")
                        number = int(m.group(2))
                        if m.group(1) == self.PRESET and number not in presets:
                            raise VendorSettingError(
                                f"{key!r}: not one of {self.title}'s preset ids "
                                f"({', '.join(map(str, sorted(presets)))})")
                        if m.group(1) == self.COMPOSITION and number not in self.COMPOSITIONS:
                            raise VendorSettingError(
                                f"{key!r}: not one of {self.title}'s compositions "
                                f"({self.COMPOSITIONS[0]}-{self.COMPOSITIONS[-1]})")
                        rules.append((comm_size, start, number if m.group(1) == self.PRESET
                                      else f"composition{number}"))
                        start = end + 1
        return rules

    def read_value(self, text: str) -> list:
        """[(comm size, from bytes, preset id)] of an ``I_MPI_ADJUST_ALLREDUCE``
        value (``<id>[:<l>[-<m>][@<p>[-<q>]],...];...``)."""
        text = text.strip()
        valid = {a.value for a in self.algorithms() if not self.composition(a)} | {0}
        rules = []
        for part in filter(None, text.split(";")):
            m = re.fullmatch(r"(\d+)(?::(.*))?", part.strip())
            if not m or int(m.group(1)) not in valid:
                raise VendorSettingError(
                    f"{part!r} is not '<id>[:<conditions>]' with an id of {self.title}'s "
                    f"({', '.join(map(str, sorted(valid)))})")
            for condition in filter(None, (m.group(2) or "").split(",")):
                c = re.fullmatch(r"(\d+)(?:-(\d+))?(?:@(\d+)(?:-(\d+))?)?", condition.strip())
                if not c:
                    raise VendorSettingError(f"condition {condition!r} is not "
                                             "'<l>[-<m>][@<p>[-<q>]]'")
                rules.append((int(c.group(3) or 0), int(c.group(1)), int(m.group(1))))
            if not m.group(2):
                rules.append((0, 0, int(m.group(1))))
        if not rules:
            raise VendorSettingError("no algorithm given")
        return rules

    def in_force(self):
        value = os.environ.get(self.CONTROL, "").strip()
        path = os.environ.get(self.FILE, "").strip()
        if value and path:
            raise VendorSettingError(f"both {self.CONTROL} and {self.FILE} are set: set one "
                                     "(which of them Intel MPI follows is not documented)")
        if path:
            if not os.path.isabs(path):
                raise VendorSettingError(f"{self.FILE}={path}: give an absolute path")
            rules = self.check_file(path)
            if not rules:
                return VENDOR  # (a file of other collectives)
            if len(rules) == 1:
                return self.algorithm(str(rules[0][2])).label
            return TUNED_LABEL
        if not value:
            return VENDOR
        rules = self.read_value(value)
        if ":" not in value and len(rules) == 1:
            return self.algorithm(str(rules[0][2])).label if rules[0][2] else VENDOR
        return TUNED_LABEL

    def require_in_process(self):
        raise VendorSettingError(
            f"{self.title} reads its settings at start-up only: launch once per algorithm, "
            f"a preset with {self.CONTROL}=<id>, a composition with {self.FILE}=<absolute "
            f"path of a JSON file naming it> (bench then names its MPI row mpi:<name>); "
            f"presets: " + ", ".join(f"{a.value} {a.name}" for a in self.algorithms()
                                     if not self.composition(a))
            + f"; compositions: composition{self.COMPOSITIONS[0]}-"
              f"composition{self.COMPOSITIONS[-1]}")

    def forcing(self, comm, algorithm):
        self.require_in_process()


LIBRARIES = {cls.key: cls for cls in (OpenMPI, MPICH, IntelMPI)}


def identify(version: str) -> Library:
    """The library of ``MPI.Get_library_version()``'s text; UnknownVendor
    for any other."""
    if "Open MPI" in version:
        return OpenMPI()
    if "Intel(R) MPI" in version or "Intel MPI" in version:
        return IntelMPI()
    if "MPICH" in version:
        return MPICH()
    first = version.strip().splitlines()[0] if version.strip() else "an MPI that names nothing"
    raise UnknownVendor(f"the vendor's own algorithms are not known for this MPI ({first}); "
                        f"known: {', '.join(cls.title for cls in LIBRARIES.values())}")


@functools.lru_cache(maxsize=1)
def running() -> Library:
    """The MPI library this process runs on; UnknownVendor for one we do not know."""
    return identify(MPI.Get_library_version())


def by_key(key: str) -> Library:
    return LIBRARIES[key]()
