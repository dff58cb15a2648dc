"""End-to-end runs of examples/train_image_classification.py.

Each test runs the script in a subprocess for a handful of steps on a
small data set written to a temporary folder in the real on-disk format,
and checks the parseable epoch lines, metrics.csv, metrics.png and the
checkpoint.
"""
import csv
import gzip
import json
import math
import pickle
import re
import struct
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from gluon_parallel.loss_scaling import bfloat16_problem
from launch_helpers import wait_for_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'examples' / 'train_image_classification.py'
EPOCH_LINE = re.compile(r'^epoch (\d+) train_loss=(\d+\.\d{4}) train_acc=(\d\.\d{4}) '
                        r'val_acc=(\d\.\d{4}) val_top5=(\d\.\d{4}) samples/s=(\d+)$', re.M)
TIMEOUT = 240


def run(*args, check=True):
    """Run the example; return the CompletedProcess (text output)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), '--no-progress'] + [str(a) for a in args],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=str(ROOT))
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def epochs_of(stdout):
    """{epoch: (train_loss, train_acc, val_acc)} from the parseable lines."""
    return {int(m.group(1)): m.group(2, 3, 4) for m in EPOCH_LINE.finditer(stdout)}


def read_metrics(save_dir):
    with open(save_dir / 'metrics.csv') as f:
        return list(csv.DictReader(f))


def check_outputs(save_dir, epochs):
    """metrics.csv, metrics.png and a checkpoint of the last epoch exist."""
    rows = read_metrics(save_dir)
    assert [int(r['epoch']) for r in rows] == list(range(1, epochs + 1))
    for r in rows:
        assert 0 <= float(r['val_acc']) <= float(r['val_top5']) <= 1
        assert float(r['train_loss']) >= 0
    assert (save_dir / 'metrics.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert (save_dir / 'checkpoint.params').stat().st_size > 0
    assert (save_dir / 'checkpoint.states').stat().st_size > 0
    assert (save_dir / 'checkpoint.json').stat().st_size > 0


def random_images(n, size, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


# ------------------------------------------------- the data-set formats --

def test_default_mnist5k(tmp_path):
    proc = run('--epochs', 2, '--max-steps-per-epoch', 3, '--save-dir', tmp_path)
    assert 'mnist5k: 4000 train / 1000 val images, 10 classes, 28x28; small-cnn + ' \
           'SyncBatchNorm on 4 device(s)' in proc.stdout
    assert sorted(epochs_of(proc.stdout)) == [1, 2]
    check_outputs(tmp_path, 2)


def test_progress_off_a_terminal_is_one_line_per_epoch(tmp_path):
    # Output to a pipe, as in a CI log or a SLURM job's file: no bar frames
    # (carriage returns, one line growing with every refresh).
    # Bytes: text mode would turn each carriage return into a newline.
    proc = subprocess.run([sys.executable, str(SCRIPT), '--dataset', 'synthetic',
                           '--num-samples', '64', '--image-size', '8', '--batch-size', '8',
                           '--num-devices', '2', '--epochs', '2', '--save-dir', str(tmp_path)],
                          capture_output=True, timeout=TIMEOUT, cwd=str(ROOT))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out.decode()
    assert b'\r' not in out, repr(out[:2000])
    assert max(map(len, out.split(b'\n'))) < 200, out.decode()
    assert sorted(epochs_of(proc.stdout.decode())) == [1, 2]


def test_digits(tmp_path):
    proc = run('--dataset', 'digits', '--epochs', 2, '--max-steps-per-epoch', 3,
               '--save-dir', tmp_path)
    assert 'digits: 1437 train / 360 val images, 10 classes, 8x8' in proc.stdout
    assert sorted(epochs_of(proc.stdout)) == [1, 2]
    check_outputs(tmp_path, 2)


def test_synthetic_last_batch_smaller_than_device_count(tmp_path):
    # 18 images in global batches of 8: the last batch has 2 rows for 4
    # devices; validation has 18 // 4 = 4 images. Also covers --hybridize
    # with SyncBatchNorm.
    proc = run('--dataset', 'synthetic', '--num-samples', 18, '--image-size', 8,
               '--batch-size', 8, '--num-devices', 4, '--hybridize',
               '--epochs', 1, '--save-dir', tmp_path)
    assert sorted(epochs_of(proc.stdout)) == [1]
    assert 'synthetic: 18 train / 4 val' in proc.stdout
    check_outputs(tmp_path, 1)


def test_image_folder(tmp_path):
    data = tmp_path / 'data'
    for split, n in (('train', 6), ('val', 2)):
        for c, cls in enumerate(('cat', 'dog', 'fish')):
            folder = data / split / cls
            folder.mkdir(parents=True)
            for i, img in enumerate(random_images(n, 12 + 4 * c, seed=c)):
                cv2.imwrite(str(folder / (f'{i:d}.png')), img)
    proc = run('--dataset', 'imagefolder', '--data-dir', data, '--image-size', 16,
               '--model', 'resnet20', '--batch-size', 8, '--epochs', 1,
               '--num-workers', 1, '--save-dir', tmp_path / 'out')
    assert 'imagefolder: 18 train / 6 val images, 3 classes, 16x16' in proc.stdout
    assert sorted(epochs_of(proc.stdout)) == [1]
    check_outputs(tmp_path / 'out', 1)


def test_record_file(tmp_path):
    from mxnet import recordio
    for split, n in (('train', 12), ('val', 6)):
        rec = recordio.MXIndexedRecordIO(str(tmp_path / (split + '.idx')),
                                         str(tmp_path / (split + '.rec')), 'w')
        for i, img in enumerate(random_images(n, 20, seed=n)):
            header = recordio.IRHeader(0, float(i % 4), i, 0)
            rec.write_idx(i, recordio.pack_img(header, img, img_fmt='.png'))
        rec.close()
    proc = run('--dataset', 'rec', '--data-dir', tmp_path, '--image-size', 16,
               '--model', 'resnet18', '--num-devices', 2, '--batch-size', 6, '--epochs', 1,
               '--num-workers', 0,
               '--save-dir', tmp_path / 'out')
    assert 'rec: 12 train / 6 val images, 4 classes, 16x16' in proc.stdout
    assert sorted(epochs_of(proc.stdout)) == [1]
    check_outputs(tmp_path / 'out', 1)


@pytest.mark.parametrize('version', ['py', 'bin'])
def test_cifar10_files(tmp_path, version):
    folder = tmp_path / ('cifar-10-batches-' + version)
    folder.mkdir()
    for b, name in enumerate([f'data_batch_{i:d}' for i in range(1, 6)] + ['test_batch']):
        images = random_images(4, 32, seed=b)
        labels = [(b + i) % 10 for i in range(4)]
        rows = images.transpose(0, 3, 1, 2).reshape(4, 3072)        # CHW planes per row
        if version == 'py':
            with open(folder / name, 'wb') as f:
                pickle.dump({b'data': rows, b'labels': labels}, f)
        else:
            np.hstack([np.array(labels, np.uint8)[:, None], rows]).tofile(folder / (name + '.bin'))
    proc = run('--dataset', 'cifar10', '--data-dir', tmp_path, '--batch-size', 8,
               '--epochs', 1, '--num-workers', 0, '--save-dir', tmp_path / 'out')
    assert 'cifar10: 20 train / 4 val images, 10 classes, 32x32' in proc.stdout
    check_outputs(tmp_path / 'out', 1)


def test_mnist_idx_files(tmp_path):
    def idx(name, array):
        header = struct.pack('>BBBB', 0, 0, 0x08, array.ndim) + struct.pack(
            f'>{array.ndim:d}I', *array.shape)
        with gzip.open(tmp_path / (name + '.gz'), 'wb') as f:
            f.write(header + array.astype(np.uint8).tobytes())
    rng = np.random.default_rng(0)
    for prefix, n in (('train', 10), ('t10k', 5)):
        idx(prefix + '-images-idx3-ubyte', rng.integers(0, 256, (n, 28, 28)))
        idx(prefix + '-labels-idx1-ubyte', np.arange(n) % 10)
    proc = run('--dataset', 'mnist', '--data-dir', tmp_path, '--batch-size', 5,
               '--epochs', 1, '--save-dir', tmp_path / 'out')
    assert 'mnist: 10 train / 5 val images, 10 classes, 28x28' in proc.stdout
    check_outputs(tmp_path / 'out', 1)


# -------------------------------------------------------------- resume --

def killed_after_a_checkpoint(args, save):
    """Run the example with `args` and SIGKILL it as soon as its first
    checkpoint is complete."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), '--no-progress', *map(str, args),
                             '--save-dir', str(save)], cwd=str(ROOT),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_checkpoint(proc, save, TIMEOUT)
        proc.kill()
    finally:
        proc.wait()


