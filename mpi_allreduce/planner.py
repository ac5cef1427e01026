"""A validated call -> its algorithm -> its spec -> its plan -> what runs it.

:func:`choice` is the algorithm (named, or ``auto``'s choice from the
decision table), :func:`spec_of` the call's
:class:`~mpi_allreduce.spec.CallSpec` (hierarchical's options resolved by
:func:`~mpi_allreduce.selection.hierarchical_options`, a flat algorithm's
by its module: :func:`algorithm_options`), :func:`plan_for`
its :class:`~mpi_allreduce.executor.Plan` from the context's cache, and
:func:`runner` the blocking call bound to the caller's arrays through the
engine (:func:`~mpi_allreduce.progress.blocking`), or under live
selection a small loop around the selector.
"""

from __future__ import annotations

import time

from . import progress, registry, selection as _selection
from .context import Context
from .executor import Plan
from .ops import dtype_label, spec_label
from .spec import CallSpec
from .validate import Call

__all__ = ["choice", "spec_of", "algorithm_options", "plan_for", "resolved", "runner",
           "LIVE_MIN_BYTES", "SAMPLE"]

#: below this many bytes live selection leaves ``auto`` to the table: a call
#: is then latency, the algorithms' order follows their message counts, and
#: the selector's own Python (about 0.3 us a call) would be 10% of a call
LIVE_MIN_BYTES = 16 * 1024


#: live selection times one call of the current algorithm in this many
#: (each timed call stands for them all: the mean is what it needs)
SAMPLE = 8


def choice(context: Context, call: Call, count: int) -> str:
    """The algorithm the table runs for this call (``auto`` resolved)."""
    if call.algorithm != "auto":
        return call.algorithm
    nbytes = count * call.recv.dtype.itemsize
    name = context.table(call.tuning).choose(nbytes, context.size, context.oversubscribed)
    return name if call.op.commutative else registry.in_rank_order(name)


def spec_of(context: Context, call: Call, name: str) -> CallSpec:
    """The spec of ``call`` run with algorithm ``name`` on ``context``
    (hierarchical's options resolved by
    :func:`~mpi_allreduce.selection.hierarchical_options`, the others' by
    :func:`algorithm_options`)."""
    count, dtype = call.recv.size, call.recv.dtype
    if name == "hierarchical":
        options = _selection.hierarchical_options(
            context.nodes(call.ranks_per_node), call.inner, count * dtype.itemsize,
            context.table(call.tuning),
            context.oversubscribed, call.op.commutative)
    else:
        options = algorithm_options(name, call.options, context.size)
    return CallSpec("allreduce", name, context.size, count, dtype_label(dtype),
                    spec_label(call.op, dtype, call.datatype, count), call.segment_size, options,
                    salt=call.salt)


def algorithm_options(name: str, opts, size: int) -> tuple:
    """The options a flat algorithm's builder takes (those its module names
    in ``OPTIONS``: ``radix``, ``row_size``), resolved by the module for
    ``size`` ranks, defaults included, as sorted ``(key, value)`` pairs:
    what the call's spec, and so its fingerprint, carries."""
    module = registry.get(name)
    names = getattr(module, "OPTIONS", ())
    if not names:
        return ()
    return tuple(sorted(module.resolve(size, **{n: getattr(opts, n) for n in names})))


def plan_for(context: Context, call: Call, name: str) -> Plan:
    """The plan of algorithm ``name`` for this call's spec, from the context's cache."""
    spec = spec_of(context, call, name)
    key = (spec, call.op.identity, call.backend)

    def build():
        schedule = registry.schedule(name, context.comm.Get_rank(), context.size, spec.count,
                                     spec.segment_size, spec.options)
        return Plan(context.comm, schedule, call.recv.dtype, call.op, call.backend, spec)
    return context.plan(key, build)


def resolved(context: Context, call: Call) -> dict:
    """What check mode compares next: the spec the call runs (the decision
    table's choice, hierarchical's options), where the table decides."""
    if not call.recv.size or (call.algorithm == "auto" and call.selection == "live"):
        return {}
    return spec_of(context, call, choice(context, call, call.recv.size)).fields()


def runner(context: Context, call: Call):
    """What runs this call on these arrays: the bound plan of the chosen
    algorithm, or under live selection a small loop around the selector."""
    send, recv = call.send, call.recv
    name = choice(context, call, recv.size)
    if call.algorithm != "auto" or call.selection == "table" or \
            recv.nbytes < LIVE_MIN_BYTES:
        bound = plan_for(context, call, name).bind(send, recv, datatype=call.datatype)
        return progress.blocking(bound, context, "allreduce")
    shape = (recv.size, dtype_label(recv.dtype), call.op.identity, call.backend, call.segment_size)
    candidates = tuple(a for a in registry.candidates(recv.nbytes)
                       if call.op.commutative or a in registry.ORDERED)
    table_choice = name

    def make():
        return _selection.LiveSelector(context.comm, table_choice, candidates, context=context)
    bound = {}
    clock = time.perf_counter
    name = step = None  # the current algorithm and its bound call on these arrays

    def bound_run(chosen):
        run = bound.get(chosen)
        if run is None:
            b = plan_for(context, call, chosen).bind(send, recv, datatype=call.datatype)
            run = bound[chosen] = progress.blocking(b, context, "allreduce")
        return run

    def live_run():
        nonlocal name, step
        # found per call (the context keeps the selector of each shape, the
        # same on every rank): arrays bound to one shape share its counts
        s = context.selector(shape, make)
        s.made += 1
        if name != s.current:
            name, step = s.current, bound_run(s.current)
        if s.made < s.due:  # most calls: the current algorithm, untimed
            step()
            return
        start = clock()  # a first call pays for its plan: it is counted
        probe = s.probe
        if probe is not None:
            bound_run(probe)()
            s.observe(probe, clock() - start)
            s.counted += 1
        else:
            step()
            # this timed call stands for the untimed ones since the last
            s.tick(clock() - start, s.made - s.counted)
            s.counted = s.made
        s.due = s.made + 1 if s.probe is not None or name != s.current else s.made + SAMPLE
    return progress.guarded(context, ("allreduce (live selection)", None), live_run)
