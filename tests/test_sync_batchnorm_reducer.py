"""SyncBatchNorm.reducer: a layer normalises with the statistics of a group
larger than the parallel call's devices.

The group here is this process plus a phantom batch that no replica sees
(what another worker of a dist job would hold): the reducer adds its
totals. The independent reference is float64 gluon.nn.BatchNorm on one
device applied to the concatenation [x; phantom], the phantom a constant,
its rows left out of the loss.
"""
import threading

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import gluon_parallel as gp
from gluon_parallel.nn import SyncBatchNorm

C, MOMENTUM, EPS = 3, 0.8, 1e-5


class PhantomReducer:
    """Adds the per-channel sum, sum of squares and row count of `extra`
    (NCHW numpy) to what this process holds; records its calls."""

    def __init__(self, extra):
        x = extra.astype('float64').swapaxes(0, 1).reshape(extra.shape[1], -1)
        self.totals = np.stack([x.sum(axis=1), (x * x).sum(axis=1),
                                np.full(x.shape[0], x.shape[1], dtype='float64')])
        self.calls = []

    def __call__(self, layer, totals):
        self.calls.append((layer.name, threading.current_thread().name, totals.asnumpy()))
        return totals + nd.array(self.totals, ctx=totals.context, dtype='float64')


def data(batch, seed=0):
    rng = np.random.RandomState(seed)
    x = (rng.randn(batch, C, 2, 3) * 1.5 + 3).astype('float32')
    phantom = (rng.randn(5, C, 2, 3) * 0.7 - 1).astype('float32')
    w = rng.randn(batch, C, 2, 3).astype('float32')
    gamma, beta = rng.uniform(0.5, 1.5, C), rng.uniform(-0.5, 0.5, C)
    return x, phantom, w, gamma, beta


def layer(cls, ctx, gamma, beta, dtype='float32'):
    bn = cls(in_channels=C, momentum=MOMENTUM, epsilon=EPS)
    bn.initialize(ctx=ctx)
    bn.cast(dtype)
    bn.gamma.set_data(nd.array(gamma, dtype=dtype))
    bn.beta.set_data(nd.array(beta, dtype=dtype))
    return bn


def reference(x, phantom, w, gamma, beta, steps):
    """float64 BatchNorm on [x; phantom]: output rows of x, dx, dgamma,
    dbeta of sum(out * w), running statistics after `steps` passes."""
    bn = layer(gluon.nn.BatchNorm, mx.cpu(0), gamma, beta, 'float64')
    xa = nd.array(x, dtype='float64')
    xa.attach_grad()
    for _ in range(steps):
        with autograd.record():
            out = bn(nd.concat(xa, nd.array(phantom, dtype='float64'), dim=0))[:len(x)]
            loss = (out * nd.array(w, dtype='float64')).sum()
        loss.backward()
    return (out.asnumpy(), xa.grad.asnumpy(), bn.gamma.grad().asnumpy(),
            bn.beta.grad().asnumpy(), bn.running_mean.data().asnumpy(),
            bn.running_var.data().asnumpy())


def run_sync(bn, ctx, x, w, steps):
    """The same through DataParallel on `ctx` (or a direct call when ctx
    is one context): per-context results gathered on the host."""
    dp = gp.DataParallel(bn, ctx) if len(ctx) > 1 else None
    xa = nd.array(x)
    xa.attach_grad()
    try:
        for _ in range(steps):
            with autograd.record():
                outs = dp(xa) if dp else [bn(xa)]
                rows = np.cumsum([0] + [o.shape[0] for o in outs])
                losses = [(o * nd.array(w[a:b], ctx=o.context)).sum()
                          for o, a, b in zip(outs, rows[:-1], rows[1:])]
            autograd.backward(losses)
    finally:
        if dp:
            dp.close()
    return np.concatenate([o.asnumpy() for o in outs]), xa.grad.asnumpy()


