"""Training runs for the checkpoint tests: the DataParallel loop they
train with, and the two halves of the resume test that run in processes of
their own (train N steps, save, keep going; or load and train M more)."""
import os

import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp
from loops import ADAM, CTX, LOSS, SGD, conv_net, make_batches, values

RESUME_CONFIGS = [
    # name, optimizer, update_on_kvstore at save, at load, batch norm
    ('sgd', SGD, None, None, 'sync'),
    ('sgd-local', SGD, False, False, 'sync'),
    ('adam', ADAM, None, None, 'sync'),
    ('adam-local-then-kvstore', ADAM, False, None, 'sync'),
    ('sgd-plain-bn', SGD, None, None, 'plain'),
]
N_STEPS, M_STEPS = 3, 2


def resume_model(bn, ctx):
    net = conv_net(gp.nn.SyncBatchNorm if bn == 'sync' else nn.BatchNorm)
    net.initialize(mx.init.Xavier(), ctx=ctx)      # overwritten by the checkpoint
    return net


def train(net, trainer, batches, ctx):
    with gp.DataParallel(net, ctx) as dp:
        dp_loss = gp.DataParallelLoss(LOSS)
        for x, y in batches:
            with autograd.record():
                losses = dp_loss(dp(x), y)
            autograd.backward(losses)
            trainer.step(len(x))


def resume_child(folder):
    """Run in a new process: load each checkpoint, train M more steps."""
    batches = make_batches([12, 10, 12, 3, 12])[N_STEPS:]
    out = {}
    for name, opt, _, uok, bn in RESUME_CONFIGS:
        net = resume_model(bn, CTX)
        trainer = gluon.Trainer(net.collect_params(), opt[0], dict(opt[1]),
                                update_on_kvstore=uok)
        meta = gp.load_checkpoint(os.path.join(folder, name), net, trainer)
        assert meta == {'step': N_STEPS, 'name': name}, meta
        train(net, trainer, batches, CTX)
        for k, copies in values(net).items():
            for i, c in enumerate(copies):
                out[f'{name}|{k}|{i:d}'] = nd.array(c)
    nd.save(os.path.join(folder, 'resumed.params'), out)


def uninterrupted_child(folder, init):
    """Run in a new process: train N steps, save, keep going M more steps
    without stopping; write the final values."""
    batches = make_batches([12, 10, 12, 3, 12])
    out = {}
    for name, opt, uok, _, bn in RESUME_CONFIGS:
        net = conv_net(gp.nn.SyncBatchNorm if bn == 'sync' else nn.BatchNorm)
        net.load_parameters(init, ctx=CTX)
        trainer = gluon.Trainer(net.collect_params(), opt[0], dict(opt[1]),
                                update_on_kvstore=uok)
        train(net, trainer, batches[:N_STEPS], CTX)
        gp.save_checkpoint(os.path.join(folder, name), net, trainer, step=N_STEPS, name=name)
        train(net, trainer, batches[N_STEPS:], CTX)      # keeps going, never stops
        for k, copies in values(net).items():
            for i, c in enumerate(copies):
                out[f'{name}|{k}|{i:d}'] = nd.array(c)
    nd.save(os.path.join(folder, 'uninterrupted.params'), out)
