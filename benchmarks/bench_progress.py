"""What progress reports cost (``--stall-timeout``, issue 56): a tiny-MLP
dist_sync step with them and without.

The job: 2 worker processes (one CPU context each) and one server, an MLP
of 8 -> 16 -> 4 units, ``gluon.Trainer`` on ``dist.get_kvstore()``
(``update_on_kvstore=False``), a batch of 16 per worker: a step of some
milliseconds, almost all of it the reduction, where a per-step cost shows
most. "with": the launcher's default (every pushpull reports; at most one
message a second per worker); "without": ``--stall-timeout 0`` (no
channel: every report is a no-op). The two alternate for --rounds rounds;
a job's step time is the slowest worker's mean over --steps timed steps.
Target: with / without <= 1.01.
"""
import argparse
import time

from harness.jobs import alternate, result_line, run_job as launch_job
from harness.machine import load_avg, load_str
from harness.tables import Targets, print_targets, table

MODES = {'with': (), 'without': ('--stall-timeout', '0')}


def worker(args):
    """One worker: train, time, print a BENCH_RESULT line."""
    from gluon_parallel import dist
    import mxnet as mx
    from mxnet import autograd, gluon, nd
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, in_units=8, activation='relu'), gluon.nn.Dense(4, in_units=16))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01},
                            kvstore=dist.get_kvstore(), update_on_kvstore=False)
    dist.init_trainer(trainer)
    x, y = nd.random.uniform(shape=(16, 8)), nd.random.uniform(shape=(16, 4))
    loss_fn = gluon.loss.L2Loss()

    def step():
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(dist.global_batch_size(16))

    for _ in range(args.warmup):
        step()
    nd.waitall()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    nd.waitall()
    result_line({'rank': dist.rank(), 'step': (time.perf_counter() - start) / args.steps})
    dist.barrier()


def run_job(mode, args):
    """The step time of one job, or None with the reason."""
    results, why, _ = launch_job(__file__, ['--steps', args.steps, '--warmup', args.warmup],
                                 args.timeout, launch_args=MODES[mode])
    if results is None:
        return None, why
    return max(r['step'] for r in results), None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--rounds', type=int, default=5, help='jobs per mode (default %(default)s)')
    p.add_argument('--steps', type=int, default=2000, help='timed steps (default %(default)s)')
    p.add_argument('--warmup', type=int, default=100, help='untimed steps (default %(default)s)')
    p.add_argument('--timeout', type=int, default=600, help='seconds per job (default %(default)s)')
    p.add_argument('--quick', action='store_true', help='smoke run: 1 round, 50 steps')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 50, 5
    print(f'bench_progress: tiny MLP, 2 dist_sync workers, {args.steps:d} timed steps per job, '
          f'{args.rounds:d} rounds; {load_str(load_avg())}')
    times, failed, med = alternate(MODES, args.rounds, lambda mode: run_job(mode, args),
                                   lambda v: f'{v * 1e3:.3f} ms/step')
    rows = [[m, '-' if med[m] is None else f'{med[m] * 1e3:.3f}',
             ', '.join(f'{v * 1e3:.3f}' for v in times[m]) or failed.get(m, '-')] for m in MODES]
    print()
    print(table(['reports', 'ms/step (median)', 'every job'], rows))
    targets = Targets()
    if med['with'] and med['without']:
        targets.check('step with / without progress reports', med['with'] / med['without'],
                      1.01)
    else:
        targets.note('step with / without progress reports', 'SKIP', '; '.join(failed.values()))
    print_targets(targets)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
