"""The checks of SyncBatchNorm shared by its test files and by
tests/test_kernels.py, which runs them again with the optional C++ kernels
loaded: the layer against gluon.nn.BatchNorm on the whole batch on one
context (the independent reference), against the float64 truth, and in
float16/float64.
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

import gluon_parallel as gp
import yardstick
from gluon_parallel.nn import SyncBatchNorm

FLAGS = {'dynamic': {}, 'static': {'static_alloc': True, 'static_shape': True}}


RTOL, ATOL, ATOL_PARAM = 1e-4, 1e-5, 1e-4


#: (devices, global batch): even and uneven splits, and a batch smaller
#: than the device count (3 rows on 4 devices: one stays idle).
SPLITS = [(1, 7), (2, 7), (4, 7), (4, 3)]


_truths = {}


def cpus(n):
    return [mx.cpu(i) for i in range(n)]


def bounds(batch, n):
    """Row ranges of the slices, computed independently of split_sizes."""
    sizes = [len(a) for a in np.array_split(np.arange(batch), min(batch, n))]
    ends = np.cumsum(sizes)
    return [(e - s, e) for s, e in zip(sizes, ends)]


def make_pair(channels, ctxs, seed=0, **kwargs):
    """A SyncBatchNorm on ctxs and a BatchNorm on cpu(0) with equal,
    non-trivial gamma/beta."""
    rng = np.random.RandomState(seed)
    gamma = rng.uniform(0.5, 1.5, channels).astype('float32')
    beta = rng.uniform(-0.5, 0.5, channels).astype('float32')
    sync = SyncBatchNorm(in_channels=channels, **kwargs)
    ref = gluon.nn.BatchNorm(in_channels=channels, **kwargs)
    sync.initialize(ctx=ctxs)
    ref.initialize(ctx=mx.cpu(0))
    for blk in (sync, ref):
        blk.gamma.set_data(nd.array(gamma))
        blk.beta.set_data(nd.array(beta))
    return sync, ref


def step_both(dp, ref, x, w, ctxs, input_grad=True):
    """One forward+backward of sum(bn(x) * w) through DataParallel and
    through the reference; returns outputs and input gradients of both
    (without `input_grad`, None for DataParallel's: an input that needs its
    own gradient keeps a call out of graph mode)."""
    batch = x.shape[0]
    xs = [nd.array(x[b:e], ctx=c) for (b, e), c in zip(bounds(batch, len(ctxs)), ctxs)]
    ws = [nd.array(w[b:e], ctx=c) for (b, e), c in zip(bounds(batch, len(ctxs)), ctxs)]
    for xi in xs:
        xi.attach_grad()
    # Pre-split input: run through parallel_apply-like path via DataParallel on the
    # concatenated batch is what users do; here DataParallel gets the whole batch
    # and we reproduce its slices for the input gradient.
    xfull = nd.array(x)
    if input_grad:
        xfull.attach_grad()
    with autograd.record():
        outs = dp(xfull)
        losses = [(o * wi.as_in_context(o.context)).sum() for o, wi in zip(outs, ws)]
    autograd.backward(losses)
    out = np.concatenate([o.asnumpy() for o in outs])
    xr = nd.array(x)
    xr.attach_grad()
    with autograd.record():
        yr = ref(xr)
        lr = (yr * nd.array(w)).sum()
    lr.backward()
    return out, xfull.grad.asnumpy() if input_grad else None, yr.asnumpy(), xr.grad.asnumpy()


def assert_close(a, b, atol=ATOL, what=''):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=atol, err_msg=what)


class Hybridized(gluon.HybridBlock):
    """`layer` inside a block of its own, to hybridize."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer

    def hybrid_forward(self, F, x):
        return self.layer(x)


