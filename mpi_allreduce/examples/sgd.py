"""Data-parallel training: synchronous SGD of a small numpy MLP.

Every rank holds the same model and its own shard of a synthetic
classification task (labels from a fixed random "teacher" network).  A step
is forward, backward layer by layer from the top, the gradients averaged
over the ranks, and one SGD update.  The gradients are averaged three ways,
each for ``--steps`` steps from the same start (the first ``--warmup``
steps, which build plans and buckets, are not timed):

* ``fused``: each gradient goes into a :class:`~mpi_allreduce.Fusion` the
  moment backprop has produced it; full buckets are reduced (non-blocking)
  while the layers below are still being differentiated;
* ``ours``: after backprop, one blocking ``mar.allreduce`` per tensor;
* ``mpi``: after backprop, one ``comm.Allreduce`` per tensor, then a division.

Afterwards every rank checks that its weights are bit-identical to rank
0's (for every mode), rank 0 prints the mean step time of each mode and
writes the fused run's loss curve as a PNG.  Run::

    mpiexec -n 4 python -m mpi_allreduce.examples.sgd --png sgd-loss.png
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar

MODES = ("fused", "ours", "mpi")


def init_model(sizes: list, seed: int) -> list:
    """[W1, b1, W2, b2, ...] with He initialisation (the same on every rank)."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2 / fan_in))
                      .astype(np.float32))
        params.append(np.zeros(fan_out, np.float32))
    return params


def make_data(sizes: list, samples: int, rank: int) -> tuple:
    """This rank's shard: inputs and the teacher network's labels."""
    teacher = init_model(sizes, seed=1234)
    x = np.random.default_rng(100 + rank).standard_normal((samples, sizes[0])).astype(np.float32)
    logits, _ = forward(teacher, x)
    return x, logits.argmax(axis=1)


def forward(params: list, x: np.ndarray) -> tuple:
    """Logits and the activations backprop needs."""
    activations = [x]
    h = x
    layers = len(params) // 2
    for k in range(layers):
        h = h @ params[2 * k] + params[2 * k + 1]
        if k < layers - 1:
            h = np.maximum(h, 0)
        activations.append(h)
    return h, activations


def loss_and_top_gradient(logits: np.ndarray, labels: np.ndarray) -> tuple:
    """Softmax cross-entropy and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=1, keepdims=True)
    n = len(labels)
    loss = float(-np.log(probs[np.arange(n), labels] + 1e-12).mean())
    probs[np.arange(n), labels] -= 1
    return loss, probs / n


def backward(params: list, activations: list, top: np.ndarray, ready) -> list:
    """Gradients, top layer first; ``ready(grad)`` is told of each one as
    soon as it exists (the fused mode starts communicating there)."""
    grads = [None] * len(params)
    delta = top
    for k in reversed(range(len(params) // 2)):
        grads[2 * k] = activations[k].T @ delta
        ready(grads[2 * k])
        grads[2 * k + 1] = delta.sum(axis=0)
        ready(grads[2 * k + 1])
        if k:
            delta = (delta @ params[2 * k].T) * (activations[k] > 0)
    return grads


def train(mode: str, comm, args, x, y) -> tuple:
    """``args.steps`` steps; (losses, seconds per step, final params)."""
    sizes = [args.inputs] + [args.hidden] * args.layers + [args.classes]
    params = init_model(sizes, seed=7)
    fusion = mar.Fusion(comm, op="avg", bucket_bytes=args.bucket_bytes)
    size = comm.Get_size()
    ready = fusion.add if mode == "fused" else (lambda grad: None)
    losses = []
    rng = np.random.default_rng(comm.Get_rank())
    comm.Barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        if step == args.warmup:  # the first steps build plans and buckets: not timed
            comm.Barrier()
            start = time.perf_counter()
        batch = rng.integers(0, len(x), args.batch)
        logits, activations = forward(params, x[batch])
        loss, top = loss_and_top_gradient(logits, y[batch])
        grads = backward(params, activations, top, ready)
        if mode == "fused":
            fusion.wait()
        elif mode == "ours":
            for g in grads:
                mar.allreduce(MPI.IN_PLACE, g, "avg", comm=comm)
        else:
            for g in grads:
                comm.Allreduce(MPI.IN_PLACE, g, MPI.SUM)
                g /= size
        for p, g in zip(params, grads):
            p -= args.lr * g
        losses.append(comm.allreduce(loss) / size)
    comm.Barrier()
    return losses, (time.perf_counter() - start) / (args.steps - args.warmup), params


def digest(params: list) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10, help="first steps, not timed")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--samples", type=int, default=4096, help="samples per rank")
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3, help="hidden layers")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--bucket-bytes", type=int, default=1 << 20)
    parser.add_argument("--png", help="write the fused run's loss curve here (rank 0)")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and less than --steps")

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    sizes = [args.inputs] + [args.hidden] * args.layers + [args.classes]
    x, y = make_data(sizes, args.samples, rank)
    results = {mode: train(mode, comm, args, x, y) for mode in MODES}

    failed = False
    for mode, (_, _, params) in results.items():
        digests = comm.allgather(digest(params))
        same = all(d == digests[0] for d in digests)
        failed |= not same
        if rank == 0:
            print(f"# {mode:>5}: weights on all {comm.Get_size()} ranks bit-identical to "
                  f"rank 0's: {'yes' if same else 'NO'}")
    if rank == 0:
        n_params = sum(p.size for p in results["fused"][2])
        print(f"# MLP {sizes}: {len(results['fused'][2])} tensors, {n_params} parameters; "
              f"{args.steps} steps of {args.batch} samples per rank; buckets of "
              f"{args.bucket_bytes} B")
        base = results["mpi"][1]
        for mode, (losses, seconds, _) in results.items():
            print(f"{mode:>6}: {seconds * 1e3:8.2f} ms/step ({seconds / base:.2f}x mpi)  "
                  f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        if args.png:
            write_png(args.png, results["fused"][0], comm.Get_size())
    return 1 if failed else 0


def write_png(path: str, losses: list, ranks: int) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed (pip install 'mpi_allreduce[plot]'): no PNG")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(f"synchronous SGD on {ranks} ranks, fused non-blocking all-reduce")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"# loss curve: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
