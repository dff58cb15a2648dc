"""Shared helpers of the graph-mode tests."""
import pathlib

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp
import loops

HERE = pathlib.Path(__file__).resolve().parent


class identity(nn.HybridBlock):
    """A stand-in for a BatchNorm layer in loops.conv_net: no statistics,
    so every device count computes the same thing."""

    def __init__(self, in_channels=0):
        super(identity, self).__init__()

    def hybrid_forward(self, F, x):
        return x


def bn_net(bn=nn.BatchNorm, hybridize=True, seed=0):
    """loops.conv_net with `bn`, initialised on every test context."""
    mx.random.seed(seed)
    net = loops.conv_net(bn)
    net.initialize(mx.init.Xavier(), ctx=loops.CTX)
    if hybridize:
        net.hybridize()
    return net


def run_steps(net, ctx, sizes, graph='auto', dp=None, seed=7):
    """SGD steps of batches of `sizes` rows; returns (net, dp, steps): per
    step, {parameter name: context 0's value} read right after the step."""
    if dp is None:
        dp = gp.DataParallel(net, ctx, graph=graph)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    dl = gp.DataParallelLoss(loops.LOSS)
    rng = np.random.RandomState(seed)
    steps = []
    for b in sizes:
        x = nd.array(rng.normal(size=(b, 2, 8, 8)))
        y = nd.array(rng.randint(0, 3, b))
        with autograd.record():
            losses = dl(dp(x), y)
        autograd.backward(losses)
        trainer.step(b)
        steps.append({k: p.data(ctx[0]).asnumpy()
                      for k, p in net._collect_params_with_prefix().items()})
    return net, dp, steps


def steps_both_modes(build, ctx, sizes):
    """run_steps of build() per replica and in graph mode."""
    return [run_steps(build(), ctx, sizes, graph=g)[2] for g in (False, True)]
