#!/usr/bin/env python
"""Train an image classifier on several devices with gluon_parallel.

With no arguments: a small CNN with SyncBatchNorm on the 8x8 digits that
ship with scikit-learn, data-parallel over 4 devices (every GPU if there
are any, else 4 CPU contexts). See examples/README.md for every flag.

    python examples/train_image_classification.py
    python examples/train_image_classification.py --dataset cifar10 \\
        --data-dir ~/data --model resnet20 --epochs 30 --batch-size 128

Every epoch prints one line that scripts can parse::

    epoch 3 train_loss=0.1234 train_acc=0.9650 val_acc=0.9711 samples/s=1530

and writes a checkpoint, metrics.csv and metrics.png to --save-dir.
"""
import argparse
import csv
import os
import random
import sys
import time

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon
from tqdm import tqdm

import gluon_parallel as gp
from gluon_parallel import dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from image_data import DATASETS, DataError, EpochSampler, load_dataset  # noqa: E402
from image_models import MODELS, build_model  # noqa: E402

# dist_*: several worker processes, under python -m gluon_parallel.launch or
# another DMLC launcher (dist_async keeps the optimizer state on the servers,
# where no checkpoint can save it, so it is not offered).
KVSTORES = ('device', 'local', 'nccl', 'dist_sync', 'dist_device_sync')
METRICS = ('epoch', 'train_loss', 'train_acc', 'val_acc', 'samples_per_s', 'lr', 'seconds')
# Flags that a resumed run must repeat: they change the data or the schedule.
RESUME_CONFIG = ('dataset', 'model', 'epochs', 'batch_size', 'max_steps_per_epoch', 'seed')


# ----------------------------------------------------------------- setup --

def positive_int(text):
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError('must be a positive integer, got %s' % text)
    return value


