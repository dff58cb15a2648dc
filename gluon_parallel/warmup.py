"""The first-call warm-up every parallel call needs.

Several threads finishing a block's deferred initialisation or building its
hybridized graph at once race (measured: corrupted name scopes, wrong
shapes), so that work happens once, serially, on one device, under one lock
(:func:`warm_up`), in the mode of the call it serves: a hybridized graph is
traced as Gluon traces it at its first call, and it keeps that graph.
"""
import threading
import weakref

from mxnet import autograd, gluon

from . import _gluon
from ._gluon import call_with_kwargs as call_block
from .nested import ndarrays
from .replica_context import annotate

__all__ = ['warm_up', 'unbuilt_graphs', 'graph_unbuilt']


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


def graph_unbuilt(block):
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
                inputs = _graph_inputs(block, args, kwargs)
                if inputs is not None:
                    _gluon.build_graph(block, inputs)
                else:
                    _run_once(block, args, kwargs)
        except BaseException as e:
            annotate(e, rank, ctx)      # the same exception, its message naming the replica
            raise


def _graph_inputs(block, args, kwargs):
    """The inputs `block`'s call hands its cached graph, if it is an active
    HybridBlock whose graph they build without running anything: its
    arguments themselves, or, for a call with keywords or to a block with a
    ``__call__`` of its own, what that call hands its graph
    (``_gluon.cached_graph_inputs``; forward hooks would run twice, so a
    block with hooks runs once instead). None: run the block once."""
    if not _gluon.is_active_hybrid(block):
        return None
    if not kwargs and not _gluon.own_call(block):
        return args
    if _gluon.has_forward_hooks(block):
        return None
    try:
        return _gluon.cached_graph_inputs(block, args, kwargs)
    except Exception:       # noqa: B902 (run once: the call raises it there, named)
        return None


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
