"""Blocks whose graph depends on the autograd mode they are traced in, and
the per-device Gluon loop they are checked against (warm-up tests)."""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

__all__ = ['ModeScaled', 'TargetsInTraining', 'Glue', 'make', 'batch', 'per_device_loop',
           'grads', 'running']


class ModeScaled(gluon.HybridBlock):
    """2 * y in training, y in predict mode (y: BatchNorm of a Dense): the
    traced graph depends on the mode."""

    def __init__(self, deferred=False, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=0 if deferred else 3)
            self.bn = gluon.nn.BatchNorm(in_channels=0 if deferred else 4)

    def hybrid_forward(self, F, x):
        y = self.bn(self.dense(x))
        return 2 * y if autograd.is_training() else y


class TargetsInTraining(gluon.HybridBlock):
    """As GluonCV's YOLOv3: in training it takes targets and returns a
    loss; its predict graph refuses them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.body = ModeScaled()

    def hybrid_forward(self, F, x, *targets):
        y = self.body(x)
        if autograd.is_training():
            return F.sum(F.square(y - targets[0]), axis=1), y
        if targets:
            raise TypeError('TargetsInTraining inference only needs one input')
        return y


class Glue(gluon.Block):
    """Imperative code around a hybridized mode-scaled child, with a
    Dropout of its own: its first call runs (no graph to build without
    running the glue)."""

    def __init__(self, rate=0.5, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.inner = ModeScaled()
            self.drop = gluon.nn.Dropout(rate)

    def forward(self, x):
        h = self.drop(x) + 1
        return self.inner(h) * 3 if autograd.is_training() else self.inner(h)


def make(cls, ctx, seed=0, **kwargs):
    """A fresh `cls(**kwargs)` initialised on `ctx`, hybridized unless it
    is a plain Block (its children are)."""
    mx.random.seed(seed)
    net = cls(**kwargs)
    net.initialize(mx.init.Xavier(), ctx=ctx)
    if isinstance(net, gluon.HybridBlock):
        net.hybridize()
    else:
        net.inner.hybridize()
    return net


def batch(n, seed=0):
    rng = np.random.RandomState(seed)
    return nd.array(rng.uniform(-1, 1, (n, 3))), nd.array(rng.uniform(-1, 1, (n, 4)))


def per_device_loop(net, ctx, x, *targets):
    """The per-device Gluon loop's recorded outputs (one call per device on
    its rows, split as DataParallel splits) and their backward."""
    from gluon_parallel.split import split_sizes
    sizes = split_sizes(x.shape[0], len(ctx))
    outs, start = [], 0
    with autograd.record():
        for c, k in zip(ctx, sizes):
            rows = [a[start:start + k].as_in_context(c) for a in (x,) + targets]
            outs.append(net(*rows))
            start += k
    autograd.backward([_head(o) for o in outs])
    return outs


def _head(out):
    return out[0] if isinstance(out, (list, tuple)) else out


def grads(net):
    return {k: [g.asnumpy() for g in p.list_grad()]
            for k, p in net._collect_params_with_prefix().items() if p.grad_req != 'null'}


def running(net):
    return {k: [d.asnumpy() for d in p.list_data()]
            for k, p in net._collect_params_with_prefix().items() if 'running' in k}
