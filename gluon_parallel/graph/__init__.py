"""Graph mode: a hybridized block's replicas run as one multi-device graph.

Gluon runs a hybridized block as one CachedOp per device, and a CachedOp
takes inputs on one context only; MXNet's executor runs one graph across
contexts (``Symbol.bind(group2ctx=...)``) and inserts the cross-device
copies itself. So, per call:

1. **trace** — the block's own traced graph (Gluon's, SyncBatchNorm a
   marked BatchNorm node), parsed once (``syncgraph.Traced``);
2. **replicate** (replicate.py) — every replica's copy on its device group,
   SyncBatchNorm merged inside the graph with ``syncgraph``'s arithmetic;
3. **bind** (bind.py, executor.py) — one executor per input signature,
   bound to the parameters' own arrays, its memory shared with the other
   signatures' (memory.py);
4. **run** (recording.py) — copy the inputs in, push the forward pass, return
   outputs that autograd hands their gradients through; right after
   autograd's backward pass, the executor's is pushed.

A DataParallelLoss on the outputs runs as one more executor (loss.py),
whose backward is pushed first (calls.py).

No Python runs per replica or per layer: a training step is one forward
and one backward push for all devices.
"""
import collections
import threading
from typing import NamedTuple

from mxnet import autograd

from .. import _gluon
from ..nested import ndarrays
from ..split import Batch
from ..nn.embedding import is_pinned
from ..syncgraph import Traced
from ..syncgraph.layers import sync_layers, why_not_one_graph
from . import recording
from .bind import bind_network
from .executor import elements, mkldnn_cpu
from .memory import Arenas
from .replicate import replicate

__all__ = ['GraphMode', 'Outcome']


class Outcome(NamedTuple):
    """What :meth:`GraphMode.run` made of a call: every replica's outputs,
    or why the call cannot run as one graph (then the replicas run it)."""
    outputs: list | None
    reason: str | None


class _Graph(NamedTuple):
    """The block's current traced graph (one per CachedOp handle) and what
    follows from it."""
    handle: object
    traced: Traced
    params: dict            # name -> Parameter
    layers: list            # its SyncBatchNorm blocks
    reason: str | None      # why it cannot run as one graph (reducers aside)
    in_format: list         # the nesting of the inputs it was built for (gluon's _flatten)
    plain: bool             # those inputs are NDArrays, none nested or None


class _Key(NamedTuple):
    """What an executor is bound for."""
    handle: object
    signature: tuple        # every replica's (shape, dtype) of each input
    train: bool
    record: bool
    arrays: tuple           # the parameters' array lists and grad_req (_gluon.param_arrays_state)
    sources: tuple | None   # where the whole inputs are (executor.Rows), or None: slices


