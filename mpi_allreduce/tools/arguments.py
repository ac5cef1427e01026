"""The command line's argument types: each checks one kind of value while
argparse parses it, so that a value a command cannot use is refused as a
usage error (one ``error:`` line naming the option, exit status 2) before
any MPI message is sent, or anything measured.  An option gets its check by
choosing its type: ``type=whole(1)`` for a positive count, ``type=size()``
for a size in bytes, ``type=output_file()`` for a file it writes, and so on.

Every type raises :class:`argparse.ArgumentTypeError`, whose message
argparse prints after the option's name.  What is wrong only in
combination (a range whose first size exceeds its last) is refused right
after parsing, through the command's ``parser.error``.

What a command finds wrong with a file only when it reads it (a trace
whose events lack their fields) it raises as :class:`ArgumentRefused`,
which the command line turns into the same usage error.

Under ``mpiexec`` every rank parses the same arguments and checks the same
paths, so every rank refuses them alike and none waits for another (a
check that could differ from rank to rank, such as the memory free now,
has no place here).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import os
import sys
import tempfile
from typing import Callable, Iterable, Optional

#: the largest message size (bytes) the commands take: 64 GiB
MAX_BYTES = 1 << 36
#: the most elements a vector of the commands may have
MAX_COUNT = 1 << 36
#: the most message sizes a size range may give
MAX_SIZES = 1000
#: the most elements ``verify --counts`` takes: every rank holds some ten
#: copies of the vector (its data, the reference, the result, the device's),
#: 2.5 GiB of complex128 at this count
MAX_VERIFY_COUNT = 1 << 24
#: the most timed (and the most warm-up) calls a size of a benchmark makes
MAX_ITERS = 1_000_000
#: the most repeats of a benchmark's whole set
MAX_REPEATS = 1000
#: the most timed calls, iterations times repeats, a benchmark keeps the
#: time of (8 bytes each, per algorithm and size)
MAX_SAMPLES = 10_000_000
#: the largest seed (numpy's generators take any, the data's seed + 1 too)
MAX_SEED = (1 << 63) - 1


class ArgumentRefused(Exception):
    """A file named on the command line that a command finds unusable only
    when it reads it (after parsing, before any MPI message): the command
    line refuses it as a usage error, naming ``option``."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


