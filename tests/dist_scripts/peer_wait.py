"""A stand-in for a Horovod job, without Horovod or MXNet, for
tests/test_launch_stall.py: every worker runs steps whose reduction is a
barrier of files in DIR (each worker writes its own file for the step and
waits for the others'), reported through ``gluon_parallel.progress`` as a
real reduction is. A worker that waits longer than ``--wait`` seconds
raises a Gloo-like timeout, as a Horovod worker does when its peer stops.

``--fault block``: worker ``--rank`` blocks in Python (time.sleep) at step
``--at``, before its reduction. ``--fault raise``: worker ``--rank`` raises
in its own code at step ``--at`` while everyone moves. The scheduler and
servers of a dist_sync launch only wait to be stopped.
"""
import argparse
import functools
import os
import time

from gluon_parallel import progress


def reduction(folder, step, rank, size, limit):
    """The barrier of `step`; raises after `limit` seconds without the others."""
    open(os.path.join(folder, f'{step:d}.{rank:d}'), 'w').close()
    end = time.monotonic() + limit
    while not all(os.path.exists(os.path.join(folder, f'{step:d}.{r:d}')) for r in range(size)):
        if time.monotonic() > end:
            raise RuntimeError(f'gloo::IoException: [gloo/transport/tcp/pair.cc:598] Timed out '
                               f'waiting {limit * 1000:.0f}ms for recv operation to complete')
        time.sleep(0.02)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('dir')
    p.add_argument('--steps', type=int, default=1000)
    p.add_argument('--fault', choices=('block', 'raise'), default='block')
    p.add_argument('--rank', type=int, default=1)
    p.add_argument('--at', type=int, default=20)
    p.add_argument('--wait', type=float, default=8.0)
    args = p.parse_args()
    if os.environ.get('DMLC_ROLE', 'worker') != 'worker':
        while True:
            time.sleep(1)
    rank, size = int(os.environ['GLUON_PARALLEL_LAUNCH_RANK']), int(os.environ['DMLC_NUM_WORKER'])
    for step in range(1, args.steps + 1):
        time.sleep(0.05)            # its own work
        if rank == args.rank and step == args.at:
            print(f'{args.fault} at step {step:d}', flush=True)
            if args.fault == 'raise':
                raise ValueError('a bug in its own code')
            time.sleep(3600)
        run = functools.partial(reduction, args.dir, step, rank, size, args.wait)
        progress.reduce('grads', run)
    print(f'done {args.steps:d} steps', flush=True)


if __name__ == '__main__':
    main()
