"""Replicate: one traced graph becomes one graph of every replica.

Replica r's copy of every operator runs on device group ``dev<r>``
(``__ctx_group__``, which ``Symbol.bind(group2ctx=...)`` maps to a context);
its variables are renamed per replica, so each binds to the parameter's own
array on that replica's context. Without SyncBatchNorm the replicas share
nothing: no edge crosses devices.

In a training graph each SyncBatchNorm node (a BatchNorm node marked by the
layer) becomes the arithmetic of ``syncgraph`` (its stats):
every replica's sums and pivot on its own device; on every device, the
merge of all replicas' sums in rank order (the executor copies the other devices' sums:
the only cross-device edges), so every replica gets bit-identical
statistics (sums of centred data, in the parameters' dtype: see
``syncgraph.centred_sums``); ``(x - pivot) * scale + shift`` by the affine kernel
on CPU contexts when it is built, else by BatchNorm's fused kernel.
The batch statistics of each replica's trained BatchNorm and SyncBatchNorm
uses are one extra output; the running statistics take them when the
call's backward pass is pushed (bind.py), as Gluon's BatchNorm takes them
in its backward pass.
Nothing runs in Python per layer.
"""
import collections

import numpy as np

from ..syncgraph import (Counts, GraphWriter, Scratch, Update, batch_statistics,
                         batchnorm_with_outputs, centred_affine, centred_sums, merge, unit, zero)

__all__ = ['Replicated', 'replicate', 'GROUP']

GROUP = 'dev%d'


class _Writer(GraphWriter):
    """A GraphWriter that puts every operator it writes on one replica's
    device group, and names copied nodes per replica (names must be unique
    in one graph)."""

    def __init__(self):
        super().__init__('_gp')
        self.group = None

    def _mark(self, entry_or_id):
        nid = entry_or_id if isinstance(entry_or_id, int) else \
            entry_or_id[0][0] if isinstance(entry_or_id[0], list) else entry_or_id[0]
        attrs = self.nodes[nid].setdefault('attrs', {})
        attrs['__ctx_group__'] = GROUP % self.group
        return entry_or_id

    def copy(self, node, inputs):
        node = dict(node, name=f'r{self.group}_{node["name"]}')
        node['attrs'] = dict(node.get('attrs', {}))
        return self._mark(super().copy(node, inputs))

    def op(self, name, *inputs, **attrs):
        return self._mark(super().op(name, *inputs, **attrs))


class Replicated:
    """The graph of all replicas and how to bind it.

    Attributes
    ----------
    symbol : Symbol
        Outputs: every replica's outputs in replica order, then (recorded
        training) one vector of batch statistics per replica that has
        running statistics to update.
    num_outputs : int
        Outputs of one replica.
    variables : dict
        Variable name -> what it binds to: an input kind of
        ``syncgraph`` (Param, Data, Scratch, Counts, Constant) whose
        ``rank`` is its replica.
    running : list of list of syncgraph.Momentum
        Per replica, the running-statistics updates its batch-statistics
        output (the extra output after all replicas' outputs, when there is
        any) feeds, in the order to apply them.
    """

    def __init__(self, symbol, num_outputs, variables, running):
        self.symbol = symbol
        self.num_outputs = num_outputs
        self.variables = variables
        self.running = running


class _Shape(collections.namedtuple('_Shape', 'shape dtype')):
    """What Traced.layers reads of an input array."""


def _layers_and_rows(traced, params, inputs, layer_of):
    """The stats.Layer of every marked node, and per replica the rows of
    its slice per channel of each (one shape inference per signature)."""
    info, rows, by_batch = {}, [], {}
    for shapes in inputs:
        key = tuple(shapes)
        if key not in by_batch:
            by_batch[key] = traced.layers(params, [_Shape(*s) for s in shapes], layer_of)
        info, x_shapes = by_batch[key]
        rows.append({m: int(np.prod(x_shapes[m], dtype=np.int64)) // info[m].channels
                     for m in info})
    return info, rows


def replicate(traced, params, inputs, train, record, layer_of, cpu=False, kernels=None):
    """The graph of all replicas of a traced block.

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
    layer_of : callable
        Marker attribute -> the SyncBatchNorm block, or None.
    cpu : bool
        Every device is a CPU context (SyncBatchNorm may use the kernels,
        CPU operators).
    kernels : syncgraph.Kernels or None
        The optional operators.
    """
    traced.check_variables(params)
    info, rows = ({}, None) if not (train and traced.synced()) else \
        _layers_and_rows(traced, params, inputs, layer_of)
    rep = _Replicator(traced, len(inputs), record, cpu, kernels)
    for i, node in enumerate(traced.nodes):
        if node['op'] == 'null':
            continue
        use = traced.batchnorms.get(i)
        if i in info:
            rep.sync_batchnorm(use, info[i], tuple((r[i],) for r in rows))
        elif record and use is not None and use.updates:
            rep.batchnorm(use, node)
        else:
            rep.copy(i, node)
    return rep.replicated(params)


