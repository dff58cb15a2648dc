"""Run a hybridized block's staged graph (staged.py) in a replica.

Per replica and barrier: one CachedOp call per stage, the rendezvous (each
replica hands over its float64 sums and row counts), n - 1 copies of the
others' sums to this device, and one operator writing every running
statistic of the layers merged there.

Gluon sends every call of a hybridized block through one method of
HybridBlock; :func:`install` routes it here, so that inside a parallel call
and in training mode a graph holding SyncBatchNorm runs staged. Everywhere
else Gluon's own method runs unchanged.
"""
import numpy as np
from mxnet import autograd, nd

from .. import _gluon
from ..replica import current_replica
from . import moments
from .staged import staged_graph

__all__ = ['install', 'run']

_layer_of = None          # given by sync_batchnorm (see install)


def _route(block, args, original):
    if autograd.is_training():
        replica = current_replica()
        if replica is not None:
            staged = staged_graph(block, args, _layer_of)
            if staged is not None:
                return _gluon.nested_outputs(block, run(staged, args, replica))
    return original(block, *args)


def install(layer_of):
    """Route hybridized blocks through the staged path (idempotent).
    layer_of(mark): the SyncBatchNorm a graph node's marker names, or None.
    """
    global _layer_of
    _layer_of = layer_of
    _gluon.route_cached_op_calls(_route)


def _gather(*pushed):
    return pushed          # a tuple: every party gets all of them


def run(staged, args, replica):
    """The outputs (flat list) of `staged` for one replica's inputs; the
    replicas meet at every barrier through a ParallelState of the call."""
    steps = _steps(staged, args, replica)
    try:
        level, mine = next(steps)
        while True:
            if replica.size > 1:
                state = replica.next_state((staged, level), _gather)
                pushed = state.pull(state.push(mine, replica.rank))
            else:
                pushed = (mine,)
            level, mine = steps.send(pushed)
    except StopIteration as done:
        return done.value


def _steps(staged, args, replica):
    """A generator running one replica's stages: at each barrier it yields
    (level, (its sums, its row counts)) and is sent every replica's, in rank
    order; it returns the outputs (flat list)."""
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
        field, markers = kind[1], kind[2]               # 'const': per-channel eps/momentum
        return moments.const(('gp', field, markers, id(staged), ctx), lambda: nd.array(
            np.concatenate([np.full(staged.layers[m].channels, getattr(staged.layers[m], field))
                            for m in markers]), ctx=ctx, dtype='float64'))

    for level, st in enumerate(staged.stages(n, recording)):
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
                    _store_running(staged, st.merges, out, replica, ctx)
                else:
                    _check_finite(staged, st.merges, out)
        if st.sums_of:
            pushed = yield level, (local, _row_counts(staged, st.sums_of, env, args))
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
        if layer._cross_worker is not None:
            raise NotImplementedError(
                '%s synchronises across worker processes, which runs in imperative mode only: '
                'call hybridize(False) on the network' % layer.name)
        if layer.num_devices is not None and layer.num_devices != len(replica.call.all_ctx):
            raise ValueError('%s was built with num_devices=%d, but DataParallel runs on %d '
                             'devices' % (layer.name, layer.num_devices,
                                          len(replica.call.all_ctx)))


def _check_finite(staged, markers, merged):
    if not np.isfinite(merged.asnumpy()).all():
        names = sorted({staged.layers[m].block.name for m in markers
                        if staged.layers[m].block is not None})
        raise FloatingPointError('%s: the batch mean or variance is NaN or Inf: the input of '
                                 'this layer holds non-finite values' % ', '.join(names))
