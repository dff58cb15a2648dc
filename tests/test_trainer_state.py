"""gluon_parallel/checkpoint/trainer_state.py: optimizer state that does not
depend on the number of devices.

A checkpoint saved by a trainer on N contexts and loaded (gp.load_checkpoint)
by one on M contexts trains on with every replica identical, and equal to
the run that kept its N contexts, for gluon.Trainer and gp.Trainer and every
optimizer MXNet 1.9.1 registers (MXNet keeps update counts per device id,
and the states file holds one device's; before spread_update_counts Adam
2 -> 4 contexts left the replicas 1.3e-2 apart). Two exceptions, whose
replicas differ in a run that never changes size (docs/elastic.md):
SGLD draws its noise per device, and Nadam keeps one momentum schedule
that every update of every parameter on every device advances (with
updates on the kvstore, one updater, it does not depend on the devices).
"""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import gluon_parallel as gp

# Optimizers whose replicas differ even in a run that never changes size.
PER_DEVICE = {'sgld': 'noise drawn per device', 'nadam': 'one schedule for all updates'}
OPTIMIZERS = sorted(set(mx.optimizer.Optimizer.opt_registry) - set(PER_DEVICE))
PARAMS = {'sgd': {'momentum': 0.9}, 'nag': {'momentum': 0.9}, 'ccsgd': {'momentum': 0.9},
          'lbsgd': {'momentum': 0.9}, 'lars': {'momentum': 0.9}}
X = np.random.RandomState(0).randn(12, 4).astype('float32')
Y = np.random.RandomState(1).randn(12, 3).astype('float32')
STEPS = 3


def _net(ctx):
    # No biases: GroupAdaGrad takes 2-D weights only.
    net = gluon.nn.HybridSequential(prefix='m_')
    with net.name_scope():
        net.add(gluon.nn.Dense(5, in_units=4, use_bias=False, activation='tanh'),
                gluon.nn.Dense(3, in_units=5, use_bias=False))
    net.initialize(mx.init.Constant(0), ctx=ctx)
    rng = np.random.RandomState(2)
    for p in net.collect_params().values():
        p.set_data(nd.array(rng.normal(0, 0.5, p.shape)))
    return net


def _trainer(kind, name, net, update_on_kvstore):
    cls = gp.Trainer if kind == 'gp' else gluon.Trainer
    return cls(net.collect_params(), name, dict(PARAMS.get(name, {}), learning_rate=0.01),
               update_on_kvstore=True if kind == 'kvstore' else update_on_kvstore)


def _train(net, trainer, ctx, steps):
    for s in steps:
        xs = gluon.utils.split_and_load(nd.array(X * (1 + 0.1 * s)), ctx)
        ys = gluon.utils.split_and_load(nd.array(Y), ctx)
        with autograd.record():
            losses = [((net(x) - y) ** 2).sum() for x, y in zip(xs, ys)]
        autograd.backward(losses)
        trainer.step(len(X))


def _replicas(net):
    return {k: [a.asnumpy() for a in p.list_data()] for k, p in net.collect_params().items()}


# gp.Trainer runs Gluon's own update for every optimizer but SGD (fused):
# SGD and one optimizer that reads the counts cover both of its paths.
# Updates on the kvstore: one updater, whatever the devices (Nadam included;
# Gluon 1.9.1 has no kvstore on one device, where update_on_kvstore fails).
CASES = [(name, kind, sizes) for name, kind in
         [(name, 'gluon') for name in OPTIMIZERS] + [('sgd', 'gp'), ('adam', 'gp')]
         for sizes in ((2, 4), (3, 1))] + [('adam', 'kvstore', (2, 4)),
                                           ('nadam', 'kvstore', (2, 4))]


@pytest.mark.parametrize('name,kind,sizes', CASES,
                         ids=[f'{n}-{k}-{a}to{b}' for n, k, (a, b) in CASES])
def test_a_checkpoint_loads_on_any_number_of_devices(tmp_path, name, kind, sizes):
    before, after = ([mx.cpu(i) for i in range(n)] for n in sizes)
    uok = False         # updates on the devices (but kind 'kvstore'): counts kept per device
    net = _net(before)
    trainer = _trainer(kind, name, net, uok)
    _train(net, trainer, before, range(2 * STEPS))
    kept = _replicas(net)

    net = _net(before)
    trainer = _trainer(kind, name, net, uok)
    _train(net, trainer, before, range(STEPS))
    gp.save_checkpoint(tmp_path / 'ckpt', net, trainer)
    net = _net(after)
    trainer = _trainer(kind, name, net, uok)
    gp.load_checkpoint(tmp_path / 'ckpt', net, trainer)
    _train(net, trainer, after, range(STEPS, 2 * STEPS))
    for k, copies in _replicas(net).items():
        for i, c in enumerate(copies[1:], 1):
            assert np.array_equal(c, copies[0]), (k, i, abs(c - copies[0]).max())
        want = kept[k][0]
        # Only the order of the gradient sums across devices differs.
        scale = max(1.0, float(abs(want).max()))
        assert abs(copies[0] - want).max() <= 1e-5 * scale, (k, abs(copies[0] - want).max())


@pytest.mark.parametrize('ids', [(2, 3), (0, 1)])
def test_counts_follow_other_device_ids(tmp_path, ids):
    """Saved on cpu(2), cpu(3) and loaded on cpu(0), cpu(1) (or the same
    ids): Adam goes on from the saved counts on every device."""
    saved = [mx.cpu(2), mx.cpu(3)]
    net = _net(saved)
    trainer = _trainer('gluon', 'adam', net, False)
    _train(net, trainer, saved, range(STEPS))
    gp.save_checkpoint(tmp_path / 'ckpt', net, trainer)
    net = _net([mx.cpu(i) for i in ids])
    trainer = _trainer('gluon', 'adam', net, False)
    gp.load_checkpoint(tmp_path / 'ckpt', net, trainer)
    counts = trainer._optimizer._all_index_update_counts
    for i in ids:
        assert counts[i] == {0: STEPS, 1: STEPS}, counts
