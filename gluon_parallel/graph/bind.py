"""Bind: one executor of the replicated graph for one input signature.

The executor's arguments are the parameters' own per-context arrays, its
gradient arrays the parameters' own (``grad_req`` as Gluon has it: write,
add, null), so the Trainer, kvstores, checkpoints and ``gp.step`` see
exactly the arrays they see in the per-replica path. Its backward is pushed
in the caller's thread right after autograd's (bridge.py), so it is
ordered before the Trainer's reads like any gradient of Gluon's.
"""
import itertools

import numpy as np
from mxnet import nd

from .. import _gluon
from ..syncgraph import Param
from .replicate import GROUP

__all__ = ['Bound', 'Rows', 'signature_of']


class Bound:
    """The executor of one signature, with its inputs and outputs.

    Parameters
    ----------
    replicated : replicate.Replicated
    ctx_list : list of Context
        One per replica.
    params : dict
        Parameter name -> Parameter.
    inputs : list of list of (shape, dtype)
        Every replica's data inputs.
    record : bool
        Gradients are wanted: trainable parameters bind their gradients.
    sources : tuple of Context, optional
        Where each whole input is, when every replica's inputs are rows of
        them (:class:`Rows`; then :meth:`forward` takes the whole inputs).

    Attributes
    ----------
    call : bridge.Call or None
        The recorded call whose backward may still come (the executor's
        arrays hold its forward pass).
    """

    def __init__(self, replicated, ctx_list, params, inputs, record, sources=None):
        self.replicated = rep = replicated
        self.ctx_list = ctx_list
        self.rows = Rows(inputs, sources) if sources else None
        # The parameters' array lists, gradients' too (gp.Trainer's buckets
        # replace them): their ids are part of the cache key.
        self.keep = [(p.list_data(), _gluon.grad_arrays(p)) for p in params.values()]
        sym = rep.symbol
        args, aux, grads, req = {}, {}, {}, {}
        self.data = [[None] * len(inputs[0]) for _ in inputs]
        self.trainable = []                 # (parameter's array, its gradient, grad_req)
        self.call = None
        aux_names = set(sym.list_auxiliary_states())
        feed = _Feed(self, params, inputs)
        for name in sym.list_inputs():
            kind = rep.variables[name]
            arr = kind.value(feed)
            p = params[kind.param] if isinstance(kind, Param) else None
            if record and p is not None and p.grad_req != 'null' and name not in aux_names:
                grads[name] = p.grad(arr.context)
                self.trainable.append((arr, grads[name], p.grad_req))
                req[name] = p.grad_req
            elif name not in aux_names:
                req[name] = 'null'
            (aux if name in aux_names else args)[name] = arr
        self.trained = [t[0] for t in self.trainable]
        group2ctx = {GROUP % r: c for r, c in enumerate(ctx_list)}
        self.executor = _gluon.bind_replicas(sym, len(ctx_list), lambda: sym.bind(
            ctx_list[0], args, args_grad=grads, grad_req=req, aux_states=aux,
            group2ctx=group2ctx))
        n, k = len(ctx_list), rep.num_outputs
        outs = self.executor.outputs
        self.outputs = [outs[r * k:(r + 1) * k] for r in range(n)]
        #: New arrays with every replica's outputs (bridge.run returns them:
        #: the executor's own are overwritten by its next forward pass).
        self.copy_outputs = _gluon.Copier(outs[:n * k])
        self.train, self.idle_ctx = False, ()
        extra = iter(outs[n * k:])
        self.running = [_RunningUpdate(momenta, next(extra), params, c) if momenta else None
                        for momenta, c in zip(rep.running, ctx_list)]
        # Every replica's updates in one list: one Python call per step for
        # all devices (each array's updates stay in their order).
        self.running_ops = [op for run in self.running if run is not None for op in run.ops]
        # Head gradients: the replicas' outputs' (bridge.py has autograd
        # write them), then the batch-statistics outputs' (never used).
        self.heads = [nd.zeros(o.shape, ctx=o.context, dtype=o.dtype) for o in outs[:n * k]] \
            if record else None
        #: Makes the returned outputs autograd variables of ``heads``.
        self.mark_outputs = _gluon.VariableMarker(self.heads) if record else None
        self.zero_heads = [nd.zeros(o.shape, ctx=o.context, dtype=o.dtype) for o in outs[n * k:]]

    def forward(self, args_list, train, idle_ctx=()):
        """Copy every replica's inputs (or, bound with `sources`, the whole
        inputs) into the bound arrays and push the forward pass; returns the
        outputs (the executor's own arrays). `idle_ctx`: the contexts idle
        in the call (see :meth:`update_running`).

        Waits until the previous forward pass of this executor has run:
        MXNet's engine has no back-pressure, and a loop that never reads a
        value would otherwise queue steps without bound (memory, and a
        Ctrl-C that waits for all of them); the caller stays one step ahead
        of the devices, as with the per-replica path's arrays."""
        self.outputs[0][0].wait_to_read()
        if self.rows is not None:
            self.rows.copy_in(args_list)
        else:
            self._copy_slices(args_list)
        _gluon.executor_forward(self.executor, train)
        self.train, self.idle_ctx = train, idle_ctx
        return self.outputs

    def _copy_slices(self, args_list):
        """Copy every replica's inputs into its bound arrays."""
        dsts = getattr(self, '_dsts', None)
        if dsts is None:        # (an input the graph does not read has no array)
            flat = list(itertools.chain.from_iterable(self.data))
            self._used = [d is not None for d in flat]
            dsts = self._dsts = [d for d in flat if d is not None]
        _gluon.copy_into(itertools.compress(itertools.chain.from_iterable(args_list), self._used),
                         dsts)

    def update_running(self):
        """Push the running-statistics updates of the forward pass this
        executor holds (Gluon's BatchNorm makes them in its backward pass:
        bridge.py calls this when it pushes the call's backward), every
        replica's on its context; contexts idle in the call take replica 0's
        SyncBatchNorm statistics (a BatchNorm's are per device: an idle
        device keeps its own, as in the per-replica path)."""
        if not self.train:
            return
        for run in self.running:
            if run is not None:
                run.push_exact()
        _gluon.invoke_each(self.running_ops)
        if self.idle_ctx and self.running[0] is not None:
            self.running[0].copy_synced(self.idle_ctx)

    def backward(self, accumulate=False):
        """Push the backward pass for the head gradients in ``heads`` and
        mark the gradients fresh for the Trainer. `accumulate`: add to the
        gradients this backward pass wrote already (a second call of one
        pass) instead of replacing them."""
        kept = [(g, _gluon.copy(g)) for _, g, req in self.trainable if req == 'write'] \
            if accumulate else ()
        self.executor.backward(self.heads + self.zero_heads)
        for g, old in kept:
            _gluon.add_into(g, old)
        _gluon.mark_grads_fresh(self.trained)


