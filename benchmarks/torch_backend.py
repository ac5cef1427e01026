"""The torch backend against gloo, side by side on the same processes.

Under one mpiexec, ``dist.init_process_group("mpi_allreduce")`` is the
default group and ``dist.new_group(backend="gloo")`` a gloo group of the
same ranks.  Per size (float32 SUM, in place), in interleaved repeats (a
shuffled order per repeat, the same on every rank), each batch ``--iters``
calls after a warm-up, the slowest rank's mean:

* ``ours``: ``dist.all_reduce`` on this library's backend;
* ``gloo``: ``dist.all_reduce`` on the gloo group;
* ``mar``: ``mar.allreduce`` on the tensor's memory (the backend's floor:
  what the ProcessGroup adds is the difference);
* ``mpi``: the vendor's ``MPI.Allreduce`` on the same memory;
* ``empty``: ``dist.all_reduce`` on a group of the same backend whose
  ``allreduce`` does nothing but return a completed ``Work``: what torch's
  dispatch to a ProcessGroup written in Python costs by itself, so that
  ``mar + empty`` is the least a Python backend can take;
* the same three with ``async_op=True`` and ``wait()`` (``mar``:
  ``mar.iallreduce`` + ``wait``, the repeated call's kept request), in a
  table of their own.

Then DDP training steps on each backend, interleaved, of two models: a
4-layer MLP of about 1.1 M parameters at batch 256, whose compute
dominates, and a wide one (3 layers of 2048 x 2048, 12.6 M parameters) at batch 4,
whose gradients (50 MB) are all-reduced every step.  The ``empty`` group
trains too: its step, with no communication at all, is the least any
backend's step can take on these processes.  ``allreduce`` is the
gradients' all-reduce alone (``mar.allreduce`` of one float32 array of the
model's parameter count, in the same repeats): each rank's compute holds
its core here (2 ranks, 2 cores), so communication can hide behind it only
in part, and ``no communication + allreduce`` estimates a step whose
communication does not overlap at all -- what ``ours/no communication``
comes to without overlap is ``(no communication + allreduce) / no
communication``.  Ratios are taken per repeat.
Run::

    mpiexec -n 2 python benchmarks/torch_backend.py > benchmarks/results/torch-backend-np2.txt

``--device cuda`` runs it all on CUDA tensors (each rank's GPU: local rank
mod visible GPUs): ``mar`` on a cupy view of the tensor's memory, ``mpi`` on
a host copy made and written back per call (the vendor's MPI is not assumed
CUDA-aware), the models and their data on the GPU.
"""

from __future__ import annotations

import argparse
import platform
from statistics import median

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import torch as backend
from mpi_allreduce.tools.bench import (batch_mean_us, human, iterations_for, paired_ratios,
                                       parse_size, repeat_order, sizes_between)
from mpi_allreduce.tools.verify import mpi_library


#: the DDP models: (layer widths, batch) -- compute-bound, then communication-bound
DDP_MODELS = {"MLP of 1.1 M parameters, batch 256": ((512, 1024, 512, 64), 256),
              "wide MLP of 12.6 M parameters, batch 4": ((2048, 2048, 2048, 2048), 4)}


def _ddp_step_us(comm, group, widths, repeats_data, iters: int, device) -> float:
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1]).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = repeats_data

    def step():
        optimizer.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        optimizer.step()
        _sync(device)
    return batch_mean_us(comm, step, iters, 2)


def _memory(t: torch.Tensor):
    """The tensor's memory as the library takes it: a cupy view of a CUDA
    tensor, a numpy view of a CPU one."""
    if t.device.type == "cuda":
        from mpi_allreduce import backend as arrays

        return arrays.device_view(t)
    return t.numpy()


def _gradients_allreduce_us(comm, widths, iters: int, device) -> float:
    """The model's gradients all-reduced as one buffer, without DDP."""
    count = sum(a * b + b for a, b in zip(widths, widths[1:]))
    a = _memory(torch.zeros(count, device=device))

    def call():
        mar.allreduce(MPI.IN_PLACE, a, comm=comm)
        _sync(device)
    return batch_mean_us(comm, call, iters, 2)