class GraphMode:
    """The graph-mode runner of one DataParallel.

    Parameters
    ----------
    block : Block
        The wrapped block.
    ctx_list : list of Context
        The DataParallel's devices.
    cache_size : int, default 8
        Executors kept per arena (memory.py): input signatures, each
        in train and predict mode.
    """

    def __init__(self, block, ctx_list, cache_size=8):
        self.block = block
        self.ctx_list = ctx_list
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self.arenas = Arenas(cache_size)
        self._replicated = collections.OrderedDict()    # (handle, n, train, record, rows) -> graph
        self._graph = None                              # _Graph
        self._calls = None          # the RecordedCalls this runner holds (the backward hook)
        self._own_call = _gluon.own_call(block)     # its call is run down to its graph
        self.binds = 0                                  # executors bound so far (tests)

    def run(self, batch):
        """Run the call of `batch` (split.Batch) as one graph if it can:
        an :class:`Outcome`, with every replica's outputs as the block
        returns them (its whole inputs copied in when it has them, else its
        slices, left where the inputs are), or the reason it cannot."""
        batch, reason = self._graph_inputs(batch)
        graph = None if reason is not None else self._current(batch)
        reason = reason if graph is None else self._why_not_graph(graph, batch)
        if reason is not None:
            return Outcome(None, reason)
        train, record = autograd.is_training(), autograd.is_recording()
        key, inputs = self._key(graph, batch, train, record)
        calls = self._recorded_calls()
        with self._lock:
            ex = self._executor(graph, key, calls)
            recorded = record and ex.trainable
            flat = recording.run(ex, inputs, train, recorded, self.ctx_list[batch.n:])
        k = len(flat) // batch.n
        outputs = _gluon.nested_outputs_all(self.block, [flat[r * k:(r + 1) * k]
                                                         for r in range(batch.n)])
        if recorded:
            calls.add(ex, flat, outputs)
        return Outcome(outputs, None)

    def _graph_inputs(self, batch):
        """(the Batch of the inputs the block's graph takes, None), or
        (None, why the call cannot run in graph mode whatever the block's
        graph). (An input that needs a gradient makes its slices need it
        too: checked once on the whole inputs, not per replica.)"""
        block = self.block
        if not _gluon.is_active_hybrid(block):
            return None, f'{block.name} is not a hybridized HybridBlock (call hybridize())'
        if _gluon.has_forward_hooks(block):
            return None, f'{block.name} has forward hooks (graph mode does not call the block)'
        if batch.kwargs or self._own_call:
            batch, reason = self._positional(batch)
            if reason is not None:
                return None, reason
        if autograd.is_recording() and any(map(_gluon.needs_grad, ndarrays(batch.args))):
            return None, ('an input needs its own gradient (it was computed under record() '
                          'from an array with attach_grad)')
        return batch, None

    def _positional(self, batch):
        """(the Batch of the positional inputs a call with keywords, or to a
        block with a ``__call__`` of its own, hands the block's graph, None),
        or (None, why the call cannot run as one graph). The call is run
        down to its graph to find them (``_gluon.cached_graph_inputs``);
        each must be one of the call's own arguments, or hold no array
        (None, an empty list), so that the replicas' slices of the
        arguments are the graph's inputs."""
        try:
            inputs = _gluon.cached_graph_inputs(self.block, batch.args, batch.kwargs)
        except Exception as e:              # noqa: B902 (the replicas raise it, named)
            return None, f'its call raised {type(e).__name__}: {e}'
        if inputs is None:
            return None, f'the call of {self.block.name} does not reach its graph'
        given = {id(v) for v in (*batch.args, *batch.kwargs.values())}
        for x in inputs:
            if id(x) not in given and next(ndarrays(x), None) is not None:
                return None, (f'the call of {self.block.name} computes inputs of its graph '
                              'from its arguments')
        return Batch(inputs, {}, batch.ctx_list, batch.axis), None

    def _why_not_graph(self, graph, batch):
        """Why the block's graph cannot run the call of `batch` as one
        graph, or None."""
        if graph.reason is not None:
            return graph.reason
        if graph.layers:
            reason = why_not_one_graph(graph.layers, len(self.ctx_list))
            if reason is not None:
                return reason
        if not (graph.plain and batch.plain and len(batch.args) == len(graph.in_format)) \
                and not _gluon.fits_graph_format(graph.in_format, _one_replica(batch)):
            # Gluon's own call raises its ValueError for it, replica by replica.
            return (f'the inputs do not have the structure {self.block.name}\'s graph was '
                    f'built for ({graph.in_format})')
        return None

    def _key(self, graph, batch, train, record):
        """The call's _Key, and the inputs its executor's forward takes."""
        if batch.whole is not None:
            inputs, sources = batch.whole, tuple(a.context for a in batch.whole)
            sig = _gluon.row_signature(batch.whole, batch.sizes)
        else:
            inputs, sources = _gluon.flat_inputs_all(batch.slices(load=False).args), None
            sig = _gluon.signature(inputs)
        key = _Key(graph.handle, sig, train, record,
                   _gluon.param_arrays_state(graph.params.values()), sources)
        return key, inputs

    def _executor(self, graph, key, calls):
        """The executor of `key` from the arenas, bound on a miss."""
        arena, ex = self.arenas.find(key, calls.give_up_oldest)
        if ex is None:
            share = _shareable(graph, key, self.ctx_list)
            ex = self._bind(graph, key, arena.room_for(elements(key.signature), share))
            arena.add(key, ex, share)
        return ex

    def _recorded_calls(self):
        """The process's recorded calls, the backward hook, which this
        runner holds from its first call until it closes (acquired again
        if something removed it meanwhile)."""
        calls = self._calls
        if calls is None or recording.BACKWARD_HOOK.calls is not calls:
            calls = self._calls = recording.BACKWARD_HOOK.acquire(self)
        return calls

    def _current(self, batch):
        """The _Graph of the block's current graph (traced and checked once
        per graph: hybridize(), cast() or a new child build another)."""
        handle = _gluon.graph_handle(self.block)
        if self._graph is None or self._graph.handle is not handle:
            args = () if handle is not None else batch.slices().args[0]
            handle, data_names, out, _ = _gluon.traced_graph(self.block, args)
            traced = Traced(out, data_names)
            params = {p.name: p for p in self.block.collect_params().values()}
            layers = sync_layers(traced)
            in_format = _gluon.graph_input_format(self.block)
            self._graph = _Graph(handle, traced, params, layers, _reason(params), in_format,
                                 in_format == [0] * len(in_format))
        return self._graph

    def _bind(self, graph, key, shared):
        """The executor of `key` (memory shared with `shared`, if given)."""
        n = len(key.signature)
        ctx = self.ctx_list[:n]
        rep = self._replicate(graph, key, n)
        try:
            ex = bind_network(rep, ctx, graph.params, [list(per) for per in key.signature],
                              key.record, key.sources, shared, elements(key.signature))
        except Exception as e:              # noqa: B902 (MXNet raises MXNetError)
            raise _bind_error(e, ctx) from None
        self.binds += 1
        return ex

    def _replicate(self, graph, key, n):
        """The replicated graph for `key`: without SyncBatchNorm, one for
        every signature of a device count and mode (only SyncBatchNorm's
        counts depend on the rows)."""
        rows = key.signature if graph.layers else None
        rkey = (key.handle, n, key.train, key.record, rows)
        rep = self._replicated.get(rkey)
        if rep is None:
            ctx = self.ctx_list[:n]
            rep = self._replicated[rkey] = replicate(
                graph.traced, graph.params, [list(per) for per in key.signature], key.train,
                key.record, cpu=all(c.device_type == 'cpu' for c in ctx), mkldnn=mkldnn_cpu(ctx))
            while len(self._replicated) > self.cache_size:
                self._replicated.popitem(last=False)
        self._replicated.move_to_end(rkey)
        return rep

    def close(self):
        """Drop the executors (a call whose backward may still come keeps
        its own) and give the backward hook back."""
        with self._lock:
            self.arenas.clear()
            self._replicated.clear()
        self._calls = None
        recording.BACKWARD_HOOK.release(self)