class _Replicator:
    """Writes every replica's copy of a traced graph, node by node."""

    def __init__(self, traced, n, record, cpu, kernels):
        self.traced, self.n, self.record, self.cpu, self.kernels = traced, n, record, cpu, kernels
        self.g = _Writer()
        self.variables = {}
        self.made = [{} for _ in range(n)]          # per replica: node id -> its copy's id
        self.updates = [[] for _ in range(n)]       # per replica: trained (Sync)BatchNorm uses

    def var(self, kind):
        self.variables.setdefault(kind.name, kind)
        entry = self.g.var(kind.name)
        # Placement propagates from operators to variables, except into the
        # mutable inputs of BatchNorm: those must be placed.
        self.g.nodes[entry[0]].setdefault('attrs', {})['__ctx_group__'] = GROUP % kind.rank
        return entry

    def entry(self, r, e):
        if self.traced.is_variable(e):
            return self.var(self.traced.variable(e, r))
        return [self.made[r][e[0]], e[1], 0]

    def copy(self, i, node):
        """An operator every replica runs as traced."""
        for r in range(self.n):
            self.g.group = r
            self.made[r][i] = self.g.copy(node, [self.entry(r, e) for e in node['inputs']])

    def batchnorm(self, use, node):
        """A trained BatchNorm: its batch statistics become outputs."""
        for r in range(self.n):
            self.g.group = r
            ins = [self.entry(r, e) for e in node['inputs']]
            scratch = [self.var(Scratch(f'{use.node}_{k}', name, r))
                       for k, name in zip(('mean', 'var'), use.running)]
            self.made[r][use.node] = batchnorm_with_outputs(self.g, node, ins, scratch)
            # (channels: known from the parameters, in replicated())
            self.updates[r].append(Update(use, self.made[r][use.node], None, None, False))

    def sync_batchnorm(self, use, layer, rows):
        """A SyncBatchNorm: every replica's sums cross to every device, each
        merges them all (rows: per replica, its rows per channel)."""
        g, n, i, c = self.g, self.n, use.node, layer.channels
        sent, pivots, shifted = [], [], []
        for r in range(n):
            g.group = r
            d, s1, s2, q, pivot = centred_sums(g, self.entry(r, use.x), layer,
                                               self.var(zero(layer, r)),
                                               self.var(unit(layer, r)), self.cpu,
                                               self.kernels)
            sent.append(g.concat(s1, s2, q))
            pivots.append(pivot)
            shifted.append(d)
        for r in range(n):
            g.group = r
            beta = self.entry(r, use.beta)
            # A fixed gamma is 1, its gradient zeros (as BatchNorm's with
            # fix_gamma: a symbol's gamma may have a gradient to write).
            gamma = self.entry(r, use.gamma)
            gamma = g.op('ones_like', gamma) if layer.fix_gamma else gamma
            counts = self.var(Counts(f'counts{i}', rows, (c,), layer.param_dtype, r))
            scale, shift, _ = merge(g, sent, counts, [pivots[r]], [gamma], [beta], None,
                                    layer.eps, layer.momentum, layer.param_dtype,
                                    acc=layer.param_dtype)
            if self.record:
                # The batch statistics from the sums behind BlockGrad: taken
                # from the merge above, the statistics output changed the
                # executor's plan so that MKL-DNN (MXNet 1.9.1) failed in
                # the backward pass (benchmarks/mkldnn_record/probe.py);
                # unreachable, the copy's scale and shift are not computed.
                _, _, run = merge(g, [g.op('BlockGrad', e) for e in sent], counts,
                                  [pivots[r]], [gamma], [beta], None, layer.eps,
                                  layer.momentum, layer.param_dtype, acc=layer.param_dtype,
                                  batch=True)
                self.updates[r].append(Update(use, None, run, c, True))
            self.made[r][i] = centred_affine(g, shifted[r], scale, shift,
                                             self.var(zero(layer, r)), self.var(unit(layer, r)),
                                             layer, pivots[r], self.cpu, self.kernels)[0]

    def replicated(self, params):
        """The Replicated: every replica's outputs, then its batch
        statistics."""
        heads = self.traced.heads
        outputs = [self.entry(r, h) for r in range(self.n) for h in heads]
        running = []
        for r in range(self.n):
            self.g.group = r
            updates = [u if u.channels else u._replace(channels=params[u.use.running[0]].shape[0])
                       for u in self.updates[r]]
            stats, momenta = batch_statistics(self.g, updates)
            if stats is not None:
                outputs.append(stats)
            running.append(momenta)
        return Replicated(self.g.symbol(outputs), len(heads), self.variables, running)
