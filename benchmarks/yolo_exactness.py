"""SyncBatchNorm's exactness on GluonCV's YOLOv3 (issue 41): one SGD step of
yolo3_mobilenet0.25_voc from the same values, every run's parameter changes
compared with the float64 truth (BatchNorm, one device, whole batch); the
yardstick is float32 BatchNorm's own error on one device. Two losses:

  fixed   a fixed random weighting of the raw predictions (the network's
          layers without its targets: tests/detection_loops.YoloRaw), so
          the gradient does not depend on thresholds of the predictions
  yolo    YOLOv3's own loss (its ignore mask taken from the predictions of
          each run: IoU > 0.7 with a box drops the anchor's objectness)

ReLU and LeakyReLU have their kinks rounded over |x| < 1e-2 in every run
(tests/yardstick.smooth_relu), so that which run's rounding flips a
pre-activation's sign does not decide the comparison.

Prints, per loss and run: the median and the largest relative error (L2 of
the parameter change's difference, over the truth's) over the parameters,
and the same as a multiple of the yardstick's.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'tests'))


def main():
    import mxnet as mx
    from mxnet import nd
    import gluon_parallel as gp
    import detection_loops as dl
    import yardstick
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--devices', type=int, default=4)
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--size', type=int, default=96)
    args = parser.parse_args()
    ctx = [mx.cpu(i) for i in range(args.devices)]
    name = 'yolo3_mobilenet0.25_voc'
    target_net = dl.yolo_net(name)
    path = dl.init_file(target_net, '/tmp/yolo_exactness.params', (1, 3, args.size, args.size))
    batch = dl.yolo_batches(target_net, [args.size], args.batch)[0]
    rng = np.random.RandomState(3)
    weights = None

    def fixed(out, rank):
        rows = out.shape[0]
        w = nd.array(weights[rank * rows:(rank + 1) * rows], ctx=out.context, dtype=out.dtype)
        return (out * w).sum()

    def yolo(out, rank):
        return out[0] + out[1] + out[2] + out[3]

    # fixed loss: every run against the float64 truth, the yardstick
    # float32 BatchNorm's own error.
    runs = {}
    for run, devices, sync, dtype, graph in RUNS_FIXED(args.devices):
        net = dl.YoloRaw(dl.yolo_net(name, norm_layer=gp.nn.SyncBatchNorm if sync else None,
                                     params=path, ctx=ctx[:devices]))
        net.cast(dtype)
        net.hybridize()
        with yardstick.smooth_relu():
            if weights is None:
                probe = dl.YoloRaw(dl.yolo_net(name, params=path, ctx=ctx[:1]))
                with mx.autograd.train_mode():      # (its raw outputs: training)
                    shape = probe(batch[0].as_in_context(ctx[0])).shape
                weights = rng.uniform(-1, 1, shape)
            runs[run], taken = dl.one_step_change(net, ctx[:devices], (batch[0],), fixed, dtype,
                                                  graph)
        print(f'fixed: {run} ({taken})', flush=True)
    truth = runs.pop('truth: float64 BN 1 device')
    table('fixed loss, against the float64 truth', runs, truth, 'float32 BN 1 device')

    # YOLOv3's loss (float32 only: its target generator's constants are
    # float32): every run against float32 BatchNorm on one device; the
    # yardstick that run with its input moved by one part in 1e6.
    runs = {}
    for run, devices, sync, graph, scale in RUNS_YOLO(args.devices):
        net = dl.yolo_net(name, norm_layer=gp.nn.SyncBatchNorm if sync else None, params=path,
                          ctx=ctx[:devices])
        net.hybridize()
        inputs = (batch[0] * scale, batch[6]) + tuple(batch[1:6])
        with yardstick.smooth_relu():
            runs[run], taken = dl.one_step_change(net, ctx[:devices], inputs, yolo, 'float32',
                                                  graph)
        print(f'yolo: {run} ({taken})', flush=True)
    ref = runs.pop('reference: float32 BN 1 device')
    table("YOLOv3's loss, against float32 BN on one device", runs, ref,
          'float32 BN 1 device, input x (1 + 1e-6)')


def RUNS_FIXED(n):
    return (('truth: float64 BN 1 device', 1, False, 'float64', 'auto'),
            ('float32 BN 1 device', 1, False, 'float32', 'auto'),
            (f'float32 SyncBN {n} devices, graph', n, True, 'float32', 'auto'),
            (f'float32 SyncBN {n} devices, staged', n, True, 'float32', False))


def RUNS_YOLO(n):
    return (('reference: float32 BN 1 device', 1, False, 'auto', 1.0),
            ('float32 BN 1 device, input x (1 + 1e-6)', 1, False, 'auto', 1 + 1e-6),
            (f'float32 SyncBN {n} devices, graph', n, True, 'auto', 1.0),
            (f'float32 SyncBN {n} devices, staged', n, True, False, 1.0))


def table(title, runs, truth, yard_run):
    """Per run: the median and largest relative error of the parameters'
    changes, as such and as multiples of the yardstick run's on the same
    parameter, and the largest of the running statistics (every device)."""
    import yardstick
    yard = yardstick.relative_errors(runs[yard_run], truth)
    # (parameters the step does not change, e.g. the anchors, have none)
    params = [k for k in truth if 'running_' not in k and np.linalg.norm(truth[k]) > 0]
    running = [k for k in truth if 'running_' in k]
    print(f'\n{title} (yardstick: {yard_run})')
    print(f'{"run":42} {"median err":>10} {"max err":>9} {"median x yard":>13} '
          f'{"max x yard":>10} {"running max err":>15}  worst x yard')
    for run, change in runs.items():
        err = yardstick.relative_errors(change, truth)
        ratio = {k: err[k] / yard[k] for k in params}
        worst = max(ratio, key=ratio.get)
        print(f'{run:42} {np.median([err[k] for k in params]):10.2e} '
              f'{max(err[k] for k in params):9.2e} {np.median(list(ratio.values())):13.2f} '
              f'{ratio[worst]:10.2f} {max(err[k] for k in running):15.2e}  {worst}', flush=True)


if __name__ == '__main__':
    main()
