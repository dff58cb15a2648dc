"""SyncBatchNorm (and trained BatchNorm) in graph mode: everything graph
mode (``gluon_parallel.graph``) needs of them, in one place.

Graph mode runs every replica's copy of a traced network as one executor
graph (graph/replicate.py). Its BatchNorm nodes are the only ones that are
not copied as traced:

1. **the node rewrite** (:meth:`BatchNormsInGraph.rewrite`) — a
   SyncBatchNorm node in training becomes every replica's centred sums on
   its own device, on every device the merge of all replicas' sums in rank
   order (the executor copies the other devices' sums: the only edges
   across devices, so every replica gets bit-identical statistics), and
   ``(x - pivot) * scale + shift``; a trained BatchNorm keeps its kernel,
   which updates scratch arrays instead of the parameters
   (:func:`batchnorm_with_outputs`). The arithmetic is stats.py's, shared
   with the staged path;
2. **the running statistics** (:meth:`BatchNormsInGraph.outputs`) — when
   recorded, each replica's batch statistics become one extra output of
   the graph, and :meth:`BatchNormsInGraph.running_updates` makes their
   momentum updates (:class:`MomentumUpdates`) from the bound executor's
   extra outputs;
3. **their order against backward** (:func:`push_after_backward`) —
   Gluon's BatchNorm updates its running statistics in its backward pass,
   so the updates are pushed with the calls' backward, the later call
   first; contexts idle in a call take replica 0's SyncBatchNorm
   statistics.

graph/ reaches all of this through :class:`BatchNormsInGraph` (one per
replicated graph) and :func:`push_after_backward`; which layers a graph
holds, and whether it may run as one graph, is layers.py's.

The node rewrite writes through a *replicator* (graph/replicate.py's): an
object with ``g`` (a GraphWriter whose ``rank`` puts the operators it
writes on one replica's device), ``n`` (replicas), ``entry(r, e)``
(replica r's copy of a traced entry) and ``var(kind)`` (a variable of an
input kind).

The layers (their blocks, and the optional kernels their graphs use) come
from the layer registry (layers.py), as in the staged path.
"""
import collections
from typing import NamedTuple

import numpy as np
from mxnet import nd

from .. import _gluon
from .inputs import Counts, Scratch, unit, zero
from .layers import kernels_of, layer_of
from .stats import Centring, LayerInputs, MergeSettings, centred_affine, centred_sums, merge
from .writer import json_entry

__all__ = ['BatchNormsInGraph', 'MomentumUpdates', 'Momentum', 'UseStatistics',
           'push_after_backward', 'batch_statistics', 'batchnorm_with_outputs']


class _Shape(NamedTuple):
    """What Traced.layers reads of an input array."""
    shape: tuple
    dtype: object


class BatchNormsInGraph:
    """The BatchNorm nodes of one replicated graph: how each is rewritten,
    the running statistics' outputs, and their updates.

    Parameters
    ----------
    traced : syncgraph.Traced
        The block's traced graph.
    params : dict
        Parameter name -> Parameter.
    inputs : list of list of (shape, dtype)
        Every replica's data inputs.
    train : bool
        Training mode: SyncBatchNorm nodes merge the replicas' statistics.
    record : bool
        Recorded for backward: the running statistics are updated (as in
        the staged path, a forward that autograd does not record leaves
        them).
    cpu : bool
        Every device is a CPU context (SyncBatchNorm may use the kernels,
        CPU operators).
    mkldnn : bool
        MXNet runs MKL-DNN kernels on some of the devices: the kernels'
        float64 sums next to MKL-DNN's float32 layouts are untested, so
        MXNet's operators compute the sums.
    """

    def __init__(self, traced, params, inputs, train, record, cpu=False, mkldnn=False):
        self.traced, self.params, self.record, self.cpu = traced, params, record, cpu
        self.layers, self.rows = {}, None
        if train and traced.synced():
            self.layers, self.rows = _layers_and_rows(traced, params, inputs)
        blocks = [] if mkldnn else [layer.block for layer in self.layers.values()]
        self.ops = kernels_of(b for b in blocks if b is not None)
        self.updates = [[] for _ in inputs]     # per replica: its UseStatistics, in graph order
        #: Per replica, the Momentum updates its batch-statistics output
        #: feeds, in the order to apply them (:meth:`outputs`).
        self.momenta = [[] for _ in inputs]

    def rewrite(self, rep, i, node):
        """Write every replica's copy of traced node `i` (`node`) if it is a
        SyncBatchNorm in training or a trained BatchNorm whose running
        statistics a recorded call updates; returns per replica its copy's
        node id, or None (the node is not theirs: copied as traced)."""
        use = self.traced.batchnorms.get(i)
        if i in self.layers:
            made = _sync_batchnorm(rep, use, self.layers[i], tuple((r[i],) for r in self.rows),
                                   self)
        elif self.record and use is not None and use.updates:
            made = _trained_batchnorm(rep, use, node)
        else:
            return None
        for r, m in enumerate(made):
            if m.update is not None:
                self.updates[r].append(m.update)
        return [m.node for m in made]

    def outputs(self, rep):
        """Write each replica's batch statistics (after every node's copy);
        returns the entries to append to the graph's outputs (one per
        replica that has running statistics to update, in replica order)."""
        extra = []
        for r in range(rep.n):
            rep.g.rank = r
            updates = [u if u.channels else
                       u._replace(channels=self.params[u.use.running.mean].shape[0])
                       for u in self.updates[r]]
            stats, self.momenta[r] = batch_statistics(rep.g, updates)
            if stats is not None:
                extra.append(stats)
        return extra

    def running_updates(self, stats, ctx_list):
        """The :class:`MomentumUpdates` of an executor bound to this graph
        (`stats`: its outputs after every replica's own, the batch
        statistics :meth:`outputs` wrote), or None (nothing to update)."""
        return MomentumUpdates(self.momenta, stats, self.params, ctx_list) if stats else None