def parse_args(argv=None):
    """Parse and cross-check the command line (argparse exits on errors)."""
    p = argparse.ArgumentParser(
        description='Data-parallel image classification with gluon_parallel.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = p.add_argument_group('data')
    d.add_argument('--dataset', choices=DATASETS, default='digits',
                   help='digits ships with scikit-learn; cifar10, mnist, imagefolder and rec '
                        'are read from --data-dir (never downloaded); synthetic is random')
    d.add_argument('--data-dir', help='folder holding the data set files '
                                      '(required for cifar10, mnist, imagefolder, rec)')
    d.add_argument('--image-size', type=positive_int,
                   help='resize images to this square size (default: native size; '
                        '32 for imagefolder, rec and synthetic)')
    d.add_argument('--num-classes', type=positive_int,
                   help='rec: number of classes (default: counted from val.rec); '
                        'synthetic: number of classes (default 10)')
    d.add_argument('--num-samples', type=positive_int, default=2048,
                   help='synthetic: number of training images')
    d.add_argument('--num-workers', type=int,
                   help='DataLoader worker processes (default: 0 for in-memory data sets, '
                        'else min(4, CPU count))')
    m = p.add_argument_group('model and devices')
    m.add_argument('--model', choices=MODELS, default='small-cnn')
    m.add_argument('--num-devices', type=positive_int,
                   help='number of devices (default: every GPU, else 4 CPU contexts)')
    m.add_argument('--gpus', help='comma-separated GPU ids, e.g. 0,1,2,3')
    m.add_argument('--no-syncbn', action='store_true',
                   help='plain BatchNorm with per-device statistics instead of SyncBatchNorm')
    m.add_argument('--hybridize', action='store_true',
                   help='hybridize the network (needs --no-syncbn)')
    t = p.add_argument_group('training')
    t.add_argument('--batch-size', type=positive_int, default=64,
                   help='GLOBAL batch size, split across the devices (and the workers)')
    t.add_argument('--epochs', type=positive_int, default=8)
    t.add_argument('--lr', type=float, default=0.1,
                   help='initial learning rate, decayed to 0 by a cosine schedule')
    t.add_argument('--momentum', type=float, default=0.9)
    t.add_argument('--wd', type=float, default=5e-4, help='weight decay')
    t.add_argument('--seed', type=int, default=0)
    t.add_argument('--kvstore', choices=KVSTORES, default='device',
                   help='gradient aggregation, passed to gluon.Trainer')
    t.add_argument('--max-steps-per-epoch', type=positive_int,
                   help='stop every epoch after this many batches (quick tests)')
    o = p.add_argument_group('output')
    o.add_argument('--save-dir', default=None,
                   help='checkpoint, metrics.csv and metrics.png go here '
                        '(default: runs/DATASET-MODEL)')
    o.add_argument('--resume', nargs='?', const='', metavar='PREFIX',
                   help='continue from a checkpoint: PREFIX (PREFIX.params/.states/.json), '
                        'or, with no value, SAVE_DIR/checkpoint')
    o.add_argument('--no-progress', action='store_true', help='no tqdm progress bar')
    args = p.parse_args(argv)

    if args.dataset in ('cifar10', 'mnist', 'imagefolder', 'rec') and not args.data_dir:
        p.error('--dataset %s reads its files from disk: give --data-dir' % args.dataset)
    if args.hybridize and not args.no_syncbn:
        p.error('--hybridize needs --no-syncbn: SyncBatchNorm synchronises the devices in '
                'imperative mode only, so a network that contains it cannot be hybridized')
    if args.gpus is not None:
        try:
            args.gpus = [int(g) for g in args.gpus.split(',')]
        except ValueError:
            p.error('--gpus takes comma-separated integers, got %r' % args.gpus)
        if mx.context.num_gpus() == 0:
            p.error('--gpus given, but MXNet sees no GPU')
        if args.num_devices is not None and args.num_devices != len(args.gpus):
            p.error('--num-devices %d disagrees with --gpus %s'
                    % (args.num_devices, ','.join(map(str, args.gpus))))
    if args.num_workers is not None and args.num_workers < 0:
        p.error('--num-workers must be >= 0')
    if args.save_dir is None:
        args.save_dir = os.path.join('runs', '%s-%s' % (args.dataset, args.model))
    return args


def select_contexts(args):
    """--gpus, else the first --num-devices GPUs, else CPU contexts."""
    if args.gpus:
        return [mx.gpu(i) for i in args.gpus]
    gpus = mx.context.num_gpus()
    if gpus:
        n = args.num_devices or gpus
        if n > gpus:
            raise SystemExit('error: --num-devices %d, but there are only %d GPUs' % (n, gpus))
        return [mx.gpu(i) for i in range(n)]
    # mx.cpu(0..N-1) are distinct MXNet devices sharing the host's cores.
    return [mx.cpu(i) for i in range(args.num_devices or 4)]


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    mx.random.seed(seed)


def make_loaders(data, args):
    """Training loader (reshuffled per epoch by an EpochSampler) and
    validation loader; the last, smaller batch of each is kept."""
    workers = args.num_workers
    if workers is None:
        workers = 0 if data.in_memory else min(4, os.cpu_count() or 1)
    sampler = EpochSampler(len(data.train), args.seed)
    # Several workers: each reads its part of every epoch's order, with its
    # share of the global batch.
    train = gluon.data.DataLoader(data.train, batch_size=args.batch_size // dist.num_workers(),
                                  sampler=dist.shard_sampler(sampler),
                                  last_batch='keep', num_workers=workers)
    val = gluon.data.DataLoader(data.val, batch_size=args.batch_size, shuffle=False,
                                last_batch='keep', num_workers=workers)
    return train, val, sampler


def build_network(args, data, ctx_list):
    """The model, initialised on every device, parameter shapes known."""
    net = build_model(args.model, data.classes, data.image_size, syncbn=not args.no_syncbn)
    # He-style scaling suits the ReLU networks here; initialisation draws on
    # the CPU and copies to every device, so every replica starts identical.
    net.initialize(mx.init.Xavier(magnitude=2), ctx=ctx_list)
    if args.hybridize:
        net.hybridize(static_alloc=True)
    # One predict-mode call on a dummy image resolves the deferred shapes,
    # so a checkpoint can be loaded into them before training starts.
    with ctx_list[0], autograd.pause(train_mode=False):
        net(mx.nd.zeros((1, data.channels, data.image_size, data.image_size), ctx=ctx_list[0]))
    return net


def make_trainer(net, args, steps_per_epoch):
    """SGD with momentum and a cosine learning-rate decay to 0."""
    schedule = mx.lr_scheduler.CosineScheduler(max_update=args.epochs * steps_per_epoch,
                                               base_lr=args.lr, final_lr=0)
    return gluon.Trainer(net.collect_params(), 'sgd',
                         {'learning_rate': args.lr, 'momentum': args.momentum, 'wd': args.wd,
                          'lr_scheduler': schedule},
                         kvstore=dist.get_kvstore(args.kvstore))


# -------------------------------------------------------------- training --

def train_epoch(dp, dp_loss, trainer, loader, epoch, args):
    """One pass over `loader` with the documented data-parallel loop.

    Returns
    -------
    dict
        train_loss, train_acc, samples_per_s, steps.
    """
    steps = len(loader) if args.max_steps_per_epoch is None \
        else min(len(loader), args.max_steps_per_epoch)
    bar = tqdm(total=steps, desc='epoch %d/%d' % (epoch, args.epochs), unit='batch',
               disable=args.no_progress, leave=False, file=sys.stderr)
    loss_sum = correct = seen = 0
    start = time.time()
    for step, (data, label) in enumerate(loader):
        if step == steps:
            break
        with autograd.record():
            outputs = dp(data)                  # one output per device
            losses = dp_loss(outputs, label)    # one loss per device
        autograd.backward(losses)
        # The GLOBAL batch (this worker's x the workers): gradients are sums.
        trainer.step(dist.global_batch_size(data.shape[0]))
        # Gathering to the CPU waits for this step, which keeps the
        # samples/s honest and the memory bounded.
        loss_sum += gp.gather(losses, mx.cpu()).sum().asscalar()
        pred = gp.gather(outputs, mx.cpu()).argmax(axis=1)
        correct += (pred == label.astype(pred.dtype)).sum().asscalar()
        seen += data.shape[0]
        bar.update(1)
        bar.set_postfix(loss='%.4f' % (loss_sum / seen), acc='%.4f' % (correct / seen),
                        samples_s='%.0f' % (seen / (time.time() - start)))
    bar.close()
    return {'train_loss': loss_sum / seen, 'train_acc': correct / seen,
            'samples_per_s': seen / (time.time() - start), 'steps': steps}


def evaluate(dp, loader):
    """Accuracy of the network (predict mode: running BN statistics)."""
    correct = seen = 0
    for data, label in loader:
        pred = gp.gather(dp(data), mx.cpu()).argmax(axis=1)
        correct += (pred == label.astype(pred.dtype)).sum().asscalar()
        seen += data.shape[0]
    return correct / seen


# --------------------------------------------------------------- outputs --

def write_metrics(save_dir, history):
    """metrics.csv: one row per epoch."""
    path = os.path.join(save_dir, 'metrics.csv')
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=METRICS, extrasaction='ignore')
        writer.writeheader()
        writer.writerows([{k: '%.6g' % v if isinstance(v, float) else v
                           for k, v in row.items()} for row in history])
    return path


