"""DataParallel: one call splits the batch (split.py), runs one replica per
device on the worker pool (pool.py) inside a ReplicaContext (replica.py),
and returns the per-device outputs. The autograd graph spans all devices,
so one ``autograd.backward(losses)`` in the caller gives every parameter
copy its gradient; the Trainer's kvstore then sums them.
"""
import math
from collections.abc import Sequence
from typing import Any, Literal

import mxnet as mx
from mxnet import autograd, gluon, nd

from .grads import clear_idle_grads
from .loss_scaling import check_trainers, checked_trainers
from .params import check_params, register_wrapper
from .apply import check_ctx_list, graph_pending, warm_up
from .graph import GraphMode
from .pool import WorkerPool, check_threads, wait_all
from .replica import ParallelCall, default_timeout
from .split import batch_rows, check_batch_axis, split_load_kwargs, split_sizes

__all__ = ['DataParallel']


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
    graph : 'auto', True or False, default 'auto'
        ``'auto'``: a hybridized HybridBlock runs all its replicas as one
        multi-device engine graph per call (graph mode: no Python per
        replica or per layer); other blocks, and calls graph mode cannot run
        (an input that needs its own gradient, a SyncBatchNorm with a
        reducer, forward hooks, row-sparse or pinned parameters), run per
        replica. ``True``:
        graph mode or a ValueError naming the reason. ``False``: always
        per replica.

    Examples
    --------
    >>> dp = DataParallel(net, [mx.cpu(i) for i in range(4)])
    >>> dp_loss = DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    >>> with autograd.record():
    ...     losses = dp_loss(dp(data), label)
    >>> autograd.backward(losses)
    >>> trainer.step(data.shape[0])
    """

    def __init__(self, block: gluon.Block, ctx_list: Sequence[mx.Context] | None = None,
                 batch_axis: int = 0, sync: bool = False, timeout: float | None = None,
                 threads: bool | Literal['auto'] = 'auto',
                 graph: bool | Literal['auto'] = 'auto') -> None:
        super().__init__(prefix='', params=None)
        if not isinstance(block, gluon.Block):
            raise TypeError(f'DataParallel wraps a gluon Block, got {type(block).__name__}')
        self._block = block
        self._ctx_list = check_ctx_list(ctx_list)
        self._batch_axis = check_batch_axis(batch_axis)
        self._sync = bool(sync)
        if timeout is None:
            timeout = default_timeout()
        self._timeout = None if timeout is None or math.isinf(timeout) else float(timeout)
        self._checked = False
        self._param_list = []
        self._trainers_checked = checked_trainers()
        # 'auto' or True; True sticks once a call needed the threads.
        self._threads = check_threads(threads)
        self._pool = WorkerPool(self._ctx_list, name='gluon_parallel')
        if graph not in ('auto', True, False):
            raise ValueError(f"graph must be 'auto', True or False, got {graph!r}")
        self._graph_option = graph
        self._graph = GraphMode(block, self._ctx_list) if graph is not False else None
        self._graph_ran = False     # the last call ran as one graph (its slices stay put)

    @property
    def block(self) -> gluon.Block:
        """The wrapped Block."""
        return self._block

    @property
    def ctx_list(self) -> list[mx.Context]:
        """The devices, in replica order."""
        return list(self._ctx_list)

    def __setattr__(self, name, value):
        # Block.__setattr__ would register a Block value as a child (and
        # raise TypeError for other types) before the read-only property
        # refuses it: refuse first, leaving nothing behind.
        if name in ('block', 'ctx_list'):
            raise AttributeError(f'DataParallel.{name} is read-only: create a new DataParallel')
        super().__setattr__(name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Split the inputs, run the replicas, return their outputs.

        Returns
        -------
        list
            One output per replica that ran, in context order.
        """
        if self._pool.closed:
            raise RuntimeError('DataParallel is closed: create a new one')
        first = not self._checked
        warm = first or graph_pending(self._block)
        # Graph mode copies the slices into its executor's arrays: loading
        # them onto their devices first would copy them twice. Expected when
        # the last call ran as one graph (a block that keeps falling back,
        # e.g. SyncBatchNorm with MKL-DNN, is not split twice per call).
        in_place = self._graph_ran and not warm
        rows = batch_rows(args, kwargs, self._batch_axis)
        whole = bool(rows)
        if in_place and whole:
            # Graph mode copies each whole input in once: no slices to make
            # (made below if the call runs per replica after all).
            sizes = split_sizes(rows, len(self._ctx_list))
            args_list = kwargs_list = None
            n = len(sizes)
        else:
            sizes = None
            args_list, kwargs_list = split_load_kwargs(args, kwargs, self._ctx_list,
                                                       self._batch_axis, load=not in_place)
            n = len(args_list)
        if warm:
            self._first_call(args_list[0], kwargs_list[0])
        if autograd.is_recording():
            check_trainers(self._param_list, self._trainers_checked)
            if n < len(self._ctx_list):
                clear_idle_grads(self._block, self._ctx_list[n:])
        if self._graph is not None:
            reason = self._graph.why_not(args_list, kwargs_list, args)
            if reason is None:
                if not self._graph_ran:         # (Block.__setattr__ is slow: rarely)
                    self._graph_ran = True
                outputs = self._graph.run(args_list, self._ctx_list[n:], args if whole else None,
                                          sizes)
                if self._sync:
                    wait_all(outputs)
                return outputs
            if self._graph_option is True:
                raise ValueError('DataParallel(graph=True) cannot run this call as one graph: '
                                 f'{reason}')
            if in_place:
                self._graph_ran = False
                args_list, kwargs_list = split_load_kwargs(args, kwargs, self._ctx_list,
                                                           self._batch_axis)
        call = ParallelCall(self._ctx_list[:n], self._ctx_list, self._timeout)
        outputs = self._pool.run(self._block, args_list, kwargs_list, call, self._sync,
                                 threads=self._threads)
        if call.used_threads and self._threads == 'auto':   # (Block.__setattr__ is slow: rarely)
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
        warm_up(self._block, args, kwargs, self._ctx_list[0],
                check=lambda: check_params(self._block, self._ctx_list))
        self._param_list = list({id(p): p for p in self._block.collect_params().values()}.values())
        self._checked = True

    def hybridize(self, active: bool = True, **kwargs: Any) -> None:
        """Hybridize the wrapped block (graphs are rebuilt on the next call)."""
        self._block.hybridize(active, **kwargs)
        self._checked = False

    def save_parameters(self, filename: str, deduplicate: bool = False) -> None:
        """Save the wrapped block's parameters (a file plain Gluon loads)."""
        self._block.save_parameters(filename, deduplicate=deduplicate)

    def load_parameters(self, filename: str,
                        ctx: mx.Context | Sequence[mx.Context] | None = None,
                        **kwargs: Any) -> None:
        """Load parameters into the wrapped block, on every context."""
        self._block.load_parameters(filename, ctx=ctx if ctx is not None else self._ctx_list,
                                    **kwargs)

    @property
    def last_path(self) -> str | None:
        """Which path the last call took: ``'graph'`` (graph mode: one
        executor for all replicas), ``'replicas'`` (the block called once
        per replica), or None before any call."""
        if self._graph_ran:
            return 'graph'
        return 'replicas' if self._checked else None

    @property
    def graph_mode(self) -> GraphMode | None:
        """The graph-mode runner (None with ``graph=False``)."""
        return self._graph

    def close(self) -> None:
        """Stop the worker threads and drop graph mode's executors. Calling
        the DataParallel afterwards raises."""
        self._pool.close()
        if self._graph is not None:
            self._graph.close()

    def __enter__(self) -> 'DataParallel':
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        block = repr(self._block).replace('\n', '\n  ')
        threads = True if self._threads is True else "'auto'"
        return (f'DataParallel(\n  {block},\n  ctx_list={self._ctx_list}, '
                f'batch_axis={self._batch_axis:d}, sync={self._sync}, threads={threads})')


def _misplaced(obj, ctx, path):
    """Path and context of the first NDArray in `obj` not on `ctx`."""
    if isinstance(obj, nd.NDArray):
        return (path, obj.context) if obj.context != ctx else None
    items = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        found = _misplaced(v, ctx, f'{path}[{k!r}]')
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
                f'replica {rank:d} returned {found[0]} on {found[1]}, not on its device '
                f'{ctx_list[rank]}: the block moved data '
                'to another device (as_in_context, copyto, an array created on a fixed '
                'context...). Every replica must compute on its own device, or its '
                'parameters get no gradient')
