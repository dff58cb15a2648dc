"""A small dist_sync job for tests/test_launch_stall.py: every worker trains
a tiny MLP (``gluon.Trainer`` on ``dist.get_kvstore()``, or ``gp.Trainer``
with ``--gp-trainer``), and one of them may be made to misbehave at a
chosen step: block in Python forever, take a step more than the others,
spend long in ``dist.busy``, or warm up long before its first step.

Nothing happens before ``import mxnet`` (via gluon_parallel.dist): in the
scheduler and server roles that import runs the server loop and exits.
"""
import argparse
import os
import threading
import time

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
    args = p.parse_args()
    mx.random.seed(0)
    net = gluon.nn.Dense(4, in_units=8)
    net.initialize(mx.init.Xavier(), ctx=[mx.cpu()])
    kind = gp.Trainer if args.gp_trainer else gluon.Trainer
    trainer = kind(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                   kvstore=dist.get_kvstore(), update_on_kvstore=False)
    dist.init_trainer(trainer)
    rank, me = dist.rank(), dist.rank() == args.rank
    x, y = mx.nd.ones((4, 8)), mx.nd.zeros((4, 4))
    steps = args.steps + (1 if me and args.fault == 'extra-step' else 0)
    if me and args.fault == 'warmup':
        time.sleep(args.seconds)
    print(f'ready rank {rank:d} pid {os.getpid():d}', flush=True)
    for step in range(1, steps + 1):
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
    print(f'done {steps:d} steps', flush=True)


if __name__ == '__main__':
    main()
