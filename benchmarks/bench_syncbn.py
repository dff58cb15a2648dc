"""SyncBatchNorm cost: forward+backward on 4 CPU contexts.

Two networks, each contender in its own process (a contender that hangs is
killed after --timeout seconds and reported as "hangs"), timed in
interleaved rounds; one iteration = split, forward, backward from the
outputs (head gradient ones), ``nd.waitall()``:

  (a) a single BatchNorm layer on a (32, 64, 16, 16) batch
  (b) a conv-BN-relu stack: 3 x [Conv2D 3x3 32 channels, BN, relu] on a
      (32, 16, 32, 32) batch

Contenders (suffix -h: the network hybridized with static_alloc and
static_shape):
  ours, ours-h        gluon_parallel.nn.SyncBatchNorm inside DataParallel
                      (with the C++ sums kernel when it is built)
  ours-ops, ours-ops-h  the same with GLUON_PARALLEL_KERNELS=0 (MXNet's own
                      operators only)
  contrib, contrib-h  mxnet.gluon.contrib.nn.SyncBatchNorm in the sequential
                      loop (split_and_load, [net(x) for x in xs]), its
                      process started with MXNET_CPU_TEMP_COPY=64
  bn-seq, bn-seq-h    plain gluon.nn.BatchNorm (per-device statistics, no
                      sync) in the sequential loop
  bn-ours, bn-ours-h  plain BatchNorm inside DataParallel
  ours-graph-h        SyncBatchNorm in graph mode (DataParallel(graph=True):
                      the statistics merged inside one multi-device
                      executor graph), MKL-DNN off (graph-mode SyncBatchNorm
                      needs it on CPU contexts)
  bn-graph-edges-h    its floor: the bare multi-device executor of plain
                      BatchNorm with one negligible cross-device edge per
                      layer each way (executor_reference.py), MKL-DNN off
  bn-graph-h          the same executor without the edges, MKL-DNN off

Targets: (a) ours <= 1.25 x contrib (issue 3); (b) SyncBatchNorm in its
fastest mode <= 1.25 x BatchNorm in its fastest mode (issue 13, with and
without the kernel); ours <= 1.0 x contrib in every network and mode where
contrib runs (issue 13); (b) ours-graph-h <= 1.25 x bn-graph-edges-h (issue
20).
"""
import argparse
import os
import sys

from harness.machine import load_avg, load_str, machine_info
from harness.options import add_common_args
from harness.tables import fmt_ratio, mib, save_json, table, Targets
from harness.timing import interleave, median, setup_all, time_iters, TimedContender
from harness.workers import close_workers, Worker, worker_main

CONTENDERS = ('ours', 'ours-h', 'ours-ops', 'ours-ops-h', 'contrib', 'contrib-h', 'bn-seq',
              'bn-seq-h', 'bn-ours', 'bn-ours-h', 'ours-graph-h', 'bn-graph-edges-h',
              'bn-graph-h')
#: Graph-mode SyncBatchNorm on CPU contexts needs MKL-DNN off; so do its floors.
NOMKL_ENV = {'MXNET_MKLDNN_ENABLED': '0'}
CASES = {
    'a': {'title': '(a) single BN layer', 'shape': (32, 64, 16, 16)},
    'b': {'title': '(b) conv-BN-relu x3', 'shape': (32, 16, 32, 32)},
}
#: MXNet's contrib SyncBatchNorm waits inside the engine; all CPU contexts
#: share MXNET_CPU_TEMP_COPY temp buffers (default 4), read at import.
CONTRIB_ENV = {'MXNET_CPU_TEMP_COPY': '64'}


def env_of(name):
    if name.startswith('contrib'):
        return CONTRIB_ENV
    if name.startswith('ours-ops'):
        return {'GLUON_PARALLEL_KERNELS': '0'}
    if 'graph' in name:
        return NOMKL_ENV
    return {}


