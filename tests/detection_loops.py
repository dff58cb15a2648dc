"""GluonCV's detection training loops (scripts/detection/yolo/train_yolo3.py,
scripts/detection/ssd/train_ssd.py: not in the pip package), reproduced on
tiny synthetic data: the scripts' per-device loops, the same steps through
one DataParallel call, and what the tests compare (losses, parameters,
every device's running statistics).

No weights are downloaded: the networks are built with
``pretrained_base=False`` and initialised from one parameter file that
both contenders load.
"""
import random

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd
from gluoncv.data.batchify import Pad, Stack, Tuple
from gluoncv.model_zoo import get_model

__all__ = ['yolo_net', 'yolo_batches', 'yolo_loop_step', 'yolo_dp_step', 'ssd_net', 'ssd_batches',
           'ssd_loop_step', 'ssd_dp_step', 'trainer', 'values', 'compare', 'init_file',
           'is_running', 'YoloRaw', 'one_step_change']


def _images(n, size, rng):
    """n synthetic images (HWC uint8) with 1-3 boxes each: [x0, y0, x1, y1, class]."""
    out = []
    for _ in range(n):
        img = nd.array(rng.randint(0, 256, (size, size, 3)), dtype='uint8')
        k = rng.randint(1, 4)
        x0 = rng.uniform(0, size * 0.6, (k, 2))
        wh = rng.uniform(size * 0.15, size * 0.4, (k, 2))
        box = np.concatenate([x0, np.minimum(x0 + wh, size - 1), rng.randint(0, 20, (k, 1))], 1)
        out.append((img, box.astype('float32')))
    return out


def init_file(net, path, shape, *extra):
    """Initialise `net` on the CPU (a predict-mode forward on `shape` finishes
    the deferred shapes), save its parameters to `path`."""
    mx.random.seed(0)
    # (a symbol block's BatchNorm parameters have no initializer of their own)
    net.collect_params('.*gamma|.*running_var|.*moving_var').setattr('init', mx.init.One())
    net.collect_params('.*beta|.*running_mean|.*moving_mean').setattr('init', mx.init.Zero())
    net.initialize(mx.init.Xavier(magnitude=2), ctx=mx.cpu())
    net(nd.zeros(shape), *extra)
    net.save_parameters(path)
    return path


# ---------------------------------------------------------------- YOLOv3

def yolo_net(name='yolo3_mobilenet0.25_voc', norm_layer=None, params=None, ctx=None):
    """GluonCV's YOLOv3 without pretrained weights; `params`: a file to load
    on `ctx`."""
    kwargs = {} if norm_layer is None else {'norm_layer': norm_layer}
    net = get_model(name, pretrained_base=False, **kwargs)
    if params is not None:
        net.load_parameters(params, ctx=ctx)
    return net


def yolo_batches(target_net, sizes, batch, seed=0):
    """One batch per input size, as the script's loader makes it:
    YOLO3DefaultTrainTransform (augmentation, then the targets from the
    network's anchors), batchified as (image, 5 fixed targets, gt boxes)."""
    from gluoncv.data.transforms.presets.yolo import YOLO3DefaultTrainTransform
    np.random.seed(seed)
    random.seed(seed)
    rng = np.random.RandomState(seed)
    batchify = Tuple(*([Stack() for _ in range(6)] + [Pad(axis=0, pad_val=-1)]))
    out = []
    for size in sizes:
        transform = YOLO3DefaultTrainTransform(size, size, target_net)
        out.append(batchify([transform(img, box) for img, box in _images(batch, size, rng)]))
    return out


def yolo_loop_step(net, ctx, batch, trainer):
    """train_yolo3.py's step: split_and_load, net(x, gt_boxes, *targets) per
    device under record, backward of the summed losses, step(batch size).
    Returns each device's four losses."""
    data = gluon.utils.split_and_load(batch[0], ctx_list=ctx, batch_axis=0)
    fixed = [gluon.utils.split_and_load(batch[i], ctx_list=ctx, batch_axis=0)
             for i in range(1, 6)]
    gt_boxes = gluon.utils.split_and_load(batch[6], ctx_list=ctx, batch_axis=0)
    losses, sums = [], []
    with autograd.record():
        for ix, x in enumerate(data):
            out = net(x, gt_boxes[ix], *[f[ix] for f in fixed])
            losses.append(out)
            sums.append(out[0] + out[1] + out[2] + out[3])
        autograd.backward(sums)
    trainer.step(batch[0].shape[0])
    return losses


def yolo_dp_step(dp, batch, trainer):
    """The same step as one DataParallel call (docs/detection.md)."""
    with autograd.record():
        outs = dp(batch[0], batch[6], *batch[1:6])
        autograd.backward([o[0] + o[1] + o[2] + o[3] for o in outs])
    trainer.step(batch[0].shape[0])
    return outs


# ------------------------------------------------------------------- SSD

def ssd_net(name='ssd_300_mobilenet0.25_voc', norm_layer=None, params=None, ctx=None):
    kwargs = {} if norm_layer is None else {'norm_layer': norm_layer}
    net = get_model(name, pretrained_base=False, **kwargs)
    if params is not None:
        net.load_parameters(params, ctx=ctx)
    return net


def ssd_batches(target_net, size, count, batch, seed=0):
    """`count` batches as train_ssd.py's loader makes them:
    SSDDefaultTrainTransform with the network's anchors (a training-mode
    forward of `target_net` on a fake image), batchified as (image, class
    targets, box targets)."""
    from gluoncv.data.transforms.presets.ssd import SSDDefaultTrainTransform
    np.random.seed(seed)
    random.seed(seed)
    rng = np.random.RandomState(seed)
    with autograd.train_mode():
        _, _, anchors = target_net(nd.zeros((1, 3, size, size)))
    transform = SSDDefaultTrainTransform(size, size, anchors)
    batchify = Tuple(Stack(), Stack(), Stack())
    return [batchify([transform(img, box) for img, box in _images(batch, size, rng)])
            for _ in range(count)]


