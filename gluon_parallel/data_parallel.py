"""DataParallel, DataParallelLoss and parallel_apply.

The data path of one call: split the batch (split.py), run one replica per
device on the persistent pool (pool.py) inside a ReplicaContext
(context.py), return the per-device outputs. The autograd graph spans all
devices, so one ``autograd.backward(losses)`` in the caller gives every
parameter copy its gradient; the Trainer's kvstore then sums them.
"""
import threading
import math
import weakref

import mxnet as mx
from mxnet import autograd, gluon, nd

from .context import ParallelCall, current_replica, default_timeout
from .pool import WorkerPool, _annotate
from .split import split_load_kwargs, _first_ctx, _split_ndarrays
from .grads import clear_idle_grads
from .params import check_params, register_wrapper

__all__ = ['DataParallel', 'DataParallelLoss', 'parallel_apply']


def _default_ctx_list():
    n = mx.context.num_gpus()
    return [mx.gpu(i) for i in range(n)] if n else [mx.cpu()]


def _check_ctx_list(ctx_list):
    if ctx_list is None:
        return _default_ctx_list()
    if isinstance(ctx_list, mx.Context):
        ctx_list = [ctx_list]
    ctx_list = list(ctx_list)
    if not ctx_list:
        raise ValueError('ctx_list is empty: give at least one context')
    for c in ctx_list:
        if not isinstance(c, mx.Context):
            raise TypeError('ctx_list must hold mxnet Contexts, got %r' % (c,))
    if len(set(ctx_list)) != len(ctx_list):
        raise ValueError('ctx_list lists a context twice: %s' % ctx_list)
    return ctx_list


def _call_block(block, args, kwargs):
    """``block(*args, **kwargs)``; Gluon 1.x ``Block.__call__`` takes no
    keyword arguments, so those go to ``forward`` with the hooks run here."""
    if not kwargs:
        return block(*args)
    for hook in block._forward_pre_hooks.values():
        hook(block, args)
    out = block.forward(*args, **kwargs)
    for hook in block._forward_hooks.values():
        hook(block, args, out)
    return out


def _unbuilt_graphs(block):
    """True if a hybridized block in the tree has no cached graph yet or a
    parameter still waits for deferred initialisation: the first run builds
    them, and several threads doing that at once race (measured)."""
    for p in block.collect_params().values():
        if p._deferred_init:
            return True
    stack = [block]
    while stack:
        b = stack.pop()
        if isinstance(b, gluon.HybridBlock) and b._active:
            if b._cached_op is None:
                return True
            continue            # children of an active block run inside its graph
        stack.extend(b._children.values())
    return False


_pools = {}
_pools_lock = threading.Lock()


def _shared_pool(ctx_list, depth=0):
    # One pool per nesting depth: a parallel_apply made inside a replica of
    # another one on the same contexts must not wait for the outer call's
    # pool, which is busy until that very replica returns.
    key = (tuple(ctx_list), depth)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool.closed:
            pool = _pools[key] = WorkerPool(key[0], name='gluon_parallel-apply', lazy=True)
        return pool


def _check_threads(threads):
    if threads is True or threads == 'auto':
        return threads
    raise ValueError("threads must be 'auto' or True, got %r" % (threads,))


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
    threads = _check_threads(threads)
    inputs = [x if isinstance(x, tuple) else (x,) for x in inputs]
    if not inputs:
        raise ValueError('parallel_apply needs at least one replica input')
    if ctx_list is None:
        ctx_list = [_first_ctx(x) for x in inputs]
    ctx_list = _check_ctx_list(ctx_list)
    if len(ctx_list) < len(inputs):
        raise ValueError('%d replica inputs but only %d contexts' % (len(inputs), len(ctx_list)))
    if isinstance(fn_or_blocks, (list, tuple)) and len(fn_or_blocks) != len(inputs):
        raise ValueError('%d callables for %d replica inputs' % (len(fn_or_blocks), len(inputs)))
    if kwargs_list is not None and len(kwargs_list) != len(inputs):
        raise ValueError('%d kwargs dicts for %d replica inputs' % (len(kwargs_list), len(inputs)))
    n = len(inputs)
    _warm_up_blocks(fn_or_blocks, inputs, kwargs_list, ctx_list)
    outer = current_replica()
    call = ParallelCall(ctx_list[:n], ctx_list, default_timeout())
    call.depth = 0 if outer is None else outer.call.depth + 1
    return _shared_pool(ctx_list, call.depth).run(fn_or_blocks, inputs, kwargs_list, call, sync,
                                      inline=threads == 'auto')


_warmed = weakref.WeakSet()


