"""Graph mode: a hybridized block's replicas run as one multi-device graph.

Gluon runs a hybridized block as one CachedOp per device, and a CachedOp
takes inputs on one context only; MXNet's executor runs one graph across
contexts (``Symbol.bind(group2ctx=...)``) and inserts the cross-device
copies itself. So, per call:

1. **trace** — the block's own traced graph (Gluon's, SyncBatchNorm a
   marked BatchNorm node);
2. **replicate** (replicate.py) — every replica's copy on its device group,
   SyncBatchNorm merged inside the graph with ``syncgraph``'s arithmetic;
3. **bind** (bind.py) — one executor per input signature, bound to the
   parameters' own arrays;
4. **run** (bridge.py) — copy the slices in, push the forward pass, return
   outputs that autograd hands their gradients through; right after
   autograd's backward pass, the executor's is pushed.

A DataParallelLoss on the outputs runs as one more executor (loss.py),
whose backward the bridge pushes first.

No Python runs per replica or per layer: a training step is one forward
and one backward push for all devices.
"""
import collections
import threading

from mxnet import autograd, nd

from .. import _gluon
from ..nn import kernels, sync_batchnorm
from ..nn.embedding import is_pinned
from ..syncgraph import Traced, check_devices
from . import bridge
from .bind import Bound, Rows, signature_of
from .replicate import replicate

__all__ = ['GraphMode']


