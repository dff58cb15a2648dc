"""Replicate: one traced graph becomes one graph of every replica.

Replica r's copy of every operator runs on device group ``dev<r>``
(``__ctx_group__``, which ``Symbol.bind(group2ctx=...)`` maps to a context);
its variables are renamed per replica, so each binds to the parameter's own
array on that replica's context. Without SyncBatchNorm the replicas share
nothing: no edge crosses devices.

In a training graph each SyncBatchNorm node (a BatchNorm node marked by the
layer) becomes the arithmetic of ``nn/centred.py`` and ``nn/moments.py``:
every replica's sums and pivot on its own device; on every device, the
merge of all replicas' sums in rank order (the executor copies the other devices' sums:
the only cross-device edges), so every replica gets bit-identical
statistics (sums of centred data, in the parameters' dtype: see
``nn/centred.py``); ``(x - pivot) * scale + shift`` by the affine kernel
on CPU contexts when it is built, else by BatchNorm's fused kernel.
The batch statistics of each replica's trained BatchNorm and SyncBatchNorm
layers are one extra output; the running statistics take them when the
call's backward pass is pushed (bind.py), as Gluon's BatchNorm takes them
in its backward pass.
Nothing runs in Python per layer.
"""
import collections
import json

from ..nn import centred, moments
from ..nn._graph import GraphWriter
from ..nn.staged import is_marker, layer_info

__all__ = ['Replicated', 'replicate', 'GROUP']