def test_resume_continues_exactly(tmp_path):
    """An interrupted run, resumed, prints the epochs an uninterrupted one does."""
    args = ['--dataset', 'digits', '--epochs', 3, '--max-steps-per-epoch', 4, '--batch-size', 32]
    full = epochs_of(run(*args, '--save-dir', tmp_path / 'full').stdout)
    assert sorted(full) == [1, 2, 3]

    # Kill the run as soon as its first checkpoint is complete (the .json
    # is written last), i.e. somewhere in epoch 2.
    save = tmp_path / 'killed'
    killed_after_a_checkpoint(args, save)

    resumed = run(*args, '--save-dir', save, '--resume')
    where = re.escape(str(save / 'checkpoint'))
    saved = int(re.search(rf'^resumed from {where} at epoch (\d+)$', resumed.stdout, re.M).group(1))
    assert 1 <= saved < 3
    again = epochs_of(resumed.stdout)
    assert sorted(again) == list(range(saved + 1, 4))
    for epoch, values in again.items():
        assert values == full[epoch], (epoch, values, full[epoch])
    check_outputs(save, 3)

    # The checkpoint's learning-rate schedule ends after 3 epochs.
    proc = run('--dataset', 'digits', '--epochs', 4, '--max-steps-per-epoch', 4,
               '--batch-size', 32, '--save-dir', save, '--resume', check=False)
    assert proc.returncode != 0 and '--epochs 3, not 4' in proc.stderr