class _RunningUpdate:
    """One replica's running-statistics updates from its batch-statistics
    output, ``old * momentum + batch * (1 - momentum)`` in order, as few
    operators as possible: ``multi_sgd_update`` (MXNet 1.9.1:
    ``w = (1 - lr * wd) * w - lr * rescale_grad * g``, one operator for up
    to its limit of weights) with lr = 1 - momentum, wd = 1 and
    rescale_grad = -1. An update of a parameter already in the current
    operator (a layer used twice) starts the next one, so the engine
    applies them in order. Statistics that are not float32 (its lr and wd
    are float32) take scalar operators.

    Parameters
    ----------
    updates : list of syncgraph.Momentum
    stats : NDArray
        The replica's batch-statistics output (the executor's own array).
    params : dict
        Parameter name -> Parameter.
    ctx : Context
        The replica's context.
    """

    #: Weights per multi_sgd_update (MXNet 1.9.1's kernel takes at most 60).
    MAX_WEIGHTS = 60

    def __init__(self, updates, stats, params, ctx):
        self.ops = []                   # (prepared operator, its parameters)
        self.exact = []                 # (array, batch view, momentum): not float32
        self.synced = []                # (Parameter, its array on ctx)
        data, lrs, out = [], [], []
        for u in updates:
            arrays = [params[u.mean].data(ctx), params[u.var].data(ctx)]
            if arrays[0].dtype != np.float32:
                # multi_sgd_update's lr and wd are float32: float64
                # statistics would lose half their digits.
                self.exact += [(a, stats[at:at + u.channels], u.momentum)
                               for a, at in zip(arrays, (u.mean_at, u.var_at))]
                continue
            if len(out) + 2 > self.MAX_WEIGHTS or any(
                    a is b for a in arrays for b in out):
                self.ops.append(self._prepare(data, lrs, out))
                data, lrs, out = [], [], []
            for a, at in zip(arrays, (u.mean_at, u.var_at)):
                data += [a, stats[at:at + u.channels]]      # (a view: no operator)
                lrs.append(1.0 - u.momentum)
                out.append(a)
            if u.synced:
                self.synced += [(params[u.mean], arrays[0]), (params[u.var], arrays[1])]
        if out:
            self.ops.append(self._prepare(data, lrs, out))

    @staticmethod
    def _prepare(data, lrs, out):
        """One ``multi_sgd_update`` on these arrays, built once for
        ``_gluon.invoke_each`` (the executor's arrays never change)."""
        return (_gluon.prepared_op('multi_sgd_update', data, out),
                _gluon.op_params({'lrs': tuple(lrs), 'wds': (1.0,) * len(out),
                                  'rescale_grad': -1.0, 'num_weights': len(out)}))

    def push_exact(self):
        """The updates of statistics that are not float32 (the float32
        ones are :attr:`ops`, which the Bound pushes for every replica)."""
        for a, batch, momentum in self.exact:
            nd.broadcast_add(a * momentum, batch * (1.0 - momentum), out=a)

    def copy_synced(self, ctx_list):
        """Copy the SyncBatchNorm statistics to the contexts in `ctx_list`
        (each parameter's last update wins: the same array twice is copied
        twice, harmlessly)."""
        for p, arr in self.synced:
            for ctx in ctx_list:
                if ctx in p.list_ctx():
                    _gluon.copy(arr, p.data(ctx))


