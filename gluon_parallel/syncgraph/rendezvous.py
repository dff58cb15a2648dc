"""Run a staged graph (stages.py) in a replica.

Per replica and barrier: one CachedOp call per stage, the rendezvous (each
replica hands over its float64 sums and row counts), n - 1 copies of the
others' sums to this device, and one operator writing every running
statistic of the layers merged there. At a barrier where layers have a
reducer (SyncBatchNorm.reducer), the rendezvous instead adds up every
replica's sums once (stats.totals), passes a reducer's layers through it,
and every replica merges that one entry.

What the replicas exchange at a barrier is a :class:`Message`.
"""
import functools
from typing import NamedTuple

import numpy as np
from mxnet import autograd, nd

from .. import _gluon
from ..replica_context import ParallelCall, ReplicaContext
from . import stats
from .inputs import counts_array
from .writer import GraphWriter

__all__ = ['Message', 'run', 'write_new_running']


class Message(NamedTuple):
    """What a replica hands over at a barrier."""
    sums: object        # float64 [S1 | S2 | q] of the barrier's layers, on its device
    rows: tuple         # its slice's rows per channel, per layer


def _gather(*pushed):
    """Every party gets every replica's message, in rank order."""
    return [list(pushed)] * len(pushed)


def run(staged, args, replica=None, has_reducers=False):
    """The outputs (flat list) of `staged` for one replica's inputs; the
    replicas meet at every barrier through a ParallelState of the call.
    `replica` None: a call of one device (the inputs'). `has_reducers`:
    whether some SyncBatchNorm may have a reducer."""
    if replica is None:
        replica = ReplicaContext(0, ParallelCall([_gluon.flat_inputs(args)[0].context]))
    if replica.size == 1 and replica.call.on_alone is not None:
        replica.call.on_alone()
    steps = _steps(staged, args, replica, has_reducers)
    try:
        level, mine, operation = next(steps)
        while True:
            if replica.size > 1:
                state = replica.next_state((staged, level, operation is _gather), operation)
                pushed = state.pull(state.push(mine, replica.rank))
            else:
                pushed = operation(mine)[0]
            level, mine, operation = steps.send(pushed)
    except StopIteration as done:
        return done.value


class _ReplicaFeed:
    """One replica's arrays for the stages' inputs (syncgraph.inputs)."""

    def __init__(self, staged, args, ctx):
        self.staged, self.args, self.ctx = staged, args, ctx
        self.env, self.received, self.counts_in = {}, None, None

    def data(self, kind):
        return self.args[kind.index]

    def param(self, kind):
        return self.staged.params[kind.param].data(self.ctx)

    def carried(self, kind):
        return self.env[kind.entry]

    def pivot(self, kind):
        return self.env[kind]

    def sums(self, kind):
        return self.received[kind.sender]

    def counts(self, kind):
        return self.counts_in

    def context(self, rank):
        return self.ctx

    def head(self, h):
        return self.env[h] if h in self.env else \
            self.staged.traced.variable(h).value(self)


def _steps(staged, args, replica, has_reducers):
    """A generator running one replica's stages: at each barrier it yields
    (level, its Message, the barrier's operation) and is sent the
    operation's result; it returns the outputs (flat list)."""
    args = _gluon.flat_inputs(args)
    ctx, n, rank = args[0].context, replica.size, replica.rank
    recording = autograd.is_recording()
    if replica.call.num_devices:
        for layer in staged.layer_blocks:
            layer.check_devices(replica.call.num_devices)
    feed = _ReplicaFeed(staged, args, ctx)
    reduced = staged.reduced_levels() if has_reducers else frozenset()
    for level, st in enumerate(staged.stages(n, recording, reduced)):
        out = None
        if st.op is not None:
            outs = st.op(*[k.value(feed) for k in st.inputs])
            out = st.outputs(outs if isinstance(outs, list) else [outs])
            feed.env.update(out.carried)
            feed.env.update(out.pivots)
            if out.run is not None:
                # One writer a device: a second replica there would race the first.
                own = [] if rank in replica.call.second_on_device else [ctx]
                write_new_running(out.run, [staged.running(m).mean for m in st.writes]
                              + [staged.running(m).var for m in st.writes],
                              own + (replica.call.idle_ctx if rank == 0 else []))
            if out.check is not None:
                _check_finite(staged, st.merges, out.check)
        if st.sums_of:
            mine = Message(out.sums, _row_counts(staged, st.sums_of, feed))
            if level + 1 in reduced:
                entry, counts = yield level, mine, functools.partial(_reduce, staged, st.sums_of)
                feed.received, feed.counts_in = [entry.as_in_context(ctx)], \
                    counts.as_in_context(ctx)
            else:
                pushed = yield level, mine, _gather
                feed.received, feed.counts_in = _merge_inputs(staged, st.sums_of, pushed,
                                                              rank, ctx)
        for e in st.drop:
            feed.env.pop(e, None)
    return [feed.head(h) for h in staged.heads]


