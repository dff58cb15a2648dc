"""SyncBatchNorm (and trained BatchNorm) in one graph of every replica
(graph mode, gluon_parallel/graph/replicate.py): what a marked node
becomes.

Every replica's centred sums on its own device; on every device, the merge
of all replicas' sums in rank order (the executor copies the other
devices' sums: the only edges across devices), so every replica gets
bit-identical statistics; ``(x - pivot) * scale + shift``. When recorded,
each replica's batch statistics become a forward output whose momentum
updates (running.py) are pushed with the call's backward pass, as Gluon's
BatchNorm makes them in its backward pass.

Both functions write through a *replicator*: an object with ``g`` (a
GraphWriter whose ``group`` puts the operators it writes on one replica's
device), ``n`` (replicas), ``entry(r, e)`` (replica r's copy of a traced
entry), ``var(kind)`` (a variable of an input kind), ``record``, ``cpu``
and ``ops`` (the kernels' names, or None).
"""
from .inputs import Counts, Scratch, unit, zero
from .running import Update, batchnorm_with_outputs
from .stats import Centring, LayerInputs, MergeSettings, centred_affine, centred_sums, merge

__all__ = ['sync_batchnorm', 'trained_batchnorm']


def sync_batchnorm(rep, use, layer, rows):
    """Every replica's copy of a SyncBatchNorm use (a traced.Use; `layer`:
    its stats.Layer; rows: per replica, its rows per channel). Returns per
    replica (its output entry, its Update or None)."""
    g, n, c = rep.g, rep.n, layer.channels
    sent, centred, centrings = [], [], []
    for r in range(n):
        g.group = r
        centring = Centring(rep.var(zero(layer, r)), rep.var(unit(layer, r)), rep.cpu, rep.ops)
        sums = centred_sums(g, rep.entry(r, use.x), layer, centring)
        sent.append(g.concat(sums.s1, sums.s2, sums.q))
        centred.append(sums)
        centrings.append(centring)
    settings = MergeSettings(layer.eps, layer.momentum, layer.param_dtype,
                             acc=layer.param_dtype)
    made = []
    for r, sums in enumerate(centred):
        g.group = r
        beta = rep.entry(r, use.beta)
        # A fixed gamma is 1, its gradient zeros (as BatchNorm's with
        # fix_gamma: a symbol's gamma may have a gradient to write).
        gamma = rep.entry(r, use.gamma)
        gamma = g.op('ones_like', gamma) if layer.fix_gamma else gamma
        counts = rep.var(Counts(f'counts{use.node}', rows, (c,), layer.param_dtype, r))
        inputs = LayerInputs([sums.pivot], [gamma], [beta])
        merged = merge(g, sent, counts, inputs, settings)
        update = None
        if rep.record:
            # The batch statistics from the sums behind BlockGrad: taken
            # from the merge above, the statistics output changed the
            # executor's plan so that MKL-DNN (MXNet 1.9.1) failed in the
            # backward pass (benchmarks/mkldnn_record/probe.py); unreachable,
            # the copy's scale and shift are not computed.
            batch = merge(g, [g.op('BlockGrad', e) for e in sent], counts, inputs, settings,
                          batch=True)
            update = Update(use, None, batch.run, c, True)
        out = centred_affine(g, sums, merged, layer, centrings[r])
        made.append((out[0], update))
    return made


def trained_batchnorm(rep, use, node):
    """Every replica's copy of a trained BatchNorm node whose batch
    statistics become outputs (running.batchnorm_with_outputs). Returns
    per replica (its node's id, its Update; channels are known from the
    parameters later)."""
    made = []
    for r in range(rep.n):
        rep.g.group = r
        ins = [rep.entry(r, e) for e in node['inputs']]
        scratch = [rep.var(Scratch(f'{use.node}_{k}', name, r))
                   for k, name in zip(('mean', 'var'), use.running)]
        nid = batchnorm_with_outputs(rep.g, node, ins, scratch)
        made.append((nid, Update(use, nid, None, None, False)))
    return made
