"""Graph-mode loss: DataParallelLoss over a graph-mode call, as one more
executor.

A recorded graph-mode call's outputs stay in its executor (bridge.py), so a
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

Right after autograd's backward pass, the bridge pushes the loss executor's
backward, then the model's (``bridge.Call.followers``): a training step is
two forward and two backward pushes for all devices. Anything else (another
loss, pre-split targets, keyword arguments, a loss with parameters, a loss
that does not trace) runs replica by replica, as it would without graph mode.
"""
import threading
import weakref

import mxnet as mx
from mxnet import autograd, gluon, nd

from .. import _gluon
from ..split import batch_rows, split_ndarrays, split_sizes
from . import bridge
from .bind import Rows
from .replicate import GROUP

__all__ = ['GraphLoss']


class GraphLoss:
    """The graph-mode runner of one DataParallelLoss.

    Parameters
    ----------
    loss : callable
        The DataParallelLoss's loss.
    batch_axis : int
        Axis along which targets are split.
    """

    def __init__(self, loss, batch_axis):
        self.loss = loss
        self.batch_axis = batch_axis
        self._lock = threading.Lock()
        self._traced = {}                           # (n, outputs, targets) -> Symbol or None
        self._bound = weakref.WeakKeyDictionary()   # model Bound -> {target signature: LossBound}
        self.binds = 0                              # executors bound so far (tests)

    def usable(self):
        """Whether the loss itself can run as a graph: a HybridBlock without
        parameters (a plain callable or Block runs in Python). Forward hooks
        are looked for at every call."""
        loss = self.loss
        return isinstance(loss, gluon.HybridBlock) and not list(loss.collect_params().keys())

    def run(self, outputs, targets, ctx_list=None):
        """The losses of a graph-mode call's `outputs` (every replica's, as
        DataParallel returned them) for the full-batch NDArray `targets`, or
        None when this call must run replica by replica (which checks the
        outputs' contexts against the DataParallelLoss's `ctx_list`, if
        given)."""
        if not autograd.is_recording() or _gluon.has_forward_hooks(self.loss):
            return None
        calls = bridge.pending(install=False)
        call = None if calls is None else calls.call_of(outputs)
        if call is None or call.followers:
            return None                 # not graph mode's, or a second loss on it
        model = call.bound
        ctxs = model.ctx_list
        if ctx_list is not None and ctxs != ctx_list[:len(ctxs)]:
            return None
        key = (len(model.outputs), len(model.outputs[0]), len(targets))
        if key not in self._traced:
            with self._lock:
                self._traced[key] = self._trace(*key)
        symbol = self._traced[key]
        if symbol is None:
            return None                 # (before the split: the fallback splits again)
        rows = batch_rows(targets, None, self.batch_axis)
        if rows:                        # copied in whole: no slices to make
            parts, sizes = None, split_sizes(rows, len(ctxs))
            sig = Rows.signature(targets, sizes)
            sources = tuple(t.context for t in targets)
        else:
            split = split_ndarrays(targets, ctxs, self.batch_axis, load=False)
            if split is None:
                return None
            parts, sizes = split
            sig, sources = _gluon.signature(parts), None
        with self._lock:
            per_model = self._bound.setdefault(model, {})
            lb = per_model.get((sig, sources), False)
            if lb is False:
                lb = per_model[sig, sources] = self._bind(symbol, model, sig, sizes, sources)
        if lb is None:
            return None
        return calls.follow(call, lb, lb.forward(parts if sources is None else targets,
                                                 autograd.is_training()))

    def _bind(self, symbol, model, sig, sizes, sources):
        """A LossBound, or None where the per-replica path must decide (it
        raises the error a mismatch deserves)."""
        rows = [per[0].shape[self.batch_axis] if per[0].ndim else None for per in model.outputs]
        if len(sizes) != len(rows) or any(r is not None and r != s
                                           for r, s in zip(rows, sizes)):
            return None
        try:
            lb = LossBound(symbol, model, sig, sources)
        except Exception:               # noqa: B902 (MXNet raises MXNetError)
            return None
        self.binds += 1
        return lb

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


class LossBound:
    """The loss executor of one model executor and target signature.

    Parameters
    ----------
    symbol : Symbol
        Every replica's loss (GraphLoss._trace).
    model : bind.Bound
        The model's executor: its outputs are this executor's arguments, its
        head gradients what this executor's backward writes.
    sig : tuple
        Every replica's target (shape, dtype).
    sources : tuple of Context, optional
        Where each whole target is, when every replica's targets are rows
        of them (``bind.Rows``; then :meth:`forward` takes the whole
        targets).

    Attributes
    ----------
    heads : list of NDArray
        The losses' head gradients (autograd writes them).
    covered : set of int
        The model outputs (flat index) whose gradient this executor writes:
        a loss may ignore an output (an auxiliary head).
    """

    def __init__(self, symbol, model, sig, sources=None):
        ctx_list = model.ctx_list
        k = len(model.outputs[0])
        args, grads, req = {}, {}, {}
        self.targets = []                       # (bound array, replica, index)
        self.rows = Rows(sig, sources) if sources else None
        self.covered = set()
        for name in symbol.list_arguments():
            r, kind, i = _parse(name)
            if kind == 'out':
                args[name] = model.outputs[r][i]
                grads[name] = model.heads[r * k + i]
                req[name] = 'write'
                self.covered.add(r * k + i)
            else:
                shape, dtype = sig[r][i]
                args[name] = self.rows.view(r, i) if self.rows else \
                    nd.empty(shape, ctx=ctx_list[r], dtype=dtype)
                req[name] = 'null'
                self.targets.append((args[name], r, i))
        group2ctx = {GROUP % r: c for r, c in enumerate(ctx_list)}
        self.executor = _gluon.bind_replicas(symbol, len(ctx_list), lambda: symbol.bind(
            ctx_list[0], args, args_grad=grads, grad_req=req, group2ctx=group2ctx))
        self.heads = [nd.zeros(o.shape, ctx=o.context, dtype=o.dtype)
                      for o in self.executor.outputs]
        self._copy_losses = _gluon.Copier(self.executor.outputs)
        #: Makes the returned losses autograd variables of ``heads``.
        self.mark_outputs = _gluon.VariableMarker(self.heads)
        #: ``ones_like`` into each of ``heads`` (bridge.Pending.heads_only).
        self.fill_ones = [_gluon.prepared_op('ones_like', [h], [h]) for h in self.heads]

    def forward(self, targets, train):
        """Copy the targets in (every replica's, or the whole targets: see
        `sources`), push the forward pass; returns copies of the losses (the
        executor's own arrays are reused by its next call)."""
        with autograd.pause(train_mode=train):
            if self.rows is not None:
                self.rows.copy_in(targets)
            else:
                _gluon.copy_into([targets[r][i] for _, r, i in self.targets],
                                 [dst for dst, _, _ in self.targets])
            _gluon.executor_forward(self.executor, train)
            return self._copy_losses()

    def backward(self):
        """Push the backward pass for ``heads``: writes the gradients of the
        model outputs in ``covered`` into the model's head gradients."""
        self.executor.backward(self.heads)


def _parse(name):
    """('r3_out1') -> (3, 'out', 1)."""
    rank, rest = name[1:].split('_', 1)
    kind = 'out' if rest.startswith('out') else 'target'
    return int(rank), kind, int(rest[len(kind):])
