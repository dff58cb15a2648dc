"""Replicate: one traced graph becomes one graph of every replica.

Replica r's copy of every operator runs on device group ``dev<r>``
(``__ctx_group__``, which ``Symbol.bind(group2ctx=...)`` maps to a context);
its variables are renamed per replica, so each binds to the parameter's own
array on that replica's context. Without SyncBatchNorm the replicas share
nothing: no edge crosses devices.

The BatchNorm nodes are the exception, written by
``syncgraph.in_graph.BatchNormsInGraph`` (SyncBatchNorm's home in graph
mode): in a training graph each SyncBatchNorm node (a BatchNorm node marked
by the layer) becomes every replica's sums on its own device, their merge
on every device (the only edges across devices) and the affine map; when
recorded, the batch statistics of each replica's trained BatchNorm and
SyncBatchNorm uses are one extra output, whose momentum updates are pushed
with the call's backward pass. Nothing runs in Python per layer.
"""
from ..syncgraph import Entry, GraphWriter, json_entry
from ..syncgraph.in_graph import BatchNormsInGraph
from .executor import GROUP

__all__ = ['Replicated', 'replicate']


class _Writer(GraphWriter):
    """A GraphWriter that puts every operator it writes on one replica's
    device group, and names copied nodes per replica (names must be unique
    in one graph)."""

    def __init__(self):
        super().__init__('_gp')
        self.rank = None            # the replica whose device group gets the operators

    def _mark(self, entry_or_id):
        nid = entry_or_id if isinstance(entry_or_id, int) else \
            entry_or_id[0][0] if isinstance(entry_or_id[0], list) else entry_or_id[0]
        attrs = self.nodes[nid].setdefault('attrs', {})
        attrs['__ctx_group__'] = GROUP % self.rank
        return entry_or_id

    def copy(self, node, inputs):
        node = dict(node, name=f'r{self.rank}_{node["name"]}')
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
    batchnorms : syncgraph.in_graph.BatchNormsInGraph
        Its BatchNorm nodes: ``running_updates`` makes the running
        statistics' updates of an executor bound to it from the outputs
        after all replicas' own.
    """

    def __init__(self, symbol, num_outputs, variables, batchnorms):
        self.symbol = symbol
        self.num_outputs = num_outputs
        self.variables = variables
        self.batchnorms = batchnorms


def replicate(traced, params, inputs, train, record, cpu=False, mkldnn=False):
    """The graph of all replicas of a traced block (`traced`, a
    syncgraph.Traced; `params`, parameter name -> Parameter; `inputs`,
    every replica's data inputs as lists of (shape, dtype)). Its BatchNorm
    nodes are written by a syncgraph.in_graph.BatchNormsInGraph, which
    takes these arguments and says what `train`, `record`, `cpu` and
    `mkldnn` change."""
    traced.check_variables(params)
    batchnorms = BatchNormsInGraph(traced, params, inputs, train, record, cpu, mkldnn)
    rep = _Replicator(traced, len(inputs))
    for i, node in enumerate(traced.nodes):
        if node['op'] == 'null':
            continue
        made = batchnorms.rewrite(rep, i, node)
        if made is None:
            rep.copy(i, node)
        else:
            for r, nid in enumerate(made):
                rep.made[r][i] = nid
    return rep.replicated(batchnorms)


class _Replicator:
    """Writes every replica's copy of a traced graph, node by node."""

    def __init__(self, traced, n):
        self.traced, self.n = traced, n
        self.g = _Writer()
        self.variables = {}
        self.made = [{} for _ in range(n)]          # per replica: node id -> its copy's id

    def var(self, kind):
        self.variables.setdefault(kind.name, kind)
        entry = self.g.var(kind.name)
        # Placement propagates from operators to variables, except into the
        # mutable inputs of BatchNorm: those must be placed.
        self.g.nodes[entry[0]].setdefault('attrs', {})['__ctx_group__'] = GROUP % kind.rank
        return entry

    def entry(self, r, e):
        """Replica r's copy of traced entry `e` (an Entry, or a node's input
        as MXNet's JSON lists it)."""
        e = Entry(*e[:2])
        if self.traced.is_variable(e):
            return self.var(self.traced.variable(e, r))
        return json_entry(self.made[r][e.node], e.index)

    def copy(self, i, node):
        """An operator every replica runs as traced."""
        for r in range(self.n):
            self.g.rank = r
            self.made[r][i] = self.g.copy(node, [self.entry(r, e) for e in node['inputs']])

    def replicated(self, batchnorms):
        """The Replicated: every replica's outputs, then its batch
        statistics."""
        heads = self.traced.heads
        outputs = [self.entry(r, h) for r in range(self.n) for h in heads]
        outputs += batchnorms.outputs(self)
        return Replicated(self.g.symbol(outputs), len(heads), self.variables, batchnorms)
