"""A small writer of MXNet graphs in their JSON form.

The staged execution of SyncBatchNorm (staged.py) cuts a traced network
into pieces and adds operators of its own. It writes those graphs as JSON
rather than composing Symbols: composing two Symbols that share a variable
duplicates the variable (MXNet 1.9.1), which a CachedOp with
``static_alloc`` then binds twice, and the operators written here must not
be rewritten by AMP's patched ``mx.sym`` functions (which would sum in 16
bits). The JSON format is MXNet's own (``Symbol.tojson``).
"""
import json

from mxnet import sym

__all__ = ['GraphWriter', 'json_entry']


def _attr(value):
    if isinstance(value, bool):
        return 'True' if value else 'False'
    if isinstance(value, (tuple, list)):
        return '({})'.format(', '.join('None' if v is None else str(int(v)) for v in value))
    return str(value)


def json_entry(node, index=0):
    """MXNet's JSON entry of output `index` of node id `node`: ``[node,
    index, 0]`` (the last field a version, always 0 in a graph's JSON)."""
    return [node, index, 0]


class GraphWriter:
    """Nodes of one graph; an entry is :func:`json_entry`'s.

    Variables are unified by name: asking twice for the same name gives
    the same node.
    """

    def __init__(self, prefix):
        self.nodes = []
        self._vars = {}
        self._prefix = prefix

    def var(self, name, attrs=None):
        """The variable called `name` (created on first use)."""
        nid = self._vars.get(name)
        if nid is None:
            node = {'op': 'null', 'name': name, 'inputs': []}
            if attrs:
                node['attrs'] = dict(attrs)
            nid = self._vars[name] = len(self.nodes)
            self.nodes.append(node)
        return json_entry(nid)

    def copy(self, node, inputs):
        """Append a node of another graph with its inputs remapped; returns
        its id."""
        node = dict(node)
        node['inputs'] = [list(e) for e in inputs]
        self.nodes.append(node)
        return len(self.nodes) - 1

    def op(self, name, *inputs, **attrs):
        """Append operator `name` (MXNet's registered name) and return its
        first output; ``outputs=k`` returns k entries instead."""
        outputs = attrs.pop('outputs', None)
        node = {'op': name, 'name': f'{self._prefix}{len(self.nodes)}_{name.lower()}',
                'inputs': [list(e) for e in inputs]}
        if attrs:
            node['attrs'] = {k: _attr(v) for k, v in attrs.items()}
        self.nodes.append(node)
        nid = len(self.nodes) - 1
        if outputs is None:
            return json_entry(nid)
        return [json_entry(nid, k) for k in range(outputs)]

    # Shorthands for the operators the statistics use.
    def cast(self, x, dtype):
        return self.op('Cast', x, dtype=dtype)

    def reshape(self, x, shape):
        return self.op('Reshape', x, shape=shape)

    def slice_axis(self, x, axis, begin, end):
        return self.op('slice_axis', x, axis=axis, begin=begin, end=end)

    def concat(self, *xs):
        if len(xs) == 1:
            return xs[0]
        return self.op('Concat', *xs, dim=0, num_args=len(xs))

    def symbol(self, heads):
        """The Symbol whose outputs are `heads` (entries)."""
        args = [i for i, n in enumerate(self.nodes) if n['op'] == 'null']
        graph = {'nodes': self.nodes, 'arg_nodes': args, 'heads': [list(h) for h in heads],
                 'attrs': {'mxnet_version': ['int', 10901]}}
        return sym.load_json(json.dumps(graph))
