"""The torch.distributed backend (``import mpi_allreduce.torch``) under
mpiexec: every collective it runs, against results computed locally; async
calls; a subgroup; DDP leaving every rank's weights bit-identical.  Skipped
where torch is not installed (``pip install 'mpi_allreduce[torch]'``)."""

from __future__ import annotations

import time
import warnings

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

MPI = pytest.importorskip("mpi4py.MPI")

from .test_construction_mpi import interrupt_watchdog  # noqa: E402,F401 - a fixture

pytestmark = pytest.mark.mpi

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "prod": dist.ReduceOp.PRODUCT,
       "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
       "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "uint8": torch.uint8}
BITWISE = ("band", "bor", "bxor")


@pytest.fixture(scope="module")
def group():
    import mpi_allreduce.torch  # noqa: F401 - registers the backend

    dist.init_process_group("mpi_allreduce")
    yield dist.group.WORLD
    dist.destroy_process_group()


def _mine(rank: int, count: int, dtype) -> "torch.Tensor":
    """Small values whose reduction is exact in any order, different per rank."""
    base = (torch.arange(count) * 7 + rank * 3) % 5 + 1
    return base.to(dtype)


def _expected(p: int, count: int, dtype, op: str) -> "torch.Tensor":
    parts = [_mine(r, count, torch.float64 if dtype.is_floating_point else torch.int64)
             for r in range(p)]
    out = parts[0].clone()
    for part in parts[1:]:
        out = {"sum": torch.add, "avg": torch.add, "prod": torch.mul,
               "min": torch.minimum, "max": torch.maximum, "band": torch.bitwise_and,
               "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op](out, part)
    if op == "avg":
        out = out / p
    return out.to(dtype)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(OPS))
def test_all_reduce(group, op, dtype, async_op):
    torch_dtype = DTYPES[dtype]
    if op in BITWISE and torch_dtype.is_floating_point:
        pytest.skip("bitwise ops take integers")
    if op == "avg" and not torch_dtype.is_floating_point:
        pytest.skip("avg takes floats")
    p, r = dist.get_world_size(), dist.get_rank()
    if op == "prod" and p > 4 and torch_dtype in (torch.float16, torch.bfloat16, torch.uint8):
        pytest.skip("the product leaves the type's exact range")
    for count in (0, 1, p + 1, 13):
        t = _mine(r, count, torch_dtype)
        work = dist.all_reduce(t, op=OPS[op], async_op=async_op)
        if async_op:
            work.wait()
            assert work.is_completed()
            work.get_future().wait()
        torch.testing.assert_close(t, _expected(p, count, torch_dtype, op), rtol=0, atol=0)


def test_gathers_scatters_and_broadcast(group):
    p, r = dist.get_world_size(), dist.get_rank()
    out = torch.empty(2 * p)
    dist.all_gather_into_tensor(out, torch.full((2,), float(r)))
    assert out.tolist() == [float(i) for i in range(p) for _ in range(2)]
    pieces = [torch.empty(3, dtype=torch.int64) for _ in range(p)]
    dist.all_gather(pieces, torch.full((3,), r, dtype=torch.int64))
    assert [x[0].item() for x in pieces] == list(range(p))
    shard = torch.empty(2)
    dist.reduce_scatter_tensor(shard, torch.arange(2.0 * p) + r)
    assert shard.tolist() == [p * (2 * r + k) + p * (p - 1) / 2 for k in range(2)]
    shards = [torch.full((2,), float(i + r)) for i in range(p)]
    mine = torch.empty(2)
    dist.reduce_scatter(mine, shards)
    assert mine.tolist() == [p * r + p * (p - 1) / 2] * 2
    b = torch.full((4,), float(r))
    dist.broadcast(b, src=p - 1)
    assert b.tolist() == [float(p - 1)] * 4
    dist.barrier()


def test_temporaries_are_not_kept_only_the_callers_tensors(group):
    """The views kept for repeats are of the caller's own tensors (an
    all-reduce's, a reduce-scatter's output); the backend's temporaries
    (the concatenated input of a reduce_scatter, gathered pieces) are not
    kept, so their memory goes with them (keeping them held up to 256 MiB
    of dead tensors)."""
    from mpi_allreduce import torch as backend

    p, r = dist.get_world_size(), dist.get_rank()
    backend._VIEWS.clear()
    grad, shard = torch.ones(8), torch.empty(2)
    for step in range(50):
        dist.all_reduce(grad)
        shards = [torch.full((2,), float(i + r + step)) for i in range(p)]
        dist.reduce_scatter(shard, shards)
        pieces = [torch.empty(2) for _ in range(p)]
        dist.all_gather(pieces, torch.full((2,), float(r)))
    assert shard.tolist() == [p * (r + 49) + p * (p - 1) / 2] * 2
    assert [x[0].item() for x in pieces] == [float(i) for i in range(p)]
    assert len(backend._VIEWS) <= 2, f"{len(backend._VIEWS)} views kept"  # grad's, shard's


def test_a_strided_tensor_is_reduced_in_place(group):
    p = dist.get_world_size()
    t = torch.ones(4, 6)[:, ::2]
    assert not t.is_contiguous()
    dist.all_reduce(t)
    assert (t == p).all()


def test_a_subgroup(group):
    p, r = dist.get_world_size(), dist.get_rank()
    members = list(range(0, p, 2))
    sub = dist.new_group(members)
    if r in members:
        t = torch.ones(3)
        dist.all_reduce(t, group=sub)
        assert t.tolist() == [float(len(members))] * 3
    dist.barrier()


@pytest.mark.parametrize("factor", [2.5, "tensor"])
def test_premul_sum_multiplies_every_input_first(group, factor):
    """PREMUL_SUM (``_make_nccl_premul_sum``, a number or a one-element
    tensor): all_reduce, reduce_scatter_tensor and reduce give the sum of
    every rank's input times the factor (exact here: small integers and a
    factor of 2.5); reduce_scatter leaves its input as it was.  A torch whose
    ReduceOp does not show its factor to Python (2.11) gets a ValueError
    saying so on every rank, before any message, and the group goes on."""
    p, r = dist.get_world_size(), dist.get_rank()
    scale = 2.5
    op = dist._make_nccl_premul_sum(torch.tensor([scale]) if factor == "tensor" else scale)
    expected = _expected(p, 2 * p, torch.float64, "sum") * scale
    t = _mine(r, 2 * p, torch.float64)
    if not hasattr(dist.ReduceOp, "factor"):
        for call in (lambda: dist.all_reduce(t, op=op),
                     lambda: dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.float64), t,
                                                        op=op),
                     lambda: dist.reduce(t, 0, op=op)):
            with pytest.raises(ValueError, match="ReduceOp has .factor"):
                call()
        assert torch.equal(t, _mine(r, 2 * p, torch.float64))
        dist.all_reduce(t)
        assert torch.equal(t, _expected(p, 2 * p, torch.float64, "sum"))
        return
    dist.all_reduce(t, op=op)
    assert torch.equal(t, expected)
    mine = _mine(r, 2 * p, torch.float64)
    out = torch.empty(2, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, mine, op=op)
    assert torch.equal(out, expected[2 * r:2 * r + 2])
    assert torch.equal(mine, _mine(r, 2 * p, torch.float64))
    kept = _mine(r, 2 * p, torch.float64)
    dist.reduce(kept, 0, op=op)
    assert torch.equal(kept, expected if r == 0 else _mine(r, 2 * p, torch.float64))


