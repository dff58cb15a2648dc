"""DataParallel: one call scatters the batch (split.Batch), runs it with
one of two runners, chosen per call — graph mode (graph/: every replica in
one multi-device executor graph) or the replicas (one job per device on the
worker pool, workers.py, inside a ReplicaContext, replica_context.py) — and returns
the per-device outputs. The autograd graph spans all devices, so one
``autograd.backward(losses)`` in the caller gives every parameter copy its
gradient; the Trainer's kvstore then sums them.
"""
import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import mxnet as mx
from mxnet import autograd, gluon, nd

from . import progress
from .grads import clear_idle_grads
from .loss_scaling import check_trainers, checked_trainers
from .params import check_params, register_wrapper
from .contexts import check_ctx_list
from .warmup import graph_unbuilt, warm_up
from .graph import GraphMode
from .nested import arrays
from .workers import WorkerPool, check_threads, wait_all
from .replica_context import ParallelCall, default_timeout
from .split import Batch, check_batch_axis
from .syncgraph import ensure_routing
from .trainer import make_buckets

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
        The devices; default: every GPU, else ``[mx.cpu()]`` (a warning at
        construction names the devices chosen).
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
    cache_size : int, default 8
        Graph mode: executors kept per memory pool (one per input signature
        and train/predict mode). The executors of every input signature
        share one memory pool (bound from the largest inputs seen, as
        MXNet's BucketingModule binds its largest bucket first), so peak
        memory with many input sizes stays close to the largest one's;
        keeping an executor costs little memory and saves binding it again
        (tens of milliseconds). When more signatures come than it holds,
        the least used is dropped, never all of them in turn. Results never
        depend on it.

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
                 graph: bool | Literal['auto'] = 'auto', cache_size: int = 8) -> None:
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
        if graph not in ('auto', True, False):
            raise ValueError(f"graph must be 'auto', True or False, got {graph!r}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f'cache_size must be a positive int, got {cache_size!r}')
        self._graph_option = graph
        self._graph = GraphMode(block, self._ctx_list, cache_size) if graph is not False \
            else None
        self._replicas = _ReplicaRunner(block, self._ctx_list, threads, self._timeout, self._sync)
        self._last = _Last()
        self._progress = progress.reporter()    # the process's: a call is progress

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
        """Scatter the inputs, run them, return the replicas' outputs.

        Returns
        -------
        list
            One output per replica that ran, in context order.
        """
        if self._replicas.pool.closed:
            raise RuntimeError('DataParallel is closed: create a new one')
        first = not self._checked
        batch = Batch(args, kwargs, self._ctx_list, self._batch_axis)
        self._prepare(batch)
        outputs = self._run(batch)
        self._progress.called()
        return self._finish(outputs, first)

    def _prepare(self, batch):
        """What the call of `batch` (split.Batch) needs before it runs: the
        first call's warm-up (or a rebuilt graph's), and the checks of a
        recorded call."""
        if not self._checked or graph_unbuilt(self._block):
            args_list, kwargs_list = batch.slices()
            self._first_call(args_list[0], kwargs_list[0])
        if autograd.is_recording():
            check_trainers(self._param_list, self._trainers_checked)
            if batch.n < len(self._ctx_list):
                clear_idle_grads(self._block, self._ctx_list[batch.n:])

    def _run(self, batch):
        """Every replica's outputs: graph mode runs the call if it can (it
        decides, and runs, in one step), else the replicas."""
        if self._graph is not None:
            ran = self._graph.run(batch)
            if ran.reason is None:
                self._last.runner = self._graph
                return ran.outputs
            if self._graph_option is True:
                raise ValueError('DataParallel(graph=True) cannot run this call as one graph: '
                                 f'{ran.reason}')
        self._last.runner = self._replicas
        return self._replicas.run(batch)

    def _finish(self, outputs, first):
        """The replicas' outputs, as they are (DataParallel gathers
        nothing), computed first with ``sync`` (the replicas' runner waits
        in their jobs already); the first call checks where they are."""
        if self._sync and self._last.runner is not self._replicas:
            wait_all(outputs)
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
        # Gradient buckets before any executor binds the gradient arrays.
        make_buckets(self._param_list)
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
    def graph_mode(self) -> GraphMode | None:
        """The graph-mode runner (None with ``graph=False``)."""
        return self._graph

    @property
    def last_path(self) -> Literal['graph', 'replicas'] | None:
        """How the last call ran: ``'graph'`` (graph mode: every replica in
        one executor graph), ``'replicas'`` (one replica per device on the
        worker pool), or None before the first call."""
        runner = self._last.runner
        return None if runner is None else 'graph' if runner is self._graph else 'replicas'

    def close(self) -> None:
        """Stop the worker threads and drop graph mode's executors. Calling
        the DataParallel afterwards raises."""
        self._replicas.pool.close()
        if self._graph is not None:
            self._graph.close()

    def __enter__(self) -> 'DataParallel':
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        block = repr(self._block).replace('\n', '\n  ')
        threads = True if self._replicas.threads is True else "'auto'"
        return (f'DataParallel(\n  {block},\n  ctx_list={self._ctx_list}, '
                f'batch_axis={self._batch_axis:d}, sync={self._sync}, threads={threads})')


class _Last:
    """The runner of the last call (a plain object: Block.__setattr__ is
    slow, and this is set on every call)."""
    __slots__ = ('runner',)

    def __init__(self):
        self.runner = None


class _ReplicaRunner:
    """DataParallel's per-replica runner: one job per replica on the
    worker pool (workers.py), the block called on each replica's slices.

    Parameters
    ----------
    block : Block
    ctx_list : list of Context
    threads : 'auto' or True
        As DataParallel's; 'auto' becomes True once a call needed the
        threads (a replica waited for the others).
    timeout : float or None
        The ParallelStates' timeout.
    sync : bool
        Every replica waits for its outputs.
    """

    def __init__(self, block, ctx_list, threads, timeout, sync):
        self.block, self.ctx_list, self.timeout, self.sync = block, ctx_list, timeout, sync
        self.threads = check_threads(threads)
        self.pool = WorkerPool(ctx_list, name='gluon_parallel')

    def run(self, batch):
        """Every replica's outputs for the call of `batch` (split.Batch)."""
        args_list, kwargs_list = batch.slices()
        ensure_routing()        # a hybridized SyncBatchNorm network runs in stages per replica
        call = ParallelCall(self.ctx_list[:batch.n], self.ctx_list, self.timeout)
        outputs = self.pool.run(self.block, args_list, kwargs_list, call, self.sync,
                                threads=self.threads)
        if call.used_threads:
            self.threads = True
        return outputs


class _Misplaced(NamedTuple):
    """An output array on another context than its replica's."""
    path: str
    context: mx.Context


def _misplaced(obj, ctx):
    """The first NDArray in `obj` not on `ctx` (a _Misplaced), or None."""
    for path, a in arrays(obj, 'output'):
        if isinstance(a, nd.NDArray) and a.context != ctx:
            return _Misplaced(path, a.context)
    return None


def _check_output_ctx(outputs, ctx_list):
    """First-call sanity check: a block that moves its data to another
    device computes there with that device's parameter copy, and the
    replica's own copy silently gets no gradient."""
    for rank, out in enumerate(outputs):
        found = _misplaced(out, ctx_list[rank])
        if found:
            raise ValueError(
                f'replica {rank:d} returned {found.path} on {found.context}, not on its device '
                f'{ctx_list[rank]}: the block moved data '
                'to another device (as_in_context, copyto, an array created on a fixed '
                'context...). Every replica must compute on its own device, or its '
                'parameters get no gradient')
