"""Peak memory and step time when the input size changes every step, as in
detection training (GluonCV's YOLOv3 recipe draws one of 10 sizes every
few batches; every epoch ends with a short batch).

A darknet-style CNN (9 conv-BN-LeakyReLU layers, global pooling, a dense
classifier), 4 CPU contexts, global batch 8, 10 input sizes (64..208), a
new size every step (each size once in every 10 steps, in a shuffled
order). Contenders, each in its own process (its peak RSS is its own),
timed in interleaved rounds:

  ours          DataParallel (graph mode, cache_size=10: every size's
                executor kept, as BucketingModule keeps every bucket) +
                DataParallelLoss + gp.Trainer, on the schedule
  ours-cache8   the same with the default cache_size=8 (two sizes more
                than it keeps: the least used are bound again)
  ours-largest  ours, the largest size only (the reference peak)
  ours-short    ours, the largest size and every 5th batch short (5)
  loop          the idiomatic per-device Gluon loop (split_and_load, one
                forward per device, gluon.Trainer), on the schedule
  bucketing     MXNet's BucketingModule, the largest bucket bound first
                (``default_bucket_key``), on the schedule

Targets (issue 38): peak(ours) <= 1.15 x peak(ours-largest) and <= 0.90 x
peak(loop); ms/step(ours) <= 1.05 x bucketing's and <= 0.60 x loop's;
peak(ours-short) <= 1.05 x peak(ours-largest).
"""
import argparse
import os
import random
import sys

from harness.machine import load_avg, load_str
from harness.options import add_common_args
from harness.tables import Targets, finish, fmt_ratio, mib, table
from harness.timing import TimedContender, interleave, median, setup_all, time_iters
from harness.workers import Worker, close_workers, worker_main

CONTENDERS = ('ours', 'ours-cache8', 'ours-largest', 'ours-short', 'loop', 'bucketing')
SIZES = tuple(range(64, 209, 16))
CLASSES = 10
SGD = {'learning_rate': 0.01, 'momentum': 0.9, 'wd': 1e-4}


def schedule(name, sizes, batch, seed=0):
    """The (batch, size) of every step, endlessly."""
    rng = random.Random(seed)
    step = 0
    while True:
        if name == 'ours-largest':
            yield batch, max(sizes)
        elif name == 'ours-short':
            yield (5 if step % 5 == 4 else batch), max(sizes)
        else:
            if step % len(sizes) == 0:
                order = list(sizes)
                rng.shuffle(order)
            yield batch, order[step % len(sizes)]
        step += 1


def darknet(gluon):
    """9 conv-BN-LeakyReLU layers (three of them stride 2), pooling, dense."""
    net = gluon.nn.HybridSequential()
    for i, c in enumerate((16, 32, 32, 64, 64, 64, 128, 128, 128)):
        net.add(gluon.nn.Conv2D(c, 3, padding=1, strides=2 if i in (1, 3, 6) else 1,
                                use_bias=False),
                gluon.nn.BatchNorm(), gluon.nn.LeakyReLU(0.1))
    net.add(gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(CLASSES))
    return net