def _warm_up_blocks(fn_or_blocks, inputs, kwargs_list, ctx_list):
    """parallel_apply's counterpart of DataParallel._first_call: a Block that
    still has to finish deferred initialisation or build its graph runs once,
    serially, before the replicas run it concurrently (several threads doing
    that at once race on the block's name scope and can leave the caller's
    scope corrupted)."""
    fns = fn_or_blocks if isinstance(fn_or_blocks, (list, tuple)) else [fn_or_blocks]
    for i, fn in enumerate(fns):
        if not isinstance(fn, gluon.Block) or (fn in _warmed and not _top_unbuilt(fn)):
            continue
        if _unbuilt_graphs(fn):
            try:
                with ctx_list[i], autograd.pause(train_mode=False):
                    fn(*inputs[i], **(kwargs_list[i] if kwargs_list is not None else {}))
            except BaseException as e:
                raise _annotate(e, i, ctx_list[i])
        _warmed.add(fn)


@register_wrapper
class DataParallel(gluon.Block):
    """Run a Block on several devices at once, each on a slice of the batch.

    Parameters
    ----------
    block : Block
        The network. Its parameters must be (or get, through
        ``initialize(ctx=ctx_list)``) on every context of `ctx_list`.
    ctx_list : list of Context, optional
        The devices; default: every GPU, else ``[mx.cpu()]``.
    batch_axis : int, default 0
        Axis along which inputs are split.
    sync : bool, default False
        Make every replica wait for its outputs to be computed.
    timeout : float, optional
        Seconds a replica waits at a synchronisation point (SyncBatchNorm)
        for the others before raising TimeoutError; default
        ``$GLUON_PARALLEL_TIMEOUT`` or 300; ``math.inf`` waits forever.
    threads : 'auto' or True, default 'auto'
        ``'auto'``: the calling thread issues the replicas one after another
        (MXNet's asynchronous engine runs the devices concurrently all the
        same) until a replica waits for the others at a ParallelState
        (SyncBatchNorm); from then on, for this and every later call, the
        replicas run concurrently on the worker threads, created at that
        moment. This saves the threads' GIL hand-offs, a third of a small
        network's step on few cores. ``True``: always the worker threads;
        use it for blocks that wait for their own results inside forward
        (``asnumpy()``, ``asscalar()``, ``wait_to_read()``), which would
        otherwise keep the next device from starting.

    Examples
    --------
    >>> dp = DataParallel(net, [mx.cpu(i) for i in range(4)])
    >>> dp_loss = DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    >>> with autograd.record():
    ...     losses = dp_loss(dp(data), label)
    >>> autograd.backward(losses)
    >>> trainer.step(data.shape[0])
    """

    def __init__(self, block, ctx_list=None, batch_axis=0, sync=False, timeout=None,
                 threads='auto'):
        super(DataParallel, self).__init__(prefix='', params=None)
        if not isinstance(block, gluon.Block):
            raise TypeError('DataParallel wraps a gluon Block, got %s' % type(block).__name__)
        self._block = block
        self._ctx_list = _check_ctx_list(ctx_list)
        self._batch_axis = batch_axis
        self._sync = bool(sync)
        if timeout is None:
            timeout = default_timeout()
        self._timeout = None if timeout is None or math.isinf(timeout) else float(timeout)
        self._checked = False
        self._first_lock = threading.Lock()
        self._threads = _check_threads(threads) is True      # sticky once needed
        self._pool = WorkerPool(self._ctx_list, name='gluon_parallel', lazy=not self._threads)
        self._replica = lambda *args, **kwargs: _call_block(block, args, kwargs)

    @property
    def block(self):
        """The wrapped Block."""
        return self._block

    @property
    def ctx_list(self):
        """The devices, in replica order."""
        return list(self._ctx_list)

    def __setattr__(self, name, value):
        # Block.__setattr__ would register a Block value as a child (and
        # raise TypeError for other types) before the read-only property
        # refuses it: refuse first, leaving nothing behind.
        if name in ('block', 'ctx_list'):
            raise AttributeError('DataParallel.%s is read-only: create a new DataParallel'
                                 % name)
        super(DataParallel, self).__setattr__(name, value)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Split the inputs, run the replicas, return their outputs.

        Returns
        -------
        list
            One output per replica that ran, in context order.
        """
        if self._pool.closed:
            raise RuntimeError('DataParallel is closed: create a new one')
        args_list, kwargs_list = split_load_kwargs(args, kwargs, self._ctx_list, self._batch_axis)
        n = len(args_list)
        first = not self._checked
        if first or _top_unbuilt(self._block):
            with self._first_lock:      # two caller threads: one builds, one waits
                if not self._checked or _top_unbuilt(self._block):
                    self._first_call(args_list[0], kwargs_list[0])
        if n < len(self._ctx_list) and autograd.is_recording():
            clear_idle_grads(self._block, self._ctx_list[n:])
        call = ParallelCall(self._ctx_list[:n], self._ctx_list, self._timeout)
        outputs = self._pool.run(self._replica, args_list, kwargs_list, call, self._sync,
                                 inline=not self._threads)
        if call.threaded and not self._threads:     # (Block.__setattr__ is slow: rarely)
            self._threads = True
        if first:
            try:
                _check_output_ctx(outputs, self._ctx_list)
            except ValueError:
                self._checked = False       # check again on the next call
                raise
        return outputs

    def _first_call(self, args, kwargs):
        """Check the parameters, then build graphs and finish deferred
        initialisation on one device, serially, before replicas run
        concurrently. The check comes first: a parameter missing on a
        device must be named before any device has run anything."""
        check_params(self._block, self._ctx_list)
        if _unbuilt_graphs(self._block):
            try:
                # Predict mode, not recorded: no running-stat update, no
                # random numbers drawn, nothing for backward.
                with self._ctx_list[0], autograd.pause(train_mode=False):
                    _call_block(self._block, args, kwargs)
            except BaseException as e:
                raise _annotate(e, 0, self._ctx_list[0])
        self._checked = True

    def hybridize(self, active=True, **kwargs):
        """Hybridize the wrapped block (graphs are rebuilt on the next call)."""
        self._block.hybridize(active, **kwargs)
        self._checked = False

    def save_parameters(self, filename, deduplicate=False):
        """Save the wrapped block's parameters (a file plain Gluon loads)."""
        self._block.save_parameters(filename, deduplicate=deduplicate)

    def load_parameters(self, filename, ctx=None, **kwargs):
        """Load parameters into the wrapped block, on every context."""
        self._block.load_parameters(filename, ctx=ctx if ctx is not None else self._ctx_list,
                                    **kwargs)

    def close(self):
        """Stop the worker threads. Calling the DataParallel afterwards raises."""
        self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return 'DataParallel(\n  %s,\n  ctx_list=%s, batch_axis=%d, sync=%s, threads=%s)' % (
            repr(self._block).replace('\n', '\n  '), self._ctx_list,
            self._batch_axis, self._sync, True if self._threads else "'auto'")


