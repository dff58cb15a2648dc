"""GluonCV's Faster R-CNN and Mask R-CNN training loops (scripts/detection/
faster_rcnn/train_faster_rcnn.py, mask_rcnn/train_mask_rcnn.py: not in the
pip package) on a tiny network and tiny synthetic images (Mask R-CNN's
masks: the boxes filled), with GluonCV's own ForwardBackwardTask: one image per
device, each of its own size, put to a ``Parallel``, the results got, the
trainer stepped. Run with any module providing ``Parallel``
(``gluoncv.utils.parallel`` or ``gluon_parallel.gluoncv``).

What is deterministic: the RPN's targets are made once, in the data
transform (numpy's generator, seeded), and handed to both contenders; the
RPN itself draws nothing. The R-CNN's sampler (inside the network) shuffles
its candidates with MXNet's generator, which CPU contexts share, and which
candidates it keeps depends on the draws. In the serial start (the first
round, run in the caller in put order by both contenders) the draws come
in the same order after the same seed: everything compares. In a threaded
round the devices' tasks draw in whatever order the threads run: the RPN's
losses and the gradients of the RPN's own layers (the R-CNN's losses reach
them through no path: the proposals are cut from the graph) compare, the
rest only when the draws happened to come in put order.
"""
import time

import numpy as np
import mxnet as mx
from mxnet import gluon, nd
from gluoncv.data.batchify import FasterRCNNTrainBatchify, MaskRCNNTrainBatchify
from gluoncv.data.transforms.presets.rcnn import FasterRCNNDefaultTrainTransform
from gluoncv.model_zoo.rcnn.faster_rcnn import FasterRCNN
from gluoncv.model_zoo.rcnn.faster_rcnn import data_parallel as faster_task
from gluoncv.model_zoo.rcnn.mask_rcnn import MaskRCNN
from gluoncv.model_zoo.rcnn.mask_rcnn import data_parallel as mask_task

__all__ = ['rcnn_net', 'rcnn_inputs', 'rcnn_train', 'SIZES', 'NUM_BOXES']

#: (height, width) of the images, one size per device.
SIZES = [(64, 64), (64, 96)]
NUM_BOXES = 2
POST_NMS = 16
ASHAPE = 16


def _features():
    """A stride-16 feature extractor: four stride-2 convolutions."""
    net = gluon.nn.HybridSequential()
    for channels in (8, 8, 16, 16):
        net.add(gluon.nn.Conv2D(channels, 3, strides=2, padding=1, activation='relu'))
    return net


def rcnn_net(params=None, ctx=None, mask=False):
    """GluonCV's FasterRCNN (MaskRCNN if `mask`) on a tiny base (no
    pretrained weights), sized for 64-pixel images. `params`: a file to
    load on `ctx`; without it, the network initialised on the CPU."""
    top = gluon.nn.HybridSequential()
    top.add(gluon.nn.Conv2D(16, 1, activation='relu'))
    make, extra = (MaskRCNN, {'mask_channels': 8, 'rcnn_max_dets': POST_NMS,
                                       'target_roi_scale': 2}) if mask \
        else (FasterRCNN, {})
    net = make(
        _features(), top, classes=('a', 'b'), short=64, max_size=96, roi_size=(4, 4),
        rpn_channel=16, scales=(2, 4), ratios=(1,), alloc_size=(ASHAPE, ASHAPE),
        rpn_train_pre_nms=32, rpn_train_post_nms=POST_NMS, rpn_test_pre_nms=32,
        rpn_test_post_nms=POST_NMS, rpn_min_size=4,
        num_sample=POST_NMS + NUM_BOXES, pos_ratio=0.25, max_num_gt=NUM_BOXES, **extra)
    if params is None:
        mx.random.seed(0)
        net.initialize(mx.init.Xavier(magnitude=2), ctx=mx.cpu())
        net(nd.zeros((1, 3) + SIZES[0]))       # (predict mode) the deferred shapes
    else:
        net.load_parameters(params, ctx=ctx)
    return net


