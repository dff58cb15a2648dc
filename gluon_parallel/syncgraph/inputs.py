"""What the inputs of a rewritten graph are bound to.

Each variable a rewritten graph reads is one of these kinds. A kind knows
its variable's name and asks a *feed* for its array: the staged path's feed
gives one replica's arrays at run time (rendezvous.py), graph mode's binds
every replica's once per executor (graph/bind.py). ``rank`` is the replica
of a graph spanning devices (graph mode), None in one replica's graph.

A feed has the methods ``data``, ``param``, ``carried``, ``pivot``,
``sums``, ``counts``, ``scratch`` (each given the kind) and ``context(rank)``
for the constants; a feed that never meets a kind need not define its
method.
"""
from typing import NamedTuple

import numpy as np
from mxnet import nd

from . import stats

__all__ = ['Data', 'Param', 'Carried', 'Pivot', 'Sums', 'Counts', 'Constant', 'Scratch',
           'unit', 'zero']


def _name(base, rank):
    return base if rank is None else f'{base}_r{rank}'


class Data(NamedTuple):
    """A data input of the call (position `index` among its inputs)."""
    input_name: str
    index: int
    rank: object = None

    @property
    def name(self):
        return _name(self.input_name, self.rank)

    def value(self, feed):
        return feed.data(self)


class Param(NamedTuple):
    """A parameter's array on the replica's context."""
    param: str
    rank: object = None

    @property
    def name(self):
        return _name(self.param, self.rank)

    def value(self, feed):
        return feed.param(self)


class Carried(NamedTuple):
    """An output of an earlier stage (the staged path): `entry` of the
    traced graph."""
    entry: tuple        # a traced.Entry

    @property
    def name(self):
        return f'_gp_e{self.entry.node}_{self.entry.index}'

    def value(self, feed):
        return feed.carried(self)


class Pivot(NamedTuple):
    """The pivot of marked node `node`, an output of the stage before its
    barrier (the staged path)."""
    node: int

    @property
    def name(self):
        return f'_gp_pivot{self.node}'

    def value(self, feed):
        return feed.pivot(self)


class Sums(NamedTuple):
    """Replica `sender`'s sums, received at the barrier (the staged path)."""
    sender: int

    @property
    def name(self):
        return f'_gp_sums{self.sender}'

    def value(self, feed):
        return feed.sums(self)


class Counts(NamedTuple):
    """The row counts of every replica per channel, (n, T): received at the
    barrier (the staged path: `rows` None), or known when the graph is
    built (graph mode: `rows` per replica, per layer)."""
    label: str = 'counts'
    rows: object = None             # tuple per replica of a tuple per layer
    channels: tuple = ()
    dtype: str = 'float64'
    rank: object = None

    @property
    def name(self):
        return _name(f'_gp_{self.label}', self.rank)

    def value(self, feed):
        return feed.counts(self)

    def array(self, ctx):
        """The matrix of `rows`, a fresh array on `ctx`."""
        return counts_array(self.rows, self.channels, ctx, self.dtype)


def counts_array(rows, channels, ctx, dtype='float64'):
    """(n, T): per replica, its row count repeated over each layer's channels."""
    return nd.array(np.array([np.repeat(row, channels) for row in rows], dtype=dtype),
                    ctx=ctx, dtype=dtype)


class Constant(NamedTuple):
    """A vector never written to: per layer, (channels, value)."""
    label: str
    values: tuple
    dtype: str
    rank: object = None

    @property
    def name(self):
        return _name(f'_gp_{self.label}', self.rank)

    def value(self, feed):
        return self.array(feed.context(self.rank))

    def array(self, ctx):
        """The vector on `ctx` (cached: see :func:`stats.const`)."""
        return stats.const((self.values, self.dtype, ctx), lambda: nd.array(
            np.concatenate([np.full(c, v) for c, v in self.values]), ctx=ctx,
            dtype=self.dtype))


def unit(layer, rank=None):
    """The variance BatchNorm's kernel divides by, so that it computes
    x - mean unscaled (stats.UNIT_VAR)."""
    dtype, c = layer.param_dtype, layer.channels
    return Constant(f'unit_{dtype}_{c}', ((c, stats.UNIT_VAR[dtype]),), dtype, rank)


def zero(layer, rank=None):
    dtype, c = layer.param_dtype, layer.channels
    return Constant(f'zero_{dtype}_{c}', ((c, 0.0),), dtype, rank)


class Scratch(NamedTuple):
    """A fresh array shaped as a running statistic, for BatchNorm's kernel
    to update in graph mode (graph/replicate.py says why)."""
    label: str
    param: str
    rank: object = None

    @property
    def name(self):
        return _name(f'_gp_scratch{self.label}', self.rank)

    def value(self, feed):
        return feed.scratch(self)