class _Feed:
    """The arrays a Bound binds to its graph's variables (syncgraph's
    input kinds, each with the replica it belongs to)."""

    def __init__(self, bound, params, inputs):
        self.bound, self.params, self.inputs = bound, params, inputs

    def context(self, rank):
        return self.bound.ctx_list[rank]

    def param(self, kind):
        return self.params[kind.param].data(self.context(kind.rank))

    def data(self, kind):
        if self.bound.rows is not None:
            return self.bound.rows.view(kind.rank, kind.index)
        shape, dtype = self.inputs[kind.rank][kind.index]
        arr = self.bound.data[kind.rank][kind.index] = nd.empty(
            shape, ctx=self.context(kind.rank), dtype=dtype)
        return arr

    def scratch(self, kind):
        return nd.zeros_like(self.params[kind.param].data(self.context(kind.rank)))

    def counts(self, kind):
        return kind.array(self.context(kind.rank))


class Rows:
    """An executor's data inputs as rows of whole arrays: input k of every
    replica is a view of one array on `sources[k]` (the caller's batch's
    context), its rows in replica order. A step copies each whole input
    in once, not once per replica; the executor copies each replica's rows
    to its device itself (MXNet 1.9.1: a bound variable lives where its
    array does, and the executor inserts the cross-device copy to its
    consumers).

    Parameters
    ----------
    inputs : list of list of (shape, dtype)
        Every replica's inputs; input k's shapes differ in their rows only.
    sources : tuple of Context
        Where each whole input is.
    """

    def __init__(self, inputs, sources):
        self.whole, self.views = [], []
        for k, ctx in enumerate(sources):
            rows = [per[k][0][0] for per in inputs]
            shape, dtype = inputs[0][k]
            arr = nd.empty((sum(rows),) + tuple(shape[1:]), ctx=ctx, dtype=dtype)
            self.whole.append(arr)
            self.views.append(_gluon.row_slices(arr, rows))
        self.used = [False] * len(sources)

    @staticmethod
    def signature(whole, sizes):
        """Every replica's (shape, dtype) of each input (what
        ``signature_of`` gives for the slices) when replica r gets
        ``sizes[r]`` rows of each array of `whole`, without slicing."""
        described = _gluon.signature([whole])[0]
        return tuple(tuple(((k,) + shape[1:], dtype) for shape, dtype in described)
                     for k in sizes)

    def view(self, rank, index):
        """Replica `rank`'s input `index` (bound: from now on copied in)."""
        self.used[index] = True
        return self.views[index][rank]

    def copy_in(self, arrays):
        """Copy the whole inputs the graph reads into their arrays."""
        _gluon.copy_into(itertools.compress(arrays, self.used),
                         itertools.compress(self.whole, self.used))


def signature_of(args_list):
    """The shapes and dtypes of every replica's inputs."""
    return _gluon.signature(args_list)
