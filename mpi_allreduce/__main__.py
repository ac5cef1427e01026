"""Command line: ``python -m mpi_allreduce
{verify,bench,simulate,draw,trace,report,plot,model,tune,info}``, under
mpiexec or srun (``draw``, ``trace``, ``report``, ``plot`` and ``simulate``
need neither).

An argument a command cannot use is refused as argparse refuses one: a
usage line and one ``error:`` line naming the option, exit status 2, on
every rank alike and before any MPI message is sent or anything measured
(every option's type checks its value, :mod:`mpi_allreduce.tools.arguments`;
what is wrong only in combination is checked right after parsing).  So is
a file named on the command line whose fault only reading it shows (a
trace whose events lack their fields), and a value of an ``MPI_ALLREDUCE_*``
setting the library refuses (read before the command runs), naming the
variable.  Past that, an exception on any rank aborts the whole job
(``MPI.COMM_WORLD.Abort``) instead of leaving the other ranks waiting in a
message.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback

from mpi4py import MPI

from . import trace
from .tools.arguments import (MAX_COUNT, MAX_ITERS, MAX_REPEATS, MAX_SAMPLES, MAX_SEED,
                              MAX_VERIFY_COUNT, ArgumentRefused, Parser, algorithm,
                              bench_results, check_sizes, device, dtype, image_file, listed,
                              measured_file, nonempty, number, op, output_directory, output_file,
                              params_file, placement_value, size, size_range, trace_file,
                              trace_input, unwritable, whole)

#: the most ranks ``simulate`` runs, and ``--predict`` predicts for
MAX_SIMULATED_RANKS = 65536
#: the most ranks, and elements, ``draw`` draws
MAX_DRAWN = 4096


def _inner():
    """--inner's type: the leaders' algorithm, or auto."""
    return algorithm(extra=("auto",), exclude=("hierarchical",))


def _vendor_list(text: str) -> str:
    """--vendor-algorithms' type: all, or comma-separated names or numbers
    (which the running library has is checked after parsing)."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9_]+(,[A-Za-z0-9_]+)*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not 'all' or comma-separated "
                                         "algorithm names or numbers")
    return text


def _hierarchy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks-per-node", type=whole(1, 1 << 31), default=None,
                        help="hierarchical: emulate nodes of this many consecutive ranks")
    parser.add_argument("--inner", type=_inner(), default=None,
                        help="hierarchical: algorithm across node leaders (default auto)")
    parser.add_argument("--segment-bytes", type=size(1, 1 << 40), default=None,
                        help="bytes per message at most where the data is reduced, "
                             "e.g. 256K (default 1 MiB)")
    _shape_args(parser)


def _shape_args(parser: argparse.ArgumentParser) -> None:
    """The options of the radix-k algorithms and of the torus (each goes
    to the algorithms that take it: :func:`~mpi_allreduce.options.keywords_for`)."""
    parser.add_argument("--radix", type=whole(2, 1 << 31), default=None,
                        help="recursive_multiplying, knomial: ranks in a group (default 4)")
    parser.add_argument("--row-size", type=whole(1, 1 << 31), default=None,
                        help="torus: ranks in a row of its grid, a divisor of the ranks "
                             "(default: the divisor nearest their square root)")


def _shape_options(args, name: str) -> dict:
    """--radix and --row-size, where given and taken by algorithm ``name``."""
    from .options import keywords_for

    given = {"radix": args.radix, "row_size": args.row_size}
    return keywords_for({k: v for k, v in given.items() if v is not None}, "allreduce", name)


def _algorithms_run(algorithms) -> tuple:
    """The algorithms a command runs, from its -a (None or 'all': every one)."""
    from .registry import ALGORITHMS

    return tuple(ALGORITHMS if algorithms is None or "all" in algorithms else algorithms)


#: the command line's options that some algorithms take, and their keywords
_ALGORITHM_OPTIONS = {"--ranks-per-node": "ranks_per_node", "--inner": "inner",
                      "--radix": "radix", "--row-size": "row_size"}


def _check_taken(args, error, algorithms, placing: bool = False) -> None:
    """An option of some algorithms (--radix, --inner, ...) given where none
    of the algorithms run takes it is refused: it would be ignored, and the
    run would not be the one asked for (``placing``: --ranks-per-node also
    places ranks on a network's nodes, as simulate's does)."""
    from .options import algorithms_taking

    names = _algorithms_run(algorithms)
    for flag, name in _ALGORITHM_OPTIONS.items():
        if getattr(args, name, None) is None or (placing and name == "ranks_per_node"):
            continue
        users = algorithms_taking(name)
        if not set(users) & set(names):
            error(f"{flag} is an option of {' and '.join(users)}; none of the algorithms "
                  f"run ({', '.join(names)}) takes it")


def _check_row_size(args, error, ranks: int, algorithms) -> None:
    """--row-size must divide the ranks the torus runs on (where it runs)."""
    if args.row_size is not None and "torus" in _algorithms_run(algorithms) \
            and ranks % args.row_size:
        divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
        error(f"--row-size {args.row_size} does not divide the {ranks} ranks into rows; "
              f"choose one of {', '.join(map(str, divisors))}")


def _size_args(parser: argparse.ArgumentParser, maxbytes: str, factor: float) -> None:
    """-b, -e and -f: the message sizes from -b to -e, each -f times the last."""
    parser.add_argument("-b", "--minbytes", type=size(), default="8",
                        help="smallest size (default 8)")
    parser.add_argument("-e", "--maxbytes", type=size(), default=maxbytes,
                        help=f"largest size (default {maxbytes})")
    parser.add_argument("-f", "--stepfactor", type=number(above=1), default=factor,
                        help=f"size factor, more than 1 (default {factor:g})")


def _trace_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=output_directory, default=None, metavar="DIR",
                        help="record every call of ours (MPI_ALLREDUCE_TRACE) and write the "
                             "run's merged trace to DIR/trace.json (Chrome trace format); "
                             "recording adds time to every call")