def _layers_and_rows(traced, params, inputs):
    """The stats.Layer of every marked node, and per replica the rows of
    its slice per channel of each (one shape inference per signature)."""
    info, rows, by_batch = {}, [], {}
    for shapes in inputs:
        key = tuple(shapes)
        if key not in by_batch:
            by_batch[key] = traced.layers(params, [_Shape(*s) for s in shapes], layer_of)
        info = by_batch[key].layers         # (a traced.LayersInfo)
        x_shapes = by_batch[key].x_shapes
        rows.append({m: int(np.prod(x_shapes[m], dtype=np.int64)) // info[m].channels
                     for m in info})
    return info, rows


class _Made(NamedTuple):
    """One replica's copy of a rewritten node: its id, its UseStatistics
    (None: its running statistics are not updated)."""
    node: int
    update: object


class UseStatistics(NamedTuple):
    """Where the batch statistics of a trained BatchNorm or SyncBatchNorm
    use of one replica are in its graph: its traced.Use; a BatchNorm's copy
    (batchnorm_with_outputs: outputs 1 and 2 are the batch mean and
    1/sqrt(var + eps)), or a SyncBatchNorm's entry
    of its batch's [mean | var] (`stats`); its channels; `synced`: the same
    statistics on every replica (SyncBatchNorm)."""
    use: object
    node: object
    stats: object
    channels: object
    synced: bool


def _sync_batchnorm(rep, use, layer, rows, plan):
    """Every replica's copy of a SyncBatchNorm use (a traced.Use; `layer`:
    its stats.Layer; rows: per replica, its rows per channel); `plan`: the
    BatchNormsInGraph (record, cpu, ops). Returns a _Made per replica."""
    g, n, c = rep.g, rep.n, layer.channels
    sent, centred, centrings = [], [], []
    for r in range(n):
        g.rank = r
        centring = Centring(rep.var(zero(layer, r)), rep.var(unit(layer, r)), plan.cpu, plan.ops)
        sums = centred_sums(g, rep.entry(r, use.x), layer, centring)
        sent.append(g.concat(sums.s1, sums.s2, sums.q))
        centred.append(sums)
        centrings.append(centring)
    settings = MergeSettings(layer.eps, layer.momentum, layer.param_dtype,
                             acc=layer.param_dtype)
    made = []
    for r, sums in enumerate(centred):
        g.rank = r
        beta = rep.entry(r, use.beta)
        # A fixed gamma is 1, its gradient zeros (as BatchNorm's with
        # fix_gamma: a symbol's gamma may have a gradient to write).
        gamma = rep.entry(r, use.gamma)
        gamma = g.op('ones_like', gamma) if layer.fix_gamma else gamma
        counts = rep.var(Counts(f'counts{use.node}', rows, (c,), layer.param_dtype, r))
        inputs = LayerInputs([sums.pivot], [gamma], [beta])
        merged = merge(g, sent, counts, inputs, settings)
        update = None
        if plan.record:
            # The batch statistics from the sums behind BlockGrad: taken
            # from the merge above, the statistics output changed the
            # executor's plan so that MKL-DNN (MXNet 1.9.1) failed in the
            # backward pass (benchmarks/mkldnn_record/probe.py); unreachable,
            # the copy's scale and shift are not computed.
            batch = merge(g, [g.op('BlockGrad', e) for e in sent], counts, inputs, settings,
                          batch=True)
            update = UseStatistics(use, None, batch.run, c, True)
        out = centred_affine(g, sums, merged, layer, centrings[r])
        made.append(_Made(out[0], update))       # (a json_entry)
    return made