def test_ddp_keeps_every_rank_bit_identical(group):
    p, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    torch.manual_seed(100 + r)  # different data on every rank
    for _ in range(6):
        x, y = torch.randn(16, 10), torch.randn(16, 1)
        optimizer.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        optimizer.step()
    flat = torch.cat([w.detach().reshape(-1) for w in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(p)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], other) for other in everyone)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_mpi_collectives_every_dtype(group, async_op):
    """reduce, gather, scatter, all_to_all(_single), broadcast, send/recv: MPI's,
    moving bytes, so every dtype (bfloat16 and bool too) travels unchanged."""
    p, r = dist.get_world_size(), dist.get_rank()
    root = p - 1
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        mine = _mine(r, 5, torch.float64).to(dtype)
        everyone = [_mine(k, 5, torch.float64).to(dtype) for k in range(p)]

        def done(work):
            if async_op:
                work.wait()
        t = mine.clone()
        if dtype != torch.bool:
            done(dist.reduce(t, dst=root, op=dist.ReduceOp.MAX, async_op=async_op))
            if r == root:
                torch.testing.assert_close(t, torch.stack(everyone).max(0).values,
                                           rtol=0, atol=0)
        bucket = [torch.empty_like(mine) for _ in range(p)] if r == root else None
        done(dist.gather(mine, bucket, dst=root, async_op=async_op))
        if r == root:
            assert all(torch.equal(a, b) for a, b in zip(bucket, everyone))
        out = torch.empty_like(mine)
        done(dist.scatter(out, everyone if r == root else None, src=root, async_op=async_op))
        assert torch.equal(out, everyone[r])
        t = mine.clone()
        done(dist.broadcast(t, src=root, async_op=async_op))
        assert torch.equal(t, everyone[root])
        # all_to_all: rank r sends piece k of its tensor to rank k
        pieces = [torch.full((2,), 10 * r + k).to(dtype) for k in range(p)]
        got = [torch.empty(2, dtype=dtype) for _ in range(p)]
        done(dist.all_to_all(got, pieces, async_op=async_op))
        assert all(torch.equal(g, torch.full((2,), 10 * k + r).to(dtype))
                   for k, g in enumerate(got))
        single = torch.cat(pieces)
        received = torch.empty_like(single)
        done(dist.all_to_all_single(received, single, async_op=async_op))
        assert torch.equal(received, torch.cat(got))


def test_all_to_all_single_with_uneven_splits(group):
    p, r = dist.get_world_size(), dist.get_rank()
    send_splits = [k + 1 for k in range(p)]  # k+1 rows to rank k
    recv_splits = [r + 1] * p
    source = torch.cat([torch.full((k + 1, 3), float(100 * r + k)) for k in range(p)])
    target = torch.empty(sum(recv_splits), 3)
    dist.all_to_all_single(target, source, recv_splits, send_splits)
    expected = torch.cat([torch.full((r + 1, 3), float(100 * k + r)) for k in range(p)])
    assert torch.equal(target, expected)


def test_send_and_recv_in_a_ring(group):
    """Every rank sends to the next and receives from the one before: the
    sends do not wait for their receives (isend/irecv, then wait)."""
    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1:
        pytest.skip("one rank has no peer")
    out = torch.full((4,), float(r))
    into = torch.empty(4)
    works = [dist.isend(out, (r + 1) % p), dist.irecv(into, (r - 1) % p)]
    for work in works:
        work.wait()
    assert into.tolist() == [float((r - 1) % p)] * 4


def test_recv_from_any_source_says_who_sent(group):
    """``dist.recv`` without ``src`` on rank 0 takes the other ranks'
    messages in whatever order they come and returns each one's sender;
    each holds what that sender sent."""
    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1:
        pytest.skip("one rank has no peer")
    if r:
        dist.send(torch.full((3,), float(r)), 0, tag=5)
        return
    senders = []
    for _ in range(p - 1):
        into = torch.zeros(3)
        sender = dist.recv(into, tag=5)
        assert into.tolist() == [float(sender)] * 3
        senders.append(sender)
    assert sorted(senders) == list(range(1, p))


