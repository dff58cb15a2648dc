"""Run a hybridized block's staged graph (staged.py) in a replica.

Per replica and barrier: one CachedOp call per stage, the rendezvous (each
replica hands over its float64 sums and row counts), n - 1 copies of the
others' sums to this device, and one operator writing every running
statistic of the layers merged there. At a barrier where layers have a
reducer (SyncBatchNorm.reducer), the rendezvous instead adds up every
replica's sums once (moments.totals), passes a reducer's layers through it,
and every replica merges that one entry.

Gluon sends every call of a hybridized block through one method of
HybridBlock; :func:`install` routes it here, so that inside a parallel call
(or, for a layer with a reducer, anywhere) and in training mode a graph
holding SyncBatchNorm runs staged. Everywhere else Gluon's own method runs
unchanged.
"""
import functools

import numpy as np
from mxnet import autograd, nd

from .. import _gluon
from ..replica import ParallelCall, ReplicaContext, current_replica
from . import moments
from ._graph import GraphWriter
from .staged import staged_graph

__all__ = ['install', 'run']

_layer_of = None          # given by sync_batchnorm (see install)
_has_reducers = None


def _route(block, args, original):
    if autograd.is_training():
        replica = current_replica()
        if replica is not None or _has_reducers():
            staged = staged_graph(block, args, _layer_of)
            # Outside a parallel call, a reducer still merges this device's
            # batch with its group's (e.g. the other workers').
            if staged is not None and (replica is not None or staged.reduced_levels()):
                return _gluon.nested_outputs(block, run(staged, args, replica))
    return original(block, *args)


def install(layer_of, has_reducers):
    """Route hybridized blocks through the staged path (idempotent).
    layer_of(mark): the SyncBatchNorm a graph node's marker names, or None;
    has_reducers(): whether any SyncBatchNorm has a reducer.
    """
    global _layer_of, _has_reducers
    _layer_of, _has_reducers = layer_of, has_reducers
    _gluon.route_cached_op_calls(_route)


def _gather(*pushed):
    return pushed          # a tuple: every party gets all of them


def run(staged, args, replica=None):
    """The outputs (flat list) of `staged` for one replica's inputs; the
    replicas meet at every barrier through a ParallelState of the call.
    `replica` None: a call of one device (the inputs')."""
    if replica is None:
        replica = ReplicaContext(0, ParallelCall([_gluon.flat_inputs(args)[0].context]))
    steps = _steps(staged, args, replica)
    try:
        level, mine, operation = next(steps)
        while True:
            if replica.size > 1:
                state = replica.next_state((staged, level, operation is _gather), operation)
                pushed = state.pull(state.push(mine, replica.rank))
            else:
                pushed = operation(mine)
            level, mine, operation = steps.send(pushed)
    except StopIteration as done:
        return done.value


def _steps(staged, args, replica):
    """A generator running one replica's stages: at each barrier it yields
    (level, (its sums, its row counts), the barrier's operation) and is sent
    the operation's result; it returns the outputs (flat list)."""
    args = _gluon.flat_inputs(args)
    ctx, n, rank = args[0].context, replica.size, replica.rank
    recording = autograd.is_recording()
    _check_layers(staged, replica)
    env, sums, counts = {}, None, None

    def value(kind):
        k = kind[0]
        if k == 'entry':
            return env[kind[1]]
        if k == 'var':
            i = staged.data_index.get(kind[1])
            return args[i] if i is not None else staged.params[kind[1]].data(ctx)
        if k == 'pivot':
            return env[kind]
        if k == 'sums':
            return sums[kind[1]]
        if k == 'counts':
            return counts
        if k == 'unit':
            dtype, c = kind[1], kind[2]
            return moments.const(('full', ctx, c, 'unit', dtype),
                                 lambda: nd.full(c, moments.UNIT_VAR[dtype], ctx=ctx, dtype=dtype))
        per_layer = kind[1]                     # 'const': per-channel eps or momentum
        return moments.const(('gp', per_layer, ctx), lambda: nd.array(
            np.concatenate([np.full(c, v) for c, v in per_layer]), ctx=ctx, dtype='float64'))

    reduced = staged.reduced_levels() if _has_reducers() else frozenset()
    for level, st in enumerate(staged.stages(n, recording, reduced)):
        local = None
        if st.op is not None:
            outs = st.op(*[value(k) for k in st.inputs])
            if not isinstance(outs, list):
                outs = [outs]
            for (kind, key), out in zip(st.outputs, outs):
                if kind == 'entry':
                    env[key] = out
                elif kind == 'pivot':
                    env[(kind, key)] = out
                elif kind == 'sums':
                    local = out
                elif kind == 'run':
                    _store_running(staged, st.writes, out, replica, ctx)
                else:
                    _check_finite(staged, st.merges, out)
        if st.sums_of:
            mine = (local, _row_counts(staged, st.sums_of, env, args))
            if level + 1 in reduced:
                entry, counts = yield level, mine, functools.partial(_reduce, staged, st.sums_of)
                sums, counts = [entry.as_in_context(ctx)], counts.as_in_context(ctx)
            else:
                pushed = yield level, mine, _gather
                sums, counts = _merge_inputs(staged, st.sums_of, pushed, rank, ctx)
        for e in st.drop:
            env.pop(e, None)
    return [env[h] if h in env else value(('var', staged.nodes[h[0]]['name']))
            for h in staged.heads]


