"""SyncBatchNorm's accuracy in model-zoo networks against the float64 truth,
with float32 BatchNorm's own distance from it as the yardstick, and its
dtypes (float16 data with float32 parameters, float64) against BatchNorm."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import gluon_parallel as gp
import yardstick

#: (devices, global batch): even and uneven splits, and a batch smaller
#: than the device count (3 rows on 4 devices: one stays idle).
SPLITS = [(1, 7), (2, 7), (4, 7), (4, 3)]

_truths = {}


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


@pytest.mark.parametrize('n,batch', SPLITS)
@pytest.mark.parametrize('name', sorted(yardstick.NETWORKS))
def test_one_sgd_step_as_accurate_as_batchnorm(name, n, batch):
    values, x, y, truth, bn_errors = truth_and_yardstick(name, batch)
    run = yardstick.one_step(name, values, x, y, [mx.cpu(i) for i in range(n)], sync=True)
    errors = yardstick.relative_errors(run, truth)
    bound, bn_worst = yardstick.worst(bn_errors)
    ours, our_worst = yardstick.worst(errors)
    assert ours <= 10 * bound, (
        '%s on %d devices, batch %d: SyncBatchNorm %.3g (%s) against the float64 truth, '
        'float32 BatchNorm %.3g (%s)' % (name, n, batch, ours, our_worst, bound, bn_worst))
    for k, v in run.items():
        if k.endswith(('running_mean', 'running_var')):
            assert all((c == v[0]).all() for c in v), f'{k} differs between devices'


def test_the_rounded_relu_is_relu_away_from_its_kink():
    x = nd.array(np.linspace(-3, 3, 601))
    with yardstick.smooth_relu():
        smooth = nd.Activation(x, act_type='relu').asnumpy()
        np.testing.assert_allclose(nd.Activation(x, act_type='tanh').asnumpy(), np.tanh(x.asnumpy()), rtol=1e-5, atol=1e-6)
    plain = nd.relu(x).asnumpy()
    far = np.abs(x.asnumpy()) > yardstick.TAU
    np.testing.assert_allclose(smooth[far], plain[far], atol=1e-6)
    assert np.abs(smooth - plain).max() <= yardstick.TAU / 4 + 1e-7
    assert (nd.Activation(x, act_type='relu') == nd.relu(x)).asnumpy().all()   # restored


# ---------------------------------------------------------------- dtypes --

def _pair(channels, ctx_list, dtype):
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


def _forward_backward(layer, x, w, ctx_list=None):
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


def _inputs(shape, mean=2.0, seed=1):
    rng = np.random.RandomState(seed)
    return rng.normal(mean, 3.0, size=shape), rng.normal(size=shape)


@pytest.mark.parametrize('n,batch', [(2, 9), (4, 10)])
def test_float16_data_with_float32_parameters(n, batch):
    ctx_list = [mx.cpu(i) for i in range(n)]
    x, w = _inputs((batch, 6, 5, 5))
    x16 = x.astype('float16')
    sync, bn16 = _pair(6, ctx_list, 'float16')
    assert np.dtype(sync.gamma.dtype) == np.float32 == np.dtype(sync.running_mean.dtype)
    bn32 = _pair(6, [mx.cpu(0)], 'float32')[1]
    ref = _forward_backward(bn32, x16.astype('float32'), w)   # the same float16 values
    ours = _forward_backward(sync, x16, w, ctx_list)
    theirs = _forward_backward(bn16, x16, w)                 # BatchNorm's own float16 error
    for what, o, t, r in zip(('output', 'input grad', 'gamma grad', 'beta grad'),
                             ours, theirs, ref):
        scale = np.abs(r).max()
        err, bn_err = np.abs(o - r).max() / scale, np.abs(t - r).max() / scale
        assert err <= max(2 * bn_err, 2e-3), (what, err, bn_err)
    mean = x16.astype('float64').mean(axis=(0, 2, 3))
    var = x16.astype('float64').var(axis=(0, 2, 3))
    for ctx in ctx_list:
        np.testing.assert_allclose(sync.running_mean.data(ctx).asnumpy(), 0.1 * mean, rtol=1e-6)
        np.testing.assert_allclose(sync.running_var.data(ctx).asnumpy(), 0.9 + 0.1 * var,
                                   rtol=1e-6)


@pytest.mark.parametrize('n,batch', [(1, 7), (2, 9), (4, 10)])
def test_float64_throughout(n, batch):
    ctx_list = [mx.cpu(i) for i in range(n)]
    x, w = _inputs((batch, 6, 5, 5), mean=100.0)
    sync, bn64 = _pair(6, ctx_list, 'float64')
    assert np.dtype(sync.gamma.dtype) == np.float64
    ours = _forward_backward(sync, x, w, ctx_list)
    ref = _forward_backward(bn64, x, w)
    for what, o, r in zip(('output', 'input grad', 'gamma grad', 'beta grad'), ours, ref):
        np.testing.assert_allclose(o, r, rtol=1e-12, atol=1e-12 * np.abs(r).max(), err_msg=what)
    # MXNet's BatchNorm updates its float64 running statistics with a float32
    # momentum (off by 5e-8): numpy is the reference here.
    for ctx in ctx_list:
        np.testing.assert_allclose(sync.running_mean.data(ctx).asnumpy(),
                                   0.1 * x.mean(axis=(0, 2, 3)), rtol=1e-13)
        np.testing.assert_allclose(sync.running_var.data(ctx).asnumpy(),
                                   0.9 + 0.1 * x.var(axis=(0, 2, 3)), rtol=1e-13)


def test_parameters_of_another_dtype_are_a_clear_error():
    sync = gp.nn.SyncBatchNorm(in_channels=3)
    sync.initialize(ctx=[mx.cpu(0), mx.cpu(1)])          # float32 parameters
    with pytest.raises(TypeError, match='float64 input needs float64 parameters'):
        with autograd.record():
            gp.DataParallel(sync, [mx.cpu(0), mx.cpu(1)])(nd.ones((4, 3, 2, 2), dtype='float64'))
