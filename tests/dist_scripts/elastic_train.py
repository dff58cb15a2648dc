"""An elastic training job for tests/test_elastic_training.py.

Every worker trains train_dist.py's MLP (no BatchNorm, no dropout) with
Adam on its part of each global batch of ``--batch`` samples
(dist.GlobalBatchSampler over 53 samples, 2 epochs), with a checkpoint
``OUT/ckpt-STEP`` every ``--every`` steps (dist.save_checkpoint: the
position in global samples). A restarted attempt resumes from the latest
checkpoint; ``--resume PREFIX`` starts from that one. At the end (or after
``--stop-after`` steps) rank 0 writes ``OUT/final.params``.

``--event ATTEMPT:RANK:STEP:SLOTS:kill|grow`` (repeatable): in that attempt,
before that step, that worker writes ``localhost:SLOTS`` to ``--hosts``;
kill: then SIGKILLs itself; grow: then waits until the discovery command
has run again (it touches ``--hosts``.seen) and a moment more, so the
launcher has seen the slots before the next checkpoint.
"""
import argparse
import glob
import os
import signal
import time

import numpy as np

from gluon_parallel import dist   # imports mxnet: servers and the scheduler stop here
import mxnet as mx
from mxnet import autograd, gluon, nd
import gluon_parallel as gp
from gluon_parallel.launch import RESTART_ENV

import train_dist

SAMPLES, EPOCHS = 53, 2


def latest(out):
    steps = [int(p[len(out) + 6:-5]) for p in glob.glob(os.path.join(out, 'ckpt-*.json'))]
    return os.path.join(out, f'ckpt-{max(steps):d}') if steps else None


def event(args, attempt, step):
    for e in args.event:
        a, rank, at, slots, what = e.split(':')
        if (int(a), int(rank), int(at)) != (attempt, dist.rank(), step):
            continue
        seen = args.hosts + '.seen'
        if os.path.exists(seen):
            os.remove(seen)
        with open(args.hosts + '.tmp', 'w') as f:
            f.write(f'localhost:{slots}\n')
        os.replace(args.hosts + '.tmp', args.hosts)
        if what == 'kill':
            os.kill(os.getpid(), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not os.path.exists(seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--out', required=True)
    p.add_argument('--init', required=True)
    p.add_argument('--batch', type=int, default=8, help='global batch size')
    p.add_argument('--every', type=int, default=3)
    p.add_argument('--num-ctx', type=int, default=1)
    p.add_argument('--resume', default=None)
    p.add_argument('--stop-after', type=int, default=None)
    p.add_argument('--hosts', default=None)
    p.add_argument('--event', action='append', default=[])
    args = p.parse_args()
    dist.get_kvstore()
    attempt = int(os.environ.get(RESTART_ENV) or 0)
    ctx = [mx.cpu(i) for i in range(args.num_ctx)]
    net = train_dist.make_net(None)
    net.load_parameters(args.init, ctx=ctx)
    trainer = gluon.Trainer(net.collect_params(), 'adam', {'learning_rate': 0.01},
                            kvstore=dist.get_kvstore())
    resume = latest(args.out) if attempt else args.resume
    position, step = {'epoch': 0, 'samples': 0}, 0
    if resume:
        meta = dist.load_checkpoint(resume, net, trainer)
        position, step = meta['position'], meta['step']
        name = os.path.basename(resume)
        print(f'attempt {attempt:d}: {dist.num_workers():d} workers from {name}', flush=True)
    else:
        dist.init_trainer(trainer)
    x, y = (nd.array(a[:SAMPLES]) for a in train_dist.make_data(7, 8, seed=3))
    sampler = dist.GlobalBatchSampler(SAMPLES, args.batch, shuffle=True, seed=1)
    dp_loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    with gp.DataParallel(net, ctx) as dp:
        for epoch in range(position['epoch'], EPOCHS):
            sampler.set_epoch(epoch, position['samples'] if epoch == position['epoch'] else 0)
            for k, part in enumerate(sampler):
                if step == args.stop_after:
                    break
                event(args, attempt, step)
                idx = nd.array(part, dtype='int64')
                with autograd.record():
                    losses = dp_loss(dp(x.take(idx)), y.take(idx))
                autograd.backward(losses)
                trainer.step(sampler.global_batch_size(k))
                step += 1
                if step % args.every == 0:
                    dist.save_checkpoint(os.path.join(args.out, f'ckpt-{step:d}'), net, trainer,
                                         step=step, position=sampler.position(k + 1))
    if dist.is_root():
        net.save_parameters(os.path.join(args.out, 'final.params'))
    print(f'done at step {step:d}', flush=True)


if __name__ == '__main__':
    np.seterr(all='raise')
    main()