class Contender(TimedContender):
    def __init__(self, name, options):
        import mxnet as mx
        self.mx = mx
        self.name = name
        self.warmup = options.get('warmup', 3)

    def setup(self, config):
        mx = self.mx
        from mxnet import autograd, gluon, nd
        n, case = config['n'], config['case']
        shape = tuple(config['shape'])
        ctx = [mx.cpu(i) for i in range(n)]
        kind = self.name[:-2] if self.name.endswith('-h') else self.name
        info = {}
        if kind in ('ours', 'ours-ops', 'ours-graph'):
            import gluon_parallel as gp
            from gluon_parallel.nn import kernels
            norm, kw = gp.nn.SyncBatchNorm, {}
            from gluon_parallel.graph import mkldnn_cpu
            # (the first SyncBatchNorm would load them: the same call, asked
            # first); graph mode leaves them out with MKL-DNN on.
            used = kernels.load() and not (kind == 'ours-graph' and mkldnn_cpu(ctx))
            info['sums'] = 'kernel' if used else 'mxnet ops'
        elif kind == 'contrib':
            from mxnet.gluon.contrib.nn import SyncBatchNorm as norm
            kw = {'num_devices': n}
        else:
            norm, kw = gluon.nn.BatchNorm, {}
        mx.random.seed(0)
        net = gluon.nn.HybridSequential()
        if case == 'a':
            net.add(norm(in_channels=shape[1], **kw))
        else:
            in_ch = shape[1]
            for _ in range(3):
                net.add(gluon.nn.Conv2D(32, 3, padding=1, in_channels=in_ch),
                        norm(in_channels=32, **kw), gluon.nn.Activation('relu'))
                in_ch = 32
        net.initialize(mx.init.Xavier(), ctx=ctx)
        if self.name.endswith('-h'):
            net.hybridize(static_alloc=True, static_shape=True)
        x = nd.random.normal(shape=shape, ctx=mx.cpu(0))

        if kind in ('ours', 'ours-ops', 'bn-ours', 'ours-graph'):
            import gluon_parallel as gp
            dp = gp.DataParallel(net, ctx, graph=kind == 'ours-graph')

            def step():
                with autograd.record():
                    outs = dp(x)
                autograd.backward(outs)
        elif kind in ('bn-graph', 'bn-graph-edges'):
            from executor_reference import executor_step
            step = executor_step(mx, net, ctx, x, None, None, None,
                                 edges=kind == 'bn-graph-edges')
        else:
            split = gluon.utils.split_and_load

            def step():
                xs = split(x, ctx, even_split=False)
                with autograd.record():
                    outs = [net(a) for a in xs]
                autograd.backward(outs)
        self.step = step
        time_iters(step, self.warmup, nd.waitall)
        return info



def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--n', type=int, default=4, help='CPU contexts (default %(default)s)')
    p.add_argument('--rounds', type=int, default=8, help='interleaved rounds (default %(default)s)')
    p.add_argument('--iters', type=int, default=5,
                   help='iterations per round (default %(default)s)')
    p.add_argument('--cases', default='a,b', help='which networks (default %(default)s)')
    add_common_args(p, CONTENDERS, 60, 'smoke run: 2 rounds')
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(Contender)
    if args.quick:
        args.rounds, args.iters, args.timeout = 2, 2, min(args.timeout, 30)
    names = args.contenders.split(',')
    load_before = load_avg()
    print(f'bench_syncbn: forward+backward on {args.n:d} CPU contexts; {args.rounds:d} rounds x '
          f'{args.iters:d} iterations; {load_str(load_before)}')
    script = os.path.abspath(__file__)
    results = {}
    for case in args.cases.split(','):
        spec = CASES[case]
        # Fresh processes per case: a contender that hung on one network
        # still gets its chance on the other.
        workers = [Worker(script, name, {'warmup': 1 if args.quick else 3}, env=env_of(name))
                   for name in names]
        cfg = {'n': args.n, 'case': case, 'shape': spec['shape']}
        status = setup_all(workers, cfg, args.timeout)
        live = [w for w in workers if not w.dead and w.name not in status]
        load = load_avg()
        times = interleave(live, args.rounds, args.iters, args.timeout)
        info = {w.name: {k: v for k, v in getattr(w, 'info', {}).items() if k != 'ok'}
                for w in workers}
        rss = close_workers(workers, status)
        ms = {k: median(times[k]) * 1e3 if times.get(k) else None for k in names}
        results[case] = {'ms': ms, 'status': status, 'rss': rss, 'load': load, 'info': info,
                         'title': spec['title'], 'shape': spec['shape']}
        print('  {} {}  ({})'.format(spec['title'], '  '.join(
            '{} {}'.format(k, status.get(k) or f'{ms[k]:.2f} ms') for k in names), load_str(load)))
    load_after = load_avg()
    out = report(names, results, load_before, load_after, args)
    save_json(args.json, out)
    return 0