def test_an_earlier_run_is_never_overwritten_silently(tmp_path):
    """SAVE_DIR holding a checkpoint: the script refuses, names the run and
    the ways on, and leaves the files alone; --overwrite deletes the earlier
    run's files and starts afresh."""
    save = tmp_path / 'run'
    save.mkdir()
    earlier = {'meta': {'epoch': 2, 'config': {'epochs': 8}}}
    (save / 'checkpoint.json').write_text(json.dumps(earlier))
    (save / 'checkpoint.params.prev').write_bytes(b'stale')
    args = ['--dataset', 'digits', '--epochs', 1, '--max-steps-per-epoch', 2, '--save-dir', save]
    proc = run(*args, check=False)
    assert proc.returncode == 1 and not EPOCH_LINE.search(proc.stdout)
    assert f'error: {save} holds an earlier run (epoch 2 of 8)' in proc.stderr, proc.stderr
    assert '--resume' in proc.stderr and '--overwrite' in proc.stderr
    assert json.loads((save / 'checkpoint.json').read_text()) == earlier
    proc = run(*args, '--overwrite')
    assert sorted(epochs_of(proc.stdout)) == [1]
    assert not (save / 'checkpoint.params.prev').exists()
    check_outputs(save, 1)
    proc = run(*args, '--overwrite', '--resume', check=False)
    assert proc.returncode == 2 and 'give one of them' in proc.stderr


def test_checkpoint_every_resumes_mid_epoch_exactly(tmp_path):
    """--checkpoint-every: killed after a checkpoint in the middle of an
    epoch, --resume goes on from that step and prints the epochs (their
    metrics summed over the steps before and after) of an uninterrupted run."""
    args = ['--dataset', 'digits', '--epochs', 2, '--max-steps-per-epoch', 16, '--batch-size', 32,
            '--num-devices', 2, '--checkpoint-every', 3]
    full = epochs_of(run(*args, '--save-dir', tmp_path / 'full').stdout)
    save = tmp_path / 'killed'
    killed_after_a_checkpoint(args, save)
    resumed = run(*args, '--save-dir', save, '--resume')
    where = re.escape(str(save / 'checkpoint'))
    m = re.search(rf'^resumed from {where} at epoch 0, sample (\d+) of epoch 1, on 1 worker\(s\)$',
                  resumed.stdout, re.M)
    assert m and int(m[1]) % 96 == 0, resumed.stdout        # after 3, 6, ... steps of 32
    assert epochs_of(resumed.stdout) == full
    check_outputs(save, 2)


