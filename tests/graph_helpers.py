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
        super().__init__()

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


class MixedBatchNorms(nn.HybridBlock):
    """Trained BatchNorm layers that graph mode cannot update as one vector:
    two settings of eps and momentum, and one layer used twice (its second
    use updates what the first left)."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.conv1 = nn.Conv2D(4, 3, padding=1, in_channels=2)
            self.bn_a = nn.BatchNorm(in_channels=4)
            self.conv2 = nn.Conv2D(4, 3, padding=1, in_channels=4)
            self.bn_b = nn.BatchNorm(in_channels=4, momentum=0.5, epsilon=1e-4)
            self.bn_c = nn.BatchNorm(in_channels=4, momentum=0.5, epsilon=1e-4)
            self.dense = nn.Dense(3, in_units=4 * 8 * 8)

    def hybrid_forward(self, F, x):
        x = F.relu(self.bn_a(self.conv1(x)))
        x = self.bn_c(F.relu(self.bn_b(self.conv2(x))))
        return self.dense(self.bn_a(x))


def mixed_bn_net(hybridize=True):
    mx.random.seed(0)
    net = MixedBatchNorms()
    net.initialize(mx.init.Xavier(), ctx=loops.CTX)
    if hybridize:
        net.hybridize()
    return net


def pooled_net(bn=nn.BatchNorm, seed=0):
    """Two conv-BN-relu layers, global pooling and a dense layer: any input
    size (conv_net's dense layer takes 8x8 inputs only), hybridized on
    every test context."""
    mx.random.seed(seed)
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, padding=1, in_channels=2), bn(in_channels=4), nn.Activation('relu'),
            nn.Conv2D(4, 3, strides=2, in_channels=4), bn(in_channels=4), nn.Activation('relu'),
            nn.GlobalAvgPool2D(), nn.Dense(3, in_units=4))
    net.initialize(mx.init.Xavier(), ctx=loops.CTX)
    net.hybridize()
    return net


def run_steps(net, ctx, sizes, graph='auto', dp=None, seed=7, every_ctx=False):
    """SGD steps of batches of `sizes` rows (an int: 8x8 images; a pair
    (rows, side): side x side images); returns (net, dp, steps): per step,
    {parameter name: context 0's value (`every_ctx`: every context's,
    stacked)} read right after the step."""
    if dp is None:
        dp = gp.DataParallel(net, ctx, graph=graph)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    dl = gp.DataParallelLoss(loops.LOSS)
    rng = np.random.RandomState(seed)
    steps = []
    for b in sizes:
        b, side = (b, 8) if isinstance(b, int) else b
        x = nd.array(rng.normal(size=(b, 2, side, side)))
        y = nd.array(rng.randint(0, 3, b))
        with autograd.record():
            losses = dl(dp(x), y)
        autograd.backward(losses)
        trainer.step(b)
        read = ctx if every_ctx else ctx[:1]
        steps.append({k: np.stack([p.data(c).asnumpy() for c in read])
                      for k, p in net._collect_params_with_prefix().items()})
    return net, dp, steps


def steps_both_modes(build, ctx, sizes):
    """run_steps of build() per replica and in graph mode (every context's
    values)."""
    return [run_steps(build(), ctx, sizes, graph=g, every_ctx=True)[2] for g in (False, True)]
