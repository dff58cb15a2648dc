"""Running statistics in rewritten graphs: the batch statistics as forward
outputs and the momentum updates they feed (graph mode), and the one
write-back of new running statistics into their parameters (the staged
path)."""
import collections

from mxnet import autograd

from .. import _gluon

__all__ = ['Update', 'Momentum', 'write_running', 'batchnorm_with_outputs', 'batch_statistics']


def write_running(vector, params, ctxs):
    """Write consecutive pieces of `vector` (the new values, in order) into
    the arrays of `params` on each context of `ctxs` where they live (the
    vector's own context always), in one operator per context."""
    sizes = [p.shape[0] for p in params]
    with autograd.pause():
        for c in ctxs:
            if c != vector.context and c not in params[0].list_ctx():
                continue
            src = vector if c == vector.context else vector.as_in_context(c)
            _gluon.split_into(src, sizes, [p.data(c) for p in params])


def batchnorm_with_outputs(g, node, ins, scratch):
    """A trained BatchNorm whose new running statistics are outputs of the
    forward pass (see :func:`batch_statistics`). In an executor, MXNet
    1.9.1's kernel updates its auxiliary arrays in the backward pass without
    the engine knowing (the backward operator does not list them as
    written): bound to the parameters' own arrays, a read right after
    ``trainer.step`` raced the update and returned the old values (measured:
    zeros after step 1). So the kernel updates scratch arrays (`scratch`:
    the entries of the mean's and the variance's), and its batch statistics
    (outputs 1 and 2) make the update, pushed with the call's backward pass
    (graph/bind.py), like SyncBatchNorm's."""
    attrs = dict(node.get('attrs', {}), output_mean_var='True')
    return g.copy(dict(node, attrs=attrs), list(ins[:3]) + list(scratch))


class Update(collections.namedtuple('Update', 'use node stats channels synced')):
    """A trained BatchNorm or SyncBatchNorm use of one replica: its
    traced.Use; a BatchNorm's copy (batchnorm_with_outputs: outputs 1 and
    2 are the batch mean and 1/sqrt(var + eps)), or a SyncBatchNorm's entry
    of its batch's [mean | var] (`stats`); its channels; `synced`: the same
    statistics on every replica (SyncBatchNorm)."""


class Momentum(collections.namedtuple('Momentum', 'mean var momentum mean_at var_at channels '
                                                  'synced')):
    """One momentum update of a layer's running statistics, applied when the
    call's backward pass is pushed: the parameters named ``mean`` and
    ``var`` take ``old * momentum + batch * (1 - momentum)`` of the batch
    statistics at ``mean_at`` and ``var_at`` (``channels`` each) of the
    replica's statistics output. ``synced``: a SyncBatchNorm's (contexts
    idle in the call take replica 0's)."""


def batch_statistics(g, updates):
    """The entry of one replica's batch statistics (or None), and their
    Momentum updates in the order Gluon applies them: its BatchNorm updates
    the running statistics in its backward pass, which meets the uses in
    reverse order (`updates`: Update per use, in graph order).

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
    for k, u in enumerate(updates):
        if u.stats is None:
            by_eps.setdefault(u.use.eps, []).append(k)
        else:
            at = put(u.stats, 2 * u.channels)
            where[k] = (at, at + u.channels)
    for eps, members in by_eps.items():
        total = sum(updates[k].channels for k in members)
        means = put(g.concat(*[[updates[k].node, 1, 0] for k in members]), total)
        inv = g.concat(*[[updates[k].node, 2, 0] for k in members])
        variances = put(g.op('_minus_scalar', g.op('reciprocal', g.op('square', inv)),
                             scalar=repr(eps)), total)
        for k in members:
            where[k] = (means, variances)
            means += updates[k].channels
            variances += updates[k].channels
    momenta = [Momentum(updates[k].use.running[0], updates[k].use.running[1],
                        updates[k].use.momentum, *where[k], updates[k].channels,
                        updates[k].synced) for k in reversed(range(len(updates)))]
    return (g.op('BlockGrad', g.concat(*entries)) if entries else None), momenta