def test_device_tensors_go_through_host_copies_written_back(group, monkeypatch):
    """How the backend takes CUDA tensors where it stages them (MPI's data
    movement always, the all-reduces and halves where cupy is missing), run
    here on CPU tensors that it is told are device tensors: every call
    works on host copies and writes them back, so the results are right
    only if each copy comes back to the caller's tensor, after the call
    completes; async calls stay async (a ring of 1 MiB isend/irecv, past
    MPI's eager size, would wait for itself otherwise).  The cupy path
    needs a GPU: tests/test_gpu_mpi.py."""
    import mpi_allreduce.torch as backend

    staged = []
    real = backend._staged
    monkeypatch.setattr(backend, "_is_device", lambda tensor: True)
    monkeypatch.setattr(backend, "_device_of", lambda args: torch.device("cpu"))
    monkeypatch.setattr(backend, "has_device_arrays", lambda: False)
    monkeypatch.setattr(backend, "_staged", lambda method, *args: staged.append(
        method.__name__) or real(method, *args))
    p, r = dist.get_world_size(), dist.get_rank()
    for op, dtype in (("sum", "float32"), ("max", "int64"), ("avg", "float64")):
        for async_op in (False, True):
            test_all_reduce(group, op, dtype, async_op)
    test_gathers_scatters_and_broadcast(group)
    for async_op in (False, True):
        test_mpi_collectives_every_dtype(group, async_op)
    test_all_to_all_single_with_uneven_splits(group)
    expected = {"allreduce", "all_gather_single", "allgather", "reduce_scatter_single",
                "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "alltoall",
                "alltoall_base"}
    if p > 1:
        test_recv_from_any_source_says_who_sent(group)
        n = 1 << 18 if backend.ASYNC else 4
        out, into = torch.full((n,), float(r)), torch.empty(n)
        works = [dist.isend(out, (r + 1) % p), dist.irecv(into, (r - 1) % p)]
        for work in works:
            work.wait()
        assert (into == (r - 1) % p).all()
        expected |= {"send", "recv"}
    # a staged call's future asked for before any wait (DDP's way; the
    # profiler asks for every call's): it completes with the result
    t = torch.full((3,), float(r + 1))
    future = dist.all_reduce(t, async_op=True).get_future()
    assert future.wait()[0].tolist() == [float(p * (p + 1) // 2)] * 3
    assert expected <= set(staged), expected - set(staged)


def test_cuda_tensors(group):
    """CUDA tensors: the all-reduce (sync and async), the halves, a
    broadcast and send/recv, against what the same calls give on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU and torch's CUDA build")
    p, r = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", r % torch.cuda.device_count())
    for dtype in (torch.float32, torch.float64, torch.int64):
        for async_op in (False, True):
            t = _mine(r, 1000, dtype).to(device)
            work = dist.all_reduce(t, async_op=async_op)
            if async_op:
                work.wait()
            torch.testing.assert_close(t.cpu(), _expected(p, 1000, dtype, "sum"), rtol=0, atol=0)
    whole = torch.empty(3 * p, device=device)
    dist.all_gather_into_tensor(whole, torch.full((3,), float(r), device=device))
    assert whole.tolist() == [float(k) for k in range(p) for _ in range(3)]
    shard = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(shard, torch.arange(2.0 * p, device=device) + r)
    assert shard.tolist() == [p * (2 * r + k) + p * (p - 1) / 2 for k in range(2)]
    b = torch.full((5,), float(r), device=device)
    dist.broadcast(b, src=p - 1)
    assert b.tolist() == [float(p - 1)] * 5
    if p > 1:
        into = torch.empty(4, device=device)
        works = [dist.isend(torch.full((4,), float(r), device=device), (r + 1) % p),
                 dist.irecv(into, (r - 1) % p)]
        for work in works:
            work.wait()
        assert into.tolist() == [float((r - 1) % p)] * 4


def test_a_blocking_calls_work_is_complete_with_its_tensors(group):
    """The Work of a call that completed before returning (async_op=False):
    complete, successful, and its future holds the call's tensors."""
    t = torch.ones(3)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    work = dist.distributed_c10d._get_default_group().allreduce([t], opts)
    assert work.is_completed() and work.is_success() and work.wait()
    (value,) = work.get_future().wait()
    assert value is t and (t == dist.get_world_size()).all()


def test_async_all_reduce_overlaps_and_completes_through_its_future(group):
    """async_op=True returns while the messages travel (where MPI runs
    threads); the future completes without wait() (DDP waits on it), and a
    hook chained on it sees the sum."""
    from mpi_allreduce.torch import ASYNC

    p = dist.get_world_size()
    t = torch.ones(1 << 16)
    work = dist.all_reduce(t, async_op=True)
    if ASYNC and p > 1:
        assert isinstance(work, dist.Work) and type(work).__name__ == "_Work"
    chained = work.get_future().then(lambda fut: fut.value()[0].sum().item())
    assert chained.wait() == p * (1 << 16)
    assert work.is_completed() and (t == p).all()
    work.wait()  # waiting again after completion is harmless


def test_the_tutorial_examples(group):
    """``python -m mpi_allreduce.examples.torch_tutorial``'s examples, on the
    backend, with what the tutorial says they print."""
    from mpi_allreduce.examples import torch_tutorial as tutorial

    p, r = dist.get_world_size(), dist.get_rank()
    sent = 1.0 if p > 1 and r in (0, 1) else 0.0
    assert tutorial.point_to_point(r, p) == sent
    assert tutorial.non_blocking(r, p) == sent
    in_group = r in ((0, 1) if p > 1 else (0,))
    assert tutorial.all_reduce_group(r, p) == (float(min(p, 2)) if in_group else 1.0)
    ops = tutorial.reduce_ops(r, p)
    factorial = 1.0
    for k in range(1, p + 1):
        factorial *= k
    assert ops == {"max": float(p), "min": 1.0, "product": factorial,
                   "async sum": p * (p + 1) / 2}
    losses = tutorial.train(r, p, epochs=3)
    assert losses[-1] < losses[0]
    everyone = [None] * p
    dist.all_gather_object(everyone, losses)
    assert all(other == losses for other in everyone)  # every rank saw the same losses


@pytest.fixture(scope="module")
def gloo(group):
    """gloo on the same processes, to compare with."""
    return dist.new_group(backend="gloo")


def test_against_gloo_on_the_same_processes(group, gloo):
    p, r = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(r)
    x = torch.randn(1000, generator=generator)
    ours, theirs = x.clone(), x.clone()
    dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # (another order of sums)
    ints = (x * 100).to(torch.int64)
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.SUM, dist.ReduceOp.BXOR):
        a, b = ints.clone(), ints.clone()
        dist.all_reduce(a, op=op)
        dist.all_reduce(b, op=op, group=gloo)
        assert torch.equal(a, b)
    a, b = torch.empty(1000 * p), torch.empty(1000 * p)
    dist.all_gather_into_tensor(a, x)
    dist.all_gather_into_tensor(b, x, group=gloo)
    assert torch.equal(a, b)
    a, b = x.clone(), x.clone()
    dist.broadcast(a, src=p - 1)
    dist.broadcast(b, src=p - 1, group=gloo)
    assert torch.equal(a, b)
    a, b = torch.empty(4 * p), torch.empty(4 * p)
    dist.all_to_all_single(a, x[:4 * p])
    dist.all_to_all_single(b, x[:4 * p], group=gloo)
    assert torch.equal(a, b)


def test_ddp_matches_a_gloo_run(group, gloo):
    """The same training on both backends: weights within float tolerance."""
    r = dist.get_rank()
    weights = []
    for pg in (None, gloo):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        torch.manual_seed(100 + r)
        for _ in range(5):
            x, y = torch.randn(16, 10), torch.randn(16, 1)
            optimizer.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            optimizer.step()
        weights.append(torch.cat([w.detach().reshape(-1) for w in model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-5, atol=1e-6)


class _Doomed:
    """A new group of every rank for a call whose ranks disagree (its
    communicator is left unusable), made with the watchdog in raise mode
    at 1 s; :meth:`everyone` restores the watchdog and gathers every rank's
    outcome on the world group."""

    def __init__(self, monkeypatch, watchdog):
        self.p, self.r = dist.get_world_size(), dist.get_rank()
        if self.p == 1:
            pytest.skip("one rank cannot disagree")
        self.monkeypatch = monkeypatch
        self.group = dist.new_group(list(range(self.p)))
        watchdog(1)

    def stalled_then_next(self, outcomes: list) -> None:
        """Every rank makes the same all-reduce after its first call (whose
        outcome is ``outcomes[0]``): no rank gets a wrong sum, and the first
        call stalled on every rank."""
        import mpi_allreduce as mar

        p, r = self.p, self.r
        t = torch.full((3,), float(r + 1))
        try:
            dist.all_reduce(t, group=self.group)
            outcomes.append("right" if (t == p * (p + 1) / 2).all() else "WRONG")
        except mar.Broken as exc:  # (Stalled is a Broken)
            outcomes.append(type(exc).__name__)
        everyone = self.everyone(outcomes)
        assert not any("WRONG" in o for o in everyone), everyone
        assert [o[0] for o in everyone] == ["Stalled"] * p, everyone

    def everyone(self, outcome) -> list:
        from .helpers import restore_watchdog

        restore_watchdog(self.monkeypatch)
        gathered = [None] * self.p
        dist.all_gather_object(gathered, outcome)
        return gathered


@pytest.fixture
def doomed(group, monkeypatch, watchdog):
    return _Doomed(monkeypatch, watchdog)


@pytest.mark.parametrize("first", [5, 0], ids=["5_against_6", "empty_against_6"])
def test_ranks_that_disagree_are_reported_not_answered(doomed, first):
    """Rank 0 reduces ``first`` elements, the others 6: no rank gets a
    wrong sum; the watchdog (raise mode, 1 s) reports the call on every
    rank (an empty tensor too: it is no short cut, or rank 0's next call
    would meet its peers' 6-element one)."""
    import mpi_allreduce as mar

    r = doomed.r
    t = torch.ones(first if r == 0 else 6)
    with pytest.raises(mar.Stalled):
        dist.all_reduce(t, group=doomed.group)
    assert (t == 1).all()
    later = dist.new_group(list(range(doomed.p)))  # the same through an async Work
    t = torch.ones(first if r == 0 else 6)
    work = dist.all_reduce(t, group=later, async_op=True)
    with pytest.raises(mar.Stalled):
        work.wait()
    assert (t == 1).all()
    doomed.everyone(None)


def test_a_call_of_no_tensors_on_one_rank_stalls_never_shifts_the_next(doomed):
    """Rank 0 gives a coalesced all-reduce no tensors where its peers give
    one, then every rank makes the same all-reduce: no rank gets a wrong sum
    (before: rank 0 made no call at all, and its next all-reduce met its
    peers' first call); the mismatched call stalls (raise mode, 1 s)."""
    import mpi_allreduce as mar

    p, r, sub = doomed.p, doomed.r, doomed.group
    outcomes = []
    for step in range(2):
        t = torch.full((p,), 1.0 + r + 10 * step)
        try:
            if step == 0:
                with warnings.catch_warnings():  # (torch calls it deprecated)
                    warnings.simplefilter("ignore")
                    dist.all_reduce_coalesced([] if r == 0 else [t], group=sub)
            else:
                dist.all_reduce(t, group=sub)
                right = (t == sum(1.0 + q + 10 for q in range(p))).all()
                outcomes.append("right" if right else "WRONG")
        except mar.Broken as exc:  # (Stalled is a Broken)
            outcomes.append(type(exc).__name__)
    everyone = doomed.everyone(outcomes)
    assert not any("WRONG" in o for o in everyone), everyone
    assert all("Stalled" in o for o in everyone), everyone


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_mpis_calls_through_the_backend_are_watched_too(group, watchdog, async_op):
    """A barrier only rank 0 enters (raise mode, 0.5 s): Stalled on rank 0,
    naming the barrier and the group (in the agreement on its shape that
    every MPI-side call begins with); the group is then unusable there (the
    next call raises before posting anything).  The others then make that
    agreement, so nothing is left waiting."""
    import mpi_allreduce as mar

    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1:
        pytest.skip("one rank's barrier never waits")
    sub = dist.new_group(list(range(p)))
    watchdog(0.5)
    if r == 0:
        with pytest.raises(mar.Stalled, match=f"barrier \\(its shape agreed\\) on the "
                                               f"mpi_allreduce backend's group of {p} ranks"):
            work = dist.barrier(group=sub, async_op=async_op)
            if async_op:
                work.wait()
        with pytest.raises(mar.Stalled, match="an earlier call on this group stalled"):
            dist.broadcast(torch.ones(2), 0, group=sub)
    MPI.COMM_WORLD.Barrier()
    if r != 0:  # (completes rank 0's abandoned agreement)
        sub._agreed("barrier", ())  # (the group is the backend's own object)
    MPI.COMM_WORLD.Barrier()


def test_mpis_calls_through_the_backend_are_reported_in_warn_mode(group, watchdog, capfd):
    """Warn mode (1 s): rank 0 waits in a receive from rank 1, which sends
    only after 2.5 s; the report names the receive, then it completes."""
    import time

    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1:
        pytest.skip("one rank has no peer")
    watchdog(1, "warn")
    if r == 0:
        into = torch.zeros(2)
        dist.recv(into, 1, tag=9)
        assert into.tolist() == [1.0, 1.0]
        assert "recv on the mpi_allreduce backend's group" in capfd.readouterr().err
    elif r == 1:
        time.sleep(2.5)
        dist.send(torch.ones(2), 0, tag=9)
    MPI.COMM_WORLD.Barrier()


def test_a_rank_that_raises_inside_a_comm_hook(group, watchdog):
    """DDP with a comm hook that raises on rank 0: rank 0's backward raises
    that error; the others wait in vain for rank 0's messages, and their
    backward raises the watchdog's Stalled (raise mode, 1 s) instead of
    returning a gradient."""
    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1:
        pytest.skip("one rank has no peer to leave waiting")
    sub = dist.new_group(list(range(p)))  # left unusable
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), process_group=sub)
    watchdog(1)  # (after DDP's own broadcast, which must pass: a late peer is no fault)

    def hook(state, bucket):
        if r == 0:
            raise RuntimeError("hook fails on purpose")
        work = dist.all_reduce(bucket.buffer(), group=sub, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    ddp.register_comm_hook(None, hook)
    # (the others' error: the watchdog's, raised in the call or through its future)
    with pytest.raises(RuntimeError, match="on purpose" if r == 0 else "Stalled|watchdog"):
        ddp(torch.randn(3, 4)).sum().backward()
    MPI.COMM_WORLD.Barrier()


def test_destroy_and_init_again(group):
    """Last: the default group destroyed and made again (the fixture then
    destroys the new one)."""
    p = dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("mpi_allreduce")
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [float(p)] * 3


@pytest.mark.parametrize("scheme", ["file", "tcp"])
def test_file_and_tcp_init_take_rank_and_size_from_mpi(group, scheme, tmp_path):
    """``init_method="file://..."`` or ``"tcp://host:port"`` naming no rank
    or world size, under mpiexec: both come from MPI (as torch's own MPI
    backend takes them); afterwards the default group is made again."""
    world = MPI.COMM_WORLD
    p = world.Get_size()
    if p == 1:
        pytest.skip("one rank: nothing for MPI to tell torch (torch's own error stands)")
    if scheme == "file":
        url = world.bcast(f"file://{tmp_path}/store" if world.Get_rank() == 0 else None)
    else:
        # rank 0 holds a multi-tenant store server on a port the system
        # picked, which torch's rank 0 then joins: no port probed and let go
        server = (dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                                wait_for_workers=False) if world.Get_rank() == 0 else None)
        url = world.bcast(f"tcp://127.0.0.1:{server.port}" if server else None)
    dist.destroy_process_group()
    try:
        dist.init_process_group("mpi_allreduce", init_method=url)
        assert (dist.get_rank(), dist.get_world_size()) == (world.Get_rank(), p)
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [float(p)] * 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("mpi_allreduce")


def test_all_reduce_coalesced_packs_its_tensors_and_reduces_each_once(group):
    """One all-reduce of the tensors packed together, as gloo's: a tensor
    given twice holds the sum once (not the sum of sums); tensors of
    different sizes and shapes; synchronous and asynchronous."""
    p = dist.get_world_size()
    twice = torch.ones(3)
    dist.all_reduce_coalesced([twice, twice])
    assert twice.tolist() == [float(p)] * 3
    for async_op in (False, True):
        a = torch.full((2, 3), float(dist.get_rank()))
        b = torch.arange(5, dtype=torch.float32)
        work = dist.all_reduce_coalesced([a, b], async_op=async_op)
        if async_op:
            work.wait()
        assert a.tolist() == [[float(p * (p - 1) // 2)] * 3] * 2
        assert b.tolist() == [float(p * i) for i in range(5)]


def test_all_gather_coalesced_fills_torchs_rank_by_input_layout(group):
    """``output_tensor_lists[rank][i]`` gets rank ``rank``'s ``i``-th
    input, with as many inputs as ranks too (where a transposed layout
    would pass unnoticed in shape)."""
    p, r = dist.get_world_size(), dist.get_rank()
    for n_inputs in sorted({2, p}):
        inputs = [torch.full((i + 1,), float(10 * r + i)) for i in range(n_inputs)]
        outputs = [[torch.zeros(i + 1) for i in range(n_inputs)] for _ in range(p)]
        dist.all_gather_coalesced(outputs, inputs)
        for q in range(p):
            for i in range(n_inputs):
                assert outputs[q][i].tolist() == [float(10 * q + i)] * (i + 1), (q, i)


def test_async_op_is_each_ranks_own_choice(group):
    """One rank waits on an async all_reduce while the others call it
    synchronously (torch lets each rank choose): the same messages, the
    right sum on every rank, at a short and a long vector."""
    from mpi_allreduce.torch import configure

    p, r = dist.get_world_size(), dist.get_rank()
    # as configured too: live selection and reproducible sums (blocking calls
    # on every rank, whatever async_op says)
    for options in ({}, {"selection": "live"}, {"reproducible": True}):
        configure(**options)
        try:
            for count in (3, 1 << 15):
                t = torch.full((count,), float(r + 1))
                if r == 0:
                    dist.all_reduce(t, async_op=True).wait()
                else:
                    dist.all_reduce(t)
                assert torch.equal(t, torch.full((count,), float(p * (p + 1) // 2))), options
        finally:
            configure()


def test_the_profiler_shows_every_call_as_torchs_backends_name_theirs(group):
    """Under torch's profiler each collective and point-to-point call is an
    event ``mpi_allreduce:<name>`` (gloo's are ``gloo:<name>``; a coalesced
    all-reduce is an ``all_reduce`` as gloo's is), once per call,
    synchronous and asynchronous, asynchronous to the profiler (ended on
    another thread, as torch's backends end theirs), with the shapes of its
    input tensors (as torch's MPI backend records them); none is recorded
    outside it."""
    p, r = dist.get_world_size(), dist.get_rank()
    t = torch.ones(4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.broadcast(t, 0)
        out = [torch.zeros(4) for _ in range(p)]
        dist.all_gather(out, t)
        dist.barrier()
        dist.gather(torch.ones(3), [torch.zeros(3) for _ in range(p)] if r == 0 else None, dst=0)
        dist.all_reduce_coalesced([t, torch.ones(2)])  # one event, not one per inner call
        if p > 1:
            if r == 0:
                dist.send(t, 1)
            elif r == 1:
                dist.recv(t, 0)
    counts, shapes = {}, {}
    for event in prof.events():
        if event.name.startswith("mpi_allreduce:"):
            counts[event.name] = counts.get(event.name, 0) + 1
            shapes.setdefault(event.name, []).append(event.input_shapes)
            assert event.is_async, event
    want = {"mpi_allreduce:all_reduce": 3, "mpi_allreduce:broadcast": 1,
            "mpi_allreduce:all_gather": 1, "mpi_allreduce:barrier": 1, "mpi_allreduce:gather": 1}
    if p > 1 and r < 2:
        want["mpi_allreduce:send" if r == 0 else "mpi_allreduce:recv"] = 1
    assert counts == want
    assert shapes["mpi_allreduce:all_reduce"] == [[[4]], [[4]], [[4], [2]]]
    assert shapes["mpi_allreduce:all_gather"] == [[[4]]]  # (its input; the outputs are not)
    assert shapes["mpi_allreduce:barrier"] == [[]]
    assert shapes["mpi_allreduce:gather"] == [[[3]]]  # (its input, on the root too)
    if p > 1 and r < 2:
        assert shapes["mpi_allreduce:send" if r == 0 else "mpi_allreduce:recv"] == [[[4]]]
    assert t.tolist() == [float(p * p * p)] * 4


@pytest.mark.mpi_timeout(480)  # (each cycle makes two communicators: slow beside other launches)
def test_groups_made_and_destroyed_keep_nothing(group):
    """``new_group`` sets the group up there (collective, as torch makes
    groups), ``destroy_process_group`` frees its communicators and the
    library's context for it: over 200 cycles of new_group / all_reduce /
    destroy, the number of live contexts and of communicators does not
    grow, and the memory grows by less than 8 MiB."""
    import resource

    from mpi_allreduce import context

    p = dist.get_world_size()

    def cycle():
        g = dist.new_group(list(range(p)))
        assert len(context._LIVE) == before + (p > 1)  # set up at new_group already
        t = torch.ones(2)
        dist.all_reduce(t, group=g)
        assert t.tolist() == [float(p)] * 2
        dist.destroy_process_group(g)

    before = len(context._LIVE)
    for _ in range(20):  # (allocators and caches warm up)
        cycle()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(200):
        cycle()
    assert len(context._LIVE) == before
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    assert grown_kib < 8 << 10, f"{grown_kib} KiB more after 200 groups"


def test_a_then_callback_may_block_and_wait_for_other_futures(group):
    """A ``then`` callback (run by the progress thread that completes the
    call, or at once where the future was already complete) that makes a
    blocking all-reduce and waits for another group's call's future, as
    code written for gloo may: every rank gets both results."""
    p = dist.get_world_size()
    other = dist.new_group()
    try:
        for _ in range(3):
            a, b, c = torch.ones(4), torch.full((3,), 2.0), torch.full((5,), 3.0)
            first = dist.all_reduce(a, async_op=True)
            second = dist.all_reduce(b, async_op=True, group=other)

            def then(future):
                dist.all_reduce(c)
                return second.get_future().wait()[0].sum().item()
            assert first.get_future().then(then).wait() == 3 * 2.0 * p
            assert c.tolist() == [3.0 * p] * 5 and a.tolist() == [float(p)] * 4
    finally:
        dist.destroy_process_group(other)


def test_a_callback_and_the_caller_may_wait_for_one_work(group):
    """The caller waits for a call's Work (holding it while its parts
    complete on the progress thread) while a ``then`` callback of another
    call, on that thread, waits for the same Work: the thread serves while
    it waits for the Work, so both return, and the Work is free afterwards
    (a lock taken twice by the thread would leave it held)."""
    p = dist.get_world_size()
    other = dist.new_group()
    try:
        for _ in range(30):
            a, b = torch.ones(1000), torch.ones(3)
            first = dist.all_reduce(a, async_op=True)
            second = dist.all_reduce(b, async_op=True, group=other)
            seen = []
            chained = second.get_future().then(
                lambda future: (first.wait(), seen.append(a.sum().item())))
            first.wait()
            chained.wait()
            assert seen == [1000.0 * p]
            lock = getattr(first, "_lock", None)
            if lock is not None:
                assert lock.acquire(False), "the Work's lock is still held"
                lock.release()
    finally:
        dist.destroy_process_group(other)


def test_then_callbacks_keep_their_order_while_one_waits_for_a_future(group):
    """Callback A (of the first call) waits for a third call's future, which
    is not complete on rank 0 when A runs, then makes a blocking all-reduce
    on a fourth group; callback B (of the second call) makes one on that
    group too.  Rank 0 runs them on the progress thread, the others at once
    on their own thread (their calls complete before they add them): A's
    call comes first everywhere, so A gets p and B 100p (with B run inside
    A's wait on rank 0, the two calls crossed and both got 100 + 1 a rank).
    The other ranks start the second call only once the first is done, so
    on rank 0 too the first call's future completes first: callbacks run in
    their futures' completion order, which for calls on two groups may
    differ between ranks (as on torch's own backends)."""
    p, r = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group() for _ in range(4)]
    try:
        for g in groups:
            dist.all_reduce(torch.ones(1), group=g)
        g1, g2, g3, gx = groups
        got: dict = {}

        def make(name, value, before=None):
            def callback(future):
                if before is not None:
                    before()
                t = torch.full((4,), value)
                dist.all_reduce(t, group=gx)
                got[name] = t[0].item()
            return callback
        works = []
        for g in (g1, g2):
            works.append(dist.all_reduce(torch.ones(3), group=g, async_op=True))
            if r != 0:
                works[-1].wait()
                time.sleep(0.3)  # (rank 0's first call done first; then its A waits)
        third = dist.all_reduce(torch.ones(3), group=g3, async_op=True)
        if r != 0:
            third.wait()
        a = works[0].get_future().then(make("A", 1.0, third.get_future().wait))
        b = works[1].get_future().then(make("B", 100.0))
        a.wait()
        b.wait()
        assert got == {"A": 1.0 * p, "B": 100.0 * p}, got
    finally:
        for g in groups:
            dist.destroy_process_group(g)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_a_then_callback_that_raises_an_interrupt_still_completes_its_future(group, interrupt):
    """torch's futures refuse an interrupt as their error (and stayed never
    complete): the chained future holds a RuntimeError naming it."""
    work = dist.all_reduce(torch.ones(3), async_op=True)

    def callback(future):
        raise interrupt("stop")
    chained = work.get_future().then(callback)
    with pytest.raises(RuntimeError, match=interrupt.__name__):
        chained.wait()
    work.wait()


@pytest.mark.parametrize("algorithm", ["auto", "recursive_doubling", "ring"])
def test_calls_complete_whatever_order_each_rank_waits_in(group, watchdog, algorithm):
    """Async all-reduces on two groups whose futures rank 0 alone asks for,
    and waits for, in the opposite order (a short vector at 3 ranks or more
    takes several rounds, each of which moves only when someone advances
    it; a split by parity would hide this, since recursive doubling's
    partners beyond the first round share a parity): every call completes,
    none waits for another (raise mode, 20 s), at 1 and 2 ranks too."""
    from mpi_allreduce.torch import configure

    p, r = dist.get_world_size(), dist.get_rank()
    watchdog(20)
    configure(algorithm=algorithm)
    try:
        a, b = dist.new_group(list(range(p))), dist.new_group(list(range(p)))
        for _ in range(3):
            ta, tb = torch.ones(5), torch.full((5,), 2.0)
            works = [dist.all_reduce(ta, group=a, async_op=True),
                     dist.all_reduce(tb, group=b, async_op=True)]
            futures = [w.get_future() for w in (works if r else works[::-1])]
            torch.futures.wait_all(futures[:1])
            torch.futures.wait_all(futures)
            assert ta.tolist() == [float(p)] * 5 and tb.tolist() == [2.0 * p] * 5
            # and waited in opposite orders on the caller's thread
            ta, tb = torch.ones(5), torch.full((5,), 2.0)
            works = [dist.all_reduce(ta, group=a, async_op=True),
                     dist.all_reduce(tb, group=b, async_op=True)]
            for work in (works if r else works[::-1]):
                work.wait()
            assert ta.tolist() == [float(p)] * 5 and tb.tolist() == [2.0 * p] * 5
        # two fresh groups whose first calls the ranks start in opposite orders
        # (MPI lets calls on different communicators come in any order): nothing
        # collective waits for a group's first call
        c, d = dist.new_group(list(range(p))), dist.new_group(list(range(p)))
        tc, td = torch.ones(5), torch.full((5,), 2.0)
        starts = [lambda: dist.all_reduce(tc, group=c, async_op=True),
                  lambda: dist.all_reduce(td, group=d, async_op=True)]
        works = [start() for start in (starts if r % 2 == 0 else starts[::-1])]
        for work in works:
            work.wait()
        assert tc.tolist() == [float(p)] * 5 and td.tolist() == [2.0 * p] * 5
        for g in (a, b, c, d):
            dist.destroy_process_group(g)
    finally:
        configure()


def test_sparse_tensors_are_refused_with_a_clear_message(group):
    sparse = torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError, match="dense tensors"):
        dist.all_reduce(sparse)
    with pytest.raises(RuntimeError, match="dense tensors"):
        dist.broadcast(sparse, 0)


def test_fsdp2_trains_as_one_process_would(group):
    """FSDP2 (``fully_shard`` on a CPU DeviceMesh) on the backend: after a few
    steps on different data per rank, the gathered weights equal those of
    one process training on every rank's data (the gradients' average)."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed.device_mesh import init_device_mesh
    p, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (p,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    alone = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    alone.load_state_dict(model.state_dict())
    for layer in (model[0], model[2], model):
        fsdp.fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer_alone = torch.optim.SGD(alone.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        xs = [torch.randn(8, 16, generator=data) for _ in range(p)]
        model(xs[r]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        (sum(alone(x).pow(2).mean() for x in xs) / p).backward()
        optimizer_alone.step()
        optimizer_alone.zero_grad()
    for name, weight in alone.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name].full_tensor(), weight,
                                   rtol=1e-5, atol=1e-6)


def test_what_the_backend_does_not_do_raises(group):
    """Methods of a ProcessGroup the backend does not implement raise: they
    never fall through to the do-nothing backend that holds the group's name."""
    with pytest.raises(RuntimeError, match="does not support monitored_barrier"):
        group.monitored_barrier()
    assert group.group_name  # the name torch set (FSDP2's DeviceMesh reads it)


def test_all_gather_into_a_tensor_that_holds_the_input(group):
    """The input as this rank's block of the output (FSDP2's in-place
    gather), and as another block of it (gathered from a copy)."""
    p, r = dist.get_world_size(), dist.get_rank()
    out = torch.zeros(3 * p)
    out[3 * r:3 * r + 3] = torch.tensor([r, r + 0.5, -r], dtype=torch.float32)
    dist.all_gather_into_tensor(out, out[3 * r:3 * r + 3])
    want = torch.tensor([[q, q + 0.5, -q] for q in range(p)], dtype=torch.float32).reshape(-1)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out = torch.zeros(3 * p)
    out[:3] = r  # every rank's input is the first block, its own only on rank 0
    dist.all_gather_into_tensor(out, out[:3])
    torch.testing.assert_close(out, torch.arange(p, dtype=torch.float32).repeat_interleave(3),
                               rtol=0, atol=0)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_an_interrupt_in_an_all_reduce_breaks_its_group_never_a_wrong_result(
        group, interrupt_watchdog, async_op):
    """Ctrl-C (SIGINT's handler, from a timer) lands on rank 0 inside an
    all_reduce -- its own wait, or the Work's ``wait()`` -- while its peers
    are late; rank 0 raises the KeyboardInterrupt, and Broken when it calls
    again on the group; the peers get the exact sum or stall and raise, and
    no retry meets the interrupted call's messages (as the library's own
    calls: tests/test_construction_mpi.py)."""
    import threading

    import numpy as np

    from .test_construction_mpi import _interrupted_by_a_timer, _judge

    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1:
        pytest.skip("one rank has no peer to leave waiting")
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals land on the main thread")
    count = 3000
    exact = sum(np.arange(count, dtype=np.float64) + q for q in range(p))
    sub = dist.new_group(list(range(p)))  # (left unusable; set up here, out of the wait)

    def call():
        t = torch.arange(count, dtype=torch.float64) + r
        work = dist.all_reduce(t, group=sub, async_op=async_op)
        if async_op:
            work.wait()
        return t.numpy()

    _judge(_interrupted_by_a_timer(call, exact, r), MPI.COMM_WORLD)


def test_an_interrupt_in_a_broadcasts_wait_breaks_its_group_never_a_wrong_result(
        group, interrupt_watchdog, monkeypatch):
    """Ctrl-C lands on rank 0 as it waits in a broadcast (MPI's call, its
    shape agreed) for a root that posts late; rank 0 raises the
    KeyboardInterrupt, then Broken when it broadcasts again, and the
    library's all-reduce on the group raises too (before: an interrupt
    there left the group usable, and the retried broadcast met the root's
    next one, a wrong result); the root never gets a wrong one."""
    import signal
    import threading

    import numpy as np

    import mpi_allreduce as mar
    from mpi_allreduce import torch as backend

    from .test_construction_mpi import _judge, _outcome

    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1:
        pytest.skip("one rank has no peer to leave waiting")
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals land on the main thread")
    sub = dist.new_group(list(range(p)))  # (left unusable)
    root, real = p - 1, backend.MPIAllreduceGroup._agreed
    if r == root:
        def late(self, *args, **kwargs):  # (the root posts its broadcast 1 s late)
            real(self, *args, **kwargs)
            time.sleep(1.0)
        monkeypatch.setattr(backend.MPIAllreduceGroup, "_agreed", late)

    def call():
        t = torch.full((4,), float(r))
        dist.broadcast(t, src=root, group=sub)
        return t.numpy()
    outcomes = []
    for attempt in range(2):
        previous = signal.getsignal(signal.SIGALRM)
        if r == 0 and attempt == 0:
            signal.signal(signal.SIGALRM, signal.default_int_handler)
            signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            outcomes.append(_outcome(call, np.full(4, float(root))))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    monkeypatch.undo()
    if r == 0:
        with pytest.raises(mar.Broken):
            dist.all_reduce(torch.ones(2), group=sub)
    _judge(outcomes, MPI.COMM_WORLD)


def test_an_interrupt_as_an_mpi_side_call_checks_its_group_breaks_it(group, interrupt_watchdog,
                                                                    monkeypatch):
    """An interrupt lands on rank 0 as a broadcast checks whether its group
    is broken (before its agreement); rank 0 broadcasts again: Broken at
    once, the root stalls, nobody gets a wrong value (before: the check ran
    outside the call's handler, rank 0 skipped a broadcast, and its next
    one met the root's first)."""
    import numpy as np

    from mpi_allreduce import torch as backend

    from .test_construction_mpi import _judge, _outcome

    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1:
        pytest.skip("one rank has no peer to leave waiting")
    sub = dist.new_group(list(range(p)))  # (left unusable)
    real, armed = backend.MPIAllreduceGroup._refuse_if_broken, [r == 0]

    def check(self):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt("lands as the broadcast checks its group")
        return real(self)
    monkeypatch.setattr(backend.MPIAllreduceGroup, "_refuse_if_broken", check)

    def call(k):
        t = torch.full((4,), float(r + 10 * k))
        dist.broadcast(t, src=p - 1, group=sub)
        return t.numpy()
    outcomes = [_outcome(lambda k=k: call(k), np.full(4, float(p - 1 + 10 * k)))
                for k in range(2)]
    monkeypatch.undo()
    _judge(outcomes, MPI.COMM_WORLD)


def _shape_cases(p: int, r: int) -> dict:
    """MPI-side collectives whose ranks disagree about the shape (rank 1
    differs; rank 0 is the root): each a function that makes the call and
    returns the tensors the call may write."""
    def broadcast(n, dtype=torch.float32):
        t = torch.full((n,), -1.0).to(dtype)
        dist.broadcast(t, src=0)
        return [t]

    def gather(n):
        t = torch.full((n,), float(r))
        out = [torch.full((3,), -1.0) for _ in range(p)] if r == 0 else None
        dist.gather(t, out, dst=0)
        return out or [t]

    def scatter(n):
        out = torch.full((n,), -1.0)
        dist.scatter(out, [torch.full((3,), float(i)) for i in range(p)] if r == 0 else None,
                     src=0)
        return [out]

    def all_to_all_single(rows):
        out = torch.full((3 * p,), -1.0)
        dist.all_to_all_single(out, torch.full((rows * p,), float(r)))
        return [out]

    def all_to_all(n):
        outs = [torch.full((3,), -1.0) for _ in range(p)]
        dist.all_to_all(outs, [torch.full((n if j == 0 else 3,), float(r)) for j in range(p)])
        return outs
    other = 2 if r == 1 else 3
    return {
        "broadcast size": lambda: broadcast(other if r == 1 else 3),
        "broadcast dtype": lambda: broadcast(3, torch.int32 if r == 1 else torch.float32),
        "gather": lambda: gather(other),
        "scatter": lambda: scatter(other),
        "all_to_all_single": lambda: all_to_all_single(other),
        "all_to_all": lambda: all_to_all(other),
        "barrier against broadcast": lambda: (dist.barrier(), None)[1] if r == 1 else
        broadcast(3),
    }


@pytest.mark.parametrize("case", ["broadcast size", "broadcast dtype", "gather", "scatter",
                                  "all_to_all_single", "all_to_all",
                                  "barrier against broadcast"])
def test_mpi_side_collectives_whose_ranks_disagree_raise_on_every_rank(group, case):
    """Rank 1 gives a broadcast, gather, scatter or all-to-all of another
    size or dtype than its peers: every rank raises ArgumentMismatch
    before a byte moves, nothing is written, and the group stays usable
    (before: MPI matched the calls by order alone -- a silently partial or
    reinterpreted tensor on one rank, a truncation error on another)."""
    import mpi_allreduce as mar

    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1:
        pytest.skip("one rank cannot disagree")
    written = None
    with pytest.raises(mar.ArgumentMismatch, match="no rank sent anything"):
        written = _shape_cases(p, r)[case]()
    assert written is None
    t = torch.full((4,), float(r))
    dist.broadcast(t, src=p - 1)  # (the group is still usable: nothing was sent)
    assert torch.equal(t, torch.full((4,), float(p - 1)))


#: all-reduces whose rank 0 differs from its peers in what the count, dtype
#: and op name do not show (on ``group``)
def _hidden_differences(group, r: int) -> dict:
    def coalesced():
        sizes = [3, 5] if r == 0 else [5, 3]
        tensors = [torch.full((n,), float(r + 1 + 10 * k)) for k, n in enumerate(sizes)]
        with warnings.catch_warnings():  # (torch calls it deprecated)
            warnings.simplefilter("ignore")
            dist.all_reduce_coalesced(tensors, group=group)

    def premul():
        op = dist._make_nccl_premul_sum(2.0) if r == 0 else dist.ReduceOp.SUM
        dist.all_reduce(torch.full((4,), float(r + 1)), op=op, group=group)
    return {"coalesced sizes": coalesced, "premul against sum": premul}


@pytest.mark.parametrize("case", ["coalesced sizes", "premul against sum"])
def test_calls_that_differ_in_what_their_count_hides_stall(doomed, case):
    """Rank 0 coalesces tensors of sizes [3, 5] where its peers give [5, 3]
    (one flat call of 8 elements on every rank), or pre-multiplies where its
    peers sum: the tensor sizes and the pre-multiplication are in the call's
    identity (``ops.tagged``), so the calls stall and are reported on every
    rank (before: a silently wrong sum on every rank)."""
    import mpi_allreduce as mar

    try:
        _hidden_differences(doomed.group, doomed.r)[case]()
        outcome = "returned"
    except mar.Stalled:
        outcome = "Stalled"
    everyone = doomed.everyone(outcome)
    assert everyone == ["Stalled"] * doomed.p, everyone


#: calls of ours that rank 0 refuses in the backend before the library's call
#: (a sparse tensor, lists that do not match), its peers' valid
def _refused_by_one(group, p: int, r: int, refuse: bool) -> dict:
    def dense(t):
        return t.to_sparse() if refuse else t

    def all_reduce():
        dist.all_reduce(dense(torch.ones(4)), group=group)

    def second_of_two():  # (the first tensor is fine on every rank)
        with warnings.catch_warnings():  # (torch calls it deprecated)
            warnings.simplefilter("ignore")
            dist.all_reduce_coalesced([torch.ones(3), dense(torch.ones(4))], group=group)

    def reduce_scatter():
        dist.reduce_scatter_tensor(torch.empty(2), dense(torch.ones(2 * p)), group=group)

    def all_gather():
        dist.all_gather_into_tensor(torch.empty(2 * p), dense(torch.ones(2)), group=group)

    def all_gather_coalesced():
        outputs = [[torch.empty(2)] for _ in range(p - 1 if refuse else p)]
        with warnings.catch_warnings():  # (torch calls it deprecated)
            warnings.simplefilter("ignore")
            dist.all_gather_coalesced(outputs, [torch.ones(2)], group=group)
    return {"all_reduce": all_reduce, "second of two": second_of_two,
            "reduce_scatter": reduce_scatter, "all_gather": all_gather,
            "all_gather_coalesced": all_gather_coalesced}


_REFUSED = ["all_reduce", "second of two", "reduce_scatter", "all_gather",
            "all_gather_coalesced"]


@pytest.mark.parametrize("case", _REFUSED)
def test_a_call_the_backend_refuses_on_one_rank_stalls_never_shifts_the_next(doomed, case):
    """Rank 0's backend refuses its tensors (sparse, or lists that do not
    match) before the library's call, its peers' are valid; then every rank
    makes the same all-reduce: no rank gets a wrong sum, the refused call
    stalls on every rank (reported, raise mode 1 s; before: rank 0 raised
    alone, and its next call met its peers' refused one)."""
    import mpi_allreduce as mar

    p, r = doomed.p, doomed.r
    outcomes = []
    try:
        _refused_by_one(doomed.group, p, r, refuse=r == 0)[case]()
        outcomes.append("returned")
    except mar.Broken as exc:  # (Stalled is a Broken)
        outcomes.append(type(exc).__name__)
    except (RuntimeError, ValueError) as exc:
        outcomes.append(f"alone: {exc}")
    doomed.stalled_then_next(outcomes)


def _several(group, p: int, n: int) -> dict:
    """Calls of ours given ``n`` tensors: one library call for each."""
    def all_gather_coalesced():
        with warnings.catch_warnings():  # (torch calls it deprecated)
            warnings.simplefilter("ignore")
            dist.all_gather_coalesced([[torch.empty(2) for _ in range(n)] for _ in range(p)],
                                      [torch.ones(2) for _ in range(n)], group=group)

    def all_gather_into_tensor_coalesced():
        with dist._coalescing_manager(group=group):
            for _ in range(n):
                dist.all_gather_into_tensor(torch.empty(2 * p), torch.ones(2), group=group)

    def reduce_scatter_tensor_coalesced():
        with dist._coalescing_manager(group=group):
            for _ in range(n):
                dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * p), group=group)
    return {"all_gather_coalesced": all_gather_coalesced,
            "all_gather_into_tensor_coalesced": all_gather_into_tensor_coalesced,
            "reduce_scatter_tensor_coalesced": reduce_scatter_tensor_coalesced}


@pytest.mark.parametrize("case", ["all_gather_coalesced", "all_gather_into_tensor_coalesced",
                                  "reduce_scatter_tensor_coalesced"])
def test_calls_given_different_numbers_of_tensors_stall_never_shift_the_next(doomed, case):
    """Rank 0 gives two tensors where its peers give one (each a library
    call of its own): the ranks first agree on how many, so the calls stall
    on every rank and the next all-reduce is exact or stalls (before: rank
    0's second call met its peers' next one, a wrong result on both)."""
    import mpi_allreduce as mar

    p, r = doomed.p, doomed.r
    outcomes = []
    try:
        _several(doomed.group, p, 2 if r == 0 else 1)[case]()
        outcomes.append("returned")
    except mar.Broken as exc:  # (Stalled is a Broken)
        outcomes.append(type(exc).__name__)
    doomed.stalled_then_next(outcomes)


@pytest.mark.parametrize("case", ["all_gather_coalesced", "all_gather_into_tensor_coalesced",
                                  "reduce_scatter_tensor_coalesced"])
def test_calls_given_numbers_of_tensors_that_differ_raise_on_every_rank(group, case):
    """Every rank gives several tensors, rank 0 more than its peers: every
    rank raises ArgumentMismatch before a library call, and the group stays
    usable."""
    import mpi_allreduce as mar

    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1:
        pytest.skip("one rank cannot disagree")
    with pytest.raises(mar.ArgumentMismatch):
        _several(None, p, 3 if r == 0 else 2)[case]()
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    assert (t == p * (p + 1) / 2).all()


@pytest.mark.parametrize("case", _REFUSED)
def test_a_call_every_rank_refuses_raises_everywhere_and_the_next_is_exact(group, case):
    """Every rank's backend refuses the call: every rank raises its refusal
    and the group's next all-reduce is exact."""
    p, r = dist.get_world_size(), dist.get_rank()
    with pytest.raises((RuntimeError, ValueError), match="dense tensors|output_tensor_lists"):
        _refused_by_one(None, p, r, refuse=True)[case]()
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    assert (t == p * (p + 1) / 2).all()


@pytest.mark.parametrize("case", ["broadcast", "gather", "scatter", "all_to_all_single",
                                  "all_to_all"])
def test_an_mpi_side_collective_one_rank_refuses_raises_on_every_rank(group, case):
    """Rank 1 gives a sparse tensor to a broadcast, gather, scatter or
    all-to-all: it raises its refusal, its peers ArgumentMismatch, before
    a byte moves, and the group stays usable (before: rank 1 raised alone
    after the agreement, and its peers' collective went ahead without it)."""
    import mpi_allreduce as mar

    p, r = dist.get_world_size(), dist.get_rank()
    if p == 1:
        pytest.skip("one rank cannot disagree")

    def mine(n):
        t = torch.full((n,), float(r))
        return t.to_sparse() if r == 1 else t
    calls = {
        "broadcast": lambda: dist.broadcast(mine(3), src=0),
        "gather": lambda: dist.gather(mine(3), [torch.empty(3) for _ in range(p)]
                                      if r == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(mine(3), [torch.ones(3) for _ in range(p)]
                                        if r == 0 else None, src=0),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(p), mine(p)),
        "all_to_all": lambda: dist.all_to_all([torch.empty(1) for _ in range(p)],
                                              [mine(1) for _ in range(p)]),
    }
    expected = (RuntimeError, "dense tensors") if r == 1 else \
        (mar.ArgumentMismatch, "no rank sent anything")
    with pytest.raises(expected[0], match=expected[1]):
        calls[case]()
    t = torch.full((4,), float(r))
    dist.broadcast(t, src=p - 1)  # (the group is still usable: nothing was sent)
    assert torch.equal(t, torch.full((4,), float(p - 1)))
