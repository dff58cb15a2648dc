"""Graph-mode loss: DataParallelLoss over a graph-mode call, as one more
executor.

A recorded graph-mode call's outputs stay in its executor (recording.py), so a
loss computed on them replica by replica is Python and several operators per
replica again. When DataParallelLoss gets exactly those outputs, a Gluon
loss (a HybridBlock without parameters) runs on all replicas as one graph:

1. **trace** — the loss called on symbols, replica r's copy on device group
   ``dev<r>`` (its inputs: the call's outputs, then the targets);
2. **bind** — one executor per model executor and target signature: its
   output arguments *are* the model executor's output arrays (no copy), the
   gradient of each is written into that executor's head gradient;
3. **run** — copy the target slices in, push the forward pass, return the
   losses as autograd variables attached to the model's call.

Right after autograd's backward pass, calls.py pushes the loss executor's
backward, then the model's (``calls.Call.followers``): a training step is
two forward and two backward pushes for all devices. Anything else (another
loss, pre-split targets, keyword arguments, a loss with parameters, a loss
that does not trace) runs replica by replica, as it would without graph mode.
"""
import operator
import threading

import mxnet as mx
from mxnet import autograd, gluon

from .. import _gluon
from . import recording
from .executor import GROUP, Executor, ExecutorSpec, bound_inputs, elements
from .memory import Arenas

__all__ = ['GraphLoss']


class GraphLoss:
    """The graph-mode runner of one DataParallelLoss.

    Parameters
    ----------
    loss : callable
        The DataParallelLoss's loss.
    batch_axis : int
        Axis along which targets are split.
    cache_size : int, default 64
        Loss executors kept per arena (memory.py). Each is dropped
        with the network executor it reads, so this only bounds a loss that
        many networks' calls share.
    """

    def __init__(self, loss, batch_axis, cache_size=64):
        self.loss = loss
        self.batch_axis = batch_axis
        self._lock = threading.Lock()
        self._traced = {}                   # (n, outputs, targets) -> Symbol or None
        self.arenas = Arenas(cache_size)      # (model executor, targets) -> Executor
        self._refused = set()               # such keys the per-replica path must decide
        self.binds = 0                      # executors bound so far (tests)

    def usable(self):
        """Whether the loss itself can run as a graph: a HybridBlock without
        parameters (a plain callable or Block runs in Python). Forward hooks
        are looked for at every call."""
        loss = self.loss
        return isinstance(loss, gluon.HybridBlock) and not list(loss.collect_params().keys())

    def run(self, outputs, targets, ctx_list, split):
        """The losses of a graph-mode call's `outputs` (every replica's, as
        DataParallel returned them) for the full-batch NDArray `targets`, or
        None when this call must run replica by replica (which checks the
        outputs' contexts against the DataParallelLoss's `ctx_list`, if
        given, and reuses the slices of `split`, the targets' SplitOnce,
        when they were made here)."""
        if not autograd.is_recording() or _gluon.has_forward_hooks(self.loss):
            return None
        calls = recording.BACKWARD_HOOK.calls
        if calls is None:
            return None                 # no graph-mode runner: not graph mode's outputs
        call = calls.latest
        if call is None or not _holds(call, outputs):
            call = calls.call_of(outputs)     # (not the latest call's outputs: a search)
        if call is None or call.followers:
            return None                 # not graph mode's, or a second loss on it
        model = call.executor
        ctxs = model.ctx_list
        if ctx_list is not None and ctxs != ctx_list[:len(ctxs)]:
            return None
        shape = (len(model.outputs), len(model.outputs[0]), len(targets))
        if shape not in self._traced:
            with self._lock:
                self._traced[shape] = self._trace(*shape)
        symbol = self._traced[shape]
        if symbol is None:
            return None                 # (before any split)
        if split.whole_sizes is not None:     # copied in whole: no slices to make
            parts, sizes = None, split.whole_sizes
            sig = _gluon.row_signature(targets, sizes)
            sources = tuple(t.context for t in targets)
        else:
            made = split.where_they_are(ctxs)
            if made is None:
                return None
            parts, sizes = made.args, made.sizes
            sig, sources = _gluon.signature(parts), None
        key = (id(model), sig, sources)
        with self._lock:
            if key in self._refused or not self._fits(model, sizes):
                return None
            arena, ex = self.arenas.find(key, calls.give_up_oldest)
            if ex is None:
                ex = self._bind(symbol, model, sig, sources, arena, key)
                if ex is None:
                    return None
        losses = recording.run(ex, parts if sources is None else targets,
                               autograd.is_training(), mark=True)
        return calls.follow(call, ex, losses)

    def _fits(self, model, sizes):
        """Whether every replica's targets have its outputs' rows (if not,
        the per-replica path raises the error a mismatch deserves)."""
        rows = [per[0].shape[self.batch_axis] if per[0].ndim else None for per in model.outputs]
        return len(sizes) == len(rows) and all(r is None or r == s for r, s in zip(rows, sizes))

    def _bind(self, symbol, model, sig, sources, arena, key):
        """The loss executor of `model` for targets `sig`, kept in `arena`
        (and dropped with `model`), or None (it does not bind: the
        per-replica path decides)."""
        size = elements(sig) + sum(o.size for per in model.outputs for o in per)
        try:
            ex = bind_loss(symbol, model, sig, sources, arena.room_for(size), size)
        except Exception:               # noqa: B902 (MXNet raises MXNetError)
            self._refused.add(key)
            model.when_closed(lambda: self._refused.discard(key))
            return None
        arena.add(key, ex)
        model.when_closed(lambda: self.arenas.drop_if(lambda e: e is ex))
        self.binds += 1
        return ex

    def _trace(self, n, num_outputs, num_targets):
        """Every replica's loss in one symbol (None: the loss does not trace,
        e.g. it calls NDArray-only functions)."""
        outs = []
        try:
            for r in range(n):
                with mx.AttrScope(ctx_group=GROUP % r):
                    ins = [mx.sym.var(f'r{r}_out{k}') for k in range(num_outputs)]
                    ins += [mx.sym.var(f'r{r}_target{k}') for k in range(num_targets)]
                    out = self.loss(*ins)
                if not isinstance(out, mx.sym.Symbol) or len(out.list_outputs()) != 1:
                    return None             # one loss array per replica, as Gluon's
                outs.append(out)
        except Exception:               # noqa: B902 (a loss that does not trace)
            return None
        return mx.sym.Group(outs)


