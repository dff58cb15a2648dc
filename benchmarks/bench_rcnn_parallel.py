"""GluonCV's Faster R-CNN and Mask R-CNN training loops (issue 49) through
gluon_parallel.gluoncv.Parallel against GluonCV's own Parallel: the
scripts' ForwardBackwardTask, one image per device (64 x 64 and 64 x 96,
hybridized network, tiny base: tests/rcnn_loops.py), on 2 CPU contexts.

Each contender runs in its own process (its peak RSS is its own). Prints
per model and contender the median ms per step over the second half of the
steps, the peak RSS, the threads alive at the end, and ours / GluonCV's.
Timings are noisy when other work shares the machine: --repeat runs each
contender several times and keeps its fastest run.
"""
import argparse
import json
import os
import subprocess
import sys
import threading

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'tests'))

CONTENDERS = ['gluoncv', 'ours']
MODELS = ['faster', 'mask']


def worker(model, contender, steps, out):
    import resource
    import mxnet as mx
    import rcnn_loops
    if contender == 'ours':
        from gluon_parallel import gluoncv as module
    else:
        from gluoncv.utils import parallel as module
    mask = model == 'mask'
    ctx = [mx.cpu(0), mx.cpu(1)]
    net = rcnn_loops.rcnn_net(mask=mask)
    net.save_parameters(out + '.params')
    inputs = rcnn_loops.rcnn_inputs(net, int(steps), mask=mask)
    times = []
    rcnn_loops.rcnn_train(module, out + '.params', inputs, ctx, mask=mask, times=times)
    half = times[len(times) // 2:]
    with open(out + '.json', 'w') as f:
        json.dump({'ms': 1000 * float(np.median(half)), 'threads': threading.active_count(),
                   'peak_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--worker', nargs=4, help=argparse.SUPPRESS)
    parser.add_argument('--out', default='/tmp/bench_rcnn_parallel')
    parser.add_argument('--steps', type=int, default=40)
    parser.add_argument('--repeat', type=int, default=1)
    parser.add_argument('--models', nargs='+', default=MODELS, choices=MODELS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    os.makedirs(args.out, exist_ok=True)
    print(f'{"model":7} {"contender":9} {"ms/step":>8} {"peak MiB":>9} {"threads":>8} '
          f'{"ms vs gluoncv":>14}')
    for model in args.models:
        best = {}
        for _ in range(args.repeat):
            for name in CONTENDERS:
                out = os.path.join(args.out, f'{model}-{name}')
                proc = subprocess.run([sys.executable, __file__, '--worker', model, name,
                                       str(args.steps), out], capture_output=True, text=True)
                if proc.returncode:
                    print(f'{model:7} {name:9} failed: {proc.stderr.strip().splitlines()[-1]}')
                    continue
                with open(out + '.json') as f:
                    r = json.load(f)
                if name not in best or r['ms'] < best[name]['ms']:
                    best[name] = r
        for name, r in best.items():
            ratio = r['ms'] / best['gluoncv']['ms'] if 'gluoncv' in best else float('nan')
            print(f'{model:7} {name:9} {r["ms"]:8.1f} {r["peak_mib"]:9.0f} {r["threads"]:8d} '
                  f'{ratio:14.2f}', flush=True)


if __name__ == '__main__':
    main()
