"""Multi-worker training throughput on the two engines: dist_sync and Horovod.

The same job on each: the CIFAR ResNet-20 of bench_train.py (BatchNorm) on
synthetic 3x32x32 images, 2 worker processes x 2 CPU contexts, global batch
128 (32 per context), SGD with momentum, DataParallel + DataParallelLoss +
``trainer.step(dist.global_batch_size(...))`` on ``dist.get_kvstore()``:

  dist_sync  python -m gluon_parallel.launch -n 2 -s 1 (one parameter server)
  horovod    python -m gluon_parallel.launch --engine horovod -n 2
             (horovodrun --gloo: ring all-reduce between the workers)

Every job runs --warmup steps, then times --steps steps on every worker
(``nd.waitall()`` at both ends); a job's samples/s is the global batch times
the steps over the slowest worker's time. The engines alternate for
--rounds rounds; the table gives each engine's median and the ratio.
Target (issue 23): horovod >= 1.0 x dist_sync.

Each worker process runs with OMP_NUM_THREADS=1 (4 processes or more share
this machine's cores in a dist_sync job: 2 workers, a server, a scheduler).
"""
import argparse
import sys
import time

from harness.jobs import alternate, resnet20_worker, result_line, run_job as launch_job
from harness.machine import load_avg, load_str
from harness.tables import Targets, print_targets, table

ENGINES = ('dist_sync', 'horovod')


def worker(args):
    """One worker of the job: train, time, print a BENCH_RESULT line."""
    trainer, dp, dp_loss = resnet20_worker(args.contexts)
    from gluon_parallel import dist
    from mxnet import autograd, nd
    per_worker = args.batch // dist.num_workers()
    x = nd.random.uniform(shape=(per_worker, 3, 32, 32))
    y = nd.random.randint(0, 10, shape=(per_worker,)).astype('float32')

    def step():
        with autograd.record():
            losses = dp_loss(dp(x), y)
        autograd.backward(losses)
        trainer.step(dist.global_batch_size(per_worker))

    for _ in range(args.warmup):
        step()
    nd.waitall()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    nd.waitall()
    seconds = time.perf_counter() - start
    result_line({'rank': dist.rank(), 'seconds': seconds})
    dist.barrier()
    dp.close()


def run_job(engine, args):
    """samples/s of one job of `engine`, or None with the reason."""
    results, why, _ = launch_job(__file__, ['--steps', args.steps, '--warmup', args.warmup,
                                            '--batch', args.batch, '--contexts', args.contexts],
                                 args.timeout, engine=engine)
    if results is None:
        return None, why
    return args.batch * args.steps / max(r['seconds'] for r in results), None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--rounds', type=int, default=3, help='jobs per engine (default %(default)s)')
    p.add_argument('--steps', type=int, default=30, help='timed steps (default %(default)s)')
    p.add_argument('--warmup', type=int, default=5, help='untimed steps (default %(default)s)')
    p.add_argument('--batch', type=int, default=128, help='global batch (default %(default)s)')
    p.add_argument('--contexts', type=int, default=2,
                   help='CPU contexts per worker (default %(default)s)')
    p.add_argument('--timeout', type=int, default=600, help='seconds per job (default %(default)s)')
    p.add_argument('--quick', action='store_true', help='smoke run: 1 round, 3 steps')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 3, 1
    print(f'bench_dist_engines: ResNet-20, 2 workers x {args.contexts:d} CPU contexts, global '
          f'batch {args.batch:d}, {args.steps:d} timed '
          f'steps per job, {args.rounds:d} rounds; {load_str(load_avg())}')
    sps, failed, med = alternate(ENGINES, args.rounds, lambda e: run_job(e, args),
                                 lambda v: f'{v:.1f} samples/s')
    rows = [[e, '-' if med[e] is None else f'{med[e]:.1f}',
             ', '.join(f'{v:.1f}' for v in sps[e]) or failed.get(e, '-')] for e in ENGINES]
    print()
    print(table(['engine', 'samples/s (median)', 'every job'], rows))
    targets = Targets()
    if med['horovod'] and med['dist_sync']:
        targets.check('horovod / dist_sync samples/s', med['horovod'] / med['dist_sync'], 1.0,
                      op='>=')
    else:
        targets.note('horovod / dist_sync samples/s', 'SKIP', '; '.join(failed.values()))
    print_targets(targets)
    return 0


if __name__ == '__main__':
    sys.exit(main())