def _mode(name):
    return 'hybridized' if name.endswith('-h') else 'imperative'


def _best(ms, names):
    """(name, ms) of the fastest of `names` that has a time."""
    timed = [(ms[k], k) for k in names if ms.get(k)]
    return (min(timed)[1], min(timed)[0]) if timed else (None, None)


def report(names, results, load_before, load_after, args):
    rows = []
    for res in results.values():
        ms, st = res['ms'], res['status']
        for k in names:
            base = 'bn-seq-h' if k.endswith('-h') else 'bn-seq'
            rows.append([res['title'], 'x'.join(map(str, res['shape'])), k, _mode(k),
                         res['info'].get(k, {}).get('sums', '-'),
                         (f'{ms[k]:.2f}') if ms.get(k) else (st.get(k) or '-'),
                         fmt_ratio(ms[k] / ms[base] if ms.get(k) and ms.get(base) else None),
                         mib(res['rss'].get(k)), '{:.2f}'.format(res['load'][0])])
    tbl = table(['network', 'input', 'contender', 'mode', 'sums', 'ms', 'x bn-seq (same mode)',
                   'RSS MiB', 'load 1m'], rows)
    t = Targets()

    def ratio(name, res, a, b, limit):
        if not (res['ms'].get(a) and res['ms'].get(b)):
            t.note(name, 'SKIP', '; '.join('{}: {}'.format(k, res['status'].get(k) or 'no result')
                                           for k in (a, b) if not res['ms'].get(k)))
        else:
            t.check(name, res['ms'][a] / res['ms'][b], limit)

    if 'a' in results:
        ratio('(a) ours / contrib', results['a'], 'ours', 'contrib', 1.25)
    res = results.get('b')
    if res:
        bn, bn_ms = _best(res['ms'], ['bn-seq', 'bn-seq-h'])
        for label, ours in (('', ['ours', 'ours-h']),
                            (' (MXNet ops only)', ['ours-ops', 'ours-ops-h'])):
            k, k_ms = _best(res['ms'], ours)
            name = f'(b) SyncBN fastest / BN fastest{label}'
            if k is None or bn is None:
                t.note(name, 'SKIP', 'no result')
            else:
                t.check(f'{name}: {k} / {bn}', k_ms / bn_ms, 1.25)
    if res and 'ours-graph-h' in names:
        ratio('(b) ours-graph-h / bn-graph-edges-h, the lockstep floor (issue 20; MKL-DNN off)',
              res, 'ours-graph-h', 'bn-graph-edges-h', 1.25)
    for case, res in results.items():
        for ours, contrib in (('ours', 'contrib'), ('ours-h', 'contrib-h')):
            if ours in names and contrib in names:
                ratio(f'({case}) {ours} / {contrib} (where contrib runs)', res, ours,
                      contrib, 1.0)
    print()
    print(tbl)
    print()
    print(f'{load_str(load_before)} before, {load_str(load_after)} after')
    print()
    print(t.render())
    return {'bench': 'syncbn', 'names': names, 'results': results, 'table': tbl,
            'targets': t.items, 'load_before': load_before, 'load_after': load_after,
            'config': {'n': args.n, 'rounds': args.rounds, 'iters': args.iters},
            'machine': machine_info()}


if __name__ == '__main__':
    sys.exit(main())
