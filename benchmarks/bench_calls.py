"""Python work per training step: how many Python function calls one full
step makes, by contender.

Counts, not times: they are the same on any machine, so they say what a
GPU user gains where no machine here can measure it. On fast devices the
step is bound by this work in the issuing thread, and graph mode's point is
to remove the part of it that grows with the devices and the layers.

One step = forward, loss, backward, ``trainer.step`` of the CIFAR ResNet-20
of bench_train.py (hybridized, static_alloc/static_shape) on a global batch
of 32, split over N CPU contexts; counted with ``sys.setprofile`` over
--steps steps after warm-up, apart for the forward+loss+backward and for
the update (``trainer.step``: gluon.Trainer for every Gluon contender but
fused+BN-h), and the whole step, their sum; ``nd.waitall()`` is outside
the count.
Contenders:

  seq+BN-h         split_and_load + [loss(net(x), y) for ...] in the caller
  ours+BN-h        DataParallel(graph=False): one CachedOp call per replica
  graph+BN-h       DataParallel(graph=True): one executor graph per step
  ours+SyncBN-h    SyncBatchNorm per replica: the staged path (one CachedOp
                   per stage per replica, a barrier per layer)
  graph+SyncBN-h   SyncBatchNorm in graph mode (merge inside the graph)
  fused+BN-h       graph mode + gluon_parallel.Trainer (batched reduction,
                   multi-tensor update)
  module+BN        MXNet's Module API (forward_backward + update)

Targets (issue 30): the whole step of fused+BN-h at N = 4 <= 0.25 x
module+BN's, and <= 25 more calls per extra device from the first to the
last N.

The process runs with MXNET_MKLDNN_ENABLED=0 (set before MXNet is
imported, unless given): graph mode's SyncBatchNorm needs it on CPU
contexts, and the count does not depend on it.
"""
import argparse
import os
import sys

os.environ.setdefault('MXNET_MKLDNN_ENABLED', '0')
from harness.tables import Targets, table

CONTENDERS = ('seq+BN-h', 'ours+BN-h', 'graph+BN-h', 'ours+SyncBN-h', 'graph+SyncBN-h',
              'fused+BN-h', 'module+BN')
BATCH = 32


class Counter:
    """sys.setprofile hook: Python function calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, frame, event, arg):
        if event == 'call':
            self.calls += 1


def make_step(name, n):
    """The contender's training step on `n` contexts, in two parts: the
    forward, loss and backward, then the update."""
    import mxnet as mx
    from mxnet import autograd, gluon, nd
    import gluon_parallel as gp
    from bench_train import resnet20
    ctx = [mx.cpu(i) for i in range(n)]
    sync = 'SyncBN' in name
    mx.random.seed(0)
    net = resnet20(gp.nn.SyncBatchNorm if sync else gluon.nn.BatchNorm, {})
    net.initialize(mx.init.Xavier(magnitude=2), ctx=ctx)
    x = nd.random.uniform(shape=(BATCH, 3, 32, 32), ctx=mx.cpu(0))
    y = nd.random.randint(0, 10, shape=(BATCH,), ctx=mx.cpu(0)).astype('float32')
    if name == 'module+BN':
        return _module_parts(mx, net, ctx, x, y)
    net.hybridize(static_alloc=True, static_shape=True)
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    trainer_cls = gp.Trainer if name.startswith('fused') else gluon.Trainer
    trainer = trainer_cls(net.collect_params(), 'sgd',
                          {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4})
    if name.startswith('seq'):
        def forward():
            xs = gluon.utils.split_and_load(x, ctx, even_split=False)
            ys = gluon.utils.split_and_load(y, ctx, even_split=False)
            return [loss(net(a), b) for a, b in zip(xs, ys)]
    else:
        dp = gp.DataParallel(net, ctx, graph=name.startswith(('graph', 'fused')))
        dpl = gp.DataParallelLoss(loss)

        def forward():
            return dpl(dp(x), y)

    def forward_backward():
        with autograd.record():
            losses = forward()
        autograd.backward(losses)
    return forward_backward, lambda: trainer.step(BATCH)


def _module_parts(mx, net, ctx, x, y):
    """bench_train's Module step, split where Module splits it."""
    from bench_train import _module_step
    step = _module_step(mx, net, ctx, x, y, BATCH)
    mod, data = step.module, step.data
    return (lambda: mod.forward_backward(data)), mod.update


def count(name, n, steps):
    """Python calls per step: (forward+backward, update)."""
    from mxnet import nd
    parts = make_step(name, n)
    for _ in range(3):
        for part in parts:
            part()
        nd.waitall()
    counters = [Counter() for _ in parts]
    for _ in range(steps):
        for part, counter in zip(parts, counters):
            sys.setprofile(counter)
            try:
                part()
            finally:
                sys.setprofile(None)
        nd.waitall()
    return tuple(c.calls / steps for c in counters)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--ns', default='1,2,4', help='numbers of CPU contexts (default %(default)s)')
    p.add_argument('--steps', type=int, default=3, help='counted steps (default %(default)s)')
    p.add_argument('--contenders', default=','.join(CONTENDERS),
                   help='comma-separated subset of {}'.format(', '.join(CONTENDERS)))
    p.add_argument('--quick', action='store_true', help='smoke run: N = 1, 2, one step')
    args = p.parse_args(argv)
    if args.quick:
        args.ns, args.steps = '1,2', 1
    ns = [int(n) for n in args.ns.split(',')]
    names = args.contenders.split(',')
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        p.error('unknown contenders: {}'.format(', '.join(unknown)))
    print(f'bench_calls: ResNet-20, global batch {BATCH}, Python calls per full training step '
          f'(MXNET_MKLDNN_ENABLED={os.environ["MXNET_MKLDNN_ENABLED"]})')
    counts = {}
    for n in ns:
        for name in names:
            counts[(name, n)] = count(name, n, args.steps)
            fb, up = counts[(name, n)]
            print(f'  N={n} {name:15s} {fb:7.0f} calls in forward+backward, {up:7.0f} in the '
                  'update', flush=True)
    for key in counts:
        counts[key] += (sum(counts[key]),)
    for part, title in enumerate(('forward + loss + backward', 'update (trainer.step)',
                                  'whole step')):
        rows = []
        for name in names:
            row = [name] + [f'{counts[(name, n)][part]:.0f}' for n in ns]
            if len(ns) > 1:
                row.append(f'{per_device(counts, name, ns, part):.0f}')
            rows.append(row)
        header = ['contender'] + [f'N={n}' for n in ns]
        if len(ns) > 1:
            header.append('per extra device')
        print()
        print(f'Python calls per step, {title}:')
        print(table(header, rows))
    targets = Targets()
    if ('fused+BN-h', 4) in counts and ('module+BN', 4) in counts:
        targets.check('fused+BN-h / module+BN, whole step, N=4',
                      counts[('fused+BN-h', 4)][2] / counts[('module+BN', 4)][2], 0.25)
    else:
        targets.note('fused+BN-h / module+BN, whole step, N=4', 'SKIP', 'not run')
    if 'fused+BN-h' in names and len(ns) > 1:
        targets.check(f'fused+BN-h calls per extra device, N={ns[0]}..{ns[-1]}',
                      per_device(counts, 'fused+BN-h', ns, 2), 25)
    print()
    print(targets.render())
    return 0


def per_device(counts, name, ns, part):
    """Calls added per extra device from the first to the last N."""
    lo, hi = ns[0], ns[-1]
    return (counts[(name, hi)][part] - counts[(name, lo)][part]) / (hi - lo)


if __name__ == '__main__':
    sys.exit(main())
