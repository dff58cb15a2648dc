"""A small dist_sync job for tests/test_launch_stall.py: every worker trains
a tiny MLP (``gluon.Trainer`` on ``dist.get_kvstore()``, or ``gp.Trainer``
with ``--gp-trainer``), and one of them may be made to misbehave at a
chosen step: block in Python forever, take a step more than the others,
spend long in ``dist.busy``, or warm up long before its first step (in
attempt 0 only). ``--save-dir``: a checkpoint every ``--save-every`` steps,
resumed from in a restarted attempt, and rank 0's final parameters.

Nothing happens before ``import mxnet`` (via gluon_parallel.dist): in the
scheduler and server roles that import runs the server loop and exits.
"""
import argparse
import os
import threading
import time

import numpy as np

from gluon_parallel import dist   # imports mxnet: servers and the scheduler stop here
import mxnet as mx
from mxnet import autograd, gluon
import gluon_parallel as gp


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--steps', type=int, default=50)
    p.add_argument('--pause', type=float, default=0.0, help='seconds of own work per step')
    p.add_argument('--rank', type=int, default=1, help='the worker that misbehaves')
    p.add_argument('--at', type=int, default=10, help='at this step')
    p.add_argument('--fault', choices=('none', 'block', 'extra-step', 'busy', 'warmup'),
                   default='none')
    p.add_argument('--seconds', type=float, default=0.0, help='busy / warm-up length')
    p.add_argument('--gp-trainer', action='store_true')
    p.add_argument('--save-dir', default=None)
    p.add_argument('--save-every', type=int, default=10)
    args = p.parse_args()
    attempt = int(os.environ.get('GLUON_PARALLEL_RESTART', '0'))
    if attempt:
        args.fault = 'none'
    mx.random.seed(0)
    net = gluon.nn.Dense(4, in_units=8)
    net.initialize(mx.init.Xavier(), ctx=[mx.cpu()])
    kind = gp.Trainer if args.gp_trainer else gluon.Trainer
    trainer = kind(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                   kvstore=dist.get_kvstore(), update_on_kvstore=False)
    prefix = os.path.join(args.save_dir, 'ckpt') if args.save_dir else None
    first = 1
    if prefix and attempt and os.path.exists(prefix + '.json'):
        first = dist.load_checkpoint(prefix, net, trainer)['step'] + 1
        print(f'resumed at step {first:d}', flush=True)
    else:
        dist.init_trainer(trainer)
    rank, me = dist.rank(), dist.rank() == args.rank
    steps = args.steps + (1 if me and args.fault == 'extra-step' else 0)
    if me and args.fault == 'warmup':
        time.sleep(args.seconds)
    print(f'ready rank {rank:d} pid {os.getpid():d}', flush=True)
    for step in range(first, steps + 1):
        rng = np.random.RandomState(step * 2 + rank)
        x, y = mx.nd.array(rng.randn(4, 8)), mx.nd.array(rng.randn(4, 4))
        if me and step == args.at and args.fault == 'block':
            print(f'blocking at step {step:d}', flush=True)
            threading.Event().wait()
        if me and step == args.at and args.fault == 'busy':
            with dist.busy('evaluating'):
                time.sleep(args.seconds)
        with autograd.record():
            loss = ((net(x) - y) ** 2).sum()
        loss.backward()
        trainer.step(dist.global_batch_size(4))
        if args.pause:
            time.sleep(args.pause)
        if step % 10 == 0:
            print(f'step {step:d} loss {loss.asscalar():.6f}', flush=True)
        if prefix and step % args.save_every == 0:
            dist.save_checkpoint(prefix, net, trainer, step=step)
    if prefix and rank == 0:
        net.save_parameters(os.path.join(args.save_dir, 'final.params'))
    print(f'done {steps:d} steps', flush=True)


if __name__ == '__main__':
    main()
