"""Running statistics in rewritten graphs: the batch statistics as forward
outputs and the momentum updates they feed (graph mode:
:func:`batch_statistics` writes them, :class:`RunningUpdates` applies them
when the call's backward pass is pushed), and the one write-back of new
running statistics into their parameters (the staged path)."""
import collections

import numpy as np
from mxnet import autograd, nd

from .. import _gluon

__all__ = ['Update', 'Momentum', 'RunningUpdates', 'write_running', 'batchnorm_with_outputs',
           'batch_statistics']


def write_running(vector, params, ctxs):
    """Write consecutive pieces of `vector` (the new values, in order) into
    the arrays of `params` on each context of `ctxs` where they live (the
    vector's own context always), in one operator per context."""
    sizes = [p.shape[0] for p in params]
    with autograd.pause():
        for c in ctxs:
            if c != vector.context and c not in params[0].list_ctx():
                continue
            src = vector if c == vector.context else vector.as_in_context(c)
            _gluon.split_into(src, sizes, [p.data(c) for p in params])


def batchnorm_with_outputs(g, node, ins, scratch):
    """A trained BatchNorm whose new running statistics are outputs of the
    forward pass (see :func:`batch_statistics`). In an executor, MXNet
    1.9.1's kernel updates its auxiliary arrays in the backward pass without
    the engine knowing (the backward operator does not list them as
    written): bound to the parameters' own arrays, a read right after
    ``trainer.step`` raced the update and returned the old values (measured:
    zeros after step 1). So the kernel updates scratch arrays (`scratch`:
    the entries of the mean's and the variance's), and its batch statistics
    (outputs 1 and 2) make the update, pushed with the call's backward pass
    (graph/bind.py), like SyncBatchNorm's."""
    attrs = dict(node.get('attrs', {}), output_mean_var='True')
    return g.copy(dict(node, attrs=attrs), list(ins[:3]) + list(scratch))


class Update(collections.namedtuple('Update', 'use node stats channels synced')):
    """A trained BatchNorm or SyncBatchNorm use of one replica: its
    traced.Use; a BatchNorm's copy (batchnorm_with_outputs: outputs 1 and
    2 are the batch mean and 1/sqrt(var + eps)), or a SyncBatchNorm's entry
    of its batch's [mean | var] (`stats`); its channels; `synced`: the same
    statistics on every replica (SyncBatchNorm)."""


class Momentum(collections.namedtuple('Momentum', 'mean var momentum mean_at var_at channels '
                                                  'synced')):
    """One momentum update of a layer's running statistics, applied when the
    call's backward pass is pushed: the parameters named ``mean`` and
    ``var`` take ``old * momentum + batch * (1 - momentum)`` of the batch
    statistics at ``mean_at`` and ``var_at`` (``channels`` each) of the
    replica's statistics output. ``synced``: a SyncBatchNorm's (contexts
    idle in the call take replica 0's)."""


def batch_statistics(g, updates):
    """The entry of one replica's batch statistics (or None), and their
    Momentum updates in the order Gluon applies them: its BatchNorm updates
    the running statistics in its backward pass, which meets the uses in
    reverse order (`updates`: Update per use, in graph order).

    BatchNorm's kernel gives 1/sqrt(var + eps) as its third output (MXNet
    1.9.1, native and MKL-DNN): uses sharing eps get their variances as one
    vector (each small operator costs the engine about as much as a
    layer's arithmetic).
    """
    entries, where, end = [], {}, [0]

    def put(entry, size):
        entries.append(entry)
        end[0] += size
        return end[0] - size

    by_eps = collections.OrderedDict()
    for k, u in enumerate(updates):
        if u.stats is None:
            by_eps.setdefault(u.use.eps, []).append(k)
        else:
            at = put(u.stats, 2 * u.channels)
            where[k] = (at, at + u.channels)
    for eps, members in by_eps.items():
        total = sum(updates[k].channels for k in members)
        means = put(g.concat(*[[updates[k].node, 1, 0] for k in members]), total)
        inv = g.concat(*[[updates[k].node, 2, 0] for k in members])
        variances = put(g.op('_minus_scalar', g.op('reciprocal', g.op('square', inv)),
                             scalar=repr(eps)), total)
        for k in members:
            where[k] = (means, variances)
            means += updates[k].channels
            variances += updates[k].channels
    momenta = []
    for k in reversed(range(len(updates))):
        u, (mean_at, var_at) = updates[k], where[k]
        momenta.append(Momentum(u.use.running.mean, u.use.running.var, u.use.momentum,
                                mean_at, var_at, u.channels, u.synced))
    return (g.op('BlockGrad', g.concat(*entries)) if entries else None), momenta