class UsageError(SystemExit):
    """A refused command line: exits with status 2, as argparse does, and
    its ``str()`` is argparse's ``error:`` line (for callers of ``main``
    in the same process, who see no stderr)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message.strip()

    def __str__(self) -> str:
        return self.message


class Parser(argparse.ArgumentParser):
    """An argument parser whose refusals raise :class:`UsageError` (its
    subcommands' parsers are of the same class)."""

    def exit(self, status: int = 0, message: Optional[str] = None):
        if message:
            self._print_message(message, sys.stderr)
        if status == 2 and message:
            raise UsageError(message)
        raise SystemExit(status)


def _named(function: Callable, name: str) -> Callable:
    """``function`` under ``name``: argparse names the type so ("invalid
    size value") where one raises ValueError instead of its own error."""
    function.__name__ = name
    return function


def whole(least: Optional[int] = None, most: Optional[int] = None,
          what: Optional[str] = None) -> Callable[[str], int]:
    """An integer from ``least`` to ``most`` (either bound may be open);
    ``what``, where given, names the value in the refusal."""
    expected = {1: "a positive integer", 0: "a non-negative integer"}.get(
        least, "an integer" if least is None else f"an integer of at least {least}")
    if most is not None:
        expected += f", at most {most}"

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            value = None
        if value is None or (least is not None and value < least) \
                or (most is not None and value > most):
            refusal = f"{what} must be {expected}" if what else f"expected {expected}"
            raise argparse.ArgumentTypeError(f"{refusal}, got {text!r}")
        return value
    return _named(parse, "integer")


def number(above: Optional[float] = None, least: Optional[float] = None,
           most: Optional[float] = None) -> Callable[[str], float]:
    """A finite number greater than ``above``, from ``least`` to ``most``."""
    bounds = [f"more than {above:g}" if above is not None else "",
              f"at least {least:g}" if least is not None else "",
              f"at most {most:g}" if most is not None else ""]
    expected = "a finite number" + "".join(f", {b}" for b in bounds if b)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not math.isfinite(value) or (above is not None and value <= above) \
                or (least is not None and value < least) or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return _named(parse, "number")


def size(least: int = 1, most: int = MAX_BYTES) -> Callable[[str], int]:
    """A size in bytes, with an optional K, M or G suffix (binary
    multiples), from ``least`` to ``most``."""
    from .bench import human, parse_size

    def parse(text: str) -> int:
        try:
            value = parse_size(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(
                f"expected a size in bytes such as 8, 64K, 16M or 1G, got {text!r}") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(
                f"expected a size from {human(least)} to {human(most)} bytes, got {text!r}")
        return value
    return _named(parse, "size")


def size_range(text: str) -> tuple[int, int]:
    """``MIN:MAX`` (or one size, both ends) -> (first, last) in bytes."""
    first, _, last = text.partition(":")
    one = size()
    lo, hi = one(first), one(last or first)
    if lo > hi:
        raise argparse.ArgumentTypeError(f"{first} is more than {last}: expected MIN:MAX "
                                         f"with MIN <= MAX")
    return lo, hi


def check_sizes(error: Callable[[str], None], first: int, last: int, factor: float,
                names: str = "-b/--minbytes, -e/--maxbytes and -f/--stepfactor") -> None:
    """Refuse a range whose first size exceeds its last, or that gives more
    than :data:`MAX_SIZES` sizes (counted without listing them)."""
    from .bench import human

    if first > last:
        error(f"{names}: the smallest size {human(first)} is more than the largest "
              f"{human(last)}")
    steps = math.log(last / first) / math.log(factor)
    if steps + 1 > MAX_SIZES:
        error(f"{names}: {human(first)} to {human(last)} bytes by a factor of {factor:g} "
              f"gives {int(steps) + 1} sizes; at most {MAX_SIZES}")


def listed(item: Callable[[str], object], what: str = "values") -> Callable[[str], list]:
    """A comma-separated list of one or more ``item`` values (each checked by
    ``item``; an empty one, as in ``1,,2``, refused), duplicates dropped."""
    def parse(text: str) -> list:
        parts = [v.strip() for v in text.split(",")]
        if not any(parts):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        if not all(parts):
            raise argparse.ArgumentTypeError(f"an empty item in {text!r}: expected "
                                             f"comma-separated {what}")
        return list(dict.fromkeys(item(v) for v in parts))
    return _named(parse, "list")


def nonempty(what: str) -> Callable[[str], str]:
    """A string that is not empty (nor only blanks)."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected {what}, got an empty string")
        return text
    return _named(parse, "text")


def one_of(choices: Iterable[str], what: str) -> Callable[[str], str]:
    """One of ``choices`` (named ``what`` in the refusal)."""
    choices = tuple(choices)

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r}; choose one of: {', '.join(choices)}")
        return text
    return _named(parse, what)


def algorithm(extra: Iterable[str] = (), exclude: Iterable[str] = ()) -> Callable[[str], str]:
    """An algorithm's name (``extra``: other names the option takes, such
    as ``auto``)."""
    from ..registry import ALGORITHMS

    exclude = tuple(exclude)
    names = tuple(extra) + tuple(a for a in ALGORITHMS if a not in exclude)
    known = one_of(names, "algorithm")

    def parse(text: str) -> str:
        if text == "auto" and text not in names:
            raise argparse.ArgumentTypeError(
                f"expected a named algorithm, not 'auto' (its choice depends on the machine); "
                f"choose one of: {', '.join(names)}")
        if text not in names and text in ALGORITHMS:
            raise argparse.ArgumentTypeError(
                f"algorithm {text!r} is not one this option takes; choose one of: "
                f"{', '.join(names)}")
        return known(text)
    return _named(parse, "algorithm")


def dtype(text: str) -> str:
    """A dtype the library reduces with the predefined ops (numpy's name,
    or an alias numpy knows, such as f4) -> numpy's name."""
    import numpy as np

    from ..ops import SUPPORTED_DTYPES

    try:
        name = np.dtype(text.strip()).name
    except (TypeError, ValueError, SyntaxError):
        name = None
    if name not in SUPPORTED_DTYPES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; choose one of: {', '.join(SUPPORTED_DTYPES)}")
    return name


def op(text: str) -> str:
    """A reduction op's name (``sum``, ``max``, ``avg`` ...)."""
    from ..ops import OPS

    return one_of(OPS, "op")(text.strip().lower())


def unwritable(path: str, directory: bool = False, make_parents: bool = False,
               beside: bool = False) -> Optional[str]:
    """Why this process could not write ``path`` (None: it can).

    A file: where it exists, a regular file this process may write (never
    a device, a pipe or a socket: a writer that renames a new file over it
    would replace a device node with a plain file); else its directory
    must be one this process may write into (with ``make_parents``, the
    nearest existing directory above it, from which the missing ones are
    made).  ``beside``: the file is written next to its target and renamed
    over it, so its directory must take a new file even where the target
    exists.  ``directory``: ``path`` is a directory to write into, made
    (with its parents) where it is missing.

    Where a new file would be made, one is made there and removed again:
    permission bits alone do not tell (root may write anywhere by them,
    yet no file can be made in ``/proc``)."""
    if not path:
        return "the name is empty"
    if os.path.exists(path):
        if directory:
            if not os.path.isdir(path):
                return "it is not a directory"
        elif os.path.isdir(path):
            return "it is a directory"
        elif not os.path.isfile(path):
            return "it is not a regular file (a device, a pipe or a socket is not replaced)"
        if not os.access(path, os.W_OK | (os.X_OK if directory else 0)):
            return "permission denied"
        if directory:
            return _cannot_make_in(path)
        if beside:
            return _cannot_make_in(os.path.dirname(os.path.abspath(path)))
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if directory or make_parents:
        while not os.path.exists(parent) and os.path.dirname(parent) != parent:
            parent = os.path.dirname(parent)
    if not os.path.exists(parent):
        return f"no directory {parent}"
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot write into {parent}: permission denied"
    return _cannot_make_in(parent)


def _cannot_make_in(directory: str) -> Optional[str]:
    """Why no file can be made in ``directory`` (None: one was made, and
    removed): the answer of the file system itself."""
    try:
        handle, probe = tempfile.mkstemp(dir=directory, prefix=".mpi_allreduce-probe-")
    except OSError as exc:
        return f"cannot make a file in {directory}: {exc.strerror or exc}"
    os.close(handle)
    try:
        os.unlink(probe)
    except OSError:
        pass
    return None


def output_file(*suffixes: str, make_parents: bool = False,
                beside: bool = False) -> Callable[[str], str]:
    """A file to write: writable now (:func:`unwritable`), named with one of
    ``suffixes`` where they are given."""
    def parse(text: str) -> str:
        if suffixes and not text.lower().endswith(suffixes):
            raise argparse.ArgumentTypeError(
                f"expected a name ending in one of {', '.join(suffixes)}, got {text!r}")
        why = unwritable(text, make_parents=make_parents, beside=beside)
        if why:
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: {why}")
        return text
    return _named(parse, "output file")


#: what a command that draws says where matplotlib is not installed
NO_MATPLOTLIB = ("drawing needs matplotlib, which is not installed "
                 "(pip install 'mpi_allreduce[plot]')")


def drawing() -> None:
    """Refuse an option that draws where matplotlib is not installed
    (looked up, not imported)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(NO_MATPLOTLIB)


def image_file(text: str) -> str:
    """A picture to write: writable, named with a suffix matplotlib writes
    (and matplotlib installed)."""
    drawing()
    formats = ()
    try:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = tuple(f".{name}" for name in FigureCanvasBase.get_supported_filetypes())
    except ImportError:  # the command says so when it draws
        pass
    return output_file(*formats)(text)


def output_directory(text: str) -> str:
    """A directory to write into (made later where it is missing)."""
    why = unwritable(text, directory=True)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: {why}")
    return text


def input_file(text: str) -> str:
    """A regular file this process can read (a device or a pipe may never
    end, or be read up by the check)."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: no such file")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: it is a directory")
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: it is not a regular file")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: permission denied")
    return text


