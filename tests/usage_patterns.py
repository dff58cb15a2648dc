"""The usage patterns graph mode must compute as Gluon does, run by three
drivers: the per-device Gluon loop (one ``net(x)`` per device on balanced
slices, the reference for BatchNorm), plain Gluon on one context with the
whole batch (the reference for SyncBatchNorm), and DataParallel.

Each pattern returns {structural name: [numpy value per context]} read
after ``nd.waitall()``: weights and running statistics.
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp
import loops

PATTERNS = ['abandoned_forward', 'two_forwards_one_backward', 'steps_16_10_16',
            'accumulate_with_a_short_batch']


def build(bn, ctx, hybridize=None, seed=0):
    """loops.conv_net with `bn`, the same values for every seed."""
    mx.random.seed(seed)
    net = loops.conv_net(bn)
    net.initialize(mx.init.Xavier(), ctx=ctx)
    if hybridize is not None:
        net.hybridize(**hybridize)
    return net


def per_device(net, ctx):
    """The per-device Gluon loop's forward: balanced slices (gp.split_sizes,
    as DataParallel splits), one call per device."""
    def forward(x, y):
        sizes = gp.split_sizes(x.shape[0], len(ctx))
        ends = np.cumsum(sizes)
        return [(net(x[e - s:e].as_in_context(c)), y[e - s:e].as_in_context(c))
                for s, e, c in zip(sizes, ends, ctx)]
    return forward


def whole_batch(net, ctx):
    """Plain Gluon on one context with the whole batch."""
    return lambda x, y: [(net(x.as_in_context(ctx[0])), y.as_in_context(ctx[0]))]


def data_parallel(net, ctx, graph='auto'):
    dp = gp.DataParallel(net, ctx, graph=graph)

    def forward(x, y):
        outs = dp(x)
        sizes = [o.shape[0] for o in outs]
        ends = np.cumsum(sizes)
        return [(o, y[e - s:e].as_in_context(o.context)) for o, s, e in zip(outs, sizes, ends)]
    forward.dp = dp
    return forward


def _batch(size, rng):
    return (nd.array(rng.normal(size=(size, 2, 8, 8))),
            nd.array(rng.randint(0, 3, size)))


def _losses(pairs):
    return [loops.LOSS(o, y) for o, y in pairs]


def run(pattern, net, forward, seed=11):
    """Run `pattern` on `net` through `forward` (one of the drivers above);
    returns every context's values."""
    rng = np.random.RandomState(seed)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
    if pattern == 'abandoned_forward':
        # A metric computed while recording: its backward never comes.
        x, y = _batch(16, rng)
        with autograd.record():
            metric = [float(v.mean().asscalar()) for v in _losses(forward(x, y))]
        assert np.isfinite(metric).all()
        batches = [[_batch(16, rng)]]
    elif pattern == 'two_forwards_one_backward':
        (x1, y1), (x2, y2) = _batch(16, rng), _batch(16, rng)
        with autograd.record():
            losses = _losses(forward(x1, y1)) + _losses(forward(x2, y2))
        autograd.backward(losses)
        trainer.step(32)
        batches = [[_batch(16, rng)]]
    elif pattern == 'steps_16_10_16':
        batches = [[_batch(b, rng)] for b in (16, 10, 16)]
    elif pattern == 'accumulate_with_a_short_batch':
        for p in net.collect_params().values():
            if p.grad_req != 'null':
                p.grad_req = 'add'
        batches = [[_batch(8, rng), _batch(3, rng)], [_batch(10, rng), _batch(2, rng)]]
    else:
        raise ValueError(pattern)
    for group in batches:
        for x, y in group:
            with autograd.record():
                losses = _losses(forward(x, y))
            autograd.backward(losses)
        trainer.step(sum(x.shape[0] for x, _ in group))
        if pattern == 'accumulate_with_a_short_batch':
            net.collect_params().zero_grad()
    nd.waitall()
    return {k: [d.asnumpy() for d in p.list_data()]
            for k, p in net._collect_params_with_prefix().items()}


def assert_close(got, ref, rtol=1e-5, atol=1e-6, what=''):
    """Every context's values against the reference's (a one-context
    reference against every context)."""
    for k, copies in ref.items():
        for i, c in enumerate(got[k]):
            r = copies[i if len(copies) > 1 else 0]
            np.testing.assert_allclose(c, r, rtol=rtol, atol=atol,
                                       err_msg=f'{what}{k} on context {i}')


def batchnorm_class(name):
    return {'BatchNorm': nn.BatchNorm, 'SyncBatchNorm': gp.nn.SyncBatchNorm}[name]
