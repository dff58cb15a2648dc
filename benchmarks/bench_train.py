"""End-to-end training throughput: CIFAR-shaped ResNet-20 on synthetic data.

One iteration = forward, loss, backward and ``trainer.step`` (SGD, momentum,
weight decay) on a global batch of 128 images 3x32x32, split over 4 CPU
contexts, then ``nd.waitall()``. A contender whose name ends in -h runs the
network hybridized (static_alloc, static_shape). Every contender runs in its
own process (its peak RSS is its own; a contender that hangs is killed after
--timeout seconds and reported as "hangs"), and the contenders are timed in
interleaved rounds.

  ours+BN          gluon_parallel.DataParallel + DataParallelLoss, BatchNorm
  seq+BN           split_and_load + [loss(net(x), y) for ...] in the caller
  gluoncv+BN       gluoncv DataParallelModel/DataParallelCriterion, default
                   sync=False (replicas one after the other in the caller)
  gluoncv-threads+BN  the same with sync=True (a new thread per replica per
                   call, each waiting for its outputs); not a target
  ours+SyncBN      DataParallel with gluon_parallel.nn.SyncBatchNorm (with the
                   C++ sums kernel when it is built)
  ours+SyncBN-ops  the same with GLUON_PARALLEL_KERNELS=0 (MXNet's operators)
  seq+contrib      the seq loop with mxnet.gluon.contrib.nn.SyncBatchNorm, its
                   process started with MXNET_CPU_TEMP_COPY=64
  gluoncv+contrib  gluoncv (sync=True, as its training scripts use with
                   SyncBatchNorm) with the contrib SyncBatchNorm, likewise
  single           one context, whole batch, BatchNorm
  ours-graph+BN-h  DataParallel(graph=True): the hybridized network's
                   replicas as one multi-device executor graph per step
                   (the other ours contenders run with graph=False)
  ours-fused+BN-h  the same with gluon_parallel.Trainer (batched reduction,
                   multi-tensor update) instead of gluon.Trainer
  module+BN        MXNet's Module API over the same contexts (the traced
                   symbol + SoftmaxOutput, forward_backward + update, the
                   same SGD settings): MXNet's own fast path
  graph+BN         the bare multi-device executor (executor_reference.py):
                   one Symbol.bind(group2ctx) of every replica, bound to the
                   Parameters' own arrays, + the same Gluon Trainer
  graph+BN+edges   the same with one negligible cross-device edge per
                   BatchNorm layer each way: the lockstep floor of any exact
                   SyncBatchNorm on the machine
  ours-graph+SyncBN-h, graph+BN+edges-nomkl
                   graph-mode SyncBatchNorm and its floor, both with
                   MXNET_MKLDNN_ENABLED=0 (where graph mode uses the optional
                   kernels; with MKL-DNN on, ours+SyncBN-h is graph mode with
                   MXNet's operators, against graph+BN+edges)
  ours-graph+SyncBN-mkl-h
                   graph-mode SyncBatchNorm with MKL-DNN on (MXNet's
                   operators), against graph+BN+edges
  seq+BN-h, ours+BN-h, ours+SyncBN-h, ours+SyncBN-ops-h, seq+contrib-h
                   hybridized

Targets: issue 6: ours+BN >= 1.0 x seq+BN and >= 1.15 x gluoncv+BN (checked
against both gluoncv modes: the issue's baseline, gluoncv+BN 0.83 x seq,
matches the threaded one); peak RSS ours+BN <= 1.05 x seq+BN. Issue 13:
ours+SyncBN >= 0.8 x seq+BN; ours+SyncBN-h >= 0.9 x seq+BN-h; ours+SyncBN >=
1.0 x seq+contrib in each mode where contrib runs (with and without the
kernel). Issue 20: ours-graph+BN-h >= 0.9 x module+BN and >= 0.95 x
graph+BN; ours-graph+SyncBN-h >= 0.9 x graph+BN+edges-nomkl; ours+SyncBN >=
0.9 x graph+BN+edges; peak RSS ours-graph+SyncBN-h <= 1.10 x seq+BN.
Issue 30: ours-fused+BN-h >= 1.00 x module+BN. Issue 32:
ours-graph+SyncBN-mkl-h >= 0.90 x graph+BN+edges (MKL-DNN on).
"""
import argparse
import os
import sys