def _one_replica(batch):
    """Arguments with the structure of every replica's inputs: the whole
    ones where the graph copies them in, else replica 0's slices (numpy
    arrays loaded), which the graph's run takes anyway."""
    return batch.args if batch.whole is not None else batch.slices(load=False).args[0]


def _shareable(graph, key, ctx_list):
    """Whether the executor of `key` may share memory with other
    signatures' (memory.py). Not a training graph of SyncBatchNorm on CPU
    contexts with MKL-DNN: its replicas' sums cross devices inside the
    executor, and MXNet 1.9.1's cross-device copy takes the MKL-DNN layout
    an operator of another executor left on the shared memory (of another
    size) as its own, which the next reader refuses ('The size of NDArray
    doesn't match the requested MKLDNN memory desc')."""
    return not (key.train and graph.layers and mkldnn_cpu(ctx_list))


def _reason(params):
    """Why a block with these parameters cannot run as one graph, or None."""
    for p in params.values():
        if _gluon.is_row_sparse(p):
            return f'{p.name} is a row-sparse parameter'
        if p.grad_req != 'null' and _gluon.has_sparse_grad(p):
            return f'{p.name} has a row-sparse gradient'
        if is_pinned(p):
            return 'a parameter is kept on one context (HostEmbedding)'
    return None


def _bind_error(exc, ctx_list):
    """A bind or shape error, naming the replica (its copies of the nodes
    are named r<rank>_...) and its device."""
    import re
    text = str(exc)
    found = re.search(r'\br(\d+)_', text)
    where = ''
    if found and int(found.group(1)) < len(ctx_list):
        r = int(found.group(1))
        where = f' (replica {r} on {ctx_list[r]})'
    return type(exc)(f'graph mode could not bind the network{where}: {text}') \
        if isinstance(exc, (ValueError, TypeError)) else \
        ValueError(f'graph mode could not bind the network{where}: {text}')