def plot_metrics(save_dir, history):
    """metrics.png: training loss, training and validation accuracy."""
    import matplotlib
    matplotlib.use('Agg')               # files only, no display needed
    import matplotlib.pyplot as plt
    epochs = [row['epoch'] for row in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [row['train_loss'] for row in history], 'o-', label='train loss')
    ax_loss.set_xlabel('epoch')
    ax_loss.set_ylabel('cross-entropy loss')
    ax_loss.set_title('Training loss')
    ax_loss.legend()
    ax_acc.plot(epochs, [row['train_acc'] for row in history], 'o-', label='train')
    ax_acc.plot(epochs, [row['val_acc'] for row in history], 's-', label='validation')
    ax_acc.set_xlabel('epoch')
    ax_acc.set_ylabel('accuracy')
    ax_acc.set_title('Accuracy')
    ax_acc.legend()
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.set_xticks(epochs if len(epochs) <= 20 else ax.get_xticks())
    fig.tight_layout()
    path = os.path.join(save_dir, 'metrics.png')
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def resume(args, net, trainer, ctx_list):
    """Load the checkpoint named by --resume; return (epoch, step, history)."""
    prefix = args.resume or os.path.join(args.save_dir, 'checkpoint')
    if not os.path.isfile(prefix + '.json'):
        raise SystemExit('error: --resume: no checkpoint %s.json (a checkpoint is the files '
                         'PREFIX.params, PREFIX.states and PREFIX.json that every epoch writes '
                         'to SAVE_DIR/checkpoint.*)' % prefix)
    meta = dist.load_checkpoint(prefix, net, trainer, ctx_list)   # on every worker
    # The restored optimizer carries the learning-rate schedule, which ends
    # after the original number of steps: these flags must not change.
    for key in RESUME_CONFIG:
        if meta['config'].get(key) != getattr(args, key):
            raise SystemExit('error: checkpoint %s was trained with --%s %s, not %s: resume '
                             'with the same value' % (prefix, key.replace('_', '-'),
                                                      meta['config'].get(key), getattr(args, key)))
    print('resumed from %s at epoch %d' % (prefix, meta['epoch']), flush=True)
    return meta['epoch'], meta['step'], meta['history']