def _top_unbuilt(block):
    # Cheap per-call check: the block was (re)hybridized after the first call.
    return isinstance(block, gluon.HybridBlock) and block._active and block._cached_op is None


def _misplaced(obj, ctx, path):
    """Path and context of the first NDArray in `obj` not on `ctx`."""
    if isinstance(obj, nd.NDArray):
        return (path, obj.context) if obj.context != ctx else None
    items = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        found = _misplaced(v, ctx, '%s[%r]' % (path, k))
        if found:
            return found
    return None


def _check_output_ctx(outputs, ctx_list):
    """First-call sanity check: a block that moves its data to another
    device computes there with that device's parameter copy, and the
    replica's own copy silently gets no gradient."""
    for rank, out in enumerate(outputs):
        found = _misplaced(out, ctx_list[rank], 'output')
        if found:
            raise ValueError(
                'replica %d returned %s on %s, not on its device %s: the block moved data '
                'to another device (as_in_context, copyto, an array created on a fixed '
                'context...). Every replica must compute on its own device, or its '
                'parameters get no gradient' % (rank, found[0], found[1], ctx_list[rank]))


class DataParallelLoss(object):
    """Apply a loss to the outputs of :class:`DataParallel`, replica by
    replica, with the targets split the same way as the inputs.

    A replica's output that is a tuple or a list (a hybridized block returns
    its tuple as a list) is unpacked into the loss's leading positional
    arguments, ``loss(*output, *targets)``, as GluonCV's
    ``DataParallelCriterion`` does: losses of networks with auxiliary heads
    take ``(pred, aux_pred, label)``. Any other output (an NDArray, a dict)
    is passed whole, ``loss(output, *targets)``.

    Parameters
    ----------
    loss : callable
        A Gluon loss (or any callable ``loss(*outputs, *targets, **kwargs)``).
    ctx_list : list of Context, optional
        Unused for splitting (targets follow their outputs' contexts); kept
        for symmetry with DataParallel and checked when given.
    batch_axis : int, default 0
        Axis along which targets are split.
    sync : bool, default False
        Wait until every loss is computed before returning.
    """

    def __init__(self, loss, ctx_list=None, batch_axis=0, sync=False):
        if not callable(loss):
            raise TypeError('loss must be callable, got %r' % (loss,))
        self.loss = loss
        self._ctx_list = None if ctx_list is None else _check_ctx_list(ctx_list)
        self._batch_axis = batch_axis
        self._sync = bool(sync)

    def __call__(self, outputs, *targets, **kwargs):
        """Return one loss NDArray per replica.

        Parameters
        ----------
        outputs : list
            What DataParallel returned: one output per replica.
        *targets : NDArray, numpy array, or list
            Full-batch targets (split like the inputs), or lists with one
            entry per replica (already split).
        **kwargs
            Passed to the loss, split like the targets.
        """
        if not isinstance(outputs, (list, tuple)) or not outputs:
            raise TypeError('outputs must be the non-empty list DataParallel returned, got %s'
                            % type(outputs).__name__)
        n = len(outputs)
        ctxs = [o.context if type(o) is nd.NDArray else _first_ctx(o) for o in outputs]
        if self._ctx_list is not None and ctxs != self._ctx_list[:n]:
            raise ValueError('outputs are on %s, expected %s' % (ctxs, self._ctx_list[:n]))
        if not kwargs and _all_ndarrays(targets):
            # The common case (full-batch NDArray targets): the split's own
            # sizes give the target rows, so only the outputs' are queried.
            fast = _split_ndarrays(targets, ctxs, self._batch_axis)
            if fast is not None:
                args_list, sizes = fast
                self._check_count(sizes, n)
                _check_rows(outputs, sizes, self._batch_axis)
                return self._apply(outputs, ctxs, args_list, None)
        presplit, full = {}, []
        for i, t in enumerate(targets):
            if isinstance(t, list):
                if len(t) != n:
                    raise ValueError('target %d is a list of %d pre-split entries, but there '
                                     'are %d outputs' % (i, len(t), n))
                presplit[i] = [x.as_in_context(c) if isinstance(x, nd.NDArray) else x
                               for x, c in zip(t, ctxs)]
            else:
                full.append(t)
        if full or kwargs:
            args_list, kwargs_list = split_load_kwargs(full, kwargs, ctxs, self._batch_axis)
            rows = [_rows(a, self._batch_axis) for a in args_list]
            self._check_count(rows, n)
            _check_rows(outputs, rows, self._batch_axis)
        else:
            args_list, kwargs_list = [()] * n, [{}] * n
        if presplit:
            args_list = [self._merge_presplit(args_list[r], presplit, r, len(targets))
                         for r in range(n)]
        return self._apply(outputs, ctxs, args_list, kwargs_list)

    @staticmethod
    def _merge_presplit(split, presplit, r, num_targets):
        """Replica r's targets in the caller's order: pre-split entries where
        given, the split full-batch ones elsewhere."""
        split = iter(split)
        return tuple(presplit[i][r] if i in presplit else next(split) for i in range(num_targets))

    @staticmethod
    def _check_count(sizes, n):
        if len(sizes) != n:
            raise ValueError('targets of batch size %d split into %d slices, but there are %d '
                             'outputs' % (sum(s for s in sizes if s), len(sizes), n))

    def _apply(self, outputs, ctxs, args_list, kwargs_list):
        losses = []
        for r, out in enumerate(outputs):
            args = (*out, *args_list[r]) if isinstance(out, (tuple, list)) \
                else (out, *args_list[r])
            try:
                with ctxs[r]:
                    if kwargs_list is None:
                        loss = self.loss(*args)
                    else:
                        loss = self.loss(*args, **kwargs_list[r])
                    if self._sync:
                        loss.wait_to_read()
            except BaseException as e:
                raise _annotate(e, r, ctxs[r])
            losses.append(loss)
        return losses


def _all_ndarrays(values):
    for v in values:
        if type(v) is not nd.NDArray:
            return False
    return bool(values)


def _rows(args, axis):
    """Rows of the first array among one replica's split targets (None if
    there is none)."""
    for a in args:
        if hasattr(a, 'shape') and a.shape:
            return a.shape[axis]
    return None


def _check_rows(outputs, target_rows, axis):
    """Each replica's targets must have as many rows as its output."""
    for r, (out, rows) in enumerate(zip(outputs, target_rows)):
        first = out[0] if isinstance(out, (list, tuple)) else out
        if rows is None or not isinstance(first, nd.NDArray):
            continue
        out_shape = first.shape                          # one C call
        if out_shape and out_shape[axis] != rows:
            raise ValueError('replica %d has %d output rows but %d target rows: targets must '
                             'have the batch size of the inputs' % (r, out_shape[axis], rows))
