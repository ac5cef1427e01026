"""Fusion with a real model's parameter sizes: fused against per-tensor calls.

Per model, side by side in one run (interleaved repeats; each time the
slowest rank's, median of ``--repeats``), all-reducing (SUM, float32) every
parameter tensor once, as one step of data-parallel training does:

* ``fused``: ``mar.Fusion`` (buckets of ``--bucket-bytes``, tensors added in
  backprop order, i.e. last layer first, buckets reduced non-blocking as they fill),
  packing each bucket's tensors into its buffer and unpacking the result;
* ``in_bucket``: the same, on tensors made by ``Fusion.empty_like`` that live
  in their buckets (DDP's ``gradient_as_bucket_view``): nothing is packed;
* ``ours``: one blocking ``mar.allreduce`` per tensor;
* ``mpi``: one blocking ``comm.Allreduce`` per tensor.

Models: ResNet-50 (161 tensors, 25,557,032 floats: torchvision's layout)
and one GPT-2-small transformer block (12 tensors, 7,087,872 floats).
Run::

    mpiexec -n 2 python benchmarks/fusion.py --json benchmarks/results/fusion-np2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from statistics import median

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce.tools.verify import mpi_library


def resnet50_shapes() -> list:
    """torchvision's ResNet-50 parameters, in forward order."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for b in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if b == 0:
                shapes += [(4 * width, inplanes, 1, 1), (4 * width,), (4 * width,)]
            inplanes = 4 * width
    return shapes + [(1000, 2048), (1000,)]


def transformer_block_shapes(d: int = 768) -> list:
    """One GPT-2-small block: layer norms, attention, MLP (weights and biases)."""
    return [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),
            (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]


MODELS = {"resnet50": resnet50_shapes, "transformer_block": transformer_block_shapes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-r", "--repeats", type=int, default=5)
    parser.add_argument("--bucket-bytes", type=int, default=mar.fusion.DEFAULT_BUCKET_BYTES)
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = []
    for model, shapes_of in MODELS.items():
        shapes = shapes_of()
        tensors = [np.full(s, rank + 1, np.float32) for s in shapes]
        backprop = tensors[::-1]
        fusion = mar.Fusion(comm, op="sum", bucket_bytes=args.bucket_bytes)
        homed = mar.Fusion(comm, op="sum", bucket_bytes=args.bucket_bytes)
        in_buckets = homed.empty_like(backprop)

        def fused():
            fusion.allreduce(backprop)

        def in_bucket():
            homed.allreduce(in_buckets)

        def ours():
            for t in backprop:
                mar.allreduce(MPI.IN_PLACE, t, MPI.SUM, comm=comm)

        def vendor():
            for t in backprop:
                comm.Allreduce(MPI.IN_PLACE, t, MPI.SUM)

        calls = {"fused": fused, "in_bucket": in_bucket, "ours": ours, "mpi": vendor}
        times = {name: [] for name in calls}
        for t in in_buckets:  # (empty_like's memory holds whatever was there)
            t[...] = rank + 1
        for call in calls.values():  # warm-up: plans, buckets, pages
            call()
        for repeat in range(args.repeats):
            order = list(calls)[repeat % len(calls):] + list(calls)[:repeat % len(calls)]
            for name in order:
                for t in tensors + in_buckets:
                    t[...] = rank + 1
                comm.Barrier()
                t0 = time.perf_counter()
                calls[name]()
                times[name].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
                held = in_buckets if name == "in_bucket" else tensors
                assert all(np.all(t == size * (size + 1) / 2) for t in held), name
        n = sum(t.size for t in tensors)
        for name, ts in times.items():
            rows.append({"model": model, "tensors": len(tensors), "floats": n, "call": name,
                         "ms": median(ts) * 1e3, "x_mpi": median(ts) / median(times["mpi"]),
                         "x_ours": median([a / b for a, b in zip(ts, times["ours"])]),
                         "repeats_ms": [t * 1e3 for t in ts]})
        fusion.free()
        homed.free()

    if rank == 0:
        print(f"# one step's gradients all-reduced on {size} ranks (float32 SUM); buckets of "
              f"{args.bucket_bytes} B; {args.repeats} repeats (median); {mpi_library()}; "
              f"{platform.node()}")
        print("# x mpi: median over repeats / the vendor's median; x ours: the median of the "
              "ratios to per-tensor ours, repeat by repeat")
        print(f"# {'model':>18} {'tensors':>7} {'floats':>10} {'call':>9} {'ms':>9} {'x mpi':>6}"
              f" {'x ours':>6}")
        for row in rows:
            print(f"  {row['model']:>18} {row['tensors']:7d} {row['floats']:10d} "
                  f"{row['call']:>9} {row['ms']:9.2f} {row['x_mpi']:6.2f} {row['x_ours']:6.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": f"mpiexec -n {size} python benchmarks/fusion.py",
                           "ranks": size, "bucket_bytes": args.bucket_bytes,
                           "mpi": mpi_library(), "host": platform.node(), "rows": rows},
                          f, indent=1)
    comm.Free()


if __name__ == "__main__":
    main()
