"""A traced graph, parsed once: its nodes, and one record per BatchNorm use.

SyncBatchNorm traces as a BatchNorm node marked with the attribute
:data:`MARK` (the layer's id). Both consumers of the traced graph (the
staged path, graph mode's replication) read it through :class:`Traced`:
the entries of a node's inputs by name (:class:`Use`), never by position.
"""
import json
from typing import NamedTuple

import numpy as np

from . import stats
from .inputs import Data, Param
from .writer import GraphWriter, json_entry

__all__ = ['MARK', 'BatchNormAttrs', 'Entry', 'Running', 'Use', 'LayersInfo', 'Traced',
           'batchnorm_attrs', 'is_marker']

MARK = '__gp_sync__'


def is_marker(node):
    """A BatchNorm node traced from a SyncBatchNorm."""
    return node['op'] == 'BatchNorm' and MARK in node.get('attrs', {})


class Entry(NamedTuple):
    """An output of a node: (node id, output index)."""
    node: int
    index: int


class Running(NamedTuple):
    """The names of a BatchNorm use's running-statistics parameters."""
    mean: str
    var: str


class LayersInfo(NamedTuple):
    """What :meth:`Traced.layers` infers of the marked uses: {marker:
    stats.Layer}, {marker: shape of its input x}."""
    layers: dict
    x_shapes: dict


class Use(NamedTuple):
    """One BatchNorm node of the traced graph (a layer's use in a forward
    pass): the entries of its inputs, the names of its running statistics'
    parameters, its attributes."""
    node: int
    x: Entry
    gamma: Entry
    beta: Entry
    mean: Entry
    var: Entry
    running: Running        # its running statistics' parameter names
    mark: object            # the SyncBatchNorm's id (MARK attribute), or None
    eps: float
    momentum: float
    fix_gamma: bool
    updates: bool           # trained, it updates its running statistics

    @property
    def synced(self):
        return self.mark is not None


class BatchNormAttrs(NamedTuple):
    """A BatchNorm operator's settings, read from its JSON attributes (the
    operator's defaults, MXNet 1.9.1, where Gluon left one out)."""
    axis: int
    eps: float
    momentum: float
    fix_gamma: bool
    use_global_stats: bool


def batchnorm_attrs(attrs):
    """The :class:`BatchNormAttrs` of a BatchNorm node's ``attrs``."""
    return BatchNormAttrs(int(attrs.get('axis', 1)), float(attrs.get('eps', 1e-3)),
                          float(attrs.get('momentum', 0.9)),
                          attrs.get('fix_gamma', 'True') == 'True',
                          attrs.get('use_global_stats', 'False') == 'True')


def _use(nodes, i):
    node = nodes[i]
    attrs = node.get('attrs', {})
    x, gamma, beta, mean, var = [Entry(*e[:2]) for e in node['inputs']]
    running = Running(nodes[mean.node]['name'], nodes[var.node]['name'])
    bn = batchnorm_attrs(attrs)
    return Use(i, x, gamma, beta, mean, var, running, attrs.get(MARK), bn.eps, bn.momentum,
               bn.fix_gamma, not bn.use_global_stats)


class Traced:
    """The traced graph of a hybridized block.

    Parameters
    ----------
    symbol : Symbol
        The block's traced graph.
    data_names : list of str
        Its data inputs, in argument order.

    Attributes
    ----------
    nodes : list of dict
        The graph's nodes (MXNet's JSON form), AMP's casts included.
    heads : list of Entry
        Its outputs.
    data_index : dict
        Data input name -> position among the call's inputs.
    batchnorms : dict
        Node id -> :class:`Use`, every BatchNorm node.
    markers : list of int
        Ids of the marked (SyncBatchNorm) nodes, in graph order.
    """

    def __init__(self, symbol, data_names):
        # AMP's casts are part of the network (tojson drops them by
        # default: the rewritten graph would compute in float32).
        graph = json.loads(symbol.tojson(remove_amp_cast=False))
        self.nodes = nodes = graph['nodes']
        self.heads = [Entry(*h[:2]) for h in graph['heads']]
        self.data_index = {name: i for i, name in enumerate(data_names)}
        self.batchnorms = {i: _use(nodes, i) for i, n in enumerate(nodes)
                           if n['op'] == 'BatchNorm'}
        self.markers = [i for i, n in enumerate(nodes) if is_marker(n)]

    def synced(self):
        """Whether the graph holds a SyncBatchNorm."""
        return bool(self.markers)

    def is_variable(self, entry):
        return self.nodes[entry.node]['op'] == 'null'

    def variable(self, entry, rank=None):
        """The input kind (Data or Param) of a variable entry."""
        name = self.nodes[entry.node]['name']
        if name in self.data_index:
            return Data(name, self.data_index[name], rank)
        return Param(name, rank)

    def check_variables(self, params):
        """Raise ValueError for a variable neither an input nor a parameter."""
        for n in self.nodes:
            if n['op'] == 'null' and n['name'] not in self.data_index \
                    and n['name'] not in params:
                raise ValueError(f'the traced graph reads a variable {n["name"]!r} that is '
                                 'neither an input nor a parameter of the block')

    def layers(self, params, inputs, layer_of):
        """The :class:`stats.Layer` of every marked use, and the shape of its
        input x, from the graph's shape and type inference on one call's
        inputs.

        Parameters
        ----------
        params : dict
            Parameter name -> Parameter (shapes and dtypes known).
        inputs : list
            One call's data inputs: anything with ``shape`` and ``dtype``.
        layer_of : callable
            Marker attribute -> the SyncBatchNorm block, or None.

        Returns
        -------
        LayersInfo
            {marker: stats.Layer}, {marker: shape of its input}.
        """
        uses = [self.batchnorms[m] for m in self.markers]
        g = GraphWriter('_gp_info')
        g.nodes = [dict(n) for n in self.nodes]
        probe = g.symbol([json_entry(*u.x) for u in uses])
        shapes, types = {}, {}
        for name, i in self.data_index.items():
            shapes[name], types[name] = inputs[i].shape, inputs[i].dtype
        for name, p in params.items():
            shapes[name], types[name] = p.shape, p.dtype
        known = set(probe.list_inputs())
        _, x_shapes, _ = probe.infer_shape_partial(
            **{k: v for k, v in shapes.items() if k in known})
        _, x_types, _ = probe.infer_type_partial(
            **{k: v for k, v in types.items() if k in known})
        info, x_of = {}, {}
        for u, shape, dtype in zip(uses, x_shapes, x_types):
            gamma = params[self.nodes[u.gamma.node]['name']]
            x = self.nodes[u.x.node]
            if x['name'] in self.data_index:
                dtype = inputs[self.data_index[x['name']]].dtype
            # Type inference knows no bfloat16 (AMP): 'unknown' data is
            # widened through float32 (stats.widen).
            dtype = 'unknown' if dtype is None else stats.dtype_name(dtype)
            attrs = self.nodes[u.node]['attrs']
            info[u.node] = stats.Layer(
                gamma.shape[0], int(attrs.get('axis', 1)), len(shape), dtype,
                np.dtype(gamma.dtype).name, u.eps, u.momentum, u.fix_gamma, layer_of(u.mark))
            x_of[u.node] = tuple(shape)
        return LayersInfo(info, x_of)
