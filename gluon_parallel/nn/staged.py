"""SyncBatchNorm in hybridized networks: the graph runs in stages, and the
replicas meet between stages in their issuing threads.

A barrier must not wait inside MXNet's engine on CPU contexts: all of them
share one round-robin pool of temp-space buffers (imperative operators and
dynamic graphs draw one per call, static graphs one per graph and device at
set-up), one random-number resource and one parallel-random resource, each
an engine variable served in push order. An operator blocked in a barrier
while another device's earlier operator queues on the same variable closes
a cycle; more temp copies make that rarer, never impossible (MXNet 1.9.1,
src/resource.cc, src/executor/attach_op_resource_pass.cc). So the graph a
hybridized block traced is cut at its SyncBatchNorm nodes: stage L holds
every node computable after L barriers, each stage is one CachedOp (with
the block's flags, static_alloc included), and the barrier between stages
is a ParallelState in the thread that issues the replica, as in imperative
mode. All of one replica's operators before a barrier are pushed before any
operator after it, on every device.

The traced graph keeps SyncBatchNorm as a BatchNorm node marked with the
attribute ``__gp_sync__``: outside a parallel call (for a layer without a
reducer), in predict mode, or on export, the block's own CachedOp runs it
as BatchNorm.
"""
import json
import threading

import numpy as np
from mxnet import nd

from .. import _gluon
from . import moments
from ._graph import GraphWriter

__all__ = ['MARK', 'StagedGraph', 'staged_graph', 'layer_info', 'is_marker']

MARK = '__gp_sync__'
_X, _GAMMA, _BETA, _MEAN, _VAR = range(5)          # BatchNorm's inputs
_lock = threading.RLock()


def is_marker(node):
    """A BatchNorm node traced from a SyncBatchNorm."""
    return node['op'] == 'BatchNorm' and MARK in node.get('attrs', {})


def _entry(e):
    return (e[0], e[1])


class _Stage:
    __slots__ = ('op', 'inputs', 'outputs', 'merges', 'writes', 'sums_of', 'drop')


def layer_info(nodes, markers, data_index, params, args, layers):
    """moments.Layer of every marker node, and the shape of its input x,
    from the graph's shape and type inference on one call's inputs.

    Parameters
    ----------
    nodes : list of dict
        The traced graph's nodes (its JSON form).
    markers : list of int
        Ids of the marked BatchNorm nodes.
    data_index : dict
        Data input name -> position in `args`.
    params : dict
        Parameter name -> Parameter (shapes and dtypes known).
    args : list of NDArray
        One call's data inputs.
    layers : callable
        Marker attribute -> the SyncBatchNorm block, or None.

    Returns
    -------
    (dict, list)
        {marker: moments.Layer}, and the input shape of each marker.
    """
    xs = [list(nodes[m]['inputs'][_X]) for m in markers]
    g = GraphWriter('_gp_info')
    g.nodes = [dict(n) for n in nodes]
    probe = g.symbol(xs)
    shapes, types = {}, {}
    for name, i in data_index.items():
        shapes[name], types[name] = args[i].shape, args[i].dtype
    for name, p in params.items():
        shapes[name], types[name] = p.shape, p.dtype
    known = set(probe.list_inputs())
    _, x_shapes, _ = probe.infer_shape_partial(**{k: v for k, v in shapes.items() if k in known})
    _, x_types, _ = probe.infer_type_partial(**{k: v for k, v in types.items() if k in known})
    info = {}
    for m, shape, dtype in zip(markers, x_shapes, x_types):
        attrs = nodes[m]['attrs']
        gamma = params[nodes[nodes[m]['inputs'][_GAMMA][0]]['name']]
        x = nodes[nodes[m]['inputs'][_X][0]]
        if x['name'] in data_index:
            dtype = args[data_index[x['name']]].dtype
        # Type inference knows no bfloat16 (AMP): 'unknown' data is
        # widened through float32 (moments.widen).
        dtype = 'unknown' if dtype is None else moments.dtype_name(dtype)
        info[m] = moments.Layer(
            gamma.shape[0], int(attrs.get('axis', 1)), len(shape),
            dtype, np.dtype(gamma.dtype).name,
            float(attrs.get('eps', 1e-3)),
            float(attrs.get('momentum', 0.9)), attrs.get('fix_gamma', 'True') == 'True',
            layers(attrs[MARK]))
    return info, [tuple(s) for s in x_shapes]


