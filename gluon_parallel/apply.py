"""parallel_apply (module ``apply``, so that it does not shadow the function
``gluon_parallel.parallel_apply``): run a callable once per replica, concurrently, on the
shared worker pool; and the first-call warm-up every parallel call needs.

Several threads finishing a block's deferred initialisation or building its
hybridized graph at once race (measured: corrupted name scopes, wrong
shapes), so that work happens once, serially, on one device, under one lock
(:func:`warm_up`), in the mode of the call it serves: a hybridized graph is
traced as Gluon traces it at its first call, and it keeps that graph.
"""
import os
import sys
import threading
import warnings
import weakref

import mxnet as mx
from mxnet import autograd, gluon

from . import _gluon
from ._gluon import call_with_kwargs as call_block
from .nested import ndarrays
from .pool import check_threads, shared_pool
from .replica import ParallelCall, annotate, default_timeout
from .split import first_ctx

__all__ = ['parallel_apply', 'check_ctx_list', 'graph_pending', 'unbuilt_graphs', 'warm_up']


def _default_ctx_list():
    """Every GPU, else one CPU context; says which (a UserWarning at the
    caller's line: Python shows it once per line), since with no GPU the
    multi-device path silently runs on one device."""
    n = mx.context.num_gpus()
    if n:
        ctx_list = [mx.gpu(i) for i in range(n)]
        why = f'every GPU MXNet sees, {ctx_list}'
    else:
        ctx_list = [mx.cpu()]
        why = (f'{ctx_list} only: MXNet sees no GPU. For several CPU contexts pass '
               'ctx_list=[mx.cpu(i) for i in range(N)] (docs/training-loop.md, '
               '"How many CPU contexts")')
    warnings.warn(f'gluon_parallel: no ctx_list given, so the replicas run on {why}', UserWarning,
                  stacklevel=_outside_the_package())
    return ctx_list


