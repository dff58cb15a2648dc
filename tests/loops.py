"""The training loops the end-to-end tests compare: plain Gluon on one
context with ``gluon.nn.BatchNorm`` (the reference, never this library's
own output) and the documented DataParallel loop on n contexts."""
import os

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp

CTX = [mx.cpu(i) for i in range(4)]
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()
SGD = ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3})
ADAM = ('adam', {'learning_rate': 0.01, 'wd': 1e-3})
HERE = os.path.dirname(os.path.abspath(__file__))


def conv_net(bn=gp.nn.SyncBatchNorm):
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, padding=1, in_channels=2), bn(in_channels=4), nn.Activation('relu'),
            nn.Conv2D(4, 3, strides=2, in_channels=4), bn(in_channels=4), nn.Activation('relu'),
            nn.Dense(3, in_units=36))
    return net


def make_init(path, seed=0):
    """Random values for every parameter of conv_net, running statistics
    included, in a plain Gluon parameter file."""
    rng = np.random.RandomState(seed)
    values = {}
    for k, p in conv_net(nn.BatchNorm)._collect_params_with_prefix().items():
        v = rng.uniform(0.5, 1.5, p.shape) if k.endswith('var') else rng.normal(0, 0.5, p.shape)
        values[k] = nd.array(v)
    nd.save(path, values)
    return path


def make_batches(sizes, seed=1):
    rng = np.random.RandomState(seed)
    return [(rng.normal(size=(b, 2, 8, 8)).astype('float32'),
             rng.randint(0, 3, b).astype('float32')) for b in sizes]



def values(net):
    """{structural name: [numpy copy per context]}"""
    return {k: [d.asnumpy() for d in p.list_data()]
            for k, p in net._collect_params_with_prefix().items()}


def reference(init, batches, opt=SGD, setup=None, micro=None, bn=nn.BatchNorm):
    """Plain Gluon, one context, gluon.nn.BatchNorm (or `bn`). `micro`:
    number of batches accumulated per step (grad_req='add')."""
    net = conv_net(bn)
    net.load_parameters(init, ctx=mx.cpu(0), ignore_extra=bn is not nn.BatchNorm)
    if setup:
        setup(net)
    trainer = gluon.Trainer(net.collect_params(), opt[0], dict(opt[1]))
    groups = [batches[i:i + micro] for i in range(0, len(batches), micro)] if micro \
        else [[b] for b in batches]
    for group in groups:
        for x, y in group:
            with autograd.record():
                loss = LOSS(net(nd.array(x)), nd.array(y))
            loss.backward()
        trainer.step(sum(len(x) for x, _ in group))
        if micro:
            net.collect_params().zero_grad()
    return values(net)


def parallel(init, batches, n, opt=SGD, uok=None, bn=gp.nn.SyncBatchNorm, setup=None,
             micro=None, hybridize=False, graph='auto'):
    """The documented loop on n contexts."""
    ctx = CTX[:n]
    net = conv_net(bn)
    net.load_parameters(init, ctx=ctx, ignore_extra=bn not in (nn.BatchNorm, gp.nn.SyncBatchNorm))
    if setup:
        setup(net)
    if hybridize:
        net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), opt[0], dict(opt[1]), update_on_kvstore=uok)
    groups = [batches[i:i + micro] for i in range(0, len(batches), micro)] if micro \
        else [[b] for b in batches]
    with gp.DataParallel(net, ctx, graph=graph) as dp:
        dp_loss = gp.DataParallelLoss(LOSS)
        for group in groups:
            for x, y in group:
                with autograd.record():
                    losses = dp_loss(dp(x), y)
                autograd.backward(losses)
            trainer.step(sum(len(x) for x, _ in group))
            if micro:
                net.collect_params().zero_grad()
    return values(net), net, trainer


def assert_same(got, ref, rtol=2e-4, atol=1e-6, what=''):
    """Every context identical; every parameter close to the reference."""
    assert set(got) == set(ref)
    for k, copies in got.items():
        for i, c in enumerate(copies[1:], 1):
            np.testing.assert_array_equal(c, copies[0], err_msg=f'{what}{k}: context {i:d} differs '
                                          'from context 0')
        r = ref[k][0] if isinstance(ref[k], list) else ref[k]
        np.testing.assert_allclose(copies[0], r, rtol=rtol, atol=atol,
                                   err_msg=f'{what}{k} differs from the reference')