class GraphMode:
    """The graph-mode runner of one DataParallel.

    Parameters
    ----------
    block : Block
        The wrapped block.
    ctx_list : list of Context
        The DataParallel's devices.
    cache_size : int, default 8
        Executors kept (one per input signature and train/predict).
    """

    def __init__(self, block, ctx_list, cache_size=8):
        self.block = block
        self.ctx_list = ctx_list
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._graphs = collections.OrderedDict()    # key -> Replicated
        self._bound = collections.OrderedDict()     # key -> [Bound] (Pending.take)
        self._checked = None                        # (handle, reason)
        self._params = None                         # (handle, {name: Parameter})
        self._traced = None                         # (handle, syncgraph.Traced)
        self._layers = []                           # the SyncBatchNorm layers, once checked
        self.binds = 0                              # executors bound so far (tests)

    def why_not(self, args_list, kwargs_list, inputs):
        """Why this call cannot run in graph mode, or None. `args_list`,
        `kwargs_list`: every replica's arguments (None: not split, the
        block's graph is built); `inputs`: the call's positional arguments
        before the split (a slice of an array
        that needs a gradient needs it too: checked once, not per replica;
        the check raises and catches an MXNet error for an array autograd
        did not record)."""
        block = self.block
        if not _gluon.is_active_hybrid(block):
            return f'{block.name} is not a hybridized HybridBlock (call hybridize())'
        if kwargs_list and any(kwargs_list):
            return 'keyword arguments go to the forward of a plain Block only'
        if _gluon.has_forward_hooks(block):
            return f'{block.name} has forward hooks (graph mode does not call the block)'
        if autograd.is_recording() and any(_gluon.needs_grad(a) for a in _arrays(inputs)):
            return ('an input needs its own gradient (it was computed under record() from an '
                    'array with attach_grad)')
        handle = _gluon.graph_handle(block)
        if self._checked is None or self._checked[0] is not handle:
            _, traced = self._traced_graph(args_list[0] if args_list else ())
            self._layers = [b for b in _walk(block)
                            if isinstance(b, sync_batchnorm.SyncBatchNorm)] \
                if traced.synced() else []
            self._checked = (handle, self._reason(traced))
        reason = self._checked[1]
        if reason is None and sync_batchnorm.has_reducers():
            reason = self._reducer_reason()
        return reason

    def _traced_graph(self, args):
        """(handle, syncgraph.Traced) of the block's current graph, parsed
        once per graph."""
        handle, data_names, out, _ = _gluon.traced_graph(self.block, args)
        if self._traced is None or self._traced[0] is not handle:
            self._traced = (handle, Traced(out, data_names))
        return self._traced

    def _reason(self, traced):
        """Why the block's current graph (`traced`) cannot run as one graph,
        or None."""
        for p in self.block.collect_params().values():
            if _gluon.is_row_sparse(p):
                return f'{p.name} is a row-sparse parameter'
            if p.grad_req != 'null' and _gluon.has_sparse_grad(p):
                return f'{p.name} has a row-sparse gradient'
        if any(is_pinned(p) for p in self.block.collect_params().values()):
            return 'a parameter is kept on one context (HostEmbedding)'
        return None

    def _reducer_reason(self):
        for layer in self._layers:
            if layer.reducer is not None:
                return (f'{layer.name} has a reducer (statistics across processes): its '
                        'network runs per replica, in stages')
        return None

    def run(self, args_list, idle_ctx, whole=None, sizes=None):
        """Every replica's outputs, as the block returns them.

        Parameters
        ----------
        args_list : list of tuple or None
            Every replica's positional arguments; None with `sizes`.
        idle_ctx : list of Context
            The contexts without rows in this call.
        whole : tuple of NDArray, optional
            The call's positional NDArrays, when every replica's inputs are
            their consecutive rows (split.batch_rows): copied in whole,
            once each.
        sizes : list of int, optional
            Each replica's rows of `whole`, for a call that made no slices
            (`args_list` None: the block's graph is built).
        """
        block = self.block
        handle, traced = self._traced_graph(args_list[0] if args_list else ())
        train, record = autograd.is_training(), autograd.is_recording()
        if args_list is None:
            flat = None
            sig = Rows.signature(whole, sizes)
        else:
            flat = _gluon.flat_inputs_all(args_list)
            sig = signature_of(flat)
        inputs = [list(per) for per in sig]         # every replica's (shape, dtype)
        if self._params is None or self._params[0] is not handle:
            # Walking the block is slow; its parameters change only with
            # its graph (hybridize(), cast(), a new child).
            self._params = (handle, {p.name: p for p in block.collect_params().values()})
        params = self._params[1]
        sources = None if whole is None else tuple(a.context for a in whole)
        key = (handle, sig, train, record, _param_state(params), sources)
        check_devices(self._layers, len(self.ctx_list))
        # The process's pending calls, graph mode's backward hook installed
        # by the first graph-mode call (and again if it was removed).
        calls = bridge.pending()
        with self._lock:
            rep = self._graphs.get(key)
            if rep is None:
                rep = replicate(traced, params, inputs, train, record,
                                sync_batchnorm.layer_of,
                                cpu=all(c.device_type == 'cpu' for c in self.ctx_list),
                                # The kernels' float64 sums next to MKL-DNN's
                                # float32 layouts are untested: MXNet's operators.
                                kernels=None if mkldnn_cpu(self.ctx_list)
                                else kernels.available())
                _put(self._graphs, key, rep, self.cache_size)
            bounds = self._bound.get(key)
            if bounds is None:
                bounds = []
                _put(self._bound, key, bounds, self.cache_size)
            bound = calls.take(bounds)
            if bound is None:
                bound = self._bind(rep, params, inputs, record, sources)
                bounds.append(bound)
            outs = bridge.run(bound, flat if whole is None else whole, train, record, idle_ctx,
                              calls)
        return _gluon.nested_outputs_all(block, outs)

    def _bind(self, rep, params, inputs, record, sources):
        ctx = self.ctx_list[:len(inputs)]
        try:
            with _gluon.exact_size_plan(mkldnn_cpu(ctx)):      # see _gluon/memory_plan.py
                bound = Bound(rep, ctx, params, inputs, record, sources)
        except Exception as e:              # noqa: B902 (MXNet raises MXNetError)
            raise _bind_error(e, ctx) from None
        self.binds += 1
        return bound

    def close(self):
        """Drop the executors (a call whose backward may still come keeps
        its own)."""
        self._bound.clear()
        self._graphs.clear()


def mkldnn_cpu(ctx_list):
    """Whether MXNet runs MKL-DNN kernels on some of these contexts: CPU
    contexts, a build with MKL-DNN, not disabled by MXNET_MKLDNN_ENABLED=0
    (read once per process by MXNet)."""
    import os
    import mxnet as mx
    if not any(c.device_type == 'cpu' for c in ctx_list):
        return False
    if os.environ.get('MXNET_MKLDNN_ENABLED', '1') == '0':
        return False
    return mx.runtime.Features().is_enabled('MKLDNN')


def _walk(block):
    stack = [block]
    while stack:
        b = stack.pop()
        yield b
        stack.extend(_gluon.children(b).values())


def _param_state(params):
    """What the executors bind of the parameters: their arrays (replaced by
    initialize(force_reinit=True), reset_ctx, cast) and gradient requests.
    A Bound keeps the lists it was bound to, so their ids stay unique."""
    return _gluon.param_arrays_state(params.values())


def _arrays(obj):
    """The NDArrays in nested lists and tuples."""
    if isinstance(obj, nd.NDArray):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _arrays(v)


def _put(cache, key, value, size):
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)


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