from harness.machine import import_gluoncv_parallel, load_avg, load_str, machine_info
from harness.options import add_common_args
from harness.tables import fmt_ratio, mib, save_json, table, Targets
from harness.timing import interleave, median, setup_all, time_iters, TimedContender
from harness.workers import close_workers, Worker, worker_main

CONTENDERS = ('ours+BN', 'seq+BN', 'gluoncv+BN', 'gluoncv-threads+BN', 'ours+SyncBN',
              'ours+SyncBN-ops', 'seq+contrib', 'gluoncv+contrib', 'single', 'seq+BN-h',
              'ours+BN-h', 'ours+SyncBN-h', 'ours+SyncBN-ops-h', 'seq+contrib-h',
              'ours-graph+BN-h', 'ours-fused+BN-h', 'module+BN', 'graph+BN', 'graph+BN+edges',
              'ours-graph+SyncBN-h', 'graph+BN+edges-nomkl', 'ours-graph+SyncBN-mkl-h')
#: MXNet's contrib SyncBatchNorm waits inside the engine; all CPU contexts
#: share MXNET_CPU_TEMP_COPY temp buffers (default 4), read at import.
CONTRIB_ENV = {'MXNET_CPU_TEMP_COPY': '64'}


def env_of(name):
    if 'contrib' in name:
        return CONTRIB_ENV
    if name == 'ours-graph+SyncBN-h' or name.endswith('-nomkl'):
        # Graph mode's SyncBatchNorm with the kernels (MKL-DNN off).
        return {'MXNET_MKLDNN_ENABLED': '0'}
    if 'SyncBN-ops' in name:
        return {'GLUON_PARALLEL_KERNELS': '0'}
    return {}


def resnet20(norm_layer, norm_kwargs, classes=10):
    """CIFAR ResNet-20 (v1: 3 stages x 3 basic blocks, 16/32/64 channels)."""
    from mxnet import gluon
    nn = gluon.nn

    class Basic(gluon.HybridBlock):
        def __init__(self, channels, stride, in_channels, **kw):
            super().__init__(**kw)
            with self.name_scope():
                self.body = nn.HybridSequential(prefix='')
                self.body.add(nn.Conv2D(channels, 3, stride, 1, use_bias=False,
                                        in_channels=in_channels),
                              norm_layer(in_channels=channels, **norm_kwargs),
                              nn.Activation('relu'),
                              nn.Conv2D(channels, 3, 1, 1, use_bias=False, in_channels=channels),
                              norm_layer(in_channels=channels, **norm_kwargs))
                self.down = None
                if stride != 1 or in_channels != channels:
                    self.down = nn.HybridSequential(prefix='')
                    self.down.add(nn.Conv2D(channels, 1, stride, use_bias=False,
                                            in_channels=in_channels),
                                  norm_layer(in_channels=channels, **norm_kwargs))

        def hybrid_forward(self, F, x):
            r = x if self.down is None else self.down(x)
            return F.Activation(self.body(x) + r, act_type='relu')

    net = nn.HybridSequential()
    with net.name_scope():
        net.add(nn.Conv2D(16, 3, 1, 1, use_bias=False, in_channels=3),
                norm_layer(in_channels=16, **norm_kwargs), nn.Activation('relu'))
        in_ch = 16
        for stage, ch in enumerate((16, 32, 64)):
            for i in range(3):
                net.add(Basic(ch, 2 if stage and not i else 1, in_ch))
                in_ch = ch
        net.add(nn.GlobalAvgPool2D(), nn.Dense(classes, in_units=64))
    return net