def bind_loss(symbol, model, sig, sources, shared, size):
    """The executor of every replica's loss (:meth:`GraphLoss._trace`) on a
    network executor's outputs: its output arguments *are* the network
    executor's output arrays (no copy), their gradients are written into its
    head gradients.

    Parameters
    ----------
    symbol : Symbol
    model : executor.Executor
        The network's executor.
    sig : tuple
        Every replica's target (shape, dtype).
    sources : tuple of Context, optional
        Where each whole target is, when every replica's targets are rows
        of them (then the executor's forward takes the whole targets).
    shared : executor.Executor, optional
        The loss executor whose memory it shares (memory.py).
    size : int
        The elements it binds besides the parameters (memory.py).

    Returns
    -------
    executor.Executor
        With ``covered``: the network outputs (flat index) whose gradient
        it writes (a loss may ignore an output: an auxiliary head).
    """
    ctx_list = model.ctx_list
    k = len(model.outputs[0])
    targets = bound_inputs(sig, sources, ctx_list, shared)
    args, grads, reqs, covered = {}, {}, {}, set()
    for name in symbol.list_arguments():
        r, kind, i = _parse(name)
        if kind == 'out':
            args[name] = model.outputs[r][i]
            grads[name] = model.head_grads[r * k + i]
            reqs[name] = 'write'
            covered.add(r * k + i)
        else:
            args[name] = targets.view(r, i)
            reqs[name] = 'null'
    return Executor(ExecutorSpec(
        symbol=symbol, ctx_list=ctx_list, args=args, grads=grads, reqs=reqs, aux={},
        num_outputs=1, inputs=targets, record=True, size=size, shared=shared, covered=covered))


def _parse(name):
    """('r3_out1') -> (3, 'out', 1)."""
    rank, rest = name[1:].split('_', 1)
    kind = 'out' if rest.startswith('out') else 'target'
    return int(rank), kind, int(rest[len(kind):])


def _holds(call, outputs):
    """Whether `outputs` are exactly what `call` (a pending call:
    ``RecordedCalls.latest``) returned."""
    returned = call.returned
    return len(returned) == len(outputs) and all(map(operator.is_, returned, outputs))
