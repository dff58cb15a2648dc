"""GluonCV's semantic-segmentation training loop (its
``scripts/segmentation/train.py``: the Trainer's set-up, ``training`` and
``validation``), written once against a module that provides
``DataParallelModel`` and ``DataParallelCriterion``: the same loop runs
with GluonCV's ``gluoncv.utils.parallel`` or with ``gluon_parallel.gluoncv``,
only the module switched, as a user switches the import line.

The network is GluonCV's FCN on a ResNet-50 backbone with its auxiliary
head (random weights: nothing is downloaded), on tiny 32x32 images.
"""
import warnings

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd
from gluoncv.loss import MixSoftmaxCrossEntropyLoss
from gluoncv.model_zoo import FCN
from gluoncv.model_zoo.segbase import SegEvalModel
from gluoncv.utils.metrics import SegmentationMetric

__all__ = ['NCLASS', 'initial_values', 'train_and_validate']

NCLASS, SIZE, PER_DEVICE = 4, 32, 2


def build(norm_layer=gluon.nn.BatchNorm, norm_kwargs=None):
    return FCN(NCLASS, backbone='resnet50', aux=True, pretrained_base=False, base_size=SIZE,
               crop_size=SIZE, norm_layer=norm_layer, norm_kwargs=norm_kwargs or {})


def initial_values(seed=0):
    """Structural name -> value of one random initialisation."""
    mx.random.seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', UserWarning)    # FCN initialises its heads itself
        net = build()
        net.initialize(mx.init.Xavier())
    net(nd.zeros((1, 3, SIZE, SIZE)))
    nd.waitall()
    rng = np.random.RandomState(seed)
    values = {}
    for k, p in net._collect_params_with_prefix().items():
        v = p.data().asnumpy()
        if k.endswith('running_mean'):
            v = v + rng.uniform(-0.1, 0.1, v.shape).astype(v.dtype)   # non-trivial statistics
        values[k] = v
    return values


def _batches(n_dev, steps, seed):
    rng = np.random.RandomState(seed)
    b = PER_DEVICE * n_dev
    for _ in range(steps):
        yield (nd.array(rng.normal(size=(b, 3, SIZE, SIZE))),
               nd.array(rng.randint(0, NCLASS, size=(b, SIZE, SIZE))))


def train_and_validate(parallel, values, ctx, norm_layer=gluon.nn.BatchNorm, norm_kwargs=None,
                       syncbn=False, steps=2):
    """Two training steps and one validation pass of GluonCV's loop, with
    `parallel` providing DataParallelModel/DataParallelCriterion.

    Returns
    -------
    dict
        'losses': per step, each device's loss; 'pixacc', 'miou'; 'weights':
        structural name -> every context's value after training.
    """
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', UserWarning)    # FCN initialises its heads itself
        model = build(norm_layer, norm_kwargs)
        model.initialize(ctx=ctx)
    with ctx[0]:
        model(nd.zeros((1, 3, SIZE, SIZE), ctx=ctx[0]))         # deferred shapes
    for k, p in model._collect_params_with_prefix().items():
        p.set_data(nd.array(values[k]))
    # As the script: the network, its evaluator and the criterion.
    net = parallel.DataParallelModel(model, ctx, syncbn)
    evaluator = parallel.DataParallelModel(SegEvalModel(model), ctx)
    criterion = parallel.DataParallelCriterion(MixSoftmaxCrossEntropyLoss(True, aux_weight=0.5),
                                               ctx, syncbn)
    for _, v in net.module.collect_params('.*beta|.*gamma|.*bias').items():
        v.wd_mult = 0.0
    trainer = gluon.Trainer(net.module.collect_params(), 'sgd',
                            {'learning_rate': 0.01, 'momentum': 0.9, 'wd': 1e-4},
                            kvstore=mx.kv.create('device'))
    metric = SegmentationMetric(NCLASS)
    batch_size = PER_DEVICE * len(ctx)
    mx.random.seed(3)               # the heads' Dropout: the same masks in every run
    result = {'losses': []}
    for data, target in _batches(len(ctx), steps, seed=1):                # training()
        with autograd.record(True):
            outputs = net(data)
            losses = criterion(outputs, target)
            mx.nd.waitall()
            autograd.backward(losses)
        trainer.step(batch_size)
        result['losses'].append([loss.asnumpy() for loss in losses])
    metric.reset()
    for data, target in _batches(len(ctx), 1, seed=2):                    # validation()
        outputs = evaluator(data)
        outputs = [x[0] for x in outputs]
        targets = gluon.utils.split_and_load(target, ctx, even_split=False)
        metric.update(targets, outputs)
    result['pixacc'], result['miou'] = metric.get()
    nd.waitall()
    result['weights'] = {k: [d.asnumpy() for d in p.list_data()]
                         for k, p in model._collect_params_with_prefix().items()}
    return result