def main(argv=None):
    args = parse_args(argv)
    if dist.is_distributed() != ('dist' in args.kvstore):
        raise SystemExit('error: --kvstore %s %s' % (args.kvstore, 'needs a dist job: run under '
                         'python -m gluon_parallel.launch -n WORKERS -s SERVERS -- python ...'
                         if 'dist' in args.kvstore else 'in a dist job: use --kvstore dist_sync'))
    dist.get_kvstore(args.kvstore)      # dist_*: meets the other workers here
    if args.batch_size % dist.num_workers():
        raise SystemExit('error: --batch-size %d (global) must be a multiple of the %d workers'
                         % (args.batch_size, dist.num_workers()))
    seed_everything(args.seed)
    ctx_list = select_contexts(args)
    try:
        data = load_dataset(args.dataset, args.data_dir, args.image_size, args.num_classes,
                            args.num_samples)
    except DataError as e:
        raise SystemExit('error: %s' % e)
    # Loaders first: their worker processes fork before any training thread exists.
    train_loader, val_loader, sampler = make_loaders(data, args)
    steps_per_epoch = len(train_loader) if args.max_steps_per_epoch is None \
        else min(len(train_loader), args.max_steps_per_epoch)

    net = build_network(args, data, ctx_list)
    if not args.no_syncbn:
        dist.sync_batchnorm_across_workers(net)     # statistics of every worker's batch
    trainer = make_trainer(net, args, steps_per_epoch)
    epoch, step, history = 0, 0, []
    if args.resume is not None:
        epoch, step, history = resume(args, net, trainer, ctx_list)
    else:
        dist.init_trainer(trainer)      # rank 0's initial values on every worker
    os.makedirs(args.save_dir, exist_ok=True)
    print('%s: %d train / %d val images, %d classes, %dx%d; %s%s on %d device(s) %s; '
          'global batch %d over %d worker(s)'
          % (args.dataset, len(data.train), len(data.val), data.classes,
             data.image_size, data.image_size, args.model,
             '' if args.no_syncbn else ' + SyncBatchNorm', len(ctx_list),
             ctx_list, args.batch_size, dist.num_workers()), flush=True)

    dp_loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    with gp.DataParallel(net, ctx_list) as dp:
        while epoch < args.epochs:
            epoch += 1
            sampler.set_epoch(epoch)
            start = time.time()
            stats = train_epoch(dp, dp_loss, trainer, train_loader, epoch, args)
            step += stats.pop('steps')
            stats.update(epoch=epoch, val_acc=evaluate(dp, val_loader), lr=trainer.learning_rate,
                         seconds=time.time() - start)
            history.append(stats)
            print('epoch %d train_loss=%.4f train_acc=%.4f val_acc=%.4f samples/s=%.0f'
                  % (epoch, stats['train_loss'], stats['train_acc'], stats['val_acc'],
                     stats['samples_per_s']), flush=True)
            # Every worker calls it; rank 0 writes the files.
            dist.save_checkpoint(os.path.join(args.save_dir, 'checkpoint'), net, trainer,
                                 epoch=epoch, step=step, history=history,
                                 config={key: getattr(args, key) for key in RESUME_CONFIG})
            if dist.is_root():
                write_metrics(args.save_dir, history)
                plot_metrics(args.save_dir, history)
    if history:
        print('final val_acc=%.4f; metrics, plot and checkpoint in %s'
              % (history[-1]['val_acc'], args.save_dir), flush=True)
    return history


if __name__ == '__main__':
    main()