class Contender(TimedContender):
    def __init__(self, name, options):
        import mxnet as mx
        self.mx = mx
        self.name = name
        self.options = options
        self.gcv = import_gluoncv_parallel() if name.startswith('gluoncv') else None

    def setup(self, config):
        mx = self.mx
        from mxnet import autograd, gluon, nd
        n, batch = config['n'], config['batch']
        hybrid = self.name.endswith('-h')
        name = self.name[:-2] if hybrid else self.name
        name = name[:-len('-nomkl')] if name.endswith('-nomkl') else name
        name = name[:-len('-mkl')] if name.endswith('-mkl') else name
        kind = name.split('+')[0]
        norm = name.split('+')[1] if '+' in name else 'BN'
        info = {}
        ctx = [mx.cpu(0)] if kind == 'single' else [mx.cpu(i) for i in range(n)]
        if norm in ('SyncBN', 'SyncBN-ops'):
            import gluon_parallel as gp
            from gluon_parallel.nn import kernels
            norm_layer, norm_kwargs = gp.nn.SyncBatchNorm, {}
            from gluon_parallel.graph import mkldnn_cpu
            # (the first SyncBatchNorm would load them: the same call, asked
            # first); graph mode leaves them out with MKL-DNN on.
            used = kernels.load() and not (kind == 'ours-graph' and mkldnn_cpu(ctx))
            info['sums'] = 'kernel' if used else 'mxnet ops'
        elif norm == 'contrib':
            from mxnet.gluon.contrib.nn import SyncBatchNorm
            norm_layer, norm_kwargs = SyncBatchNorm, {'num_devices': n}
        else:
            norm_layer, norm_kwargs = gluon.nn.BatchNorm, {}
        mx.random.seed(0)
        net = resnet20(norm_layer, norm_kwargs)
        net.initialize(mx.init.Xavier(magnitude=2), ctx=ctx)
        if hybrid:
            net.hybridize(static_alloc=True, static_shape=True)
        loss = gluon.loss.SoftmaxCrossEntropyLoss()
        if kind == 'ours-fused':
            import gluon_parallel as gp
            trainer_cls = gp.Trainer
        else:
            trainer_cls = gluon.Trainer
        trainer = trainer_cls(net.collect_params(), 'sgd',
                              {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4})
        x = nd.random.uniform(shape=(batch, 3, 32, 32), ctx=mx.cpu(0))
        y = nd.random.randint(0, 10, shape=(batch,), ctx=mx.cpu(0)).astype('float32')

        if kind in ('module', 'graph'):
            if kind == 'module':
                self.step = _module_step(mx, net, ctx, x, y, batch)
            else:
                from executor_reference import executor_step
                self.step = executor_step(mx, net, ctx, x, y, trainer, batch,
                                          edges=name.endswith('+edges'))
            time_iters(self.step, config.get('warmup', 2), nd.waitall)
            return info
        if kind in ('ours', 'ours-graph', 'ours-fused'):
            import gluon_parallel as gp
            dp = gp.DataParallel(net, ctx, graph=kind in ('ours-graph', 'ours-fused'))
            dpl = gp.DataParallelLoss(loss)

            def forward():
                return dpl(dp(x), y)
        elif kind in ('seq', 'single'):
            split = gluon.utils.split_and_load

            def forward():
                xs = split(x, ctx, even_split=False)
                ys = split(y, ctx, even_split=False)
                return [loss(net(a), b) for a, b in zip(xs, ys)]
        else:
            sync = norm == 'contrib' or kind == 'gluoncv-threads'
            model = self.gcv.DataParallelModel(net, ctx, sync=sync)
            crit = self.gcv.DataParallelCriterion(loss, ctx, sync=sync)

            def forward():
                return list(crit(model(x), y))

        def step():
            with autograd.record():
                losses = forward()
            autograd.backward(losses)
            trainer.step(batch)
        self.step = step
        time_iters(step, config.get('warmup', 2), nd.waitall)
        return info



