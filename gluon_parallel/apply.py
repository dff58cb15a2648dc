"""parallel_apply (module ``apply``, so that it does not shadow the function
``gluon_parallel.parallel_apply``): run a callable once per replica,
concurrently, on the shared worker pool, each Block among the callables
warmed up first (warmup.py).
"""
import weakref

from mxnet import gluon

from .contexts import check_ctx_list
from .replica_context import ParallelCall, default_timeout
from .split import first_ctx
from .syncgraph import ensure_routing
from .warmup import graph_unbuilt, unbuilt_graphs, warm_up
from .workers import check_threads, shared_pool

__all__ = ['parallel_apply']


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
    ensure_routing()        # a hybridized SyncBatchNorm network runs in stages per replica
    return shared_pool(ctx_list, call.depth).run(fn_or_blocks, inputs, kwargs_list, call, sync,
                                                 threads=threads)


_warmed = weakref.WeakSet()


def _warm_up_blocks(fn_or_blocks, inputs, kwargs_list, ctx_list):
    """Every Block among the callables that still has to build is warmed up
    (:func:`warm_up`) before the replicas run it concurrently."""
    fns = fn_or_blocks if isinstance(fn_or_blocks, (list, tuple)) else [fn_or_blocks]
    for i, fn in enumerate(fns):
        if not isinstance(fn, gluon.Block) or (fn in _warmed and not graph_unbuilt(fn)):
            continue
        if unbuilt_graphs(fn):      # (built blocks need no lock)
            warm_up(fn, inputs[i], kwargs_list[i] if kwargs_list is not None else {},
                    ctx_list[i], i)
        _warmed.add(fn)