def _outside_the_package():
    """The `stacklevel` of the innermost caller outside gluon_parallel, as
    seen from a function of the package that calls ``warnings.warn``."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def check_ctx_list(ctx_list):
    if ctx_list is None:
        return _default_ctx_list()
    if isinstance(ctx_list, mx.Context):
        ctx_list = [ctx_list]
    ctx_list = list(ctx_list)
    if not ctx_list:
        raise ValueError('ctx_list is empty: give at least one context')
    for c in ctx_list:
        if not isinstance(c, mx.Context):
            raise TypeError(f'ctx_list must hold mxnet Contexts, got {c!r}')
    if len(set(ctx_list)) != len(ctx_list):
        raise ValueError(f'ctx_list lists a context twice: {ctx_list}')
    return ctx_list


def unbuilt_graphs(block):
    """True if a hybridized block in the tree has no cached graph yet or a
    parameter still waits for deferred initialisation."""
    for p in block.collect_params().values():
        if _gluon.is_deferred(p):
            return True
    stack = [block]
    while stack:
        b = stack.pop()
        if _gluon.is_active_hybrid(b):
            if _gluon.graph_handle(b) is None:
                return True
            continue            # children of an active block run inside its graph
        stack.extend(_gluon.children(b).values())
    return False


def graph_pending(block):
    """Cheap per-call check: `block` is hybridized and its graph not built
    (yet, or again since a ``hybridize()`` or a cast)."""
    return _gluon.is_active_hybrid(block) and _gluon.graph_handle(block) is None


_locks = weakref.WeakKeyDictionary()     # block -> its warm-up lock
_locks_lock = threading.Lock()


def _lock_of(block):
    with _locks_lock:
        lock = _locks.get(block)
        if lock is None:
            # Reentrant: a block's warm-up may make a nested call of itself.
            lock = _locks[block] = threading.RLock()
        return lock


def warm_up(block, args, kwargs, ctx, rank=0, check=None):
    """Finish `block`'s deferred initialisation and build its hybridized
    graphs on `ctx`, if it still has to, in the autograd mode and recording
    state of the call it serves (the caller's), without changing what that
    call computes. Errors name the replica.

    A hybridized block's graph is built without running it
    (``_gluon.build_graph``): traced in the call's mode, as plain Gluon
    traces it at its first call (a block whose graph depends on
    ``autograd.is_training()`` gets the graph of the call's mode, which
    later calls keep, as in Gluon), its deferred shapes inferred, its
    parameters initialised; nothing is computed. Any other block runs once
    (:func:`_run_once`): its own code in the call's mode, each hybridized
    block inside it built so, then run, like every layer without children
    (BatchNorm, Dropout...), in predict mode and unrecorded: no running
    statistics move and no random numbers are drawn but those of deferred
    initialisation, which the per-device loop draws too, though between
    its forward's own draws (a Dropout before a deferred layer draws its
    mask before that layer's initial values there, after them here).

    One lock per block: callers of other blocks never wait, so a warm-up
    whose forward runs other parallel calls cannot wait for itself.
    `check()`, if given, runs first under that lock: a parameter check made
    while another thread is half-way through the block's deferred
    initialisation would see a parameter neither deferred nor created.
    """
    with _lock_of(block):
        if check is not None:
            check()
        if not unbuilt_graphs(block):
            return
        try:
            with ctx:
                if _gluon.is_active_hybrid(block) and not kwargs:
                    _gluon.build_graph(block, args)
                else:
                    _run_once(block, args, kwargs)
        except BaseException as e:
            annotate(e, rank, ctx)      # the same exception, its message naming the replica
            raise


def _run_once(block, args, kwargs):
    """`block(*args, **kwargs)` in the caller's autograd state, with every
    island (:func:`_islands`) built in that state and run in predict mode,
    unrecorded: its own hooks, added for this call, switch the state
    around it."""
    states = []

    def enter(b, b_args):
        if _has_array(b_args):          # (not a symbol, as when a graph is traced)
            if _gluon.is_active_hybrid(b):
                _gluon.build_graph(b, b_args)
            states.append((autograd.set_recording(False), autograd.set_training(False)))

    def leave(b, b_args, out):
        if states and _has_array(b_args):
            recording, training = states.pop()
            autograd.set_recording(recording)
            autograd.set_training(training)

    handles = []
    for b in _islands(block):
        handles += [b.register_forward_pre_hook(enter), b.register_forward_hook(leave)]
    # The scope restores the caller's state, whatever an error left.
    scope = autograd.record if autograd.is_recording() else autograd.pause
    try:
        with scope(train_mode=autograd.is_training()):
            call_block(block, args, kwargs)
    finally:
        for h in handles:
            h.detach()


def _has_array(obj):
    """An NDArray in nested lists, tuples and dicts."""
    return next(ndarrays(obj), None) is not None


def _islands(block):
    """The blocks under `block` (itself included) that run as one unit: a
    hybridized block (its children run inside its graph) and a
    HybridBlock without children (a layer: BatchNorm, Dropout...)."""
    stack = [block]
    while stack:
        b = stack.pop()
        kids = _gluon.children(b)
        if _gluon.is_active_hybrid(b) or (isinstance(b, gluon.HybridBlock) and not kids):
            yield b
        else:
            stack.extend(kids.values())


def parallel_apply(fn_or_blocks, inputs, kwargs_list=None, ctx_list=None, sync=False,
                   threads='auto'):
    """Run a callable once per replica, concurrently, on the worker pool.

    Parameters
    ----------
    fn_or_blocks : callable or list of callables
        One callable for every replica, or one per replica.
    inputs : list
        Positional arguments of each replica: a tuple, or a single value.
    kwargs_list : list of dict, optional
        Keyword arguments of each replica.
    ctx_list : list of Context, optional
        Context of each replica; default: the context of the first NDArray in
        each replica's inputs.
    sync : bool, default False
        Wait until the outputs are computed before returning.
    threads : 'auto' or True, default 'auto'
        As in :class:`DataParallel`.

    Returns
    -------
    list
        The output of each replica, in order.
    """
    threads = check_threads(threads)
    inputs = [x if isinstance(x, tuple) else (x,) for x in inputs]
    if not inputs:
        raise ValueError('parallel_apply needs at least one replica input')
    if ctx_list is None:
        ctx_list = [first_ctx(x) for x in inputs]
    ctx_list = check_ctx_list(ctx_list)
    if len(ctx_list) < len(inputs):
        raise ValueError(f'{len(inputs)} replica inputs but only {len(ctx_list)} contexts')
    if isinstance(fn_or_blocks, (list, tuple)) and len(fn_or_blocks) != len(inputs):
        raise ValueError(f'{len(fn_or_blocks)} callables for {len(inputs)} replica inputs')
    if kwargs_list is not None and len(kwargs_list) != len(inputs):
        raise ValueError(f'{len(kwargs_list)} kwargs dicts for {len(inputs)} replica inputs')
    n = len(inputs)
    _warm_up_blocks(fn_or_blocks, inputs, kwargs_list, ctx_list)
    call = ParallelCall(ctx_list[:n], ctx_list, default_timeout())
    return shared_pool(ctx_list, call.depth).run(fn_or_blocks, inputs, kwargs_list, call, sync,
                                                 threads=threads)


_warmed = weakref.WeakSet()


def _warm_up_blocks(fn_or_blocks, inputs, kwargs_list, ctx_list):
    """Every Block among the callables that still has to build is warmed up
    (:func:`warm_up`) before the replicas run it concurrently."""
    fns = fn_or_blocks if isinstance(fn_or_blocks, (list, tuple)) else [fn_or_blocks]
    for i, fn in enumerate(fns):
        if not isinstance(fn, gluon.Block) or (fn in _warmed and not graph_pending(fn)):
            continue
        if unbuilt_graphs(fn):      # (built blocks need no lock)
            warm_up(fn, inputs[i], kwargs_list[i] if kwargs_list is not None else {},
                    ctx_list[i], i)
        _warmed.add(fn)
