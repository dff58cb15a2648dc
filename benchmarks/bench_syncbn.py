"""SyncBatchNorm cost: forward+backward on 4 CPU contexts.

Two networks, each contender in its own process (a contender that hangs is
killed after --timeout seconds and reported as "hangs"), timed in
interleaved rounds; one iteration = split, forward, backward from the
outputs (head gradient ones), ``nd.waitall()``:

  (a) a single BatchNorm layer on a (32, 64, 16, 16) batch
  (b) a conv-BN-relu stack: 3 x [Conv2D 3x3 32 channels, BN, relu] on a
      (32, 16, 32, 32) batch

Contenders:
  ours      gluon_parallel.nn.SyncBatchNorm inside DataParallel
  contrib   mxnet.gluon.contrib.nn.SyncBatchNorm in the sequential loop
            (split_and_load, [net(x) for x in xs])
  bn-seq    plain gluon.nn.BatchNorm (per-device statistics, no sync) in the
            sequential loop
  bn-ours   plain BatchNorm inside DataParallel (separates the cost of
            synchronising from that of the wrapper)

Targets (issue 3): (a) ours <= 1.25 x contrib; (b) ours <= 1.25 x bn-seq.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

CONTENDERS = ('ours', 'contrib', 'bn-seq', 'bn-ours')
CASES = {
    'a': {'title': '(a) single BN layer', 'shape': (32, 64, 16, 16)},
    'b': {'title': '(b) conv-BN-relu x3', 'shape': (32, 16, 32, 32)},
}


class Contender(C.TimedContender):
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
        if self.name == 'ours':
            import gluon_parallel as gp
            norm, kw = gp.nn.SyncBatchNorm, {}
        elif self.name == 'contrib':
            from mxnet.gluon.contrib.nn import SyncBatchNorm as norm
            kw = {'num_devices': n}
        else:
            norm, kw = gluon.nn.BatchNorm, {}
        mx.random.seed(0)
        net = gluon.nn.Sequential()
        if case == 'a':
            net.add(norm(in_channels=shape[1], **kw))
        else:
            in_ch = shape[1]
            for i in range(3):
                net.add(gluon.nn.Conv2D(32, 3, padding=1, in_channels=in_ch),
                        norm(in_channels=32, **kw), gluon.nn.Activation('relu'))
                in_ch = 32
        net.initialize(mx.init.Xavier(), ctx=ctx)
        x = nd.random.normal(shape=shape, ctx=mx.cpu(0))

        if self.name in ('ours', 'bn-ours'):
            import gluon_parallel as gp
            dp = gp.DataParallel(net, ctx)

            def step():
                with autograd.record():
                    outs = dp(x)
                autograd.backward(outs)
        else:
            split = gluon.utils.split_and_load

            def step():
                xs = split(x, ctx, even_split=False)
                with autograd.record():
                    outs = [net(a) for a in xs]
                autograd.backward(outs)
        self.step = step
        C.time_iters(step, self.warmup, nd.waitall)
        return {}



def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--n', type=int, default=4, help='CPU contexts (default %(default)s)')
    p.add_argument('--rounds', type=int, default=8, help='interleaved rounds (default %(default)s)')
    p.add_argument('--iters', type=int, default=5, help='iterations per round (default %(default)s)')
    p.add_argument('--cases', default='a,b', help='which networks (default %(default)s)')
    C.add_common_args(p, CONTENDERS, 60, 'smoke run: 2 rounds')
    args = p.parse_args(argv)
    if args.worker:
        return C.worker_main(Contender)
    if args.quick:
        args.rounds, args.iters, args.timeout = 2, 2, min(args.timeout, 30)
    names = args.contenders.split(',')
    load_before = C.load_avg()
    print('bench_syncbn: forward+backward on %d CPU contexts; %d rounds x %d iterations; %s'
          % (args.n, args.rounds, args.iters, C.load_str(load_before)))
    script = os.path.abspath(__file__)
    results = {}
    for case in args.cases.split(','):
        spec = CASES[case]
        # Fresh processes per case: a contender that hung on one network
        # still gets its chance on the other.
        workers = [C.Worker(script, name, {'warmup': 1 if args.quick else 3}) for name in names]
        cfg = {'n': args.n, 'case': case, 'shape': spec['shape']}
        status = C.setup_all(workers, cfg, args.timeout)
        live = [w for w in workers if not w.dead and w.name not in status]
        load = C.load_avg()
        times = C.interleave(live, args.rounds, args.iters, args.timeout)
        rss = C.close_workers(workers, status)
        ms = {k: C.median(times[k]) * 1e3 if times.get(k) else None for k in names}
        results[case] = {'ms': ms, 'status': status, 'rss': rss, 'load': load,
                         'title': spec['title'], 'shape': spec['shape']}
        print('  %s %s  (%s)' % (spec['title'], '  '.join(
            '%s %s' % (k, status.get(k) or '%.2f ms' % ms[k]) for k in names), C.load_str(load)))
    load_after = C.load_avg()
    out = report(names, results, load_before, load_after, args)
    C.save_json(args.json, out)
    return 0


def report(names, results, load_before, load_after, args):
    rows = []
    for case, res in results.items():
        ms, st = res['ms'], res['status']

        def r(a, b):
            return ms[a] / ms[b] if ms.get(a) and ms.get(b) else None
        rows.append([res['title'], 'x'.join(map(str, res['shape']))]
                    + [('%.2f' % ms[k]) if ms.get(k) else (st.get(k) or '-') for k in names]
                    + [C.fmt_ratio(r('ours', 'contrib')), C.fmt_ratio(r('ours', 'bn-seq')),
                       C.fmt_ratio(r('ours', 'bn-ours')), C.mib(res['rss'].get('ours')),
                       C.mib(res['rss'].get('bn-seq')), '%.2f' % res['load'][0]])
    tbl = C.table(['network', 'input'] + ['%s ms' % k for k in names]
                  + ['ours/contrib', 'ours/bn-seq', 'ours/bn-ours', 'ours RSS MiB',
                     'bn-seq RSS MiB', 'load 1m'], rows)
    t = C.Targets()
    for case, (x, y) in (('a', ('ours', 'contrib')), ('b', ('ours', 'bn-seq'))):
        name = '(%s) %s / %s' % (case, x, y)
        res = results.get(case)
        if not res:
            t.note(name, 'SKIP', 'not run')
        elif not (res['ms'].get(x) and res['ms'].get(y)):
            t.note(name, 'SKIP', '; '.join('%s: %s' % (k, res['status'].get(k) or 'no result')
                                           for k in (x, y) if not res['ms'].get(k)))
        else:
            t.check(name, res['ms'][x] / res['ms'][y], 1.25)
    print()
    print(tbl)
    print()
    print('%s before, %s after' % (C.load_str(load_before), C.load_str(load_after)))
    print()
    print(t.render())
    return {'bench': 'syncbn', 'names': names, 'results': results, 'table': tbl,
            'targets': t.items, 'load_before': load_before, 'load_after': load_after,
            'config': {'n': args.n, 'rounds': args.rounds, 'iters': args.iters},
            'machine': C.machine_info()}


if __name__ == '__main__':
    sys.exit(main())