def _row_counts(staged, markers, feed):
    """Rows of this replica's slice per channel, for each layer merged."""
    cnt = []
    for m in markers:
        e = staged.use(m).x
        x = feed.env[e] if e in feed.env else staged.traced.variable(e).value(feed)
        cnt.append(x.size // staged.layers[m].channels)
    return tuple(cnt)


def _merge_inputs(staged, markers, pushed, rank, ctx):
    """Every replica's sums on this device, in rank order (every replica
    sums them in the same order, so all get bit-identical statistics), and
    the matrix of row counts, for the next stage's merge."""
    sums = [p.sums if r == rank else p.sums.as_in_context(ctx) for r, p in enumerate(pushed)]
    rows = tuple(p.rows for p in pushed)
    chans = tuple(staged.layers[m].channels for m in markers)
    counts = stats.const(('gp_counts', rows, chans, ctx),
                         lambda: counts_array(rows, chans, ctx))
    return sums, counts


def _reduce(staged, markers, *pushed):
    """The operation of a barrier where layers have reducers: the totals of
    every replica's sums (stats.totals, on replica 0's device), about zero
    and replaced by what its reducer returns for a layer with a reducer,
    about replica 0's pivot for the others; every replica merges that as
    one entry, with its row counts (the same pair for every party)."""
    dst = pushed[0].sums.context
    sums, counts = _merge_inputs(staged, markers, pushed, 0, dst)
    blocks = [staged.block(m) for m in markers]
    reducers = [None if b is None else b.reducer for b in blocks]
    chans = tuple(staged.layers[m].channels for m in markers)
    flags = tuple(r is None for r in reducers)
    keep = stats.const(('gp_keep', flags, chans, dst), lambda: nd.array(
        np.repeat(np.array(flags, dtype='float64'), chans), ctx=dst, dtype='float64'))
    tot, ref = _totals_op(len(sums))(*sums, counts, keep)
    parts, off = [], 0
    for block, reducer, c in zip(blocks, reducers, chans):
        off += c
        part = tot if len(chans) == 1 else nd.slice_axis(tot, axis=1, begin=off - c, end=off)
        if reducer is not None:
            part = _call_reducer(staged, block, reducer, part).as_in_context(dst)
        parts.append(part)
    tot = parts[0] if len(parts) == 1 else nd.concat(*parts, dim=1)
    entry = nd.concat(nd.reshape(nd.slice_axis(tot, axis=0, begin=0, end=2), (-1,)), ref, dim=0)
    counts = nd.slice_axis(tot, axis=0, begin=2, end=3).detach()
    return [(entry, counts)] * len(pushed)          # the same for every party


def _call_reducer(staged, block, reducer, totals):
    out = reducer(block, totals)
    if not isinstance(out, nd.NDArray) or out.shape != totals.shape or out.dtype != np.float64:
        raise TypeError(f'{block.name}: its reducer must return a float64 NDArray of shape '
                        f'{totals.shape}, got {out!r}')
    if autograd.is_recording() and staged.checked_reducers.get(id(block)) is not reducer:
        # Once per graph, layer and reducer: a result outside the recorded graph
        # would silently drop the statistics' part of the input gradients.
        if not _gluon.is_recorded(out):
            raise RuntimeError(
                f'{block.name}: its reducer returned an array autograd did not record, so input '
                'gradients would miss the batch statistics: compute the result with recorded '
                'NDArray operations, or wrap the reduction in an autograd.Function')
        staged.checked_reducers[id(block)] = reducer
    return out


_TOTALS = {}


def _totals_op(n):
    """stats.totals of n entries about ref = keep * (replica 0's pivot),
    as a function of (sums..., counts, keep) running one CachedOp (recorded
    by autograd); returns (totals, ref)."""
    fn = _TOTALS.get(n)
    if fn is None:
        g = GraphWriter('_gp_totals')
        names = [f'sums{r}' for r in range(n)] + ['counts', 'keep']
        q0 = g.slice_axis(g.reshape(g.var('sums0'), (3, -1)), 0, 2, 3)
        ref = g.op('broadcast_mul', g.reshape(q0, (-1,)), g.var('keep'))
        tot = stats.totals(g, [g.var(k) for k in names[:n]], g.var('counts'), ref)
        symbol = g.symbol([tot, ref])
        op, order = nd.CachedOp(symbol), [names.index(k) for k in symbol.list_inputs()]
        fn = _TOTALS[n] = lambda *xs: op(*[xs[i] for i in order])
    return fn


def _check_finite(staged, markers, merged):
    if not np.isfinite(merged.asnumpy()).all():
        names = sorted({staged.block(m).name for m in markers
                        if staged.block(m) is not None})
        raise FloatingPointError('{}: the batch mean or variance is NaN or Inf: the input of '
                                 'this layer holds non-finite values'.format(', '.join(names)))


def write_new_running(vector, params, ctxs):
    """The staged path's write of the new running statistics (its graphs
    compute them; graph mode's ``in_graph.MomentumUpdates`` instead updates
    the old values in place after backward). Writes consecutive pieces of
    `vector` (the new values, in order) into
    the arrays of `params` on each context of `ctxs` where they live (the
    vector's own context always), in one operator per context."""
    sizes = [p.shape[0] for p in params]
    with autograd.pause():
        for c in ctxs:
            if c != vector.context and c not in params[0].list_ctx():
                continue
            src = vector if c == vector.context else vector.as_in_context(c)
            _gluon.split_into(src, sizes, [p.data(c) for p in params])
