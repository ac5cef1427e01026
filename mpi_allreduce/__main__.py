"""Command line: ``python -m mpi_allreduce {verify,info} ...`` under mpiexec or srun.

An exception on any rank aborts the whole job (``MPI.COMM_WORLD.Abort``)
instead of leaving the other ranks waiting in a message.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from mpi4py import MPI


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _hierarchy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="hierarchical: emulate nodes of this many consecutive ranks")
    parser.add_argument("--inner", default=None,
                        help="hierarchical: algorithm across node leaders (default auto)")
    parser.add_argument("--segment-bytes", type=int, default=None,
                        help="bytes per ring message (default 1 MiB)")


def _options(args, itemsize: int = 1) -> dict:
    options = {}
    if args.ranks_per_node is not None:
        options["ranks_per_node"] = args.ranks_per_node
    if args.inner is not None:
        options["inner"] = args.inner
    return options


def build_parser() -> argparse.ArgumentParser:
    from . import ALGORITHMS
    from .ops import OPS, SUPPORTED_DTYPES

    parser = argparse.ArgumentParser(prog="python -m mpi_allreduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", help="compare every algorithm with MPI.Allreduce")
    v.add_argument("-a", "--algorithms", type=_csv, default=list(ALGORITHMS),
                   help=f"comma-separated (default: {','.join(ALGORITHMS)})")
    v.add_argument("-d", "--dtypes", type=_csv, default=list(SUPPORTED_DTYPES))
    v.add_argument("-o", "--ops", type=_csv, default=list(OPS))
    v.add_argument("--counts", type=lambda s: [int(c) for c in _csv(s)], default=None,
                   help="comma-separated element counts (default: 0, 1, p-1, p, p+1, primes, 2^k+-1)")
    v.add_argument("--no-large", action="store_true", help="skip the ~1M-element cases")
    v.add_argument("--seed", type=int, default=2026)
    _hierarchy_args(v)

    sub.add_parser("info", help="MPI library, communicator layout, GPU path")
    return parser


def cmd_verify(args) -> int:
    from .ops import OPS, SUPPORTED_DTYPES
    from .registry import get
    from .verify import verify

    for name in args.algorithms:
        get(name)
    for name in args.dtypes:
        if name not in SUPPORTED_DTYPES:
            raise SystemExit(f"unknown dtype {name!r}; choose from {', '.join(SUPPORTED_DTYPES)}")
    for name in args.ops:
        if name not in OPS:
            raise SystemExit(f"unknown op {name!r}; choose from {', '.join(OPS)}")
    options = _options(args)
    if args.segment_bytes is not None:
        import os

        os.environ["MPI_ALLREDUCE_SEGMENT_BYTES"] = str(args.segment_bytes)
    wrong = verify(MPI.COMM_WORLD, args.algorithms, args.dtypes, args.ops, args.counts,
                   large=not args.no_large, seed=args.seed, options=options)
    return 1 if wrong else 0


def cmd_info(args) -> int:
    from . import ALGORITHMS
    from .backend import cuda_aware_support

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    hosts = comm.gather(MPI.Get_processor_name(), root=0)
    local_sizes = comm.gather(node.Get_size(), root=0)
    node.Free()
    aware, why = cuda_aware_support()
    if comm.Get_rank() == 0:
        print(f"MPI library : {MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"MPI standard: {'.'.join(map(str, MPI.Get_version()))}")
        print(f"ranks       : {comm.Get_size()} on {len(set(hosts))} host(s): "
              f"{', '.join(sorted(set(hosts)))}")
        print(f"ranks/node  : {sorted(set(local_sizes))}")
        print(f"algorithms  : {', '.join(ALGORITHMS)}")
        print(f"GPU buffers : {'direct to MPI (CUDA-aware)' if aware else 'staged through host memory'}"
              f" -- {why}")
    return 0


COMMANDS = {"verify": cmd_verify, "info": cmd_info}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - any failure must end every rank
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