def check_against_batchnorm(n, shape, axis=1, steps=3, mean=0.0, hybridize=None,
                            input_grad=True, **kwargs):
    """`hybridize`: hybridize() flags for a block holding the layer;
    `input_grad`: compare the input's gradient too (see step_both)."""
    ctxs = cpus(n)
    channels = shape[axis]
    sync, ref = make_pair(channels, ctxs, axis=axis, **kwargs)
    block = sync
    if hybridize is not None:
        block = Hybridized(sync)
        block.hybridize(**hybridize)
    rng = np.random.RandomState(1)
    with gp.DataParallel(block, ctxs) as dp:
        for s in range(steps):
            x = (rng.randn(*shape) * rng.uniform(0.5, 2) + mean + rng.randn()).astype('float32')
            w = rng.randn(*shape).astype('float32')
            out, gx, ref_out, ref_gx = step_both(dp, ref, x, w, ctxs, input_grad)
            assert_close(out, ref_out, what=f'output, step {s:d}')
            if input_grad:
                assert_close(gx, ref_gx, what=f'input gradient, step {s:d}')
            if kwargs.get('scale', True):
                g = sum(sync.gamma.grad(c).asnumpy() for c in ctxs)
                assert_close(g, ref.gamma.grad().asnumpy(), ATOL_PARAM, 'gamma gradient')
            if kwargs.get('center', True):
                g = sum(sync.beta.grad(c).asnumpy() for c in ctxs)
                assert_close(g, ref.beta.grad().asnumpy(), ATOL_PARAM, 'beta gradient')
    for name in ('running_mean', 'running_var'):
        want = getattr(ref, name).data().asnumpy()
        copies = [getattr(sync, name).data(c).asnumpy() for c in ctxs]
        for c, v in zip(ctxs, copies):
            assert_close(v, want, what=f'{name} on {c}')
            np.testing.assert_array_equal(v, copies[0])   # identical on every device
    return sync, ref


class TwoLayers(gluon.HybridBlock):
    """Two SyncBN layers, the first called twice per forward."""

    def __init__(self, bn_cls, **kwargs):
        super().__init__(**kwargs)
        self.bn1 = bn_cls(in_channels=3)
        self.bn2 = bn_cls(in_channels=3)

    def hybrid_forward(self, F, x):
        y = self.bn1(x)
        y = self.bn1(y * 3 + 1)         # same layer, second round
        return self.bn2(F.relu(y) * x)


def check_two_layers(hybridize=None):
    ctxs = cpus(4)
    sync = TwoLayers(SyncBatchNorm)
    ref = TwoLayers(gluon.nn.BatchNorm)
    sync.initialize(ctx=ctxs)
    ref.initialize(ctx=mx.cpu(0))
    if hybridize is not None:
        sync.hybridize(**hybridize)
    rng = np.random.RandomState(2)
    x = rng.randn(10, 3, 4).astype('float32')
    w = rng.randn(10, 3, 4).astype('float32')
    with gp.DataParallel(sync, ctxs) as dp:
        out, gx, ref_out, ref_gx = step_both(dp, ref, x, w, ctxs)
    assert_close(out, ref_out)
    assert_close(gx, ref_gx)
    for stat in ('running_mean', 'running_var'):
        want = getattr(ref.bn2, stat).data().asnumpy()
        for c in ctxs:
            assert_close(getattr(sync.bn2, stat).data(c).asnumpy(), want)
    # bn1 ran twice: its running stats take both batches, in call order
    # (BatchNorm applies them in backward order; see SyncBatchNorm's notes).
    with autograd.train_mode():        # batch statistics, no running-stat update
        second = ref.bn1(nd.array(x)).asnumpy() * 3 + 1
    expect_mean, expect_var = np.zeros(3), np.ones(3)
    for batch in (x, second):
        expect_mean = 0.9 * expect_mean + 0.1 * batch.mean(axis=(0, 2))
        expect_var = 0.9 * expect_var + 0.1 * batch.var(axis=(0, 2))
    for c in ctxs:
        assert_close(sync.bn1.running_mean.data(c).asnumpy(), expect_mean)
        assert_close(sync.bn1.running_var.data(c).asnumpy(), expect_var)


def truth_and_yardstick(name, batch):
    """The float64 truth and float32 BatchNorm's errors against it, once per
    network and batch."""
    key = (name, batch)
    if key not in _truths:
        values = yardstick.initial_values(name)
        x, y = yardstick.data(name, batch)
        truth = yardstick.one_step(name, values, x, y, [mx.cpu(0)], dtype='float64')
        bn32 = yardstick.one_step(name, values, x, y, [mx.cpu(0)])
        _truths[key] = values, x, y, truth, yardstick.relative_errors(bn32, truth)
    return _truths[key]


def dtype_pair(channels, ctx_list, dtype):
    """SyncBatchNorm on ctx_list and BatchNorm on cpu(0), both cast to
    dtype, with equal non-trivial parameters."""
    rng = np.random.RandomState(0)
    gamma, beta = rng.uniform(0.5, 1.5, channels), rng.uniform(-0.5, 0.5, channels)
    layers = []
    for layer, ctx in ((gp.nn.SyncBatchNorm(in_channels=channels), ctx_list),
                       (gluon.nn.BatchNorm(in_channels=channels), [mx.cpu(0)])):
        layer.initialize(ctx=ctx)
        layer.cast(dtype)
        layer.gamma.set_data(nd.array(gamma, dtype=layer.gamma.dtype))
        layer.beta.set_data(nd.array(beta, dtype=layer.beta.dtype))
        layers.append(layer)
    return layers