# -------------------------------------------------------------- errors --

def test_missing_data_dir_names_path(tmp_path):
    missing = tmp_path / 'no-such-dir'
    proc = run('--dataset', 'cifar10', '--data-dir', missing, '--save-dir', tmp_path,
               check=False)
    assert proc.returncode != 0
    assert str(missing) in proc.stderr and 'cifar-10-batches-py' in proc.stderr
    assert not EPOCH_LINE.search(proc.stdout)


def test_missing_files_name_expected_layout(tmp_path):
    (tmp_path / 'train' / 'cat').mkdir(parents=True)
    proc = run('--dataset', 'imagefolder', '--data-dir', tmp_path, '--save-dir', tmp_path,
               check=False)
    assert proc.returncode != 0
    assert str(tmp_path / 'train') in proc.stderr and 'DIR' not in proc.stderr
    assert '/val/<class>/' in proc.stderr


BAD_FLAGS = [
    ['--model', 'vgg12'],
    ['--model', 'yolo3_darknet53_voc'],     # a GluonCV detector, not a classifier
    ['--lr', '0'],
    ['--lr-mode', 'exponential'],
    ['--lr-decay-epochs', 'ten'],
    ['--lr-decay', '-0.1'],
    ['--warmup-epochs', '-1'],
    ['--warmup-epochs', '8'],               # no epoch of the default 8 left after it
    ['--label-smoothing', '1'],
    ['--label-smoothing', '-0.1'],
    ['--mixup-alpha', '0'],
    ['--mixup-off-epoch', '-2'],
    ['--dtype', 'float64'],
    ['--dtype', 'float16'],                 # AMP on CPUs is bfloat16
    ['--amp', 'yes'],
    ['--dataset', 'imagenet'],
    ['--batch-size', '0'],
    ['--epochs', 'two'],
    ['--kvstore', 'nccl2'],
    ['--dataset', 'mnist'],                 # needs --data-dir
    ['--no-such-flag'],
]


def test_bad_flags_rejected():
    # One interpreter for all cases: importing MXNet costs seconds.
    code = (f'import sys; sys.path.insert(0, {str(SCRIPT.parent)!r})\n'
            'import train_image_classification as t\n'
            f'for flags in {BAD_FLAGS!r}:\n'
            '    try:\n'
            '        t.parse_args(flags)\n'
            '        print("accepted", flags)\n'
            '    except SystemExit as e:\n'
            '        print(e.code)\n')
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=str(ROOT))
    assert proc.stdout.split() == ['2'] * len(BAD_FLAGS), proc.stdout + proc.stderr
    assert proc.stderr.count('usage:') == len(BAD_FLAGS)
    assert 'give --data-dir' in proc.stderr


GOOD_FLAGS = {
    '--model cifar_resnet20_v1': ('model', 'cifar_resnet20_v1'),
    '--model resnet18_v1b': ('model', 'resnet18_v1b'),
    '--model mobilenetv2_0.25': ('model', 'mobilenetv2_0.25'),
    '--lr-mode step': ('lr_mode', 'step'),
    '--lr-mode poly': ('lr_mode', 'poly'),
    '--lr-decay-epochs 3,6': ('lr_decay_epochs', [3, 6]),
    '--lr-decay 0.5': ('lr_decay', 0.5),
    '--warmup-epochs 2': ('warmup_epochs', 2),
    '--label-smoothing 0.1': ('label_smoothing', 0.1),
    '--mixup': ('mixup', True),
    '--mixup-alpha 0.4': ('mixup_alpha', 0.4),
    '--mixup-off-epoch 2': ('mixup_off_epoch', 2),
    '--dtype bfloat16': ('amp_dtype', 'bfloat16'),
    '--amp': ('amp_dtype', 'bfloat16'),             # CPUs: bfloat16
    '': ('amp_dtype', None),                        # float32, no AMP
    '--max-steps-per-epoch 3': ('max_steps_per_epoch', 3),
}


