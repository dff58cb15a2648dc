"""Running statistics in rewritten graphs: a trained BatchNorm's update as
forward outputs (graph mode), and the one write-back of new running
statistics into their parameters (both paths)."""
import collections

from mxnet import autograd

from .. import _gluon
from . import stats

__all__ = ['Update', 'write_running', 'batchnorm_with_outputs', 'running_updates']


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
    forward pass (see :func:`running_updates`). In an executor, MXNet
    1.9.1's kernel updates its auxiliary arrays in the backward pass without
    the engine knowing (the backward operator does not list them as
    written): bound to the parameters' own arrays, a read right after
    ``trainer.step`` raced the update and returned the old values (measured:
    zeros after step 1). So the kernel updates scratch arrays (`scratch`:
    the entries of the mean's and the variance's), and its batch statistics
    (outputs 1 and 2) make the update, written into the parameters after
    each forward pass, in call order, like SyncBatchNorm's."""
    attrs = dict(node.get('attrs', {}), output_mean_var='True')
    return g.copy(dict(node, attrs=attrs), list(ins[:3]) + list(scratch))


class Update(collections.namedtuple('Update', 'use node old')):
    """A trained BatchNorm node of one replica: its traced.Use, the id of
    its copy (batchnorm_with_outputs), the (mean, var) entries it read."""


def running_updates(g, updates):
    """Entries of the new running statistics of one replica's trained
    BatchNorm nodes (`updates`: Update per node, in graph order), and the
    names of the parameters they are, in order.

    The kernel's third output is 1/sqrt(var + eps) (MXNet 1.9.1, native and
    MKL-DNN). Layers sharing eps and momentum are updated as one vector each
    (a dozen operators per replica instead of per layer: each small operator
    costs the engine about as much as a layer's arithmetic). A layer used
    several times in one call updates them once per use, the last use
    first: MXNet's kernel updates them in its backward pass, which meets
    the uses in reverse order.
    """
    times = collections.Counter(u.use.running for u in updates)
    groups, chained = collections.OrderedDict(), collections.OrderedDict()

    def update(old, mean, inv, eps, momentum):
        var = g.op('_minus_scalar', g.op('reciprocal', g.op('square', inv)), scalar=repr(eps))
        return [g.op('BlockGrad', stats.running_update(g, o, b, momentum))
                for o, b in zip(old, (mean, var))]

    for u in reversed(updates):
        key = u.use.running
        if times[key] > 1:
            chained[key] = update(chained.get(key, u.old), [u.node, 1, 0], [u.node, 2, 0],
                                  u.use.eps, u.use.momentum)
        else:
            groups.setdefault((u.use.eps, u.use.momentum), []).append(u)
    entries, names = [], []
    for (eps, momentum), members in groups.items():
        def cat(pick, members=members):
            return g.concat(*[pick(m) for m in members])
        entries += update((cat(lambda m: m.old[0]), cat(lambda m: m.old[1])),
                          cat(lambda m: [m.node, 1, 0]), cat(lambda m: [m.node, 2, 0]),
                          eps, momentum)
        names += [m.use.running[0] for m in members] + [m.use.running[1] for m in members]
    for key, new in chained.items():
        entries += new
        names += list(key)
    return entries, names
