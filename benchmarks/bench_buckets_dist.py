"""dist_sync with gradient buckets against one key per parameter.

The job: the CIFAR ResNet-20 of bench_train.py (BatchNorm, hybridized, so
graph mode) on synthetic 3x32x32 images, 2 worker processes x 2 CPU
contexts, 32 images per worker, SGD with momentum, ``gluon_parallel.Trainer``
on ``dist.get_kvstore()`` (``python -m gluon_parallel.launch -n 2 -s 1``: one
parameter server). Contenders, one job each per round, alternating:

  buckets   gp.Trainer's default: the gradients as views of flat buckets
            (bucket_cap_mb=25: ResNet-20's 65 gradients are one bucket),
            one key per bucket
  per-key   gp.Trainer(bucket_cap_mb=0): one key per parameter (Gluon's)

Each job reports, per worker:

* the time per step over --steps steps (``nd.waitall()`` at both ends);
* the summing's share of a step: over --probe more steps, the time of
  ``trainer.allreduce_grads()`` alone (after ``nd.waitall()`` and a
  barrier of the workers, up to its own ``nd.waitall()``) over the step's;
* with --messages (a separate job per contender, not timed, its processes
  under ``PS_VERBOSE=2``): the ps-lite data messages each worker sends
  and receives per step, counted from ps-lite's own log of every message
  (requests sent, responses received; the barriers' control messages not
  counted).

Targets (issue 40): messages per step per worker = 2 x buckets (1 bucket:
2, from 2 x 65), and step time with buckets <= 0.85 x per-key's.
"""
import argparse
import statistics
import sys
import time

from harness.jobs import resnet20_worker, result_line, run_job as launch_job
from harness.machine import load_avg, load_str
from harness.tables import Targets, print_targets, table

CONTENDERS = {'buckets': 25, 'per-key': 0}
MARK = 'BENCH_MESSAGES'


def worker(args):
    """One worker of the job: train, time, print a BENCH_RESULT line."""
    import gluon_parallel as gp
    trainer, dp, dp_loss = resnet20_worker(args.contexts, hybridize=True,
                                           trainer_cls=gp.Trainer, bucket_cap_mb=args.cap)
    from gluon_parallel import dist
    from mxnet import autograd, nd
    x = nd.random.uniform(shape=(args.batch, 3, 32, 32))
    y = nd.random.randint(0, 10, shape=(args.batch,)).astype('float32')
    global_batch = dist.global_batch_size(args.batch)

    def backward():
        with autograd.record():
            losses = dp_loss(dp(x), y)
        autograd.backward(losses)

    def meet():
        nd.waitall()
        dist.barrier()

    for _ in range(args.warmup):
        backward()
        trainer.step(global_batch)
    meet()
    if args.messages:
        sys.stderr.write(f'{MARK} start\n')
        sys.stderr.flush()
    start = time.perf_counter()
    for _ in range(args.steps):
        backward()
        trainer.step(global_batch)
    nd.waitall()
    seconds = (time.perf_counter() - start) / args.steps
    if args.messages:
        sys.stderr.write(f'{MARK} end\n')
        sys.stderr.flush()
    summing = []
    for _ in range(args.probe):
        backward()
        meet()
        t = time.perf_counter()
        trainer.allreduce_grads()
        nd.waitall()
        summing.append(time.perf_counter() - t)
        trainer.update(global_batch)
    buckets = trainer._buckets
    result_line({'rank': dist.rank(), 'step': seconds,
                 'summing': statistics.median(summing) if summing else None,
                 'buckets': len(buckets.layouts) if buckets else 0,
                 'params': sum(p.grad_req != 'null' for p in trainer._params)})
    meet()
    dp.close()


def count_messages(output, rank):
    """ps-lite data messages worker `rank` sent (requests) and received
    (responses) between its marks, from ps-lite's PS_VERBOSE=2 log
    (``van.cc``: one line per message sent, one per message received)."""
    prefix, inside, count = f'[worker {rank:d}] ', False, 0
    for line in output.splitlines():
        if not line.startswith(prefix):
            continue
        if f'{MARK} start' in line:
            inside = True
        elif f'{MARK} end' in line:
            inside = False
        elif inside:
            # (two threads' messages may share a line: count them all)
            count += line.count('push=')
    return count