def _module_step(mx, net, ctx, x, y, batch, loss=None, kvstore='device'):
    """MXNet's Module API on the network's traced symbol: one step is
    forward_backward + update (SGD as the Gluon trainers use it, the loss
    averaged over the batch as trainer.step(batch) does) through `kvstore`
    (a dist one: Module's defaults, the update on the servers, the loss
    averaged over every worker's batch). The loss is
    MXNet's fused ``SoftmaxOutput`` (what Module users write), or the Gluon
    `loss` block traced on symbols under ``MakeLoss`` (the operators the
    Gluon contenders run, its per-sample values computed)."""
    net.hybridize()
    net(x[:2].as_in_context(ctx[0]))
    out, label = net(mx.sym.var('data')), mx.sym.var('softmax_label')
    sym = mx.sym.SoftmaxOutput(out, label, name='softmax') if loss is None else \
        mx.sym.MakeLoss(loss(out, label))
    mod = mx.mod.Module(sym, context=ctx)
    mod.bind(data_shapes=[('data', x.shape)], label_shapes=[('softmax_label', y.shape)])
    params = {p.name: p.data(ctx[0]) for p in net.collect_params().values()}
    aux = set(sym.list_auxiliary_states())
    mod.init_params(arg_params={k: v for k, v in params.items() if k not in aux},
                    aux_params={k: v for k, v in params.items() if k in aux},
                    allow_missing=True)
    sgd = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4}
    if kvstore == 'device':
        sgd['rescale_grad'] = 1.0 / batch      # (a dist_sync one: Module's own, 1 / global batch)
    mod.init_optimizer(kvstore=kvstore, optimizer='sgd', optimizer_params=sgd)
    data = mx.io.DataBatch([x], [y])

    def step():
        mod.forward_backward(data)
        mod.update()
    step.module, step.data = mod, data      # for bench_calls.py
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--n', type=int, default=4, help='CPU contexts (default %(default)s)')
    p.add_argument('--batch', type=int, default=128, help='global batch (default %(default)s)')
    p.add_argument('--rounds', type=int, default=8, help='interleaved rounds (default %(default)s)')
    p.add_argument('--iters', type=int, default=3,
                   help='iterations per round (default %(default)s)')
    p.add_argument('--warmup', type=int, default=2, help='untimed iterations (default %(default)s)')
    add_common_args(p, CONTENDERS, 90, 'smoke run: batch 32, 1 round')
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(Contender)
    if args.quick:
        args.batch, args.rounds, args.iters, args.warmup = 32, 2, 2, 1
        args.timeout = min(args.timeout, 60)
    names = args.contenders.split(',')
    cfg = {'n': args.n, 'batch': args.batch, 'warmup': args.warmup}

    load_before = load_avg()
    print(f'bench_train: ResNet-20 (CIFAR), global batch {args.batch:d}, {args.n:d} CPU contexts; '
          f'{args.rounds:d} rounds x {args.iters:d} iterations; {load_str(load_before)}')
    script = os.path.abspath(__file__)
    workers = [Worker(script, name, env=env_of(name)) for name in names]
    status = setup_all(workers, cfg, args.timeout)
    info = {w.name: getattr(w, 'info', {}).get('sums', '-') for w in workers}
    for name, why in status.items():
        print(f'  {name}: {why}')
    live = [w for w in workers if not w.dead and w.name not in status]
    load_timed = load_avg()
    times = interleave(live, args.rounds, args.iters, args.timeout)
    rss = close_workers(workers, status)
    load_after = load_avg()
    sps = {k: (args.batch / median(times[k]) if times.get(k) else None) for k in names}
    out = report(names, sps, rss, status, times, load_before, load_timed, load_after, args,
                 info)
    save_json(args.json, out)
    return 0