class RunningUpdates:
    """The momentum updates of one executor's running statistics, every
    replica's, from its batch-statistics output: ``old * momentum + batch *
    (1 - momentum)`` in Gluon's order, in as few operators as possible:
    ``multi_sgd_update`` (MXNet 1.9.1: ``w = (1 - lr * wd) * w - lr *
    rescale_grad * g``, up to 60 weights each) with lr = 1 - momentum, wd = 1
    and rescale_grad = -1, prepared once (the executor's arrays never
    change) and pushed for every replica in one Python call. An update of a
    parameter already in the current operator (a layer used twice) starts
    the next one, so the engine applies them in order. Statistics that are
    not float32 (the operator's lr and wd are float32: float64 would lose
    half its digits) take scalar operators.

    Parameters
    ----------
    momenta : list of list of Momentum
        Per replica, its updates in order (empty: none).
    stats : list of NDArray
        The batch-statistics output of each replica that has updates, in
        replica order (the executor's own arrays).
    params : dict
        Parameter name -> Parameter.
    ctx_list : list of Context
        The replicas' contexts.
    """

    #: Weights per multi_sgd_update (MXNet 1.9.1's kernel limit).
    MAX_WEIGHTS = _gluon.MULTI_TENSOR_MAX

    def __init__(self, momenta, stats, params, ctx_list):
        self.ops = []                   # (prepared operator, its parameters)
        self.exact = []                 # (array, batch view, momentum): not float32
        self.synced = []                # replica 0's SyncBatchNorm (Parameter, array)
        stats = iter(stats)
        for r, (updates, ctx) in enumerate(zip(momenta, ctx_list)):
            if updates:
                self._prepare(updates, next(stats), params, ctx, r == 0)

    def _prepare(self, updates, stats, params, ctx, first):
        data, lrs, out = [], [], []
        for u in updates:
            mean, var = params[u.mean].data(ctx), params[u.var].data(ctx)
            arrays = [mean, var]
            views = [stats[at:at + u.channels] for at in (u.mean_at, u.var_at)]  # (no operator)
            if mean.dtype != np.float32:
                self.exact += [(a, v, u.momentum) for a, v in zip(arrays, views)]
                continue
            if len(out) + 2 > self.MAX_WEIGHTS or any(a is b for a in arrays for b in out):
                self.ops.append(self._op(data, lrs, out))
                data, lrs, out = [], [], []
            for a, v in zip(arrays, views):
                data += [a, v]
                lrs.append(1.0 - u.momentum)
                out.append(a)
            if u.synced and first:
                self.synced += [(params[u.mean], mean), (params[u.var], var)]
        if out:
            self.ops.append(self._op(data, lrs, out))

    @staticmethod
    def _op(data, lrs, out):
        return (_gluon.prepared_op('multi_sgd_update', data, out),
                _gluon.op_params({'lrs': tuple(lrs), 'wds': (1.0,) * len(out),
                                  'rescale_grad': -1.0, 'num_weights': len(out)}))

    def push(self, idle_ctx=()):
        """Push every replica's updates; the contexts in `idle_ctx` (without
        rows in the call) take replica 0's SyncBatchNorm statistics (a
        BatchNorm's are per device: an idle device keeps its own, as in the
        per-replica path)."""
        for a, batch, momentum in self.exact:
            nd.broadcast_add(a * momentum, batch * (1.0 - momentum), out=a)
        _gluon.invoke_each(self.ops)
        for p, arr in self.synced if idle_ctx else ():
            for ctx in idle_ctx:
                if ctx in p.list_ctx():         # (the last update of a parameter wins)
                    _gluon.copy(arr, p.data(ctx))
