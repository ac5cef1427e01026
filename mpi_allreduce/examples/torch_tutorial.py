"""PyTorch's distributed tutorial ("Writing Distributed Applications with
PyTorch") on this library's backend, with only the backend's name changed.

Run it under MPI (rank and world size come from MPI; no MASTER_ADDR)::

    mpiexec -n 4 python -m mpi_allreduce.examples.torch_tutorial

Each function is one of the tutorial's examples and returns what it
printed, so the tests check them: blocking and non-blocking point-to-point,
``all_reduce`` on a group, the other reduce ops, and the distributed
training function (a model wrapped in ``DistributedDataParallel``, trained
on each rank's partition of one data set).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import mpi_allreduce.torch as backend

__all__ = ["point_to_point", "non_blocking", "all_reduce_group", "reduce_ops", "train",
           "main"]


def point_to_point(rank: int, size: int) -> float:
    """Blocking point-to-point: rank 0 sends a tensor to rank 1."""
    tensor = torch.zeros(1)
    if size < 2:
        return tensor[0].item()
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
    elif rank == 1:
        dist.recv(tensor=tensor, src=0)
    return tensor[0].item()


def non_blocking(rank: int, size: int) -> float:
    """Non-blocking point-to-point: isend/irecv, then wait."""
    tensor = torch.zeros(1)
    if size < 2:
        return tensor[0].item()
    request = None
    if rank == 0:
        tensor += 1
        request = dist.isend(tensor=tensor, dst=1)
    elif rank == 1:
        request = dist.irecv(tensor=tensor, src=0)
    if request is not None:
        request.wait()
    return tensor[0].item()


def all_reduce_group(rank: int, size: int) -> float:
    """All-reduce (sum) in a group of the first two ranks."""
    members = [0, 1] if size > 1 else [0]
    group = dist.new_group(members)
    tensor = torch.ones(1)
    if rank in members:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor[0].item()


def reduce_ops(rank: int, size: int) -> dict:
    """The tutorial's other ops: MAX, MIN, PRODUCT, and one async call."""
    out = {}
    for name, op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN),
                     ("product", dist.ReduceOp.PRODUCT)):
        tensor = torch.tensor([float(rank + 1)])
        dist.all_reduce(tensor, op=op)
        out[name] = tensor[0].item()
    tensor = torch.tensor([float(rank + 1)])
    work = dist.all_reduce(tensor, async_op=True)
    work.wait()
    out["async sum"] = tensor[0].item()
    return out


def _partition(rank: int, size: int, samples: int = 512) -> tuple:
    """This rank's share of one synthetic data set (the same on every rank)."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 20, generator=generator)
    weights = torch.randn(20, 1, generator=generator)
    y = x @ weights + 0.1 * torch.randn(samples, 1, generator=generator)
    share = samples // size
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def train(rank: int, size: int, epochs: int = 5) -> list:
    """The tutorial's distributed training function: every rank trains on
    its partition, DDP averages the gradients; the loss of each epoch."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.5)
    x, y = _partition(rank, size)
    losses = []
    for _ in range(epochs):
        epoch = 0.0
        for start in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x[start:start + 32]), y[start:start + 32])
            loss.backward()
            optimizer.step()
            epoch += loss.item()
        total = torch.tensor([epoch])
        dist.all_reduce(total)
        losses.append(total.item() / size)
    return losses


def main() -> None:
    dist.init_process_group(backend.BACKEND)  # the tutorial's "gloo", renamed
    rank, size = dist.get_rank(), dist.get_world_size()
    lines = [f"point-to-point: rank {rank} has data {point_to_point(rank, size)}",
             f"non-blocking: rank {rank} has data {non_blocking(rank, size)}",
             f"all_reduce in group [0, 1]: rank {rank} has data {all_reduce_group(rank, size)}",
             f"reduce ops: rank {rank}: {reduce_ops(rank, size)}"]
    losses = train(rank, size)
    lines.append("training: rank {} epoch losses {}".format(
        rank, ", ".join(f"{v:.4f}" for v in losses)))
    for r in range(size):
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
