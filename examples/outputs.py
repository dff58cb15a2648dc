"""Files examples/train_image_classification.py writes after every epoch:
the checkpoint (checkpoint.params/.states/.json), metrics.csv (one row per
epoch) and metrics.png (loss and accuracy); and what it does when SAVE_DIR
already holds them: refuse, or with --overwrite delete them first."""
import csv
import glob
import json
import os

# Every file of a run: gluon_parallel.save_checkpoint's (with its .prev
# copies and temp files) and the metrics.
RUN_FILES = ('checkpoint.*', 'metrics.csv', 'metrics.png')

METRICS = ('epoch', 'train_loss', 'train_acc', 'val_acc', 'val_top5', 'samples_per_s', 'lr',
           'seconds')


def write_metrics(save_dir, history):
    """metrics.csv: one row per epoch."""
    path = os.path.join(save_dir, 'metrics.csv')
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=METRICS, extrasaction='ignore')
        writer.writeheader()
        writer.writerows([{k: f'{v:.6g}' if isinstance(v, float) else v
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


def earlier_run(save_dir):
    """A description of the run whose checkpoint SAVE_DIR holds ("epoch 3
    of 8"), or None when it holds none."""
    path = os.path.join(save_dir, 'checkpoint.json')
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)['meta']
        return f"epoch {meta['epoch']:d} of {meta['config']['epochs']:d}"
    except (OSError, ValueError, KeyError, TypeError):
        return 'a checkpoint'


def remove_run(save_dir):
    """Delete an earlier run's files from SAVE_DIR (--overwrite)."""
    for pattern in RUN_FILES:
        for path in glob.glob(os.path.join(glob.escape(save_dir), pattern)):
            os.remove(path)