def _not_a_trace(path: str) -> Optional[str]:
    """Why ``path`` is no trace file by its first character (None: it may
    be one; the command reads the rest): every trace is JSON, a rank's file
    an array and a merged trace an object."""
    try:
        with open(path, "rb") as f:
            head = f.read(256).lstrip()
    except OSError as exc:
        return f"cannot read {path!r}: {exc.strerror or exc}"
    if head[:1] not in (b"[", b"{"):
        return (f"{path!r} is not a trace: "
                + ("it is empty" if not head else "it is not JSON (no '[' or '{' first)"))
    return None


def trace_file(text: str) -> str:
    """A trace file (``trace``, ``bench --trace``, ``simulate --trace``):
    readable, and JSON as traces are."""
    input_file(text)
    why = _not_a_trace(text)
    if why:
        raise argparse.ArgumentTypeError(why)
    return text


def trace_input(text: str) -> str:
    """What ``trace`` merges: a rank's trace file, or a directory holding
    at least one (``rank-*.json``), each readable and JSON."""
    if not os.path.isdir(text):
        return trace_file(text)
    if not os.access(text, os.R_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: permission denied")
    from pathlib import Path

    files = sorted(str(p) for p in Path(text).glob("rank-*.json"))
    if not files:
        raise argparse.ArgumentTypeError(f"no rank-*.json trace files in {text!r}")
    for path in files:
        trace_file(path)
    return text


def bench_results(text: str) -> str:
    """A ``bench --json`` file: readable, its results and metadata as
    ``plot`` reads them (such files are small: read here whole)."""
    from .bench import load_results

    input_file(text)
    try:
        load_results([text])
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def device(text: str) -> str:
    """Where the buffers live: ``cpu``, or ``cuda`` where cupy is installed
    (looked up, not imported: importing it takes seconds and starts CUDA)."""
    name = one_of(("cpu", "cuda"), "device")(text.strip().lower())
    if name == "cuda" and importlib.util.find_spec("cupy") is None:
        raise argparse.ArgumentTypeError(
            "'cuda' needs cupy, which is not installed (pip install 'mpi_allreduce[gpu]'); "
            "or use --device cpu")
    return name


def params_file(text: str) -> str:
    """A ``model --json`` file or a machine description: readable, with
    machine parameters (and a network) the simulator takes."""
    from ..simulate import Machine

    input_file(text)
    try:
        Machine.load(text)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a `model --json` file or machine description: "
            f"{type(exc).__name__}: {exc}") from None
    return text


def measured_file(text: str) -> str:
    """A CSV of measured times (:mod:`~mpi_allreduce.tools.measured`):
    readable, its columns there and its numbers numbers."""
    from .measured import read_rows

    input_file(text)
    try:
        read_rows(text)
    except (OSError, ValueError, UnicodeDecodeError, csv.Error) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def placement_value(text: str):
    """``block``, ``round_robin``, or a file naming every rank's node
    (whitespace-separated whole numbers from 0): the file's list."""
    from ..network import PLACEMENTS

    if text in PLACEMENTS:
        return text
    input_file(text)
    try:
        with open(text) as f:
            nodes = [int(word) for word in f.read().split()]
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {', '.join(PLACEMENTS)}, or a file of every rank's node (whole numbers "
            f"from 0): {exc}") from None
    if not nodes or min(nodes) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: every rank's node, whole numbers from 0")
    return nodes