def ssd_loop_step(net, ctx, batch, trainer, mbox_loss):
    """train_ssd.py's step: per device net(x) -> (cls, box, anchors) under
    record, one SSDMultiBoxLoss over every device's lists, backward,
    step(1). Returns (sum, cls, box) losses per device."""
    data = gluon.utils.split_and_load(batch[0], ctx_list=ctx, batch_axis=0)
    cls_t = gluon.utils.split_and_load(batch[1], ctx_list=ctx, batch_axis=0)
    box_t = gluon.utils.split_and_load(batch[2], ctx_list=ctx, batch_axis=0)
    with autograd.record():
        cls_preds, box_preds = [], []
        for x in data:
            c, b, _ = net(x)
            cls_preds.append(c)
            box_preds.append(b)
        sum_loss, cls_loss, box_loss = mbox_loss(cls_preds, box_preds, cls_t, box_t)
        autograd.backward(sum_loss)
    trainer.step(1)
    return list(zip(sum_loss, cls_loss, box_loss))


def ssd_dp_step(dp, ctx, batch, trainer, mbox_loss):
    """The same step with the predictions of one DataParallel call."""
    cls_t = gluon.utils.split_and_load(batch[1], ctx_list=ctx, batch_axis=0)
    box_t = gluon.utils.split_and_load(batch[2], ctx_list=ctx, batch_axis=0)
    with autograd.record():
        outs = dp(batch[0])
        sum_loss, cls_loss, box_loss = mbox_loss([o[0] for o in outs], [o[1] for o in outs],
                                                 cls_t, box_t)
        autograd.backward(sum_loss)
    trainer.step(1)
    return list(zip(sum_loss, cls_loss, box_loss))


# ---------------------------------------------------------------- common

def trainer(net, cls=gluon.Trainer):
    """The scripts' SGD (momentum 0.9, wd 5e-4; lr 1e-3), kvstore 'local'."""
    return cls(net.collect_params(), 'sgd', {'learning_rate': 0.001, 'wd': 5e-4,
                                             'momentum': 0.9}, kvstore='local')


def is_running(name):
    """A running statistic's name (Gluon's running_*, a symbol's moving_*)."""
    return 'running_' in name or 'moving_' in name


def values(net):
    """Structural name -> every device's copy (float64)."""
    return {k: [d.asnumpy().astype(np.float64) for d in p.list_data()]
            for k, p in net._collect_params_with_prefix().items()}


def compare(got, want):
    """(largest relative difference of the parameters, of the running
    statistics), over every device's copy, and the names compared."""
    worst = {'params': 0.0, 'running': 0.0}
    for k, copies in want.items():
        kind = 'running' if is_running(k) else 'params'
        for a, b in zip(got[k], copies):
            scale = max(np.abs(b).max(), 1e-30)
            worst[kind] = max(worst[kind], float(np.abs(a - b).max() / scale))
    return worst


# ------------------------------------------------------ exactness study

class YoloRaw(gluon.HybridBlock):
    """A YOLOv3's layers without its targets: the raw predictions
    (objectness, centers, scales, classes of every anchor, concatenated),
    as YOLOV3.hybrid_forward computes them in training, on the network's
    own children (shared parameters). A fixed weighting of them is a loss
    whose gradient does not depend on thresholds of the predictions."""

    def __init__(self, yolo, **kwargs):
        super().__init__(**kwargs)
        self.yolo = yolo

    def hybrid_forward(self, F, x):
        y = self.yolo
        routes, preds = [], []
        for stage in y.stages:
            x = stage(x)
            routes.append(x)
        for i, (block, output) in enumerate(zip(y.yolo_blocks, y.yolo_outputs)):
            x, tip = block(x)
            _, centers, scales, objness, cls, _, _ = output(tip)
            preds += [p.reshape((0, -1)) for p in (objness, centers, scales, cls)]
            if i >= len(routes) - 1:
                break
            x = y.transitions[i](x)
            up = F.UpSampling(x, scale=2, sample_type='nearest')
            route = routes[::-1][i + 1]
            x = F.concat(F.slice_like(up, route * 0, axes=(2, 3)), route, dim=1)
        return F.concat(*preds, dim=1)


def one_step_change(net, ctx, batch, loss, dtype='float32', graph='auto'):
    """One step of the scripts' SGD from the network's current values (on
    `ctx`, through DataParallel), `loss(outputs of a replica, its rows)` the
    replica's loss. Returns {structural name: parameter change} (running
    statistics: their new values, every context's stacked), float64."""
    import gluon_parallel as gp
    before = {k: p.data(ctx[0]).asnumpy().astype(np.float64)
              for k, p in net._collect_params_with_prefix().items()}
    tr = trainer(net)
    with gp.DataParallel(net, ctx, graph=graph) as dp:
        with autograd.record():
            outs = dp(*[a.astype(dtype) for a in batch])
            losses = [loss(o, r) for r, o in enumerate(outs)]
        autograd.backward(losses)
        tr.step(batch[0].shape[0])
        path = dp.last_path
    change = {}
    for k, p in net._collect_params_with_prefix().items():
        now = np.stack([d.asnumpy().astype(np.float64) for d in p.list_data()])
        change[k] = now if is_running(k) else now[0] - before[k]
    return change, path
