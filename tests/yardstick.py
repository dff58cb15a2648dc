"""Accuracy against the float64 truth in model-zoo networks.

The truth is the network with plain BatchNorm on one device, whole batch,
float64. A float32 run's error is its parameter change after one SGD step
compared with the truth's; the yardstick is float32 BatchNorm's own error,
measured in the same test.

ReLU makes the gradient of a network a discontinuous function of its
inputs: a pre-activation within float32 rounding of zero (the truth has
several of those in a ResNet-20 at batch 10, 32x32) sends its whole
gradient one way or the other depending on the last bit. Such a flip moves
upstream gradients by up to 1e-2 relative, and which float32 run flips is
luck: float32 BatchNorm flips on about half of random inputs (measured).
So every run here, the truth included, uses ReLU with its kink rounded over
|x| < TAU, (x + TAU)^2 / (4 TAU): the same function elsewhere, with a
gradient that moves by at most (float32 error) / (2 TAU) where rounding
moves x. What remains is the arithmetic of the layers under test.
"""
import contextlib

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

import gluon_parallel as gp

TAU = 1e-2
LR, MOMENTUM, WD = 0.1, 0.9, 1e-4


def _smooth_relu(F, x, tau=TAU):
    # 0.5 * (x + huber(x)): x above tau, 0 below -tau, a parabola between.
    return 0.5 * (x + F.smooth_l1(x, scalar=float(tau) ** -0.5) + 0.5 * tau)


@contextlib.contextmanager
def smooth_relu():
    """Within the block, ``F.Activation(x, act_type='relu')`` (what Gluon's
    and GluonCV's ResNets call, imperative and in graphs) is the rounded
    ReLU, and ``F.LeakyReLU(x, act_type='leaky', slope=a)`` (YOLOv3's
    heads, DarkNet) ``a x + (1 - a)`` times it."""
    saved = {}
    for F in (mx.nd, mx.sym):
        original = F.Activation
        saved[F, 'Activation'] = original

        def activation(data=None, act_type=None, _F=F, _orig=original, **kwargs):
            if act_type == 'relu':
                return _smooth_relu(_F, data)
            return _orig(data, act_type=act_type, **kwargs)
        F.Activation = activation
        leaky = saved[F, 'LeakyReLU'] = F.LeakyReLU

        def leaky_relu(data=None, act_type='leaky', slope=0.25, _F=F, _orig=leaky, **kwargs):
            if act_type == 'leaky':
                return slope * data + (1 - slope) * _smooth_relu(_F, data)
            return _orig(data, act_type=act_type, slope=slope, **kwargs)
        F.LeakyReLU = leaky_relu
    try:
        yield
    finally:
        for (F, name), original in saved.items():
            setattr(F, name, original)


def resnet20(norm_layer=None):
    """GluonCV's CIFAR ResNet-20 v1 (19 BatchNorm layers)."""
    from gluoncv.model_zoo import get_model
    kwargs = {} if norm_layer is None else {'norm_layer': norm_layer}
    return get_model('cifar_resnet20_v1', classes=10, **kwargs)


def resnet18(norm_layer=None):
    """Gluon's model-zoo ResNet-18 v1; converted when norm_layer is given."""
    net = gluon.model_zoo.vision.resnet18_v1(classes=10)
    return net if norm_layer is None else gp.nn.convert_sync_batchnorm(net)


NETWORKS = {'cifar_resnet20_v1': (resnet20, (3, 32, 32)),
            'resnet18_v1': (resnet18, (3, 32, 32))}


def data(name, batch, seed=5):
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(batch,) + NETWORKS[name][1])
    y = rng.randint(0, 10, size=batch)
    return x, y


def initial_values(name):
    """Structural name -> float64 value, drawn once per network."""
    build, shape = NETWORKS[name]
    mx.random.seed(0)
    net = build()
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    net(nd.zeros((1,) + shape))                    # deferred shapes
    nd.waitall()            # the read below must not race MKL-DNN (predict_race.py)
    values = {}
    rng = np.random.RandomState(1)
    for k, p in net._collect_params_with_prefix().items():
        v = p.data().asnumpy().astype('float64')
        if k.endswith(('gamma', 'beta', 'running_mean')):
            # Non-trivial BatchNorm parameters and statistics.
            v = v + rng.uniform(-0.3, 0.3, v.shape)
        values[k] = v
    return values


def one_step(name, values, x, y, ctx_list, sync=False, dtype='float32', hybridize=None):
    """One SGD step (lr 0.1, momentum 0.9, wd 1e-4, ``trainer.step(batch)``)
    of the network from `values`. Returns {structural name: parameter
    change} (running statistics: their new value), each as float64 numpy
    (for running statistics, every context's copy, stacked)."""
    build, shape = NETWORKS[name]
    net = build(gp.nn.SyncBatchNorm if sync else None)
    net.initialize(ctx=ctx_list)
    with ctx_list[0]:
        net(nd.zeros((1,) + shape, ctx=ctx_list[0]))
    net.cast(dtype)
    params = net._collect_params_with_prefix()
    for k, p in params.items():
        p.set_data(nd.array(values[k], dtype=p.dtype))
    if hybridize is not None:
        net.hybridize(**hybridize)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {
        'learning_rate': LR, 'momentum': MOMENTUM, 'wd': WD})
    loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    with smooth_relu(), gp.DataParallel(net, ctx_list) as dp:
        with autograd.record():
            losses = loss(dp(nd.array(x, dtype=dtype)), nd.array(y, dtype=dtype))
        autograd.backward(losses)
        trainer.step(x.shape[0])
    change = {}
    for k, p in params.items():
        now = np.stack([d.asnumpy().astype('float64') for d in p.list_data()])
        change[k] = now if k.endswith(('running_mean', 'running_var')) else now[0] - values[k]
    return change


def relative_errors(run, truth):
    """Per parameter: |run - truth| / |truth| (L2), the running statistics
    of every context against the truth's; NaN where the truth did not move
    (a parameter no loss reaches): callers compare the moved ones."""
    errors = {}
    for k, t in truth.items():
        with np.errstate(invalid='ignore', divide='ignore'):
            if k.endswith(('running_mean', 'running_var')):
                errors[k] = max(np.linalg.norm(r - t[0]) for r in run[k]) / np.linalg.norm(t[0])
            else:
                errors[k] = np.linalg.norm(run[k] - t) / np.linalg.norm(t)
    return errors


def worst(errors):
    """The largest error and its parameter, over the parameters that moved."""
    k = max((k for k, e in errors.items() if e == e), key=errors.get)
    return errors[k], k