def _row_counts(staged, markers, env, args):
    """Rows of this replica's slice per channel, for each layer merged."""
    cnt = []
    for m in markers:
        e = tuple(staged.nodes[m]['inputs'][0][:2])
        x = env[e] if e in env else args[staged.data_index[staged.nodes[e[0]]['name']]]
        cnt.append(x.size // staged.layers[m].channels)
    return tuple(cnt)


def _merge_inputs(staged, markers, pushed, rank, ctx):
    """Every replica's sums on this device, in rank order (every replica
    sums them in the same order, so all get bit-identical statistics), and
    the matrix of row counts, for the next stage's merge."""
    sums = [p[0] if r == rank else p[0].as_in_context(ctx) for r, p in enumerate(pushed)]
    rows = tuple(p[1] for p in pushed)
    chans = tuple(staged.layers[m].channels for m in markers)
    counts = moments.const(('gp_counts', rows, chans, ctx), lambda: nd.array(
        [np.repeat(row, chans) for row in rows], ctx=ctx, dtype='float64'))
    return sums, counts


def _reduce(staged, markers, *pushed):
    """The operation of a barrier where layers have reducers: the totals of
    every replica's sums (moments.totals, on replica 0's device), about zero
    and replaced by what its reducer returns for a layer with a reducer,
    about replica 0's pivot for the others; every replica merges that as
    one entry, with its row counts."""
    dst = pushed[0][0].context
    sums, counts = _merge_inputs(staged, markers, pushed, 0, dst)
    blocks = [staged.layers[m].block for m in markers]
    reducers = [None if b is None else b.reducer for b in blocks]
    chans = tuple(staged.layers[m].channels for m in markers)
    flags = tuple(r is None for r in reducers)
    keep = moments.const(('gp_keep', flags, chans, dst), lambda: nd.array(
        np.repeat(np.array(flags, dtype='float64'), chans), ctx=dst, dtype='float64'))
    tot, ref = _totals_op(len(sums))(*sums, counts, keep)
    parts, off = [], 0
    for block, reducer, c in zip(blocks, reducers, chans):
        off += c
        part = tot if len(chans) == 1 else nd.slice_axis(tot, axis=1, begin=off - c, end=off)
        if reducer is not None:
            part = _call_reducer(block, reducer, part).as_in_context(dst)
        parts.append(part)
    tot = parts[0] if len(parts) == 1 else nd.concat(*parts, dim=1)
    entry = nd.concat(nd.reshape(nd.slice_axis(tot, axis=0, begin=0, end=2), (-1,)), ref, dim=0)
    return entry, nd.slice_axis(tot, axis=0, begin=2, end=3).detach()


def _call_reducer(block, reducer, totals):
    out = reducer(block, totals)
    if not isinstance(out, nd.NDArray) or out.shape != totals.shape or out.dtype != np.float64:
        raise TypeError(f'{block.name}: its reducer must return a float64 NDArray of shape {totals.shape}, got {out!r}')
    if autograd.is_recording() and block.__dict__.get('_gp_reducer_checked') is not reducer:
        # Once per layer and reducer: a result outside the recorded graph
        # would silently drop the statistics' part of the input gradients.
        if not _gluon.is_recorded(out):
            raise RuntimeError(
                f'{block.name}: its reducer returned an array autograd did not record, so input gradients '
                'would miss the batch statistics: compute the result with recorded NDArray '
                'operations, or wrap the reduction in an autograd.Function')
        block.__dict__['_gp_reducer_checked'] = reducer
    return out


_TOTALS = {}


def _totals_op(n):
    """moments.totals of n entries about ref = keep * (replica 0's pivot),
    as a function of (sums..., counts, keep) running one CachedOp (recorded
    by autograd); returns (totals, ref)."""
    fn = _TOTALS.get(n)
    if fn is None:
        g = GraphWriter('_gp_totals')
        names = ['sums%d' % r for r in range(n)] + ['counts', 'keep']
        q0 = g.slice_axis(g.reshape(g.var('sums0'), (3, -1)), 0, 2, 3)
        ref = g.op('broadcast_mul', g.reshape(q0, (-1,)), g.var('keep'))
        tot = moments.totals(g, [g.var(k) for k in names[:n]], g.var('counts'), ref)
        symbol = g.symbol([tot, ref])
        op, order = nd.CachedOp(symbol), [names.index(k) for k in symbol.list_inputs()]
        fn = _TOTALS[n] = lambda *xs: op(*[xs[i] for i in order])
    return fn


def _store_running(staged, markers, run_out, replica, ctx):
    """Write the new running means and variances of `markers` (run_out:
    [means | variances]) into their parameters on this context, and, from
    replica 0, on the contexts idle in this call."""
    params = [staged.running[m][0] for m in markers] + [staged.running[m][1] for m in markers]
    sizes = [p.shape[0] for p in params]
    with autograd.pause():
        for c in [ctx] + (replica.call.idle_ctx if replica.rank == 0 else []):
            if c != ctx and c not in params[0].list_ctx():
                continue
            src = run_out if c == ctx else run_out.as_in_context(c)
            # One operator for all of them, into the parameters' own arrays.
            _gluon.split_into(src, sizes, [p.data(c) for p in params])


def _check_layers(staged, replica):
    for layer in staged.layer_blocks:
        if layer.num_devices is not None and layer.num_devices != len(replica.call.all_ctx):
            raise ValueError('%s was built with num_devices=%d, but DataParallel runs on %d '
                             'devices' % (layer.name, layer.num_devices,
                                          len(replica.call.all_ctx)))


def _check_finite(staged, markers, merged):
    if not np.isfinite(merged.asnumpy()).all():
        names = sorted({staged.layers[m].block.name for m in markers
                        if staged.layers[m].block is not None})
        raise FloatingPointError('{}: the batch mean or variance is NaN or Inf: the input of '
                                 'this layer holds non-finite values'.format(', '.join(names)))
