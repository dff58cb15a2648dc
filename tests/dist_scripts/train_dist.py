"""A small dist_sync training run for tests/test_dist.py.

Run under ``python -m gluon_parallel.launch``: every worker trains a small
MLP with SGD + momentum on its shard of a fixed data set, with DataParallel
on ``--num-ctx`` CPU contexts, and writes its final parameters to
``OUT/rank<r>.params`` (and what it saw to ``OUT/rank<r>.json``).

Nothing happens before ``import mxnet`` (via gluon_parallel.dist): in the
scheduler and server roles that import runs the server loop and exits.
"""
import argparse
import json
import os

import numpy as np

from gluon_parallel import dist   # imports mxnet: servers and the scheduler stop here
import mxnet as mx
from mxnet import autograd, gluon
import gluon_parallel as gp

IN_UNITS, HIDDEN, CLASSES = 8, 16, 4


def make_data(num_batches, global_batch, seed=0):
    """The data set: the same in every process, and in the test's reference."""
    rng = np.random.RandomState(seed)
    n = num_batches * global_batch
    x = (rng.randn(n, IN_UNITS) * 2 + 3).astype('float32')
    y = rng.randint(0, CLASSES, size=n).astype('float32')
    return x, y


class TwinNorm(gluon.HybridBlock):
    """bn_a(x) + bn_b(x) + 2 bn_a(x): two layers normalising the same
    input, one of them twice (in a hybridized graph all three uses merge at
    one barrier), with different momenta. bn_a's two uses see the same
    batch (BatchNorm updates running statistics in backward order, ours in
    call order) but get different gradients."""

    def __init__(self, batchnorm, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.bn_a = batchnorm(in_channels=HIDDEN)
            self.bn_b = batchnorm(in_channels=HIDDEN, momentum=0.8)

    def hybrid_forward(self, F, x):
        return self.bn_a(x) + self.bn_b(x) + 2 * self.bn_a(x)


def make_net(batchnorm=None):
    """Dense -> [BatchNorm] -> relu -> Dense; `batchnorm` is the BN class
    (two of them side by side, see TwinNorm)."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(HIDDEN, in_units=IN_UNITS))
    if batchnorm is not None:
        net.add(TwinNorm(batchnorm))
    net.add(gluon.nn.Activation('relu'))
    net.add(gluon.nn.Dense(CLASSES, in_units=HIDDEN))
    return net


OPTIMIZER = ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4})


def count_reductions(kv, calls):
    """From now on, append to `calls` the size of every summing call: the
    arrays of a batched push/pull of MXNet's kvstore (its one C call, keys
    times contexts), or the keys of the Horovod store's ``pushpull_group``
    (-1 for a single key's ``pushpull``)."""
    if isinstance(kv, mx.kv.KVStore):
        lib, real = mx.base._LIB, mx.base._LIB.MXKVStorePushPull

        def counting(handle, n, *rest):
            calls.append(n.value)
            return real(handle, n, *rest)
        lib.MXKVStorePushPull = counting
        return
    group, single = kv.pushpull_group, kv.pushpull

    def grouped(keys, values, *rest, **kwargs):
        calls.append(len(keys))
        return group(keys, values, *rest, **kwargs)

    def one(*args, **kwargs):
        calls.append(-1)
        return single(*args, **kwargs)
    kv.pushpull_group, kv.pushpull = grouped, one


def freeze(net):
    """The first layer's parameters are not trained."""
    net[0].collect_params().setattr('grad_req', 'null')


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--out', required=True)
    p.add_argument('--init', required=True, help='initial parameters (rank 0 loads them)')
    p.add_argument('--num-ctx', type=int, default=2)
    p.add_argument('--batch', type=int, default=8, help='per-worker batch size')
    p.add_argument('--steps', type=int, default=5)
    p.add_argument('--syncbn', action='store_true', help='cross-worker SyncBatchNorm')
    p.add_argument('--hybridize', action='store_true', help='net.hybridize(static_alloc=True)')
    p.add_argument('--save-at', type=int, default=None, help='checkpoint after this many steps')
    p.add_argument('--resume', default=None, help='checkpoint prefix to resume from')
    p.add_argument('--fail-at', type=int, default=None, help='rank 1 raises at this step')
    p.add_argument('--skew-names', action='store_true',
                   help='rank 1 builds another block first, so its names differ (misuse)')
    p.add_argument('--server-updates', action='store_true',
                   help='a Trainer that runs the optimizer on the servers (misuse)')
    p.add_argument('--gp-trainer', action='store_true', help='gluon_parallel.Trainer')
    p.add_argument('--bucket-cap', type=float, default=None, help="gp.Trainer's bucket_cap_mb")
    p.add_argument('--compression', default=None,
                   help="gp.Trainer's compression ('fp16'), or '2bit': MXNet's kvstore "
                        "compression (compression_params, threshold 0.5)")
    p.add_argument('--grad-add', action='store_true',
                   help="grad_req='add', the gradients zeroed after each step")
    p.add_argument('--freeze', action='store_true', help="the first layer's grad_req='null'")
    args = p.parse_args()

    ctx = [mx.cpu(i) for i in range(args.num_ctx)]
    rank, workers = dist.rank(), dist.num_workers()
    if args.skew_names and rank == 1:
        gluon.nn.Dense(HIDDEN, in_units=IN_UNITS)      # takes the name dense0_
    net = make_net(gp.nn.SyncBatchNorm if args.syncbn else None)
    if rank == 0:
        net.load_parameters(args.init, ctx=ctx)
    else:
        # Deliberately different values: init_trainer must give every
        # worker rank 0's.
        mx.random.seed(1234 + rank)
        net.initialize(mx.init.Uniform(1.0), ctx=ctx)
    if args.syncbn:
        dist.sync_batchnorm_across_workers(net)
    if args.hybridize:
        net.hybridize(static_alloc=True)
    if args.grad_add:
        net.collect_params().setattr('grad_req', 'add')
    if args.freeze:
        freeze(net)
    trainer_cls = gp.Trainer if args.gp_trainer else gluon.Trainer
    kwargs = {k: v for k, v in (('bucket_cap_mb', args.bucket_cap),
                                ('compression', args.compression)) if v is not None}
    if args.compression == '2bit':
        kwargs['compression'] = None
        kwargs['compression_params'] = {'type': '2bit', 'threshold': 0.5}
    trainer = trainer_cls(net.collect_params(), *OPTIMIZER, kvstore=dist.get_kvstore(),
                          update_on_kvstore=args.server_updates, **kwargs)
    start = 0
    if args.resume:
        start = dist.load_checkpoint(args.resume, net, trainer)['step']
    elif not args.server_updates:
        dist.init_trainer(trainer)

    x, y = make_data(args.steps, args.batch * workers)
    data = dist.shard(gluon.data.ArrayDataset(x, y))
    loader = gluon.data.DataLoader(data, batch_size=args.batch, shuffle=False)
    dp = gp.DataParallel(net, ctx)
    dp_loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    losses_seen, reductions = [], []
    count_reductions(dist.get_kvstore(), reductions)
    for step, (xb, yb) in enumerate(loader):
        if step < start:
            continue
        if args.fail_at is not None and step == args.fail_at and rank == 1:
            raise RuntimeError(f'injected failure at step {step:d} on rank {rank:d}')
        with autograd.record():
            losses = dp_loss(dp(xb), yb)
        autograd.backward(losses)
        trainer.step(dist.global_batch_size(xb.shape[0]))
        if args.grad_add:
            net.collect_params().zero_grad()
        losses_seen.append(float(sum(x.sum().asscalar() for x in losses)))
        if args.save_at is not None and step + 1 == args.save_at:
            dist.save_checkpoint(os.path.join(args.out, 'ckpt'), net, trainer, step=step + 1)
    dp.close()

    os.makedirs(args.out, exist_ok=True)
    net.save_parameters(os.path.join(args.out, f'rank{rank:d}.params'))
    # Every context's copy, to check they agree.
    copies = {name: [d.asnumpy().tolist() for d in prm.list_data()]
              for name, prm in net.collect_params().items() if 'running' in name}
    with open(os.path.join(args.out, f'rank{rank:d}.json'), 'w') as f:
        json.dump({'rank': rank, 'num_workers': workers, 'steps': len(losses_seen),
                   'launch_rank': os.environ.get('GLUON_PARALLEL_LAUNCH_RANK'),
                   'running_copies': copies, 'shard': len(data),
                   'graph_binds': dp.graph_mode.binds, 'reductions': reductions,
                   'trainer': type(trainer).__module__ + '.' + type(trainer).__name__}, f)
    print(f'rank {rank:d} done: {len(losses_seen):d} steps', flush=True)


if __name__ == '__main__':
    main()