class Contender(TimedContender):
    def __init__(self, name, options):
        import mxnet as mx
        self.mx = mx
        self.name = name

    def setup(self, config):
        mx = self.mx
        from mxnet import gluon, nd
        ctx = [mx.cpu(i) for i in range(config['n'])]
        mx.random.seed(0)
        net = darknet(gluon)
        net.initialize(mx.init.Xavier(), ctx=ctx)
        net.hybridize()
        steps = schedule(self.name, SIZES, config['batch'])
        rng = nd.random.uniform

        def batch_of():
            b, s = next(steps)
            x = rng(shape=(b, 3, s, s))
            y = nd.array([i % CLASSES for i in range(b)])
            return b, x, y
        make = {'bucketing': self._bucketing, 'loop': self._loop}.get(self.name, self._ours)
        self.step = make(net, ctx, batch_of)
        time_iters(self.step, config.get('warmup', 2), nd.waitall)
        return {}

    def _ours(self, net, ctx, batch_of):
        from mxnet import autograd, gluon
        import gluon_parallel as gp
        cache = {} if self.name == 'ours-cache8' else {'cache_size': len(SIZES)}
        dp = gp.DataParallel(net, ctx, graph=True, **cache)
        dpl = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
        trainer = gp.Trainer(net.collect_params(), 'sgd', SGD, kvstore='device')

        def step():
            b, x, y = batch_of()
            with autograd.record():
                losses = dpl(dp(x), y)
            autograd.backward(losses)
            trainer.step(b)
        return step

    def _loop(self, net, ctx, batch_of):
        from mxnet import autograd, gluon
        loss = gluon.loss.SoftmaxCrossEntropyLoss()
        trainer = gluon.Trainer(net.collect_params(), 'sgd', SGD, kvstore='device')
        split = gluon.utils.split_and_load

        def step():
            b, x, y = batch_of()
            xs, ys = split(x, ctx, even_split=False), split(y, ctx, even_split=False)
            with autograd.record():
                losses = [loss(net(a), t) for a, t in zip(xs, ys)]
            autograd.backward(losses)
            trainer.step(b)
        return step

    def _bucketing(self, net, ctx, batch_of):
        """BucketingModule: one bucket per input size, the largest bound
        first so that the others share its memory."""
        mx = self.mx
        net(mx.nd.zeros((2, 3, min(SIZES), min(SIZES)), ctx=ctx[0]))     # (shapes known)
        params = {p.name: p.data(ctx[0]) for p in net.collect_params().values()}

        def sym_gen(size):
            sym = mx.sym.SoftmaxOutput(net(mx.sym.var('data')), mx.sym.var('softmax_label'),
                                       name='softmax')
            return sym, ('data',), ('softmax_label',)
        largest = max(SIZES)
        mod = mx.mod.BucketingModule(sym_gen, default_bucket_key=largest, context=ctx)
        mod.bind(data_shapes=[('data', (8, 3, largest, largest))],
                 label_shapes=[('softmax_label', (8,))])
        aux = set(sym_gen(largest)[0].list_auxiliary_states())
        mod.init_params(arg_params={k: v for k, v in params.items() if k not in aux},
                        aux_params={k: v for k, v in params.items() if k in aux},
                        allow_missing=True)
        opt = dict(SGD, rescale_grad=1.0 / 8)
        mod.init_optimizer(kvstore='device', optimizer='sgd', optimizer_params=opt)

        def step():
            b, x, y = batch_of()
            s = x.shape[2]
            data = mx.io.DataBatch([x], [y], bucket_key=s,
                                   provide_data=[mx.io.DataDesc('data', x.shape)],
                                   provide_label=[mx.io.DataDesc('softmax_label', y.shape)])
            mod.forward_backward(data)
            mod.update()
        return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--n', type=int, default=4, help='CPU contexts (default %(default)s)')
    p.add_argument('--batch', type=int, default=8, help='global batch (default %(default)s)')
    p.add_argument('--rounds', type=int, default=6,
                   help='interleaved rounds (default %(default)s)')
    p.add_argument('--iters', type=int, default=10, help='steps per round (default %(default)s)')
    add_common_args(p, CONTENDERS, 600, 'smoke run: 2 rounds of 10 steps')
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(Contender)
    if args.quick:
        args.rounds = 2
    names = args.contenders.split(',')
    load_before = load_avg()
    print(f'bench_shapes: darknet-style CNN, global batch {args.batch}, {args.n} CPU contexts, '
          f'sizes {SIZES[0]}..{SIZES[-1]} ({len(SIZES)}), a new size every step; '
          f'{args.rounds} rounds x {args.iters} steps; {load_str(load_before)}')
    workers = [Worker(os.path.abspath(__file__), name) for name in names]
    status = setup_all(workers, {'n': args.n, 'batch': args.batch, 'warmup': 2}, args.timeout)
    for name, why in status.items():
        print(f'  {name}: {why}')
    live = [w for w in workers if not w.dead and w.name not in status]
    times = interleave(live, args.rounds, args.iters, args.timeout)
    rss = close_workers(workers, status)
    ms = {k: median(times[k]) * 1e3 if times.get(k) else None for k in names}

    def ratio(a, b, of):
        return of[a] / of[b] if of.get(a) and of.get(b) else None
    rows = [[k, '-' if ms[k] is None else f'{ms[k]:.0f}', mib(rss.get(k)),
             fmt_ratio(ratio(k, 'ours-largest', rss)), fmt_ratio(ratio(k, 'loop', ms)),
             fmt_ratio(ratio(k, 'bucketing', ms))] for k in names]
    tbl = table(['contender', 'ms/step', 'peak MiB', 'peak x ours-largest', 'time x loop',
                 'time x bucketing'], rows)
    targets = Targets()
    targets.check('peak: ours / ours-largest', ratio('ours', 'ours-largest', rss), 1.15)
    targets.check('peak: ours / loop', ratio('ours', 'loop', rss), 0.90)
    targets.check('peak: ours-short / ours-largest', ratio('ours-short', 'ours-largest', rss),
                  1.05)
    targets.check('time: ours / bucketing', ratio('ours', 'bucketing', ms), 1.05)
    targets.check('time: ours / loop', ratio('ours', 'loop', ms), 0.60)
    finish('shapes', args.json, tbl, targets, load_before, ms=ms, status=status, rss=rss)
    return 0


if __name__ == '__main__':
    sys.exit(main())