def _read_settings(args, error) -> None:
    """The library's settings, read before the command sends any message:
    ``--segment-bytes`` and ``--trace`` of bench and verify set theirs
    first.  A value the library refuses, from the environment or from
    those options, is a usage error naming the variable (or the option);
    the trace directory is made here."""
    from .config import TRACE_ENV, SettingError, environment, refresh

    traced = args.command in ("bench", "verify") and args.trace is not None
    if args.command in ("bench", "verify"):
        _segment_setting(args)
    if traced:
        os.environ[TRACE_ENV] = args.trace
    refresh()
    try:
        environment()
    except SettingError as exc:
        where = "--trace" if traced and str(exc).startswith(TRACE_ENV + "=") else "environment"
        error(f"{where}: {exc}")


def _end_trace(args, comm) -> None:
    if args.trace is None:
        return
    from .trace import collect

    path = collect(comm, os.path.join(args.trace, "trace.json"),
                   {"command": " ".join(["python -m mpi_allreduce"] + sys.argv[1:])})
    if path:
        print(f"# trace: {path} (python -m mpi_allreduce report {path})", flush=True)


def _options(args) -> dict:
    options = {}
    if args.ranks_per_node is not None:
        options["ranks_per_node"] = args.ranks_per_node
    if args.inner is not None:
        options["inner"] = args.inner
    for name in ("radix", "row_size"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return options


def _segment_setting(args) -> None:
    """--segment-bytes sets the environment variable the library reads."""
    if args.segment_bytes is not None:
        from .config import SEGMENT_ENV, refresh

        os.environ[SEGMENT_ENV] = str(args.segment_bytes)
        refresh()


def build_parser() -> argparse.ArgumentParser:
    from . import ALGORITHMS
    from .ops import OPS, SUPPORTED_DTYPES
    from .tools.bench import VENDOR
    from .tools.draw import FORMATS

    parser = Parser(prog="python -m mpi_allreduce", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="compare every algorithm with MPI.Allreduce")
    v.add_argument("-a", "--algorithms", type=listed(algorithm(), "algorithms"),
                   default=list(ALGORITHMS),
                   help=f"comma-separated (default: {','.join(ALGORITHMS)})")
    v.add_argument("-d", "--dtypes", type=listed(dtype, "dtypes"), default=None,
                   help="comma-separated (default: every dtype the device's arrays hold: "
                        f"{','.join(SUPPORTED_DTYPES)} on the CPU)")
    v.add_argument("-o", "--ops", type=listed(op, "ops"), default=list(OPS))
    v.add_argument("--counts", type=listed(whole(0, MAX_VERIFY_COUNT), "element counts"),
                   default=None,
                   help="comma-separated element counts (default: 0, 1, p-1, p, p+1, primes, "
                        f"2^k+-1); at most {MAX_VERIFY_COUNT}, as every rank holds some ten "
                        "copies of the vector")
    v.add_argument("--no-large", action="store_true", help="skip the ~1M-element cases")
    v.add_argument("--seed", type=whole(0, MAX_SEED), default=2026)
    _trace_arg(v)
    _device_arg(v)
    _hierarchy_args(v)

    b = sub.add_parser("bench", help="time the algorithms and MPI.Allreduce side by side")
    b.add_argument("-m", "--message-sizes", type=size_range, default=None, metavar="MIN:MAX",
                   help="size range, e.g. 8:64M (factor -f)")
    _size_args(b, "64M", 2.0)
    b.add_argument("-n", "--iters", type=whole(1, MAX_ITERS), default=20,
                   help=f"timed iterations (fewer above 1 MiB; at most {MAX_ITERS}, and "
                        f"-n times -r at most {MAX_SAMPLES})")
    b.add_argument("-w", "--warmup", type=whole(0, MAX_ITERS), default=5,
                   help=f"untimed warm-up calls (at most {MAX_ITERS})")
    b.add_argument("-r", "--repeats", type=whole(1, MAX_REPEATS), default=1,
                   help=f"repeat the whole set interleaved; report medians (at most "
                        f"{MAX_REPEATS})")
    b.add_argument("-d", "--dtype", type=dtype, default="float32")
    b.add_argument("-o", "--op", type=op, default="sum")
    b.add_argument("-a", "--algorithms", type=listed(algorithm(extra=("auto", VENDOR)),
                                                     "algorithms"), default=None,
                   help="comma-separated; 'mpi' (MPI.Allreduce) is always added; default: all + auto")
    b.add_argument("--vendor-algorithms", nargs="?", const="all", default=None, metavar="LIST",
                   type=_vendor_list,
                   help="also time the vendor's own all-reduce algorithms, each forced through "
                        "its library's control (Open MPI, MPICH; rows mpi:<name>): all, or "
                        "comma-separated names or numbers")
    b.add_argument("--label-vendor", default=None, type=nonempty("a name"),
                   help="name for the MPI.Allreduce rows (default: mpi, or mpi:<name> / "
                        "mpi:tuned for the vendor's algorithm or tuning file in force at launch)")
    b.add_argument("-i", "--inplace", choices=["no", "yes", "both"], default="no")
    b.add_argument("-c", "--check", action="store_true", help="count wrong elements (#wrong)")
    b.add_argument("--memory", action="store_true",
                   help="record plan scratch bytes and allocations in a steady-state call")
    b.add_argument("--json", type=output_file(), default=None,
                   help="write results and metadata as JSON")
    b.add_argument("--csv", type=output_file(), default=None,
                   help="write results as CSV (metadata in a # line)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    _trace_arg(b)
    _device_arg(b)
    _hierarchy_args(b)

    si = sub.add_parser("simulate", help="run every rank's schedule in one process, no MPI: "
                                         "#wrong, messages and bytes per rank")
    si.add_argument("-p", "--size", type=whole(1, MAX_SIMULATED_RANKS), default=1024,
                    help=f"virtual ranks (default 1024, at most {MAX_SIMULATED_RANKS})")
    si.add_argument("-a", "--algorithms", type=listed(algorithm(extra=("all",)), "algorithms"),
                    default=["all"], help="comma-separated (default: all)")
    si.add_argument("--count", type=whole(0, MAX_COUNT), default=4099,
                    help="elements per rank (default 4099; every rank's fit in this process's "
                         "memory)")
    si.add_argument("-d", "--dtype", type=dtype, default="float32")
    si.add_argument("-o", "--op", type=op, default="sum")
    si.add_argument("--in-place", action="store_true")
    si.add_argument("--params", type=params_file, default=None,
                    help="a `model --json` file or a machine description (with its network: "
                         "docs/topologies.md): also predict the time on that machine")
    si.add_argument("--placement", type=placement_value, default="block",
                    help="with a --params network: ranks on nodes, block (--ranks-per-node "
                         "consecutive ranks a node, default 1), round_robin, or a file of "
                         "every rank's node")
    si.add_argument("--measured", type=measured_file, default=None, metavar="TABLE.csv",
                    help="with --params: predict every row of this table of measured times "
                         "(algorithm,nodes,ranks_per_node,bytes,microseconds,source) and print "
                         "predicted, measured, their ratio, and the share within 25%%")
    si.add_argument("--fit-on", type=listed(algorithm(), "algorithms"), default=(),
                    help="--measured: fit alpha_inter, beta_inter and gamma on the rows of "
                         "these algorithms first, comma-separated (their rows are then left "
                         "out of the summary)")
    si.add_argument("--predict", action="store_true",
                    help="with --params: predicted time of every algorithm for each of --ranks "
                         "and each size (closed forms, up to 65536 ranks; --ranks-per-node to a "
                         "node, default 1), the crossovers, optionally --png and --json")
    si.add_argument("--ranks", type=listed(whole(1, MAX_SIMULATED_RANKS), "rank counts"),
                    default="2,4,16,64,256,1024,4096,16384,65536",
                    help="--predict: comma-separated rank counts")
    _size_args(si, "256M", 8.0)
    si.add_argument("--png", type=image_file, default=None,
                    help="--predict: write the plot here")
    si.add_argument("--json", type=output_file(), default=None,
                    help="--predict or --measured: write the rows here (--measured: with the "
                         "machine they ran on, a description --params reads)")
    si.add_argument("--trace", type=output_file(make_parents=True, beside=True), default=None,
                    metavar="FILE.json",
                    help="one algorithm: write its predicted timeline in the Chrome trace "
                         "format of real traces (on the --params machine; else every message "
                         "takes 1 us and local work none)")
    _hierarchy_args(si)

    dr = sub.add_parser("draw", help="an algorithm round by round, drawn from its schedules "
                                     "(no MPI): PNG/SVG/PDF panels or an animated GIF")
    dr.add_argument("-a", "--algorithm", type=algorithm(), required=True,
                    help="one algorithm (see `info`)")
    # (the values named as draw.contributions names them)
    dr.add_argument("-p", "--size", type=whole(1, MAX_DRAWN, "the number of ranks"),
                    required=True, help=f"ranks (at most {MAX_DRAWN})")
    dr.add_argument("--count", type=whole(0, MAX_DRAWN, "count"), default=None,
                    help=f"elements of the vector (default: one a rank; at most {MAX_DRAWN})")
    dr.add_argument("--segment", type=whole(1, MAX_DRAWN, "segment_size"), default=None,
                    help=f"elements a message carries at most (default: all; at most "
                         f"{MAX_DRAWN})")
    dr.add_argument("--ranks-per-node", type=whole(1, MAX_DRAWN), default=None,
                    help="hierarchical: ranks of a node (default: half the ranks, two nodes; "
                         f"at most {MAX_DRAWN})")
    dr.add_argument("--inner", type=_inner(), default=None,
                    help="hierarchical: algorithm across node leaders (default auto)")
    _shape_args(dr)
    dr.add_argument("-o", "--output", type=output_file(*FORMATS), default=None,
                    help="file to write, .png .svg .pdf or .gif (default ALGORITHM-pP.png)")

    tr = sub.add_parser("trace", help="merge the per-rank files of MPI_ALLREDUCE_TRACE=DIR "
                                      "into one trace")
    tr.add_argument("inputs", type=trace_input, nargs="+",
                    help="the trace directory, or rank-*.json files")
    tr.add_argument("-o", "--output", type=output_file(make_parents=True, beside=True),
                    default=None,
                    help="default: DIR/trace.json")

    rp = sub.add_parser("report", help="where a trace's time went: waiting for messages, "
                                       "reducing, copying, the rest; per algorithm and round kind")
    rp.add_argument("trace", type=trace_file,
                    help="a trace file (trace, bench --trace, simulate --trace)")
    rp.add_argument("-o", "--output", type=image_file, default=None,
                    help="also draw it into this PNG, with the trace's last call")
    rp.add_argument("--against", type=trace_file, default=None, metavar="TRACE",
                    help="draw this trace's last call beside it (e.g. simulate --trace's "
                         "prediction of the same call)")

    pl = sub.add_parser("plot", help="latency and busbw against size from bench JSON files")
    pl.add_argument("inputs", type=bench_results, nargs="+",
                    help="bench --json files (merged)")
    pl.add_argument("-o", "--output", type=image_file, default="bench.png")
    pl.add_argument("--title", default=None)

    mo = sub.add_parser("model", help="fit alpha/beta/gamma and compare predicted with measured")
    _size_args(mo, "16M", 8.0)
    mo.add_argument("-n", "--iters", type=whole(1, MAX_ITERS), default=20)
    mo.add_argument("-r", "--repeats", type=whole(1, MAX_REPEATS), default=3)
    mo.add_argument("--json", type=output_file(), default=None)
    mo.add_argument("--two-level", action="store_true",
                    help="fit intra- and inter-node links separately (ranks on several nodes)")

    tu = sub.add_parser("tune", help="measure and write the decision table 'auto' uses")
    tu.add_argument("-o", "--output", type=output_file(), default=None,
                    help="write the table here (default: where auto finds it by itself, one "
                         "file per MPI library, machine and ranks per node, under "
                         "MPI_ALLREDUCE_TUNING_DIR)")
    _size_args(tu, "64M", 4.0)
    tu.add_argument("-n", "--iters", type=whole(1, MAX_ITERS), default=20)
    tu.add_argument("-r", "--repeats", type=whole(1, MAX_REPEATS), default=7)
    tu.add_argument("--merge", action="store_true",
                    help="keep the rules for other communicator sizes already in the output file")
    tu.add_argument("--export", choices=("openmpi", "mpich", "impi"), default=None,
                    help="write this vendor MPI's own tuning file to -o FILE instead: its "
                         "algorithms are timed here (Open MPI, MPICH) or read from --from files")
    tu.add_argument("--from", dest="sources", type=bench_results, nargs="+", default=None,
                    metavar="JSON", help="with --export: bench --vendor-algorithms JSON files "
                                         "to choose from instead of timing")

    info = sub.add_parser("info", help="MPI library, communicator layout, GPU path")
    _device_arg(info)
    info.add_argument("--settings", action="store_true",
                      help="print the table of environment variables (Markdown) and exit")
    return parser


def _check_sizes(args, error) -> None:
    """-b, -e and -f (or -m and -f) together: a range of a sane number of sizes."""
    if getattr(args, "message_sizes", None):
        check_sizes(error, *args.message_sizes, args.stepfactor,
                    "-m/--message-sizes and -f/--stepfactor")
    else:
        check_sizes(error, args.minbytes, args.maxbytes, args.stepfactor)


def _check_timing(args, error) -> None:
    """-n and -r together: the time of every timed call is kept, so a sane
    number of them."""
    if args.iters * args.repeats > MAX_SAMPLES:
        error(f"-n/--iters {args.iters} times -r/--repeats {args.repeats} is "
              f"{args.iters * args.repeats} timed calls a size; at most {MAX_SAMPLES}")


def _check_measured(args, error) -> None:
    """model and tune: the sizes, and the timed calls."""
    _check_sizes(args, error)
    _check_timing(args, error)


def _check_dtype_op(args, error) -> None:
    """-d and -o together: an op defined for the dtype."""
    import numpy as np

    from .ops import check_dtype, resolve_op

    try:
        check_dtype(np.dtype(args.dtype), resolve_op(args.op))
    except TypeError as exc:
        error(f"-d/--dtype {args.dtype} with -o/--op {args.op}: {exc}")


def _check_vendor(args, error) -> None:
    """bench: the vendor settings in force at launch (a forced algorithm the
    library would refuse or ignore, a tuning file it cannot read), and the
    algorithms of --vendor-algorithms, before anything is timed."""
    from . import vendor

    args.vendor, args.vendor_label, args.vendor_chosen = None, None, []
    try:
        args.vendor = vendor.running()
    except vendor.UnknownVendor as exc:
        if args.vendor_algorithms is not None:
            error(f"--vendor-algorithms: {exc}")
        return
    try:
        args.vendor_label = args.vendor.in_force()
        if args.vendor_algorithms is None:
            return
        args.vendor.require_in_process()
        names = [a.name for a in args.vendor.algorithms()] \
            if args.vendor_algorithms == "all" else args.vendor_algorithms.split(",")
        chosen = [args.vendor.algorithm(n.strip()) for n in names]
    except vendor.VendorSettingError as exc:
        error(f"{'--vendor-algorithms' if args.vendor_algorithms else 'environment'}: {exc}")
    args.vendor_chosen = list(dict.fromkeys(chosen))


def _check_bench(args, error) -> None:
    _check_measured(args, error)
    _check_dtype_op(args, error)
    _check_vendor(args, error)
    _check_held(args, error, "-d/--dtype", [args.dtype])
    _check_taken(args, error, args.algorithms)
    _check_row_size(args, error, MPI.COMM_WORLD.Get_size(), args.algorithms)
    if args.json and args.json == args.csv:
        error(f"--json and --csv both name {args.json!r}")


def _check_held(args, error, option: str, dtypes) -> None:
    """Refuse dtypes the device's arrays cannot hold (cupy's long double)."""
    from .backend import held_on

    lacking = [d for d in dtypes if d not in held_on(args.device, dtypes)]
    if lacking:
        error(f"argument {option}: {args.device} arrays cannot hold {', '.join(lacking)} "
              "(cupy has no long double); leave it out or use --device cpu")


def _check_verify(args, error) -> None:
    from .backend import held_on
    from .ops import SUPPORTED_DTYPES

    _check_taken(args, error, args.algorithms)
    _check_row_size(args, error, MPI.COMM_WORLD.Get_size(), args.algorithms)
    if args.dtypes is None:  # (every dtype the device's arrays hold)
        args.dtypes = held_on(args.device, SUPPORTED_DTYPES)
    _check_held(args, error, "-d/--dtypes", args.dtypes)
    _check_pairs(args, error)


def _check_pairs(args, error) -> None:
    """-d and -o of verify: some op defined for some dtype (pairs that are
    not are left out; none at all would verify no reduction).  maxloc on
    the CPU verifies the pair types and a user-defined op whatever -d says."""
    import numpy as np

    from .ops import check_dtype, resolve_op

    if args.device == "cpu" and "maxloc" in args.ops:
        return
    for name in args.dtypes:
        for op_name in args.ops:
            try:
                check_dtype(np.dtype(name), resolve_op(op_name))
                return
            except TypeError:
                continue
    error(f"-d/--dtypes {','.join(args.dtypes)} with -o/--ops {','.join(args.ops)}: no op "
          "is defined for any of the dtypes")


def _check_simulate(args, error) -> None:
    _check_sizes(args, error)
    _check_dtype_op(args, error)
    if "all" in args.algorithms and len(args.algorithms) > 1:
        error("-a/--algorithms: 'all' stands alone, or name the algorithms")
    _check_taken(args, error, args.algorithms, placing=True)
    if not args.predict:
        _check_row_size(args, error, args.size, args.algorithms)
    if args.placement != "block":
        from .simulate import Machine

        if not args.params or Machine.load(args.params).network is None:
            error("--placement: ranks are placed on a network's nodes: give --params a "
                  "machine description with a network")
    if args.measured:
        if not args.params:
            error("--measured needs --params (a machine description)")
        if args.predict or args.trace:
            error("--measured: not with --predict or --trace")
        return
    if args.fit_on:
        error("--fit-on goes with --measured")
    if args.predict:
        if not args.params:
            error("--predict needs --params (a `model --json` file)")
        if args.trace:
            error("--predict and --trace: one or the other")
    else:
        for name in ("png", "json"):
            if getattr(args, name):
                error(f"--{name} goes with --predict")
    if args.trace and (len(args.algorithms) != 1 or args.algorithms[0] == "all"):
        error("--trace: name one algorithm with -a/--algorithms")
    if not args.predict and not args.trace:
        _check_simulated_memory(args, error)
    if args.predict:
        _check_predicted_memory(args, error)


def _check_predicted_memory(args, error) -> None:
    """--predict: the memory of the simulations the predictions run (the
    algorithms without a closed form, and the double binary tree), known
    before any runs (:func:`~mpi_allreduce.tools.scale.memory_needed`):
    above what is available, a usage error naming what lowers it."""
    from .api import DEFAULT_SEGMENT_BYTES
    from .tools.scale import memory_needed

    need = memory_needed(args.ranks, _size_range(args), args.ranks_per_node or 1,
                         args.segment_bytes or DEFAULT_SEGMENT_BYTES)
    _within_memory(args, error, need, "--ranks and -e/--maxbytes: predicting",
                   "simulating what has no closed form",
                   "use fewer ranks (--ranks) or a shorter largest size (-e/--maxbytes)")


def _within_memory(args, error, need: int, what: str, why: str, lower: str) -> None:
    """Keep (``need``, what is available) for the run's memory line; above
    what is available, a usage error: "``what`` needs about N in this
    process (``why``), and M is available; ``lower``"."""
    from . import simulate

    args.memory = (need, simulate.available_memory())
    have = args.memory[1]
    if have is not None and need > have:
        error(f"{what} needs about {simulate.memory_text(need)} in this process ({why}), and "
              f"{simulate.memory_text(have)} is available; {lower}")


def _check_simulated_memory(args, error) -> None:
    """The algorithms simulate runs (``all``: :func:`~mpi_allreduce.simulate.default_algorithms`,
    those whose memory grows as p^2 left out above their number of ranks)
    and the memory the largest of them needs in this process, estimated
    before any schedule is made (:func:`~mpi_allreduce.simulate.footprint`):
    above what is available, a usage error that names what lowers it."""
    from . import simulate

    if args.algorithms == ["all"]:
        run, args.left_out = simulate.default_algorithms(args.size)
        args.run = list(run)
    else:
        args.run, args.left_out = list(args.algorithms), ()
    segment = _simulated_segment(args)
    have = simulate.available_memory()
    buffers = simulate.Footprint(args.size).bytes(args.count, args.dtype)
    if have is not None and buffers > have:  # (at once, without a schedule counted)
        error(f"-p/--size and --count: {args.size} ranks of {args.count} {args.dtype} elements "
              f"need at least {simulate.memory_text(buffers)} in this process, and "
              f"{simulate.memory_text(have)} is available; use fewer ranks (-p/--size) or "
              "elements (--count)")
    needs = {name: simulate.memory_needed(name, args.size, args.count, args.dtype, segment,
                                          _simulated_options(args, name))
             for name in args.run}
    args.memory = (max(needs.values()), max(needs, key=needs.get), have)
    need, largest, _ = args.memory
    if have is None or need <= have:
        return
    fitting = [name for name in args.run if needs[name] <= have]
    what = (f"simulating {args.size} ranks of {args.count} {args.dtype} elements needs about "
            f"{simulate.memory_text(need)} in this process ({largest}; the algorithms run one "
            f"at a time), and {simulate.memory_text(have)} is available")
    if fitting and len(fitting) < len(args.run):
        error(f"-a/--algorithms: {what}; leave out "
              f"{', '.join(n for n in args.run if n not in fitting)} (-a {','.join(fitting)}), "
              "or use fewer ranks (-p/--size) or elements (--count)")
    error(f"-p/--size and --count: {what}; use fewer ranks (-p/--size) or elements (--count)")


def _simulated_segment(args) -> int:
    """simulate's segment in elements: --segment-bytes (default 1 MiB) of --dtype."""
    import numpy as np

    return max(1, (args.segment_bytes or (1 << 20)) // np.dtype(args.dtype).itemsize)


def _default_drawing(args) -> str:
    return f"{args.algorithm}-p{args.size}.png"


def _default_merged(args) -> str:
    first = args.inputs[0]
    return os.path.join(first if os.path.isdir(first) else os.path.dirname(first), "trace.json")


def _check_default_output(args, error, default) -> None:
    """No -o: the file written by default, writable now."""
    if args.output is None:
        output = default(args)
        why = unwritable(output)
        if why:
            error(f"-o/--output: cannot write the default {output!r}: {why}")


def _check_draw(args, error) -> None:
    from .tools.arguments import NO_MATPLOTLIB

    if importlib.util.find_spec("matplotlib") is None:
        error(NO_MATPLOTLIB)
    _check_default_output(args, error, _default_drawing)
    _check_taken(args, error, [args.algorithm])
    _check_row_size(args, error, args.size, [args.algorithm])
    _check_drawn_memory(args, error)


def _drawn_options(args) -> dict:
    """draw's options: hierarchical on two nodes unless --ranks-per-node,
    --inner; --radix and --row-size where the algorithm takes them."""
    options = {}
    if args.algorithm == "hierarchical":
        options["ranks_per_node"] = args.ranks_per_node or max(1, -(-args.size // 2))
        if args.inner:
            options["inner"] = args.inner
    options.update(_shape_options(args, args.algorithm))
    return options


def _check_drawn_memory(args, error) -> None:
    """The memory the drawing needs, estimated before any schedule is made
    (:func:`~mpi_allreduce.tools.draw.memory_needed`): above what is
    available, a usage error naming what lowers it."""
    from .tools.draw import memory_needed

    need = memory_needed(args.algorithm, args.size, args.count, args.segment,
                         _drawn_options(args), args.output or _default_drawing(args))
    _within_memory(args, error, need,
                   f"-p/--size and --count: drawing {args.algorithm} on {args.size} ranks of "
                   f"{args.size if args.count is None else args.count} elements",
                   "a frame of every rank's vector per round, and the picture",
                   "use fewer ranks (-p/--size) or elements (--count)")


def _check_trace(args, error) -> None:
    _check_default_output(args, error, _default_merged)


def _check_tune(args, error) -> None:
    from . import vendor
    from .tools.tune import existing_table

    _check_measured(args, error)
    if args.sources and not args.export:
        error("--from goes with --export")
    if args.export:
        kind = args.export
        if args.output is None or args.merge:
            error("--export writes the vendor's file to -o FILE (no --merge)")
        args.library = vendor.by_key(kind)
        if not args.sources:
            try:
                running = vendor.running()
            except vendor.UnknownVendor as exc:
                error(f"--export: {exc}")
            if running.key != kind:
                error(f"--export {kind}: this run is under {running.title}; time under "
                      f"{args.library.title}, or give its bench --vendor-algorithms files "
                      "with --from")
            try:
                running.require_in_process()
                in_force = running.in_force()
                if in_force != vendor.VENDOR:
                    raise vendor.VendorSettingError(
                        f"a vendor setting is in force ({in_force}): tune the library's own "
                        "choice without it")
            except vendor.VendorSettingError as exc:
                error(f"--export: {exc}")
    if args.output is not None and args.merge:
        try:
            existing_table(args.output)
        except ValueError as exc:
            error(f"-o/--output with --merge: {exc}")


#: the checks of a command's values together, run right after parsing
#: with the command parser's ``error``
CHECKS = {"verify": _check_verify, "bench": _check_bench, "simulate": _check_simulate,
          "draw": _check_draw, "trace": _check_trace, "model": _check_measured,
          "tune": _check_tune}


def _device_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=device, default="cpu",
                        help="where the buffers live: numpy (cpu) or cupy (cuda, where cupy "
                             "is installed; one GPU per local rank, modulo the visible GPUs)")


def _size_range(args) -> list[int]:
    from .tools.bench import sizes_between

    lo, hi = getattr(args, "message_sizes", None) or (args.minbytes, args.maxbytes)
    return sizes_between(lo, hi, args.stepfactor)


def cmd_bench(args) -> int:
    from .tools import bench

    comm = MPI.COMM_WORLD
    algorithms = args.algorithms or (list(bench.default_algorithms()[1:]) + ["auto"])
    algorithms = [bench.VENDOR] + [a for a in algorithms if a != bench.VENDOR]
    modes = {"no": (False,), "yes": (True,), "both": (False, True)}[args.inplace]
    where = _selected_device(comm, args.device)
    with bench.vendor_forcings(comm, args.vendor, args.vendor_chosen) as forcings:
        algorithms[1:1] = list(forcings)
        results = bench.bench(comm, _size_range(args), algorithms, args.dtype, args.op,
                              args.iters, args.warmup, modes, args.check, args.repeats,
                              _options(args), progress=not args.quiet, memory=args.memory,
                              device=args.device, forcings=forcings)
    label = args.label_vendor or args.vendor_label or bench.VENDOR
    for r in results:
        if r.algorithm == bench.VENDOR:
            r.algorithm = label
    meta = bench.metadata(comm, " ".join(["python -m mpi_allreduce"] + sys.argv[1:]),
                          args.iters, args.warmup, args.repeats)
    meta["device"] = where
    if args.vendor is not None:
        meta["vendor"] = {"library": args.vendor.key, "default_row": label,
                          "forced": {a.label: " ".join(f"{k}={v}" for k, v in
                                                       args.vendor.force_env(a).items())
                                     for a in args.vendor_chosen}}
    if comm.Get_rank() == 0:
        print(bench.table(results, meta), flush=True)
        if args.json:
            bench.write_json(args.json, results, meta)
        if args.csv:
            bench.write_csv(args.csv, results, meta)
    _end_trace(args, comm)
    wrong = sum(r.wrong or 0 for r in results)
    return 1 if wrong else 0


def cmd_plot(args) -> int:
    from .tools.plot import plot

    plot(args.inputs, args.output, args.title)
    print(f"wrote {args.output}")
    return 0


def cmd_draw(args) -> int:
    from .simulate import memory_text
    from .tools.draw import contributions, draw

    output = args.output or _default_drawing(args)
    options = _drawn_options(args)
    need, have = args.memory
    print(f"# memory: about {memory_text(need)} estimated"
          + ("" if have is None else f" ({memory_text(have)} available)"), flush=True)
    try:
        drawing = contributions(args.algorithm, args.size, args.count, args.segment, options)
        panels = draw(drawing, output)
    except ValueError as exc:
        raise SystemExit(f"draw: {exc}") from None
    print(f"wrote {output}: {panels} panels ({len(drawing.frames) - 1} rounds and the result), "
          f"{len(drawing.messages)} messages")
    return 0


def cmd_trace(args) -> int:
    from .tools.traces import load, merge, validate
    from .trace import TraceError

    output = args.output or _default_merged(args)
    try:
        merge(args.inputs, output)
        counts = validate(load(output))
    except TraceError as exc:
        raise ArgumentRefused("inputs", str(exc)) from None
    print(f"wrote {output}: {counts.get('call', 0)} calls, {counts.get('round', 0)} rounds, "
          f"{counts.get('messages', 0)} messages")
    return 0


def cmd_report(args) -> int:
    from .tools.traces import read, report
    from .trace import TraceError

    docs = []
    for option, path in (("trace", args.trace), ("--against", args.against)):
        try:
            docs.append(None if path is None else read(path))
        except TraceError as exc:
            raise ArgumentRefused(option, str(exc)) from None
    print(report(args.trace, args.output, args.against, docs=tuple(docs)))
    if args.output:
        print(f"wrote {args.output}")
    return 0


def cmd_model(args) -> int:
    from .tools.model import report

    if MPI.COMM_WORLD.Get_size() < 2:  # (the same on every rank: before any message)
        raise ArgumentRefused("model", "fitting alpha and beta needs at least 2 ranks: run "
                                       "it under mpiexec -n 2 (or more)")
    return report(MPI.COMM_WORLD, _size_range(args), args.iters, args.json, args.two_level,
                  args.repeats)


def cmd_tune(args) -> int:
    from .tools.tune import export, tune

    if args.export:
        return export(MPI.COMM_WORLD, args.library, args.output, _size_range(args),
                      args.iters, args.repeats, args.sources)
    return tune(MPI.COMM_WORLD, _size_range(args), args.iters, args.repeats, args.output,
                args.merge)


def _selected_device(comm, device: str) -> str:
    """backend.select_device for verify, bench and info: a device some rank cannot
    use (cupy that does not import, no GPU) is a usage error naming
    --device, one line and exit status 2 on every rank alike (the ranks
    agree first; cupy not installed at all the parser refuses already)."""
    from .backend import DeviceUnavailable, select_device

    try:
        return select_device(comm, device)
    except DeviceUnavailable as exc:
        raise ArgumentRefused("--device", f"{device!r} cannot be used here: {exc}; "
                                          "or use --device cpu") from None


def cmd_verify(args) -> int:
    from .tools.verify import verify

    options = _options(args)
    where = _selected_device(MPI.COMM_WORLD, args.device)
    if MPI.COMM_WORLD.Get_rank() == 0 and args.device != "cpu":
        print(f"# rank 0 device: {where}", flush=True)
    wrong = verify(MPI.COMM_WORLD, args.algorithms, args.dtypes, args.ops, args.counts,
                   large=not args.no_large, seed=args.seed, options=options, device=args.device)
    _end_trace(args, MPI.COMM_WORLD)
    return 1 if wrong else 0


def _selection_line() -> str:
    from .config import environment

    if (environment().selection or "table") == "live":
        return ("live (MPI_ALLREDUCE_SELECTION=live): the table's choice, and now and then "
                "one other candidate within a 5% time budget; moves to one that is faster")
    return "the table alone: the same algorithm in every call and every run"


def cmd_predict(args) -> int:
    import dataclasses

    from .api import DEFAULT_SEGMENT_BYTES
    from .simulate import Machine, memory_text
    from .tools.scale import report

    # the closed forms give every rank a core of its own, every send a
    # matching receive and full-duplex network links: the fitted core
    # count (oversubscribed here), eager sends and half-duplex ranks are
    # the simulator's alone
    prm = dataclasses.replace(Machine.load(args.params), cores=None, eager_bytes=None,
                              half_duplex=False)
    ranks = args.ranks
    rpn = args.ranks_per_node or 1
    need, have = args.memory
    header = (f"$ python -m mpi_allreduce {' '.join(sys.argv[1:])}\n# machine: {args.params}: "
              + ", ".join(f"{k} = {v:.3g}" for k, v in prm.parameters().items()
                          if isinstance(v, float)) + "; measured message-time curves: "
              + ", ".join(k for k in ("curve", "curve_inter") if getattr(prm, k))
              + f"\n# memory: about {memory_text(need)} estimated"
              + ("" if have is None else f" ({memory_text(have)} available)"))
    report(prm, ranks, _size_range(args), rpn, args.segment_bytes or DEFAULT_SEGMENT_BYTES,
           args.png, args.json, header)
    return 0


def cmd_measured(args) -> int:
    from .tools.measured import check, describe, read_rows, report, write_json

    try:
        machine, meta = describe(args.params)
    except ValueError as exc:
        raise ArgumentRefused("--params", str(exc)) from None
    rows = read_rows(args.measured)
    how = meta.get("placement", "block")
    try:
        used = check(machine, rows, tuple(args.fit_on), how, args.dtype,
                     floors=meta.get("floors"))
    except ValueError as exc:  # (too few rows to fit on, a floor of no fitted parameter)
        raise ArgumentRefused("--fit-on", str(exc)) from None
    header = (f"$ python -m mpi_allreduce {' '.join(sys.argv[1:])}\n"
              f"# machine: {meta.get('name', args.params)}; ranks placed {how} on its first "
              f"nodes (or spread over a row's groups); {args.dtype} elements; no segments"
              + (f"; fitted on the rows of {', '.join(args.fit_on)}" if args.fit_on else ""))
    print(report(rows, used, header))
    if args.json:
        write_json(args.json, rows, used, dict(meta, fitted_on=list(args.fit_on)))
    return 0


def _placed(args, machine):
    """``machine`` with --size ranks on its nodes (--placement,
    --ranks-per-node), where it has a network; else as it is."""
    if machine is None or machine.network is None:
        return machine
    from .network import placement

    # (one rank a node unless told: hierarchical's nodes are these too)
    args.ranks_per_node = args.ranks_per_node or 1
    try:
        return machine.placed(placement(args.placement, args.size, args.ranks_per_node,
                                        machine.network))
    except ValueError as exc:
        raise ArgumentRefused("--placement", str(exc)) from None


def cmd_simulate(args) -> int:
    if args.predict:
        return cmd_predict(args)
    if args.measured:
        return cmd_measured(args)

    from .simulate import BY_NAME_ABOVE, Machine, SimulationError, memory_text, simulate

    segment = _simulated_segment(args)
    machine = None
    if args.params:
        machine = _placed(args, Machine.load(args.params))
    if args.trace:
        return _simulated_trace(args, args.algorithms, segment, machine)
    algorithms = args.run
    print(f"# simulated: p={args.size}, count={args.count}, {args.dtype} {args.op}, "
          f"segment {segment} elements, {'in place' if args.in_place else 'out of place'}; "
          f"per rank: max (mean)")
    need, largest, have = args.memory
    print(f"# memory: about {memory_text(need)} estimated, for {largest}"
          + ("" if have is None else f" ({memory_text(have)} available)"))
    if args.left_out:
        print("# left out: " + ", ".join(f"{a} (above {BY_NAME_ABOVE[a]} ranks)"
                                         for a in args.left_out)
              + ", whose memory grows as p^2; named they run: -a "
              + ",".join(algorithms + list(args.left_out)))
    print(f"{'algorithm':>20} {'#wrong':>7} {'msgs/rank':>16} {'bytes sent/rank':>24} "
          f"{'bytes reduced/rank':>24} {'rounds':>7}" + (f" {'predicted us':>13}" if machine else "")
          + (f" {'network B':>12} {'global B':>12} {'hottest link':>24}"
             if machine and machine.network else ""))
    failed = 0
    for name in algorithms:
        options = _simulated_options(args, name)
        try:
            out = simulate(name, args.size, args.count, args.dtype, args.op,
                           segment_size=segment, in_place=args.in_place, options=options,
                           machine=machine)
        except MemoryError as exc:
            raise ArgumentRefused("-p/--size and --count", str(exc)) from None
        except SimulationError as exc:
            print(f"{name:>20} FAILED: {exc}")
            failed += 1
            continue
        failed += bool(out.wrong or out.differing_ranks)

        def cell(values):
            return f"{max(values)} ({sum(values) / len(values):.0f})"
        line = (f"{name:>20} {out.wrong:>7} {cell(out.messages):>16} {cell(out.bytes_sent):>24} "
                f"{cell(out.bytes_reduced):>24} {max(out.rounds):>7}")
        if machine:
            line += f" {out.seconds * 1e6:13.1f}"
        if machine and machine.network:
            from .network import traffic

            links = traffic(out.link_bytes)
            between = links["torus"] + links["local"] + links["global"]
            line += f" {between:>12} {links['global']:>12} {links['hottest'][0]:>24}"
        print(line, flush=True)
    return 1 if failed else 0


def _vendor_line() -> str:
    """info: the vendor's own all-reduce algorithms, and the setting in force."""
    from . import vendor

    try:
        library = vendor.running()
        algorithms = ", ".join(f"{a.value} {a.name}" for a in library.algorithms())
        return (f"{library.title}'s own: {algorithms}; MPI.Allreduce runs as "
                f"{library.in_force()} (bench --vendor-algorithms times them)")
    except (vendor.UnknownVendor, vendor.VendorSettingError) as exc:
        return str(exc)


def _simulated_options(args, name: str) -> dict:
    """simulate's options for ``name``: hierarchical on nodes of --ranks-per-node
    (default: one node), recursive doubling among the leaders unless --inner;
    --radix and --row-size to the algorithms that take them."""
    if name != "hierarchical":
        return _shape_options(args, name)
    return {"ranks_per_node": args.ranks_per_node or args.size,
            "inner": args.inner or "recursive_doubling"}


def _simulated_trace(args, algorithms: list, segment: int, machine) -> int:
    from .simulate import Machine, SimulationError
    from .tools.traces import simulated
    from .trace import write

    options = _simulated_options(args, algorithms[0])
    clock = "the machine of " + args.params if machine else "every message 1 us, local work none"
    try:
        events = simulated(algorithms[0], args.size, args.count, args.dtype,
                           machine or Machine(alpha=1e-6), segment, options)
    except SimulationError as exc:
        raise SystemExit(f"simulate --trace: {exc}") from None
    write(args.trace, events, {"simulated": True, "clock": clock, "ranks": list(range(args.size)),
                               "command": " ".join(["python -m mpi_allreduce"] + sys.argv[1:])})
    print(f"wrote {args.trace}: predicted timeline of {algorithms[0]}, p={args.size}, "
          f"{args.count} elements ({clock})")
    return 0


def cmd_info(args) -> int:
    if args.settings:
        from .config import settings_table

        if MPI.COMM_WORLD.Get_rank() == 0:
            print(settings_table())
        return 0
    from . import ALGORITHMS
    from .backend import cuda_aware_support
    from .context import exchange_objects
    from .selection import describe_choices, table_source
    from .topology import on_node, oversubscribed
    from .tools.verify import mpi_library

    comm = MPI.COMM_WORLD
    device = _selected_device(comm, args.device)  # (refused before anything else is sent)
    mine = (MPI.Get_processor_name(), on_node(comm, "info: where the ranks run")[1],
            os.environ.get("SLURMD_NODENAME"), device)
    everyone = exchange_objects(comm, mine, 0, "info: every rank's host and device")
    aware, why = cuda_aware_support()
    over = oversubscribed(comm)
    auto_table = describe_choices(comm.Get_size(), over)
    if comm.Get_rank() == 0:
        hosts, local_sizes, slurm_nodes, devices = zip(*everyone)
        print(f"MPI library : {mpi_library()}")
        print(f"MPI standard: {'.'.join(map(str, MPI.Get_version()))}")
        print(f"ranks       : {comm.Get_size()} on {len(set(hosts))} host(s): "
              f"{', '.join(sorted(set(hosts)))}")
        print(f"ranks/node  : {sorted(set(local_sizes))} (MPI_COMM_TYPE_SHARED)")
        if any(slurm_nodes):
            print(f"slurm nodes : {', '.join(sorted(set(n for n in slurm_nodes if n)))}")
        print(f"algorithms  : {', '.join(ALGORITHMS)}")
        print(f"vendor's    : {_vendor_line()}")
        state = "oversubscribed: more ranks than CPUs on a node" if over else "not oversubscribed"
        print(f"auto        : {auto_table} ({state})")
        print(f"auto table  : {table_source()}")
        print(f"auto choice : {_selection_line()}")
        print(f"GPU buffers : {'direct to MPI (CUDA-aware)' if aware else 'staged through host memory'}"
              f" -- {why}")
        if args.device != "cpu":
            for rank, where in enumerate(devices):
                print(f"rank {rank:>4}   : {where}")
    return 0


COMMANDS = {"verify": cmd_verify, "bench": cmd_bench, "simulate": cmd_simulate,
            "draw": cmd_draw, "trace": cmd_trace, "report": cmd_report, "plot": cmd_plot,
            "model": cmd_model, "tune": cmd_tune, "info": cmd_info}


def _parsed(argv=None) -> tuple:
    """(the arguments parsed and checked, the command's parser)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = next(a for a in parser._actions
                   if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    check = CHECKS.get(args.command)
    if check is not None:
        check(args, command.error)
    return args, command


def parse_args(argv=None) -> argparse.Namespace:
    """The command line parsed and checked: a value a command cannot use,
    alone or with the others, is a usage error (exit status 2) here, before
    any MPI message."""
    return _parsed(argv)[0]


def main(argv=None) -> int:
    args, command = _parsed(argv)
    _read_settings(args, command.error)
    try:
        return COMMANDS[args.command](args)
    except ArgumentRefused as exc:  # (raised before any message)
        command.error(str(exc))
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - any failure must end every rank
        traceback.print_exc()
        sys.stderr.flush()
        trace.flush()  # (the trace files then show everything until here)
        MPI.COMM_WORLD.Abort(1)
    return 1


if __name__ == "__main__":
    sys.exit(main())