GROUP = 'dev%d'
_X, _GAMMA, _BETA, _MEAN, _VAR = range(5)          # BatchNorm's inputs


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
        node = dict(node, name='r%d_%s' % (self.group, node['name']))
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
        Variable name -> what it binds to: ``('param', name, r)``,
        ``('data', k, r)``, ``('scratch', running parameter name, r)``, ``('counts', rows, C, r)``
        (float64 row counts per replica, one row per replica) or
        ``('unit', dtype, C, r)`` (moments.UNIT_VAR).
    running : list of list of Update
        Per replica, the running-statistics updates its statistics output
        (the extra output after all replicas' outputs, when there is any)
        feeds, in the order to apply them.
    """

    def __init__(self, symbol, num_outputs, variables, running):
        self.symbol = symbol
        self.num_outputs = num_outputs
        self.variables = variables
        self.running = running


class _Shape(collections.namedtuple('_Shape', 'shape dtype')):
    """What layer_info reads of an input array."""


def _updates_running(node):
    """A BatchNorm node that updates its running statistics when trained."""
    attrs = node.get('attrs', {})
    return node['op'] == 'BatchNorm' and attrs.get('use_global_stats', 'False') != 'True'


def _batchnorm(g, node, ins, scratch):
    """A trained BatchNorm whose batch statistics are outputs of the
    forward pass (see :func:`_batch_statistics`). In an executor, MXNet
    1.9.1's kernel updates its auxiliary arrays in the backward pass without
    the engine knowing (the backward operator does not list them as
    written): bound to the parameters' own arrays, a read right after
    ``trainer.step`` raced the update and returned the old values (measured:
    zeros after step 1). So the kernel updates scratch arrays, and its batch
    statistics (outputs 1 and 2) make the update, pushed with the call's
    backward pass (bind.py), like SyncBatchNorm's."""
    attrs = dict(node.get('attrs', {}), output_mean_var='True')
    return g.copy(dict(node, attrs=attrs), ins[:_MEAN] + [scratch('mean'), scratch('var')])


class Update(collections.namedtuple('Update', 'mean var momentum mean_at var_at channels '
                                                  'synced')):
    """One momentum update of a layer's running statistics, applied when the
    call's backward pass is pushed: the parameters named ``mean`` and
    ``var`` take ``old * momentum + batch * (1 - momentum)`` of the batch
    statistics at ``mean_at`` and ``var_at`` (``channels`` each) of the
    replica's statistics output. ``synced``: a SyncBatchNorm's (the same on
    every replica; contexts idle in the call take replica 0's)."""


class _Use(collections.namedtuple('_Use', 'names mean inv stats eps momentum channels synced')):
    """A trained BatchNorm use (entries ``mean`` and ``inv``, its kernel's
    outputs 1 and 2) or SyncBatchNorm use (entry ``stats``: [mean | var])."""


def _batch_statistics(g, uses):
    """The entry of one replica's batch statistics (or None) and their
    Updates, in the order Gluon applies them: its BatchNorm updates the
    running statistics in its backward pass, which meets the uses in
    reverse order.

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
    for k, use in enumerate(uses):
        if use.stats is None:
            by_eps.setdefault(use.eps, []).append(k)
        else:
            at = put(use.stats, 2 * use.channels)
            where[k] = (at, at + use.channels)
    for eps, members in by_eps.items():
        total = sum(uses[k].channels for k in members)
        means = put(g.concat(*[uses[k].mean for k in members]), total)
        inv = g.concat(*[uses[k].inv for k in members])
        variances = put(g.op('_minus_scalar', g.op('reciprocal', g.op('square', inv)),
                             scalar=repr(eps)), total)
        for k in members:
            where[k] = (means, variances)
            means += uses[k].channels
            variances += uses[k].channels
    updates = [Update(uses[k].names[0], uses[k].names[1], uses[k].momentum, *where[k],
                      uses[k].channels, uses[k].synced) for k in reversed(range(len(uses)))]
    return (g.op('BlockGrad', g.concat(*entries)) if entries else None), updates


def replicate(out, data_names, params, inputs, train, record, layers, cpu=False):
    """The graph of all replicas of a traced block.

    Parameters
    ----------
    out : Symbol
        The block's traced graph.
    data_names : list of str
        Its data inputs, in argument order.
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
    layers : callable
        Marker attribute -> the SyncBatchNorm block, or None.
    cpu : bool
        Every device is a CPU context (SyncBatchNorm may use the optional
        sums kernel, a CPU operator).
    """
    # AMP's casts are part of the network (tojson drops them by default:
    # the replicas would compute in float32).
    graph = json.loads(out.tojson(remove_amp_cast=False))
    nodes, heads = graph['nodes'], [tuple(h[:2]) for h in graph['heads']]
    n = len(inputs)
    data_index = {name: i for i, name in enumerate(data_names)}
    markers = [i for i, node in enumerate(nodes) if is_marker(node)] if train else []
    info, rows = {}, [{} for _ in range(n)]
    by_batch = {}
    for r, shapes in enumerate(inputs):
        key = tuple(shapes)
        if key not in by_batch and markers:
            by_batch[key] = layer_info(nodes, markers, data_index, params,
                                       [_Shape(*s) for s in shapes], layers)
        if markers:
            info, x_shapes = by_batch[key]
            for m, shape in zip(markers, x_shapes):
                size = 1
                for d in shape:
                    size *= d
                rows[r][m] = size // info[m].channels
    g = _Writer()
    variables = {}

    def var(name, kind):
        variables.setdefault(name, kind)
        entry = g.var(name)
        # Placement propagates from operators to variables, except into the
        # mutable inputs of BatchNorm: those must be placed.
        g.nodes[entry[0]].setdefault('attrs', {})['__ctx_group__'] = GROUP % kind[-1]
        return entry

    def variable(node, r):
        name = node['name']
        if name in data_index:
            return var('%s_r%d' % (name, r), ('data', data_index[name], r))
        if name not in params:
            raise ValueError(f'the traced graph reads a variable {name!r} that is neither an input '
                             'nor a parameter of the block')
        return var('%s_r%d' % (name, r), ('param', name, r))

    made = [dict() for _ in range(n)]          # per replica: node id -> its copy's id

    def entry(r, e):
        nid, idx = e[0], e[1]
        if nodes[nid]['op'] == 'null':
            return variable(nodes[nid], r)
        return [made[r][nid], idx, 0]

    uses = [[] for _ in range(n)]             # per replica: _Use of trained (Sync)BatchNorms
    for i, node in enumerate(nodes):
        if node['op'] == 'null':
            continue
        if i not in info and not (record and _updates_running(node)):
            for r in range(n):
                g.group = r
                made[r][i] = g.copy(node, [entry(r, e) for e in node['inputs']])
            continue
        running_key = (nodes[node['inputs'][_MEAN][0]]['name'],
                       nodes[node['inputs'][_VAR][0]]['name'])
        if i not in info:
            for r in range(n):
                g.group = r
                ins = [entry(r, e) for e in node['inputs']]
                made[r][i] = _batchnorm(g, node, ins, lambda k: var(
                    '_gp_scratch%d_%s_r%d' % (i, k, r), ('scratch', running_key[k == 'var'], r)))
                attrs = node.get('attrs', {})
                uses[r].append(_Use(running_key, [made[r][i], 1, 0], [made[r][i], 2, 0], None,
                                    float(attrs.get('eps', 1e-3)),
                                    float(attrs.get('momentum', 0.9)),
                                    params[running_key[0]].shape[0], False))
            continue
        layer, ins = info[i], [[entry(r, e) for e in node['inputs']] for r in range(n)]
        sent, pivots, shifted = [], [], []
        for r in range(n):
            g.group = r
            d, s1, s2, q, pivot = centred.centred_sums(g, ins[r][_X], layer, cpu)
            sent.append(g.concat(s1, s2, q))
            pivots.append(pivot)
            shifted.append(d)
        counts_rows = tuple(rows[r][i] for r in range(n))
        c = layer.channels
        for r in range(n):
            g.group = r
            gamma, beta = ins[r][_GAMMA], ins[r][_BETA]
            counts = var('_gp_counts%d_r%d' % (i, r),
                         ('counts', counts_rows, c, layer.param_dtype, r))
            scale, shift, run = moments.merge(
                g, sent, counts, [pivots[r]], [g.op('ones_like', beta) if layer.fix_gamma
                                               else gamma],
                [beta], None, layer.eps, layer.momentum, layer.param_dtype,
                acc=layer.param_dtype, batch=record)
            if record:
                uses[r].append(_Use(running_key, None, None, run, layer.eps, layer.momentum, c,
                                    True))
            unit, zero = [var('_gp_%s_%s_%d_r%d' % (k, layer.param_dtype, c, r),
                              (k, layer.param_dtype, c, r)) for k in ('unit', 'zero')]
            made[r][i] = centred.centred_affine(g, shifted[r], scale, shift, zero, unit, layer,
                                                pivots[r], cpu)[0]
    outputs = [entry(r, h) for r in range(n) for h in heads]
    running = []
    for r in range(n):
        g.group = r
        stats, updates = _batch_statistics(g, uses[r])
        if stats is not None:
            outputs.append(stats)
        running.append(updates)
    return Replicated(g.symbol(outputs), len(heads), variables, running)