def test_new_flags_parse():
    code = (f'import sys; sys.path.insert(0, {str(SCRIPT.parent)!r})\n'
            'import train_image_classification as t\n'
            f'for flags, (key, _) in {GOOD_FLAGS!r}.items():\n'
            '    print(repr(getattr(t.parse_args(flags.split()), key)))\n')
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [repr(v) for _, v in GOOD_FLAGS.values()], proc.stdout


# Short runs with every recipe feature on: GluonCV model-zoo networks (with
# SyncBatchNorm as their norm_layer), warmup, each lr mode, label smoothing,
# mixup switched off for the last epoch, AMP. Tiny synthetic images keep them
# short; what they prove is that each combination trains end to end.
RECIPES = {
    'cifar_resnet20_v1 + smoothing + mixup + warmup + AMP':
        ['--model', 'cifar_resnet20_v1', '--label-smoothing', 0.1, '--mixup',
         '--mixup-off-epoch', 1, '--warmup-epochs', 1, '--amp'],
    'resnet18_v1b + step': ['--model', 'resnet18_v1b', '--lr-mode', 'step', '--mixup'],
    'mobilenetv2_0.25 + poly + bfloat16':
        ['--model', 'mobilenetv2_0.25', '--lr-mode', 'poly', '--dtype', 'bfloat16',
         '--label-smoothing', 0.2],
}


@pytest.mark.parametrize('name', sorted(RECIPES))
def test_recipe_runs(tmp_path, name):
    """Each recipe trains; an AMP recipe on a CPU without bfloat16 kernels
    stops before training with the reason (MXNet's own error is an
    MKL-DNN message about primitive descriptors)."""
    amp = '--amp' in RECIPES[name] or '--dtype' in RECIPES[name]
    problem = bfloat16_problem() if amp else None
    proc = run('--dataset', 'synthetic', '--num-samples', 48, '--image-size', 16,
               '--batch-size', 8, '--epochs', 2, '--max-steps-per-epoch', 2,
               '--save-dir', tmp_path, *RECIPES[name], check=not problem)
    if problem:
        assert proc.returncode == 1 and 'cannot compute in bfloat16 on this CPU' in proc.stderr, \
            proc.stdout + proc.stderr
        assert not list(tmp_path.iterdir())
        return
    model = RECIPES[name][1]
    assert f'{model} + SyncBatchNorm on 4 device(s)' in proc.stdout
    assert ('; AMP bfloat16' in proc.stdout) == ('--amp' in RECIPES[name] or
                                                 '--dtype' in RECIPES[name])
    assert sorted(epochs_of(proc.stdout)) == [1, 2]
    check_outputs(tmp_path, 2)
    for row in read_metrics(tmp_path):
        assert math.isfinite(float(row['train_loss']))


def promised_lr(mode, update, lr, steps, epochs, warmup, decay_epochs, decay=0.1):
    """The learning rate of the u-th update, as examples/README.md states it."""
    w, m = warmup * steps, (epochs - warmup) * steps
    if update < w:
        return lr * update / (w - 1)
    t = min(update - w, m - 1) / (m - 1)
    if mode == 'cosine':
        return lr * (1 + math.cos(math.pi * t)) / 2
    if mode == 'poly':
        return lr * (1 - t) ** 2
    return lr * decay ** sum(d * steps <= update for d in decay_epochs)