def _trained_batchnorm(rep, use, node):
    """Every replica's copy of a trained BatchNorm node whose batch
    statistics become outputs (:func:`batchnorm_with_outputs`). Returns a
    _Made per replica (channels are known from the parameters later)."""
    made = []
    for r in range(rep.n):
        rep.g.rank = r
        ins = [rep.entry(r, e) for e in node['inputs']]
        scratch = [rep.var(Scratch(f'{use.node}_{k}', name, r))
                   for k, name in zip(('mean', 'var'), use.running)]
        nid = batchnorm_with_outputs(rep.g, node, ins, scratch)
        made.append(_Made(nid, UseStatistics(use, nid, None, None, False)))
    return made


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
    (:class:`MomentumUpdates`), like SyncBatchNorm's."""
    attrs = dict(node.get('attrs', {}), output_mean_var='True')
    return g.copy(dict(node, attrs=attrs), list(ins[:3]) + list(scratch))


class Momentum(NamedTuple):
    """One momentum update of a layer's running statistics, applied when the
    call's backward pass is pushed: the parameters named ``mean`` and
    ``var`` take ``old * momentum + batch * (1 - momentum)`` of the batch
    statistics at ``mean_at`` and ``var_at`` (``channels`` each) of the
    replica's statistics output. ``synced``: a SyncBatchNorm's (contexts
    idle in the call take replica 0's)."""
    mean: str
    var: str
    momentum: float
    mean_at: int
    var_at: int
    channels: int
    synced: bool


def batch_statistics(g, updates):
    """The entry of one replica's batch statistics (or None), and their
    Momentum updates in the order Gluon applies them: its BatchNorm updates
    the running statistics in its backward pass, which meets the uses in
    reverse order (`updates`: UseStatistics per use, in graph order).

    BatchNorm's kernel gives 1/sqrt(var + eps) as its third output (MXNet
    1.9.1, native and MKL-DNN): uses sharing eps get their variances as one
    vector (each small operator costs the engine about as much as a
    layer's arithmetic).
    """
    entries, where, end = [], {}, 0

    def put(entry, size):
        """Append `entry` (`size` values); returns where it starts."""
        nonlocal end
        entries.append(entry)
        end += size
        return end - size

    by_eps = collections.OrderedDict()
    for k, u in enumerate(updates):
        if u.stats is None:
            by_eps.setdefault(u.use.eps, []).append(k)
        else:
            at = put(u.stats, 2 * u.channels)
            where[k] = (at, at + u.channels)
    for eps, members in by_eps.items():
        total = sum(updates[k].channels for k in members)
        means = put(g.concat(*[json_entry(updates[k].node, 1) for k in members]), total)
        inv = g.concat(*[json_entry(updates[k].node, 2) for k in members])
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


class MomentumUpdates:
    """The momentum updates of one executor's running statistics, every
    replica's, from its batch-statistics output (graph mode: the old values
    updated in place after backward; the staged path's graphs compute the
    new values, which ``rendezvous.write_new_running`` copies in): ``old * momentum + batch *
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

    def push(self, idle_ctx):
        """Push every replica's updates of a forward pass in training;
        the contexts idle in it (`idle_ctx`) take replica 0's SyncBatchNorm
        statistics (a BatchNorm's are per device: an idle device keeps its
        own, as in the per-replica path)."""
        for a, batch, momentum in self.exact:
            nd.broadcast_add(a * momentum, batch * (1.0 - momentum), out=a)
        _gluon.invoke_each(self.ops)
        for p, arr in self.synced if idle_ctx else ():
            for ctx in idle_ctx:
                if ctx in p.list_ctx():         # (the last update of a parameter wins)
                    _gluon.copy(arr, p.data(ctx))


def push_after_backward(executors):
    """Push the running-statistics updates of the calls one backward pass
    reached, right after their backward (`executors`: the calls', in call
    order; each holds its forward pass's ``running`` updates, or None, and
    whether it ran in training, ``train``, and which contexts it left idle,
    ``idle_ctx``): Gluon's BatchNorm updates its running statistics in its
    backward pass, which meets the later call first."""
    for ex in reversed(executors):
        if ex.running is not None and ex.train:
            ex.running.push(ex.idle_ctx)
