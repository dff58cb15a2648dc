"""Time of a whole training step where Python is the cost: a tiny MLP.

One step = split the global batch, forward, loss, backward, the update,
``nd.waitall()``, on a hybridized MLP (Dense 16 relu, Dense 4) over 4 CPU
contexts, global batch 32: the network is so small that what is measured
is each contender's Python and engine overhead per step. Contenders, each
in its own process, timed in interleaved rounds:

  gluon       the idiomatic Gluon loop: split_and_load, [loss(net(x), y)
              for ...], backward, gluon.Trainer(kvstore='device').step
  module      MXNet's Module API on the traced symbol: forward_backward +
              update (the same SGD settings, kvstore 'device'), the loss
              MXNet's fused SoftmaxOutput (one operator each way, no loss
              values: what Module users write)
  module-gl   the same Module with Gluon's SoftmaxCrossEntropyLoss traced
              under MakeLoss: the operators the Gluon contenders run (4
              forward, 5 backward per device), its per-sample values
              computed; the peer that differs from ours in the framework only
  ours-gluon  DataParallel (graph mode) + DataParallelLoss + gluon.Trainer
  ours        DataParallel (graph mode) + DataParallelLoss +
              gluon_parallel.Trainer (gradient buckets)
  ours-per-key  the same with bucket_cap_mb=0: Gluon's gradient arrays, one
              kvstore key per parameter (opt-in: --contenders)
  ours-unbulked  ours with MXNet's default bulk segments (15 nodes, set
              explicitly: graph mode then does not bulk per replica; opt-in)

Each contender's CPU time per step is printed too (medians over the
rounds): its whole process's, MXNet's engine threads included, and its
calling thread's (Python and the C calls it makes). Where the step has
more busy threads than the machine has cores, its time follows the first.

Targets (issue 30): ours <= 0.80 x module and <= 0.40 x gluon.
"""
import argparse
import os
import sys

from harness.machine import load_avg, load_str
from harness.options import add_common_args
from harness.tables import Targets, finish, fmt_ratio, table
from harness.timing import TimedContender, interleave, median, setup_all, time_iters
from harness.workers import Worker, close_workers, worker_main

CONTENDERS = ('gluon', 'module', 'module-gl', 'ours-gluon', 'ours')
OPTIONAL = ('ours-per-key', 'ours-unbulked')
FEATURES, HIDDEN, CLASSES = 8, 16, 4
SGD = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4}


class Contender(TimedContender):
    def __init__(self, name, options):
        import mxnet as mx
        self.mx = mx
        self.name = name
        self.warmup = options.get('warmup', 10)

    def setup(self, config):
        mx = self.mx
        from mxnet import autograd, gluon, nd
        n, batch = config['n'], config['batch']
        ctx = [mx.cpu(i) for i in range(n)]
        mx.random.seed(0)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(HIDDEN, activation='relu', in_units=FEATURES),
                gluon.nn.Dense(CLASSES, in_units=HIDDEN))
        net.initialize(mx.init.Xavier(), ctx=ctx)
        net.hybridize(static_alloc=True, static_shape=True)
        loss = gluon.loss.SoftmaxCrossEntropyLoss()
        x = nd.random.uniform(shape=(batch, FEATURES), ctx=mx.cpu(0))
        y = nd.array(range(batch), ctx=mx.cpu(0)) % CLASSES
        if self.name in ('module', 'module-gl'):
            from bench_train import _module_step      # the same SGD settings
            self.step = _module_step(mx, net, ctx, x, y, batch,
                                     loss if self.name == 'module-gl' else None)
        elif self.name == 'gluon':
            from bench_overhead import seq_forward_backward
            trainer = gluon.Trainer(net.collect_params(), 'sgd', SGD, kvstore='device')
            forward_backward = seq_forward_backward(net, loss, x, y, ctx)

            def step():
                forward_backward()
                trainer.step(batch)
            self.step = step
        else:
            import gluon_parallel as gp
            if self.name == 'ours-unbulked':
                os.environ['MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN'] = '15'
            if self.name == 'ours-gluon':
                trainer = gluon.Trainer(net.collect_params(), 'sgd', SGD, kvstore='device')
            else:
                trainer = gp.Trainer(net.collect_params(), 'sgd', SGD, kvstore='device',
                                     bucket_cap_mb=0 if self.name == 'ours-per-key' else 25)
            dp = gp.DataParallel(net, ctx, graph=True)
            dpl = gp.DataParallelLoss(loss)

            def step():
                with autograd.record():
                    losses = dpl(dp(x), y)
                autograd.backward(losses)
                trainer.step(batch)
            self.step = step
        time_iters(self.step, self.warmup, nd.waitall)
        return {}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--n', type=int, default=4, help='CPU contexts (default %(default)s)')
    p.add_argument('--batch', type=int, default=32, help='global batch (default %(default)s)')
    p.add_argument('--rounds', type=int, default=15,
                   help='interleaved rounds (default %(default)s)')
    p.add_argument('--iters', type=int, default=40, help='steps per round (default %(default)s)')
    add_common_args(p, CONTENDERS, 120, 'smoke run: 3 rounds of 10 steps')
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(Contender)
    if args.quick:
        args.rounds, args.iters = 3, 10
    names = args.contenders.split(',')
    load_before = load_avg()
    print(f'bench_step: tiny MLP {FEATURES}-{HIDDEN}-{CLASSES}, global batch {args.batch}, '
          f'{args.n} CPU contexts, whole step (forward, loss, backward, update, waitall); '
          f'{args.rounds} rounds x {args.iters} steps; {load_str(load_before)}')
    workers = [Worker(os.path.abspath(__file__), name, {'warmup': 3 if args.quick else 20})
               for name in names]
    status = setup_all(workers, {'n': args.n, 'batch': args.batch}, args.timeout)
    for name, why in status.items():
        print(f'  {name}: {why}')
    live = [w for w in workers if not w.dead and w.name not in status]
    times = interleave(live, args.rounds, args.iters, args.timeout)
    rss = close_workers(workers, status)
    us = {k: median(times[k]) * 1e6 if times.get(k) else None for k in names}
    # CPU time per step (medians over the rounds): on a machine with fewer
    # cores than the step has busy threads, the step's time follows it.
    cpu = {w.name: [median([c[i] for c in w.cpu]) * 1e6 for i in (0, 1)]
           for w in workers if w.cpu}
    rows = [[k, '-' if us[k] is None else f'{us[k]:.0f}',
             fmt_ratio(us[k] / us['module'] if us[k] and us.get('module') else None),
             fmt_ratio(us[k] / us['module-gl'] if us[k] and us.get('module-gl') else None),
             fmt_ratio(us[k] / us['gluon'] if us[k] and us.get('gluon') else None),
             *([f'{c:.0f}' for c in cpu[k]] if k in cpu else ['-', '-'])]
            for k in names]
    tbl = table(['contender', 'us/step', 'x module', 'x module-gl', 'x gluon',
                 'CPU us/step, all threads', 'CPU us/step, caller\'s thread'], rows)
    targets = Targets()
    for other, limit in (('module', 0.80), ('gluon', 0.40)):
        value = us['ours'] / us[other] if us.get('ours') and us.get(other) else None
        targets.check(f'ours / {other}', value, limit)
    finish('step', args.json, tbl, targets, load_before, us=us, cpu=cpu, status=status,
           rss=rss)
    return 0


if __name__ == '__main__':
    sys.exit(main())