@pytest.mark.parametrize('mode', ['cosine', 'step', 'poly'])
def test_warmup_and_lr_mode_give_the_promised_curve(tmp_path, mode):
    steps, epochs, warmup, lr = 3, 7, 2, 0.4
    run('--dataset', 'synthetic', '--num-samples', 24, '--image-size', 8, '--batch-size', 8,
        '--epochs', epochs, '--warmup-epochs', warmup, '--lr', lr, '--lr-mode', mode,
        '--lr-decay-epochs', '4,6', '--save-dir', tmp_path)
    got = [float(r['lr']) for r in read_metrics(tmp_path)]
    # metrics.csv holds the rate after each epoch's last update.
    want = [promised_lr(mode, e * steps, lr, steps, epochs, warmup, (4, 6))
            for e in range(1, epochs + 1)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert got[0] < lr and max(got) == pytest.approx(lr)        # a warmup, then the peak


# ------------------------------------------------------------ why_syncbn.py

WHY = ROOT / 'examples' / 'why_syncbn.py'
NORMS = ('BatchNorm', 'SyncBatchNorm', '1 device')


def test_why_syncbn_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(WHY), '--quick', '--no-progress', '--out',
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / 'why_syncbn.csv') as f:
        rows = list(csv.DictReader(f))
    assert sorted((r['norm'], int(r['global_batch'])) for r in rows) == \
        sorted((n, 4 * b) for n in NORMS for b in (2, 8))
    for r in rows:
        assert int(r['devices']) == (1 if r['norm'] == '1 device' else 4)
        assert int(r['steps']) == int(0.2 * 4000) // int(r['global_batch'])
        assert 0 <= float(r['val_error']) <= 1 and math.isfinite(float(r['train_loss']))
    # The printed table is the CSV's numbers (one seed: the mean is the run).
    for b in (2, 8):
        line = next(s for s in proc.stdout.splitlines() if s.startswith(f'| {b:d} ({4 * b:d}) |'))
        cells = [c.strip() for c in line.strip('|').split('|')[1:]]
        for norm, cell in zip(NORMS, cells):
            err = next(float(r['val_error']) for r in rows
                       if r['norm'] == norm and int(r['global_batch']) == 4 * b)
            assert cell == f'{100 * err:.2f} %'
    assert (tmp_path / 'why_syncbn.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_why_syncbn_help_and_bad_flags():
    proc = subprocess.run([sys.executable, str(WHY), '--help'], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and 'Group Normalization' in proc.stdout
    proc = subprocess.run([sys.executable, str(WHY), '--batches', 'two'], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and 'comma-separated integers' in proc.stderr


def test_why_syncbn_trains_on_the_main_scripts_stream(tmp_path):
    # The stream every run of a seed reads is what train_image_classification.py
    # --seed trains on: its DataLoader's batches over two epochs (the order and
    # the random shifts of its EpochSampler), for two seeds.
    code = (f'import sys, argparse, numpy as np; sys.path.insert(0, {str(WHY.parent)!r})\n'
            'import why_syncbn as w, train_image_classification as t\n'
            'from image_data import load_dataset\n'
            'data = load_dataset("mnist5k")\n'
            'for seed in (0, 3):\n'
            '    x, y = w.training_stream(data.train, seed, 1.5)\n'
            '    args = argparse.Namespace(num_workers=0, batch_size=500, seed=seed)\n'
            '    loader, _, sampler = t.make_loaders(data, args)\n'
            '    got = []\n'
            '    for epoch in (0, 1):\n'
            '        sampler.set_epoch(epoch)\n'
            '        got += [(a.asnumpy(), b.asnumpy()) for a, b in loader]\n'
            f'    np.savez({str(tmp_path)!r} + "/%d.npz" % seed, x=x.asnumpy(), y=y.asnumpy(),\n'
            '             ref_x=np.concatenate([a for a, _ in got]),\n'
            '             ref_y=np.concatenate([b for _, b in got]))\n')
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    streams = [np.load(tmp_path / (f'{seed:d}.npz')) for seed in (0, 3)]
    for s in streams:
        assert s['x'].shape == (8000, 1, 28, 28) and s['y'].shape == (8000,)
        np.testing.assert_array_equal(s['x'], s['ref_x'])
        np.testing.assert_array_equal(s['y'], s['ref_y'])
        # a fresh shift per epoch: the second epoch is not the first reordered
        assert not np.array_equal(np.sort(s['x'][:4000].sum(axis=(1, 2, 3))),
                                  np.sort(s['x'][4000:].sum(axis=(1, 2, 3))))
    assert not np.array_equal(streams[0]['y'], streams[1]['y'])