def report(names, sps, rss, status, times, load_before, load_timed, load_after, args,
           info=None):
    def r(a, b, d=sps):
        return d[a] / d[b] if d.get(a) and d.get(b) else None
    rows = []
    for k in names:
        if sps.get(k):
            cell = f'{sps[k]:.0f}'
        else:
            cell = status.get(k) or 'no result'
        same = 'seq+BN-h' if k.endswith('-h') else 'seq+BN'
        rows.append([k, 'hybridized' if k.endswith('-h') else 'imperative',
                     (info or {}).get(k, '-'), cell,
                     f'{args.batch / sps[k] * 1e3:.0f}' if sps.get(k) else '-',
                     len(times.get(k, [])), fmt_ratio(r(k, 'seq+BN')),
                     fmt_ratio(r(k, same)), mib(rss.get(k)),
                     fmt_ratio(r(k, 'seq+BN', rss))])
    tbl = table(['contender', 'mode', 'sums', 'samples/s', 'ms/iter (median)', 'iters timed',
                   'x seq+BN', 'x seq+BN same mode', 'peak RSS MiB', 'RSS x seq+BN'], rows)
    t = Targets()

    def check(name, a, b, limit, op, d=sps):
        missing = [k for k in (a, b) if not d.get(k)]
        if missing:
            t.note(name, 'SKIP', '; '.join('{}: {}'.format(k, status.get(k) or 'no result')
                                           for k in missing))
        else:
            t.check(name, d[a] / d[b], limit, op)
    check('throughput ours+BN / seq+BN', 'ours+BN', 'seq+BN', 1.0, '>=')
    check('throughput ours+BN / gluoncv+BN', 'ours+BN', 'gluoncv+BN', 1.15, '>=')
    if 'gluoncv-threads+BN' in names:
        check('throughput ours+BN / gluoncv-threads+BN (gluoncv sync=True)', 'ours+BN',
              'gluoncv-threads+BN', 1.15, '>=')
    check('throughput ours+SyncBN / seq+BN', 'ours+SyncBN', 'seq+BN', 0.8, '>=')
    check('throughput ours+SyncBN-h / seq+BN-h', 'ours+SyncBN-h', 'seq+BN-h', 0.9, '>=')
    check('throughput ours+SyncBN-ops / seq+BN (no kernel)', 'ours+SyncBN-ops', 'seq+BN', 0.8,
          '>=')
    check('throughput ours+SyncBN-ops-h / seq+BN-h (no kernel)', 'ours+SyncBN-ops-h',
          'seq+BN-h', 0.9, '>=')
    for ours, contrib in (('ours+SyncBN', 'seq+contrib'), ('ours+SyncBN-h', 'seq+contrib-h'),
                          ('ours+SyncBN-ops', 'seq+contrib'),
                          ('ours+SyncBN-ops-h', 'seq+contrib-h')):
        if ours in names and contrib in names:
            check(f'throughput {ours} / {contrib} (where contrib runs)', ours, contrib,
                  1.0, '>=')
    check('peak RSS ours+BN / seq+BN', 'ours+BN', 'seq+BN', 1.05, '<=', rss)
    check('throughput ours-graph+BN-h / module+BN (issue 20)', 'ours-graph+BN-h', 'module+BN',
          0.9, '>=')
    check('throughput ours-graph+BN-h / seq+BN', 'ours-graph+BN-h', 'seq+BN', 1.0, '>=')
    check('throughput ours-graph+SyncBN-mkl-h / graph+BN+edges, MKL-DNN on (issue 32)',
          'ours-graph+SyncBN-mkl-h', 'graph+BN+edges', 0.9, '>=')
    check('throughput ours-fused+BN-h / module+BN (issue 30)', 'ours-fused+BN-h', 'module+BN',
          1.0, '>=')
    check('throughput ours-graph+BN-h / graph+BN (issue 20)', 'ours-graph+BN-h', 'graph+BN',
          0.95, '>=')
    check('throughput ours-graph+SyncBN-h / graph+BN+edges-nomkl (issue 20; MKL-DNN off)',
          'ours-graph+SyncBN-h', 'graph+BN+edges-nomkl', 0.9, '>=')
    check('throughput ours+SyncBN / graph+BN+edges, the lockstep floor (issue 20)',
          'ours+SyncBN', 'graph+BN+edges', 0.9, '>=')
    check('peak RSS ours-graph+SyncBN-h / seq+BN (issue 20)', 'ours-graph+SyncBN-h', 'seq+BN',
          1.10, '<=', rss)
    print()
    print(tbl)
    print()
    print(f'{load_str(load_before)} before, {load_str(load_timed)} when timing started, '
          f'{load_str(load_after)} after')
    print()
    print(t.render())
    return {'bench': 'train', 'names': names, 'samples_per_s': sps, 'rss': rss,
            'status': status, 'load_before': load_before, 'load_timed': load_timed,
            'load_after': load_after, 'table': tbl, 'targets': t.items,
            'config': {'n': args.n, 'batch': args.batch, 'rounds': args.rounds,
                       'iters': args.iters},
            'machine': machine_info()}


if __name__ == '__main__':
    sys.exit(main())