def _sync(device) -> None:
    """A timed call ends when the GPU's work has (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Empty(backend.MPIAllreduceGroup):
    def allreduce(self, tensors, opts=None):
        return backend._Done(tensors)


def _empty_group(options, backend_options=None):
    return _Empty(options.group_rank, options.group_size, MPI.COMM_WORLD.Dup())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-b", "--min", default="8")
    parser.add_argument("-e", "--max", default="16M")
    parser.add_argument("-f", "--factor", type=float, default=8)
    parser.add_argument("-n", "--iters", type=int, default=200)
    parser.add_argument("-r", "--repeats", type=int, default=7)
    parser.add_argument("--ddp-iters", type=int, default=20)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD.Dup()
    device = torch.device("cpu")
    if args.device == "cuda":
        from mpi_allreduce import backend as arrays

        arrays.select_device(comm, "cuda")
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dist.init_process_group("mpi_allreduce")
    gloo = dist.new_group(backend="gloo")
    dist.Backend.register_backend("empty", _empty_group, extended_api=True,
                                  devices=["cpu", "cuda"])
    empty = dist.new_group(backend="empty")
    p = comm.Get_size()
    names = ["ours", "gloo", "mar", "mpi", "empty", "ours_async", "mar_async", "empty_async"]
    rows = []
    for nbytes in sizes_between(parse_size(args.min), parse_size(args.max), args.factor):
        # (zeros: repeated in-place sums stay finite)
        t = torch.zeros(max(1, nbytes // 4), device=device)
        a = _memory(t)
        if device.type == "cuda":
            def vendor():
                h = t.cpu().numpy()
                comm.Allreduce(MPI.IN_PLACE, h)
                t.copy_(torch.from_numpy(h))
        else:
            out = a.copy()

            def vendor():
                comm.Allreduce(a, out)

        def synced(fn):  # (on the CPU the call itself: no wrapper in the timed loop)
            return fn if device.type == "cpu" else lambda: (fn(), _sync(device))
        calls = {name: synced(fn) for name, fn in {
            "ours": lambda: dist.all_reduce(t),
            "gloo": lambda: dist.all_reduce(t, group=gloo),
            "mar": lambda: mar.allreduce(MPI.IN_PLACE, a, comm=comm),
            "mpi": vendor,
            "empty": lambda: dist.all_reduce(t, group=empty),
            "ours_async": lambda: dist.all_reduce(t, async_op=True).wait(),
            "mar_async": lambda: mar.iallreduce(MPI.IN_PLACE, a, comm=comm).wait(),
            "empty_async": lambda: dist.all_reduce(t, group=empty, async_op=True).wait()}.items()}
        iters, warmup = iterations_for(nbytes, args.iters, 5)
        times = {name: [] for name in names}
        for repeat in range(args.repeats):
            for name in repeat_order(names, nbytes, repeat):
                t.zero_()
                times[name].append(batch_mean_us(comm, calls[name], iters, warmup))
        rows.append((nbytes, times))
    ddp_rows = []
    for label, (widths, batch) in DDP_MODELS.items():
        torch.manual_seed(comm.Get_rank())
        data = (torch.randn(batch, widths[0], device=device),
                torch.randn(batch, widths[-1], device=device))
        ddp = {"ours": [], "gloo": [], "empty": [], "allreduce": []}
        for repeat in range(args.repeats):
            for name in repeat_order(list(ddp), 0, repeat):
                if name == "allreduce":
                    ddp[name].append(_gradients_allreduce_us(comm, widths, args.ddp_iters,
                                                             device))
                    continue
                group = {"ours": None, "gloo": gloo, "empty": empty}[name]
                ddp[name].append(_ddp_step_us(comm, group, widths, data, args.ddp_iters,
                                                 device))
        ddp_rows.append((label, ddp))
    if comm.Get_rank() == 0:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"# torch {torch.__version__} all_reduce, float32 SUM in place, {p} ranks; "
              f"tensors on {device.type} ({where}); "
              f"{args.repeats} interleaved repeats; {mpi_library()}; {platform.node()}")
        print("# medians (us) and ratios per repeat (median, q1-q3)")
        print(f"# {'size':>8} {'ours':>9} {'gloo':>9} {'mar':>9} {'mpi':>9} {'empty':>9}"
              f" {'ours/gloo':>17} {'ours/mar':>17} {'ours/mpi':>17} {'ours/(mar+empty)':>17}")
        for nbytes, times in rows:
            cells = " ".join(f"{median(times[n]):9.1f}" for n in names[:5])
            floor = [m + e for m, e in zip(times["mar"], times["empty"])]
            ratios = " ".join("{:5.2f} ({:4.2f}-{:4.2f})".format(*paired_ratios(times["ours"],
                                                                                  against))
                              for against in (times["gloo"], times["mar"], times["mpi"], floor))
            print(f"  {human(nbytes):>8} {cells} {ratios}")
        print("# async_op=True + wait(): ours, mar.iallreduce + wait on the same memory, the "
              "empty group's (torch's dispatch alone); the least a Python backend can take is "
              "mar + empty, so (mar+empty)/mar is the floor of ours/mar")
        print(f"# {'size':>8} {'ours':>9} {'mar':>9} {'empty':>9} {'ours/mar':>17} "
              f"{'floor/mar':>17} {'ours/(mar+empty)':>17}")
        for nbytes, times in rows:
            ours, mar_, empty_ = (times[n + "_async"] for n in ("ours", "mar", "empty"))
            floor = [m + e for m, e in zip(mar_, empty_)]
            cells = " ".join(f"{median(x):9.1f}" for x in (ours, mar_, empty_))
            ratios = " ".join("{:5.2f} ({:4.2f}-{:4.2f})".format(*paired_ratios(a, b))
                              for a, b in ((ours, mar_), (floor, mar_), (ours, floor)))
            print(f"  {human(nbytes):>8} {cells} {ratios}")
        for label, ddp in ddp_rows:
            ratio = paired_ratios(ddp["ours"], ddp["gloo"])
            floor = paired_ratios(ddp["empty"], ddp["gloo"])
            print(f"# DDP step ({label}): ours {median(ddp['ours']) / 1e3:.2f} ms, gloo "
                  f"{median(ddp['gloo']) / 1e3:.2f} ms, no communication "
                  f"{median(ddp['empty']) / 1e3:.2f} ms; ours/gloo {ratio[0]:.2f} "
                  f"({ratio[1]:.2f}-{ratio[2]:.2f}), no communication/gloo {floor[0]:.2f} "
                  f"({floor[1]:.2f}-{floor[2]:.2f}); ours/no communication "
                  "{:.2f} ({:.2f}-{:.2f})".format(*paired_ratios(ddp["ours"], ddp["empty"])))
            least = [e + a for e, a in zip(ddp["empty"], ddp["allreduce"])]
            print(f"#   the gradients' all-reduce alone {median(ddp['allreduce']) / 1e3:.2f} ms; "
                  "without overlap (no communication + all-reduce)/no communication "
                  "{:.2f} ({:.2f}-{:.2f}); ".format(*paired_ratios(least, ddp["empty"]))
                  + "ours/that {:.2f} ({:.2f}-{:.2f})".format(*paired_ratios(ddp["ours"], least)))
    comm.Free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