def run_job(name, args, messages=False):
    """Each worker's result of one job of contender `name`, or (None, why)."""
    worker_args = ['--cap', CONTENDERS[name], '--steps', args.steps, '--warmup', args.warmup,
                   '--batch', args.batch, '--contexts', args.contexts,
                   '--probe', 0 if messages else args.probe] + (['--messages'] if messages else [])
    results, why, output = launch_job(__file__, worker_args, args.timeout,
                                      env={'PS_VERBOSE': '2'} if messages else None)
    if results is not None and messages:
        for r in results:
            r['messages'] = count_messages(output, r['rank']) / args.steps
    return results, why


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--rounds', type=int, default=4, help='jobs per contender (default %(default)s)')
    p.add_argument('--steps', type=int, default=20, help='timed steps (default %(default)s)')
    p.add_argument('--probe', type=int, default=10,
                   help='steps timing the summing alone (default %(default)s)')
    p.add_argument('--warmup', type=int, default=5, help='untimed steps (default %(default)s)')
    p.add_argument('--batch', type=int, default=32, help='per-worker batch (default %(default)s)')
    p.add_argument('--contexts', type=int, default=2,
                   help='CPU contexts per worker (default %(default)s)')
    p.add_argument('--timeout', type=int, default=600, help='seconds per job (default %(default)s)')
    p.add_argument('--cap', type=float, help=argparse.SUPPRESS)
    p.add_argument('--messages', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--quick', action='store_true', help='smoke run: 1 round, 3 steps')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.probe = 1, 3, 1, 2
    names = list(CONTENDERS)
    print(f'bench_buckets_dist: ResNet-20 hybridized, dist_sync 2 workers x {args.contexts:d} '
          f'CPU contexts, {args.batch:d} images per worker, {args.steps:d} timed steps per job, '
          f'{args.rounds:d} rounds; {load_str(load_avg())}')
    counted, failed = {}, {}
    for name in names:
        results, why = run_job(name, args, messages=True)
        if results is None:
            failed[name] = why
            print(f'  messages {name}: failed: {why}', flush=True)
        else:
            counted[name] = results
            print(f'  messages {name}: ' + ', '.join(
                f'worker {r["rank"]:d} {r["messages"]:.1f}/step' for r in results), flush=True)
    step, share = {n: [] for n in names}, {n: [] for n in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            results, why = run_job(name, args)
            if results is None:
                failed[name] = why
                print(f'  round {r:d} {name:<8} failed: {why}', flush=True)
                continue
            seconds = max(x['step'] for x in results)
            step[name].append(seconds)
            share[name] += [x['summing'] / x['step'] for x in results]
            print(f'  round {r:d} {name:<8} {seconds * 1e3:.1f} ms/step, summing '
                  f'{statistics.median(x["summing"] for x in results) * 1e3:.2f} ms', flush=True)
    med = {n: statistics.median(v) if v else None for n, v in step.items()}
    rows = []
    for n in names:
        info = counted.get(n, [{}])[0]
        rows.append([n, str(info.get('buckets', '-')), str(info.get('params', '-')),
                     ' / '.join(f'{x["messages"]:.1f}' for x in counted.get(n, [])) or '-',
                     '-' if med[n] is None else f'{med[n] * 1e3:.1f}',
                     f'{statistics.median(share[n]):.3f}' if share[n] else '-',
                     ', '.join(f'{v * 1e3:.1f}' for v in step[n]) or failed.get(n, '-')])
    print()
    print(table(['contender', 'buckets', 'trained params', 'messages/step (worker 0 / 1)',
                 'ms/step (median)', 'summing share of step', 'every job'], rows))
    targets = Targets()
    if 'buckets' in counted:
        got = max(x['messages'] for x in counted['buckets'])
        targets.check('buckets: messages per step per worker', got,
                      2 * counted['buckets'][0]['buckets'], op='<=')
    if med['buckets'] and med['per-key']:
        targets.check('buckets / per-key ms per step', med['buckets'] / med['per-key'], 0.85)
    print_targets(targets)
    return 0


if __name__ == '__main__':
    sys.exit(main())