def forward_backward(layer, x, w, ctx_list=None):
    """Output, input gradient and summed gamma/beta gradients of
    sum(layer(x) * w), through DataParallel when ctx_list is given."""
    xx = nd.array(x, dtype=x.dtype)
    xx.attach_grad()
    with autograd.record():
        if ctx_list is None:
            out = layer(xx)
            losses = [(out.astype('float64') * nd.array(w, dtype='float64')).sum()]
        else:
            outs = gp.DataParallel(layer, ctx_list)(xx)
            ends = np.cumsum([o.shape[0] for o in outs])
            losses = [(o.astype('float64') * nd.array(w[e - o.shape[0]:e], ctx=o.context,
                                                      dtype='float64')).sum()
                      for o, e in zip(outs, ends)]
            out = nd.concat(*[o.as_in_context(mx.cpu(0)) for o in outs], dim=0)
    autograd.backward(losses)
    grads = [sum(g.asnumpy().astype('float64') for g in p.list_grad())
             for p in (layer.gamma, layer.beta)]
    return [out.asnumpy().astype('float64'), xx.grad.asnumpy().astype('float64')] + grads


def random_inputs(shape, mean=2.0, seed=1):
    rng = np.random.RandomState(seed)
    return rng.normal(mean, 3.0, size=shape), rng.normal(size=shape)


def check_large_mean_inputs(n):
    """1000 + N(0, 1): sum/sum-of-squares in float32 would cancel. Ours must
    be within tolerance of the float64 truth, and match BatchNorm up to
    BatchNorm's own float32 error (measured here: ~1.5e-4 at this mean)."""
    ctxs = cpus(n)
    rng = np.random.RandomState(4)
    x = (rng.randn(10, 3, 4, 4) + 1000).astype('float32')
    w = rng.randn(10, 3, 4, 4).astype('float32')
    sync, ref = make_pair(3, ctxs)
    with gp.DataParallel(sync, ctxs) as dp:
        out, gx, ref_out, ref_gx = step_both(dp, ref, x, w, ctxs)
    x64 = x.astype('float64')
    mean = x64.mean(axis=(0, 2, 3), keepdims=True)
    var = x64.var(axis=(0, 2, 3), keepdims=True)
    gamma = sync.gamma.data(ctxs[0]).asnumpy().reshape(1, 3, 1, 1)
    beta = sync.beta.data(ctxs[0]).asnumpy().reshape(1, 3, 1, 1)
    xhat = (x64 - mean) / np.sqrt(var + 1e-5)
    truth = xhat * gamma + beta
    assert_close(out, truth, what='output vs float64 truth')
    bn_err = np.abs(ref_out - truth).max()
    np.testing.assert_allclose(out, ref_out, rtol=RTOL, atol=ATOL + 2 * bn_err)
    # input gradient of sum(y * w), in float64
    gy = w.astype('float64') * gamma
    truth_gx = (gy - gy.mean(axis=(0, 2, 3), keepdims=True)
                - xhat * (gy * xhat).mean(axis=(0, 2, 3), keepdims=True)) / np.sqrt(var + 1e-5)
    np.testing.assert_allclose(gx, truth_gx, rtol=RTOL, atol=1e-4)
    np.testing.assert_allclose(sync.running_mean.data(ctxs[-1]).asnumpy(),
                               0.1 * mean.ravel(), rtol=RTOL)


def check_float64_throughout(n, batch):
    ctx_list = [mx.cpu(i) for i in range(n)]
    x, w = random_inputs((batch, 6, 5, 5), mean=100.0)
    sync, bn64 = dtype_pair(6, ctx_list, 'float64')
    assert np.dtype(sync.gamma.dtype) == np.float64
    ours = forward_backward(sync, x, w, ctx_list)
    ref = forward_backward(bn64, x, w)
    for what, o, r in zip(('output', 'input grad', 'gamma grad', 'beta grad'), ours, ref):
        np.testing.assert_allclose(o, r, rtol=1e-12, atol=1e-12 * np.abs(r).max(), err_msg=what)
    # MXNet's BatchNorm updates its float64 running statistics with a float32
    # momentum (off by 5e-8): numpy is the reference here.
    for ctx in ctx_list:
        np.testing.assert_allclose(sync.running_mean.data(ctx).asnumpy(),
                                   0.1 * x.mean(axis=(0, 2, 3)), rtol=1e-13)
        np.testing.assert_allclose(sync.running_var.data(ctx).asnumpy(),
                                   0.9 + 0.1 * x.var(axis=(0, 2, 3)), rtol=1e-13)