def rcnn_inputs(net, steps, seed=0, mask=False):
    """Per step, per device: (image, label, [masks,] RPN cls/box targets,
    box masks), as the script's transform and batchify make them (one image
    a device). Mask R-CNN's transform needs pycocotools for its polygons:
    Faster R-CNN's makes the rest, and each object's mask is its box."""
    transform = FasterRCNNDefaultTrainTransform(64, 96, net, flip_p=0, ashape=ASHAPE)
    batchify = (MaskRCNNTrainBatchify if mask else FasterRCNNTrainBatchify)(net, len(SIZES))
    rng = np.random.RandomState(seed)
    np.random.seed(seed)        # the RPN's target sampler draws from numpy
    out = []
    for _ in range(steps):
        samples = []
        for h, w in SIZES:
            img = nd.array(rng.randint(0, 256, (h, w, 3)), dtype='uint8')
            x0 = rng.uniform(0, 0.5, (NUM_BOXES, 2)) * (w, h)
            wh = rng.uniform(0.25, 0.5, (NUM_BOXES, 2)) * (w, h)
            label = np.concatenate([x0, np.minimum(x0 + wh, (w - 1, h - 1)),
                                    rng.randint(0, 2, (NUM_BOXES, 1))], 1).astype('float32')
            sample = transform(img, label)
            if mask:
                sample += (_box_masks(label, h, w),)
            samples.append(sample)
        batch = batchify(samples)
        out.append([tuple(part[i] for part in batch) for i in range(len(SIZES))])
    return out


def _box_masks(label, h, w):
    masks = np.zeros((len(label), h, w), 'float32')
    for m, (x0, y0, x1, y1) in zip(masks, label[:, :4].round().astype(int)):
        m[y0:y1 + 1, x0:x1 + 1] = 1
    return nd.array(masks)


def _task(net, trainer, mask):
    """GluonCV's ForwardBackwardTask, with the losses its script gives it."""
    losses = [gluon.loss.SigmoidBinaryCrossEntropyLoss(from_sigmoid=False),
              gluon.loss.HuberLoss(rho=1 / 9.), gluon.loss.SoftmaxCrossEntropyLoss(),
              gluon.loss.HuberLoss()]
    if mask:
        return mask_task.ForwardBackwardTask(
            net, trainer, *losses, gluon.loss.SigmoidBinaryCrossEntropyLoss(from_sigmoid=False),
            amp_enabled=False)
    return faster_task.ForwardBackwardTask(net, trainer, *losses, mix_ratio=1.0,
                                           amp_enabled=False)


def rcnn_train(parallel_module, params, inputs, ctx, serial_init=True, seed=0, mask=False,
               times=None):
    """The script's loop with ``parallel_module.Parallel``: per step, the
    metrics each device's task returned, the gradients summed over devices
    (before the step), and the weights at the end. `times`: a list to
    append each step's seconds to (then no gradients are kept)."""
    net = rcnn_net(params, ctx, mask)
    if mask:        # (Faster R-CNN's task does it itself)
        net.target_generator.collect_params().reset_ctx(ctx)
    net.hybridize()
    trainer = gluon.Trainer(net.collect_train_params(), 'sgd',
                            {'learning_rate': 0.01, 'wd': 1e-4, 'momentum': 0.9})
    task = _task(net, trainer, mask)
    executor = parallel_module.Parallel(len(ctx), task, serial_init)
    mx.random.seed(seed)
    structural = net._collect_params_with_prefix()
    metrics, grads = [], []
    for per_device in inputs:
        start = time.perf_counter()
        for c, data in zip(ctx, per_device):
            executor.put(tuple(a.as_in_context(c) for a in data))
        results = [executor.get() for _ in ctx]
        # completion order: by device
        by_ctx = {r[0].context: [m.asscalar() for m in r[:5 if mask else 4]] for r in results}
        metrics.append([by_ctx[c] for c in ctx])
        if times is None:
            grads.append({k: sum(g.asnumpy().astype(np.float64) for g in p.list_grad())
                          for k, p in structural.items() if p.grad_req != 'null'})
        trainer.step(len(ctx))
        if times is not None:
            nd.waitall()
            times.append(time.perf_counter() - start)
    executor.__del__()
    weights = {k: p.data(ctx[0]).asnumpy() for k, p in structural.items()}
    return metrics, grads, weights
