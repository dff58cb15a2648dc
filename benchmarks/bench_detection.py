"""GluonCV's detection training (issue 41) through DataParallel against the
scripts' per-device loops: YOLOv3 (train_yolo3.py: a new input size every
step, 128 -> 160 -> 192, twice) and SSD (train_ssd.py: 300x300), batch 8 on
4 CPU contexts, tiny synthetic data (tests/detection_loops.py).

Each contender runs in its own process (its peak RSS is its own):

  loop            the script's loop on the 4 contexts, BatchNorm
  graph, replicas one DataParallel call per step (graph mode; graph=False),
                  BatchNorm
  loop-1          the script's loop on one context, whole batch, BatchNorm:
                  what SyncBatchNorm computes, in float32 BatchNorm's
                  arithmetic
  sync-graph, sync-staged
                  SyncBatchNorm (YOLOv3: norm_layer=SyncBatchNorm; SSD:
                  convert_sync_batchnorm, which reaches the extra layers
                  the base's symbol holds), graph mode and graph=False

Prints per model and contender, against the reference (loop for
BatchNorm, loop-1 for SyncBatchNorm): the relative difference of the first
step's loss and the median and largest relative difference (L2) of the
parameters after it (running statistics apart), the same over all steps,
ms per step over the second half of the steps (every executor bound by
then), and peak RSS.
Timings are noisy when other work shares the machine.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'tests'))

CONTENDERS = ['loop', 'graph', 'replicas', 'loop-1', 'sync-graph', 'sync-staged']
MODELS = ['yolo3_mobilenet0.25_voc', 'ssd_300_mobilenet0.25_voc']


def sizes_of(model):
    """YOLOv3: a new size every step (128, 160, 192, twice); SSD: 300, 4 steps."""
    return [128, 160, 192] * 2 if model.startswith('yolo') else [300] * 4


def worker(model, contender, out):
    import resource
    import mxnet as mx
    from mxnet import nd
    from gluoncv.loss import SSDMultiBoxLoss
    import gluon_parallel as gp
    import detection_loops as dl
    sizes, yolo = sizes_of(model), model.startswith('yolo')
    ctx = [mx.cpu(i) for i in range(4)]
    build = dl.yolo_net if yolo else dl.ssd_net
    target = build(model)
    path = dl.init_file(target, out + '.init.params', (1, 3, sizes[0], sizes[0]))
    batches = dl.yolo_batches(target, sizes, 8) if yolo else \
        dl.ssd_batches(target, sizes[0], len(sizes), 8)
    one = contender == 'loop-1'
    here = ctx[:1] if one else ctx
    sync = contender.startswith('sync')
    if sync and yolo:
        net = build(model, norm_layer=gp.nn.SyncBatchNorm, params=path, ctx=here)
    else:
        net = build(model, params=path, ctx=here)
        if sync:
            gp.nn.convert_sync_batchnorm(net)
    net.hybridize()
    trainer = dl.trainer(net)
    dp = None if contender.startswith('loop') else gp.DataParallel(
        net, here, graph=False if contender in ('replicas', 'sync-staged') else 'auto')
    losses, times = [], []
    for b in batches:
        t = time.perf_counter()
        if yolo:
            out_ = dl.yolo_loop_step(net, here, b, trainer) if dp is None else \
                dl.yolo_dp_step(dp, b, trainer)
            loss = [sum(float(v.sum().asscalar()) for v in o) for o in out_]
        else:
            out_ = dl.ssd_loop_step(net, here, b, trainer, SSDMultiBoxLoss()) if dp is None \
                else dl.ssd_dp_step(dp, here, b, trainer, SSDMultiBoxLoss())
            loss = [float(o[0].sum().asscalar()) for o in out_]
        nd.waitall()
        times.append(time.perf_counter() - t)
        losses.append(sum(loss))
        if len(losses) == 1:
            np.savez(out + '.1.npz', **{k: v[0] for k, v in dl.values(net).items()})
    np.savez(out + '.npz', **{k: v[0] for k, v in dl.values(net).items()})
    half = times[len(times) // 2:]
    with open(out + '.json', 'w') as f:
        json.dump({'losses': losses, 'ms': 1000 * float(np.median(half)),
                   'path': dp.last_path if dp is not None else 'loop',
                   'peak_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--worker', nargs=3, help=argparse.SUPPRESS)
    parser.add_argument('--out', default='/tmp/bench_detection')
    parser.add_argument('--models', nargs='+', default=MODELS,
                        help='model-zoo names (yolo3_*, ssd_*); default: %(default)s')
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    os.makedirs(args.out, exist_ok=True)
    print(f'{"model":26} {"contender":12} {"path":9} {"loss@1":>9} {"params@1 med/max":>17} '
          f'{"losses":>9} {"params med/max":>17} {"ms/step":>8} {"peak MiB":>9}')
    for model in args.models:
        results = {}
        for name in CONTENDERS:
            out = os.path.join(args.out, f'{model}-{name}')
            proc = subprocess.run([sys.executable, __file__, '--worker', model, name, out],
                                  capture_output=True, text=True)
            if proc.returncode:
                print(f'{model:26} {name:12} failed: {proc.stderr.strip().splitlines()[-1]}')
                continue
            with open(out + '.json') as f:
                results[name] = dict(json.load(f), values=dict(np.load(out + '.npz')),
                                     first=dict(np.load(out + '.1.npz')))
        for name, r in results.items():
            ref = results.get('loop-1' if name.startswith('sync') or name == 'loop-1'
                              else 'loop')
            diffs = [abs(a - b) / abs(b) for a, b in zip(r['losses'], ref['losses'])]
            print(f'{model:26} {name:12} {r["path"]:9} {diffs[0]:9.1e} '
                  f'{_params(r["first"], ref["first"]):>17} {max(diffs):9.1e} '
                  f'{_params(r["values"], ref["values"]):>17} {r["ms"]:8.0f} '
                  f'{r["peak_mib"]:9.0f}', flush=True)


def _params(got, want):
    """'median/max' over the parameters (running statistics apart) of
    |got - want| / |want| (L2)."""
    errs = [np.linalg.norm(got[k] - w) / max(np.linalg.norm(w), 1e-30)
            for k, w in want.items() if 'running_' not in k and 'moving_' not in k]
    return f'{np.median(errs):.1e}/{max(errs):.1e}'


if __name__ == '__main__':
    main()