class StagedGraph:
    """The stages of one traced graph.

    Parameters
    ----------
    out : Symbol
        The traced graph (its BatchNorm nodes marked by SyncBatchNorm).
    data_names : list of str
        Names of its data inputs, in argument order.
    params : dict
        Parameter name -> Parameter (their shapes and dtypes are known).
    flags : list
        The block's CachedOp flags (static_alloc, static_shape...).
    args : list of NDArray
        One call's data inputs (shapes and dtypes of the layers' inputs).
    layers : callable
        Marker attribute -> the SyncBatchNorm block, or None.
    """

    def __init__(self, out, data_names, params, flags, args, layers):
        # AMP's casts are part of the network (tojson drops them by
        # default: the stages would compute in float32).
        g = json.loads(out.tojson(remove_amp_cast=False))
        self.nodes = nodes = g['nodes']
        self.heads = [_entry(h) for h in g['heads']]
        self.params = params
        self.data_index = {name: i for i, name in enumerate(data_names)}
        self.flags = [f for f in flags if f[0] in ('static_alloc', 'static_shape', 'inline_limit',
                                                    'forward_bulk_size', 'backward_bulk_size')]
        self.markers = [i for i, n in enumerate(nodes) if is_marker(n)]
        level = self.level = [0] * len(nodes)
        for i, node in enumerate(nodes):
            if node['op'] != 'null':
                ready = max([level[e[0]] for e in node['inputs']] or [0])
                level[i] = ready + 1 if is_marker(node) else ready
        self.num_stages = max(level) + 1
        reads = [set() for _ in range(self.num_stages)]
        for i, node in enumerate(nodes):
            if is_marker(node):
                reads[level[i]].update(_entry(e) for e in node['inputs'])
                reads[level[i] - 1].add(_entry(node['inputs'][_X]))
            elif node['op'] != 'null':
                reads[level[i]].update(_entry(e) for e in node['inputs'])
        self.exported = {e for L in range(self.num_stages) for e in reads[L]
                         if nodes[e[0]]['op'] != 'null' and level[e[0]] < L}
        self.exported.update(h for h in self.heads if nodes[h[0]]['op'] != 'null')
        self.last_read = {}
        for L in range(self.num_stages):
            for e in reads[L]:
                self.last_read[e] = L
        self.layers = layer_info(nodes, self.markers, self.data_index, params, args, layers)[0]
        self.layer_blocks = list({id(l.block): l.block for l in self.layers.values()
                                  if l.block is not None}.values())
        self.running = {m: tuple(params[nodes[nodes[m]['inputs'][k][0]]['name']]
                                 for k in (_MEAN, _VAR)) for m in self.markers}
        self._stages = {}

    # -------------------------------------------------------------- stages

    def reduced_levels(self):
        """The barriers (stage indices) where a layer has a reducer: there
        every replica merges one entry, the totals the reducer returned."""
        return frozenset(self.level[m] for m in self.markers
                         if self.layers[m].block is not None
                         and self.layers[m].block.reducer is not None)

    def stages(self, n, recording, reduced=frozenset()):
        key = (n, recording, reduced)
        st = self._stages.get(key)
        if st is None:
            with _lock:
                st = self._stages.get(key)
                if st is None:
                    st = self._stages[key] = [self._stage(L, 1 if L in reduced else n, recording)
                                              for L in range(self.num_stages)]
        return st

    def _stage(self, L, n, recording):
        nodes, level, layers = self.nodes, self.level, self.layers
        g = GraphWriter('_gp%d_' % L)
        kinds, made = {}, {}

        def var(name, kind):
            kinds.setdefault(name, kind)
            return g.var(name)

        def resolve(e):
            nid, idx = e
            if nid in made:      # a copied node's id, or the entry of an affine map
                return [made[nid], idx, 0] if isinstance(made[nid], int) else made[nid]
            src = nodes[nid]
            if src['op'] == 'null':
                kinds.setdefault(src['name'], ('var', src['name']))
                return g.var(src['name'], src.get('attrs'))
            return var('_gp_e%d_%d' % e, ('entry', e))

        here = [m for m in self.markers if level[m] == L]
        merged, offsets, off = None, {}, 0
        for m in here:
            offsets[m], off = off, off + layers[m].channels
        for i, node in enumerate(nodes):
            if node['op'] == 'null' or level[i] != L:
                continue
            if not is_marker(node):
                made[i] = g.copy(node, [resolve(_entry(e)) for e in node['inputs']])
                continue
            if merged is None:
                merged = self._merge(g, here, n, recording, var, resolve)
            c, lay = layers[i].channels, layers[i]
            scale = g.slice_axis(merged[0], 0, offsets[i], offsets[i] + c)
            shift = g.slice_axis(merged[1], 0, offsets[i], offsets[i] + c)
            made[i] = moments.affine(
                g, resolve(_entry(node['inputs'][_X])), scale, shift,
                var('_gp_pivot%d' % i, ('pivot', i)),
                var('_gp_unit_%s_%d' % (lay.param_dtype, c), ('unit', lay.param_dtype, c)), lay)
        heads, outputs = [], []
        for e in sorted(self.exported):
            if level[e[0]] == L:
                heads.append(resolve(e))
                outputs.append(('entry', e))
        if merged is not None and merged[2] is not None:
            heads.append(merged[2])
            outputs.append(('run', None))
        if merged is not None and any(layers[m].block is not None and layers[m].block.check_finite
                                      for m in here):
            heads.append(g.op('BlockGrad', g.concat(merged[0], merged[1])))
            outputs.append(('check', None))
        sums_of = [m for m in self.markers if level[m] == L + 1]
        if sums_of:
            fields = [[], [], []]                       # S1, S2, q of every layer
            for m in sums_of:
                *sums, pivot = moments.local_sums(g, resolve(_entry(nodes[m]['inputs'][_X])),
                                                  layers[m])
                for f, e in zip(fields, sums):
                    f.append(e)
                heads.append(pivot)
                outputs.append(('pivot', m))
            heads.append(g.concat(*(fields[0] + fields[1] + fields[2])))
            outputs.append(('sums', None))
        st = _Stage()
        st.merges, st.sums_of, st.outputs = here, sums_of, outputs
        st.writes = self._writes(here)
        st.drop = [e for e, last in self.last_read.items() if last == L and e not in self.heads]
        if not heads:
            st.op, st.inputs = None, []
            return st
        symbol = g.symbol(heads)
        names = symbol.list_inputs()
        st.inputs = [kinds[name] for name in names]
        params = [i for i, k in enumerate(st.inputs) if k[0] == 'var' and k[1] in self.params]
        flags = [('data_indices', [i for i in range(len(names)) if i not in params]),
                 ('param_indices', params)] + self.flags
        st.op = nd.CachedOp(symbol, flags)
        return st

    def _merge(self, g, here, n, recording, var, resolve):
        nodes, layers = self.nodes, self.layers
        sums = [var('_gp_sums%d' % r, ('sums', r)) for r in range(n)]
        counts = var('_gp_counts', ('counts',))
        ins = [[resolve(_entry(e)) for e in nodes[m]['inputs']] for m in here]
        gamma = [g.op('ones_like', i[_BETA]) if layers[m].fix_gamma else i[_GAMMA]
                 for m, i in zip(here, ins)]
        running = [(i[_MEAN], i[_VAR]) for i in ins] if recording else None
        per = {}
        for field in ('eps', 'momentum'):
            values = [getattr(layers[m], field) for m in here]
            per[field] = values[0] if len(set(values)) == 1 else var(f'_gp_{field}', (
                'const', tuple((layers[m].channels, v) for m, v in zip(here, values))))
        return moments.merge(g, sums, counts, [var('_gp_pivot%d' % m, ('pivot', m)) for m in here],
                             gamma, [i[_BETA] for i in ins], running, per['eps'],
                             per['momentum'], layers[here[0]].param_dtype,
                             chain=self._chain(here), channels=[layers[m].channels for m in here])

    def _chain(self, here):
        """Per marker merged here, the index of an earlier one updating the
        same running statistics (one layer used twice), or None."""
        seen, chain = {}, []
        for k, m in enumerate(here):
            key = tuple(id(p) for p in self.running[m])
            chain.append(seen.get(key))
            seen[key] = k
        return chain

    def _writes(self, here):
        """The markers merged here whose running statistics a stage's 'run'
        output holds, in order: the last use of each."""
        chain = self._chain(here)
        return [m for k, m in enumerate(here) if k not in chain]


def staged_graph(block, args, layer_of, flags=None):
    """The StagedGraph of a hybridized block's current graph, or None when
    it holds no SyncBatchNorm (layer_of: marker -> layer, or None). Built
    once per graph: after ``hybridize()`` or a cast, Gluon traces anew.
    `flags`: the stages' CachedOp flags, default the block's."""
    cached = block.__dict__.get('_gp_staged')
    if cached is not None and cached[0] is _gluon.graph_handle(block):
        return cached[1]
    with _lock:
        handle, data_names, out, own_flags = _gluon.traced_graph(block, args)
        cached = block.__dict__.get('_gp_staged')
        if cached is None or cached[0] is not handle:
            staged = None
            if MARK in out.tojson():
                staged = StagedGraph(out, data_names,
                                     {p.name: p for p in block.collect_params().values()},
                                     own_flags if flags is None else flags,
                                     _gluon.flat_inputs(args), layer_of)
            # A plain attribute (not through Block.__setattr__): the graph's
            # stages, kept with the handle of the graph they were cut from.
            block.__dict__['_gp_staged'] = cached = (handle, staged)
    return cached[1]
