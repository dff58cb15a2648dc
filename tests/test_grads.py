"""gluon_parallel.grads: stale gradients are skipped or count zero exactly as
unused parameters behave on one device (the reference: plain Gluon on one
context)."""

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp

from loops import CTX, LOSS, SGD, values, assert_same


class TwoHeads(gluon.Block):
    """head_b is used by none, all, or only some replicas of a step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.body = nn.Dense(4, in_units=3)
            self.head_a = nn.Dense(2, in_units=4)
            self.head_b = nn.Dense(2, in_units=4)

    def forward(self, x, mode):
        h = self.body(x)
        out = self.head_a(h)
        if mode == 'all' or (mode == 'some' and x[0, 0].asscalar() > 0):
            out = out + self.head_b(h)
        return out


def _two_heads_data():
    rng = np.random.RandomState(3)
    steps = []
    for mode in ('all', 'none', 'some', 'none', 'some', 'all'):
        x = rng.normal(size=(8, 3)).astype('float32')
        x[:, 0] = np.abs(x[:, 0]) * np.where(np.arange(8) < 4, 1, -1)   # slices 0,1 use head_b
        steps.append((x, rng.randint(0, 2, 8).astype('float32'), mode))
    return steps


def _two_heads(ctx):
    net = TwoHeads()
    net.initialize(mx.init.Xavier(), ctx=ctx)
    with autograd.pause():
        rng = np.random.RandomState(4)
        for p in net.collect_params().values():
            p.set_data(nd.array(rng.normal(0, 0.5, p.shape)))
    return net


@pytest.mark.parametrize('uok', [None, False], ids=['kvstore-update', 'local-update'])
def test_step_skips_unused_parameters_as_on_one_device(uok):
    steps = _two_heads_data()
    # Reference: one device running the four slices one after the other;
    # head_b is stale when no slice used it, and then skipped.
    ref = _two_heads(mx.cpu(0))
    tr = gluon.Trainer(ref.collect_params(), *SGD)
    for x, y, mode in steps:
        with autograd.record():
            losses = [LOSS(ref(nd.array(xs), mode), nd.array(ys))
                      for xs, ys in zip(np.array_split(x, 4), np.array_split(y, 4))]
        autograd.backward(losses)
        tr.step(len(x), ignore_stale_grad=True)

    net = _two_heads(CTX)
    trainer = gluon.Trainer(net.collect_params(), *SGD, update_on_kvstore=uok)
    with gp.DataParallel(net, CTX) as dp:
        dp_loss = gp.DataParallelLoss(LOSS)
        for x, y, mode in steps:
            with autograd.record():
                losses = dp_loss(dp(x, mode), y)
            autograd.backward(losses)
            gp.step(trainer, len(x), ignore_stale_grad=True)
    assert_same(values(net), values(ref), rtol=1e-5)


def test_step_reports_stale_gradients_by_default():
    net = _two_heads(CTX[:2])
    trainer = gluon.Trainer(net.collect_params(), *SGD)
    x, y, _ = _two_heads_data()[0]
    with gp.DataParallel(net, CTX[:2]) as dp:
        with autograd.record():
            losses = gp.DataParallelLoss(LOSS)(dp(x, 'none'), y)
        autograd.backward(losses)
        names = f'({net.head_b.weight.name}|{net.head_b.bias.name})'
        with pytest.raises(UserWarning, match=names + r'.*ignore_stale_grad=True'):
            gp.step(trainer, len(x))
    assert net.head_b.weight.grad_req == 'write'


def test_hiding_from_the_step_nests():
    """gp.step hides its unused parameters from the Trainer, and gp.Trainer
    hides the dense ones from Gluon's row-sparse reduction inside that: each
    parameter's own grad_req is still known inside the inner block, after
    it, and restored after both."""
    from gluon_parallel import _gluon
    p, q = gluon.Parameter('p', shape=(2,)), gluon.Parameter('q', shape=(2,), grad_req='add')
    with _gluon.hidden_from_step([p]):
        with _gluon.hidden_from_step([p, q]):
            assert (p.grad_req, q.grad_req) == ('null', 'null')
            assert (_gluon.true_grad_req(p), _gluon.true_grad_req(q)) == ('write', 'add')
        assert (p.grad_req, q.grad_req) == ('null', 'add')
        assert _gluon.true_grad_req(p) == 'write'
    assert (p.grad_req, q.grad_req) == ('write', 'add')
    assert (_gluon.true_grad_req(p), _gluon.true_grad_req(q)) == ('write', 'add')