def summed_grad(param):
    """What the Trainer applies: the sum over the contexts."""
    return sum(g.asnumpy() for g in param.list_grad())


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
@pytest.mark.parametrize('n,batch', [(1, 6), (3, 7), (4, 3)])
def test_reducer_gives_the_statistics_of_the_whole_group(n, batch, hybridize):
    x, phantom, w, gamma, beta = data(batch)
    steps = 2
    want = reference(x, phantom, w, gamma, beta, steps)
    ctx = [mx.cpu(i) for i in range(n)]
    bn = layer(SyncBatchNorm, ctx, gamma, beta)
    bn.reducer = reducer = PhantomReducer(phantom)
    if hybridize:
        bn.hybridize(static_alloc=True)
    out, dx = run_sync(bn, ctx, x, w, steps)
    np.testing.assert_allclose(out, want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dx, want[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(summed_grad(bn.gamma), want[2], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(summed_grad(bn.beta), want[3], rtol=1e-4, atol=1e-4)
    for c, (m, v) in enumerate(zip(bn.running_mean.list_data(), bn.running_var.list_data())):
        np.testing.assert_allclose(m.asnumpy(), want[4], rtol=1e-5, atol=1e-6, err_msg=str(c))
        np.testing.assert_allclose(v.asnumpy(), want[5], rtol=1e-5, atol=1e-6, err_msg=str(c))
    # Once per forward and process, whatever the device count, with the
    # totals of this process's whole batch.
    assert [name for name, _, _ in reducer.calls] == [bn.name] * steps
    got = reducer.calls[-1][2]
    xs = x.astype('float64').swapaxes(0, 1).reshape(C, -1)
    np.testing.assert_allclose(got, [xs.sum(1), (xs * xs).sum(1), [xs.shape[1]] * C],
                               rtol=1e-12)


class Twin(gluon.HybridBlock):
    """[a(v), 2 b(v)]: two layers reading one input (one barrier when
    hybridized)."""

    def __init__(self, cls, **kwargs):
        super().__init__()
        self.a, self.b = cls(in_channels=C, **kwargs), cls(in_channels=C, **kwargs)

    def hybrid_forward(self, F, v):
        return F.concat(self.a(v), self.b(v) * 2, dim=1)


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_layers_sharing_a_barrier_each_get_their_own_columns(hybridize):
    # Each reducer sees only its layer's channels; the layer without one
    # keeps this process's statistics. Reference: float64 BatchNorm, a on
    # [v; phantom] (rows of v kept), b on v.
    x, phantom, w, _, _ = data(8, seed=1)
    w = np.concatenate([w, -w[::-1]], axis=1)
    ref = Twin(gluon.nn.BatchNorm, epsilon=EPS)
    ref.initialize(ctx=mx.cpu(0))
    ref.cast('float64')
    xr = nd.array(x, dtype='float64')
    xr.attach_grad()
    with autograd.record():
        both = nd.concat(xr, nd.array(phantom, dtype='float64'), dim=0)
        want = nd.concat(ref.a(both)[:len(x)], ref.b(xr) * 2, dim=1)
        (want * nd.array(w, dtype='float64')).sum().backward()

    ctx = [mx.cpu(0), mx.cpu(1)]
    net = Twin(SyncBatchNorm, epsilon=EPS)
    net.initialize(ctx=ctx)
    net.a.reducer = reducer = PhantomReducer(phantom)
    if hybridize:
        net.hybridize()
    out, dx = run_sync(net, ctx, x, w, 1)
    assert len(reducer.calls) == 1 and reducer.calls[0][2].shape == (3, C)
    np.testing.assert_allclose(out, want.asnumpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dx, xr.grad.asnumpy(), rtol=1e-4, atol=1e-5)
    for blk in ('a', 'b'):
        for name in ('gamma', 'beta'):
            got = summed_grad(getattr(getattr(net, blk), name))
            np.testing.assert_allclose(got, getattr(getattr(ref, blk), name).grad().asnumpy(),
                                       rtol=1e-4, atol=1e-4, err_msg=blk + name)
        for name in ('running_mean', 'running_var'):
            for d in getattr(getattr(net, blk), name).list_data():
                np.testing.assert_allclose(
                    d.asnumpy(), getattr(getattr(ref, blk), name).data().asnumpy(),
                    rtol=1e-5, atol=1e-6, err_msg=blk + name)


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_a_neighbour_with_a_reducer_costs_a_layer_no_digits(hybridize):
    # float64 data far from zero: sums about zero would lose 12 digits of
    # the variance. The layer without a reducer stays float64-exact even
    # when it meets one with a reducer at the same barrier.
    x = 1e4 + np.random.RandomState(1).randn(8, C, 4) * 1e-2
    want = (x - x.mean((0, 2), keepdims=True)) / np.sqrt(x.var((0, 2), keepdims=True) + EPS)
    ctx = [mx.cpu(0), mx.cpu(1)]
    net = Twin(SyncBatchNorm, epsilon=EPS)
    net.initialize(ctx=ctx)
    net.cast('float64')
    net.a.reducer = lambda layer, totals: totals
    if hybridize:
        net.hybridize()
    with gp.DataParallel(net, ctx) as dp, autograd.train_mode():
        out = np.concatenate([o.asnumpy() for o in dp(nd.array(x, dtype='float64'))])
    np.testing.assert_allclose(out[:, C:], 2 * want, rtol=0, atol=1e-8)
    # The layer with a reducer loses what docs/syncbatchnorm.md says, not more.
    np.testing.assert_allclose(out[:, :C], want, rtol=0, atol=1e-2)


def test_a_reducer_block_is_not_a_child_and_can_be_removed():
    class Identity(gluon.HybridBlock):
        def forward(self, layer, totals):
            return totals

    bn = SyncBatchNorm(in_channels=C)
    bn.reducer = Identity()
    assert 'reducer' not in bn._children and len(list(bn.collect_params())) == 4
    bn.reducer = None
    assert bn.reducer is None


def test_a_reducer_outside_autograd_is_refused():
    # A reduction through numpy (e.g. another communication library) that
    # autograd does not see would drop the statistics from the gradients.
    bn = SyncBatchNorm(in_channels=C)
    bn.initialize()
    bn.reducer = lambda layer, totals: nd.array(totals.asnumpy(), dtype='float64')
    with pytest.raises(RuntimeError, match=f'{bn.name}: its reducer returned an array autograd did '
                       'not record'):
        with autograd.record():
            bn(nd.ones((4, C, 2)))
    with autograd.train_mode():        # not recording: nothing to lose
        bn(nd.array(data(4)[0]))


def test_a_bad_reducer_is_a_clear_error():
    bn = SyncBatchNorm(in_channels=C)
    with pytest.raises(TypeError, match='must be callable'):
        bn.reducer = 'kvstore'
    bn.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    bn.reducer = lambda layer, totals: totals[:2]
    dp = gp.DataParallel(bn, [mx.cpu(0), mx.cpu(1)])
    with pytest.raises(TypeError, match=rf'{bn.name}: its reducer must return a float64 NDArray of '
                       r'shape \(3, 3\)'):
        with autograd.record():
            dp(nd.ones((4, C, 2, 2)))
    dp.close()
    bn.reducer = None
    with autograd.record():       # back to the devices' own batch
        out = bn(nd.array(data(4)[0]))
    np.testing.assert_allclose(out.mean((0, 2, 3)).asnumpy(), 0, atol=1e-5)
