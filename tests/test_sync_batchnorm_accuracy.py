"""SyncBatchNorm's accuracy in model-zoo networks against the float64 truth,
with float32 BatchNorm's own distance from it as the yardstick, and its
dtypes (float16 data with float32 parameters, float64) against BatchNorm."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, nd

import gluon_parallel as gp
import yardstick
from syncbn_checks import (SPLITS, check_float64_throughout, dtype_pair, forward_backward,
                           random_inputs, truth_and_yardstick)


@pytest.mark.parametrize('n,batch', SPLITS)
@pytest.mark.parametrize('name', sorted(yardstick.NETWORKS))
def test_one_sgd_step_as_accurate_as_batchnorm(name, n, batch):
    values, x, y, truth, bn_errors = truth_and_yardstick(name, batch)
    run = yardstick.one_step(name, values, x, y, [mx.cpu(i) for i in range(n)], sync=True)
    errors = yardstick.relative_errors(run, truth)
    bound, bn_worst = yardstick.worst(bn_errors)
    ours, our_worst = yardstick.worst(errors)
    assert ours <= 10 * bound, (
        f'{name} on {n:d} devices, batch {batch:d}: SyncBatchNorm {ours:.3g} ({our_worst}) against '
        'the float64 truth, '
        f'float32 BatchNorm {bound:.3g} ({bn_worst})')
    for k, v in run.items():
        if k.endswith(('running_mean', 'running_var')):
            assert all((c == v[0]).all() for c in v), f'{k} differs between devices'


def test_the_rounded_relu_is_relu_away_from_its_kink():
    x = nd.array(np.linspace(-3, 3, 601))
    with yardstick.smooth_relu():
        smooth = nd.Activation(x, act_type='relu').asnumpy()
        np.testing.assert_allclose(nd.Activation(x, act_type='tanh').asnumpy(),
                                   np.tanh(x.asnumpy()), rtol=1e-5, atol=1e-6)
    plain = nd.relu(x).asnumpy()
    far = np.abs(x.asnumpy()) > yardstick.TAU
    np.testing.assert_allclose(smooth[far], plain[far], atol=1e-6)
    assert np.abs(smooth - plain).max() <= yardstick.TAU / 4 + 1e-7
    assert (nd.Activation(x, act_type='relu') == nd.relu(x)).asnumpy().all()   # restored


# ---------------------------------------------------------------- dtypes --


@pytest.mark.parametrize('n,batch', [(2, 9), (4, 10)])
def test_float16_data_with_float32_parameters(n, batch):
    ctx_list = [mx.cpu(i) for i in range(n)]
    x, w = random_inputs((batch, 6, 5, 5))
    x16 = x.astype('float16')
    sync, bn16 = dtype_pair(6, ctx_list, 'float16')
    assert np.dtype(sync.gamma.dtype) == np.float32 == np.dtype(sync.running_mean.dtype)
    bn32 = dtype_pair(6, [mx.cpu(0)], 'float32')[1]
    ref = forward_backward(bn32, x16.astype('float32'), w)   # the same float16 values
    ours = forward_backward(sync, x16, w, ctx_list)
    theirs = forward_backward(bn16, x16, w)                 # BatchNorm's own float16 error
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
    check_float64_throughout(n, batch)


def test_parameters_of_another_dtype_are_a_clear_error():
    sync = gp.nn.SyncBatchNorm(in_channels=3)
    sync.initialize(ctx=[mx.cpu(0), mx.cpu(1)])          # float32 parameters
    with pytest.raises(TypeError, match='float64 input needs float64 parameters'):
        with autograd.record():
            gp.DataParallel(sync, [mx.cpu(0), mx.cpu(1)])(nd.ones((4, 3, 2, 2), dtype='float64'))
