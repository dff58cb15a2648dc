"""The training recipe of examples/train_image_classification.py, as in
GluonCV's classification scripts: learning-rate warmup and decay modes,
label smoothing, mixup, top-k accuracy and mixed precision (AMP).

GluonCV's own learning-rate schedulers are used. Its label-smoothing and
mixup helpers (``gluoncv.auto.estimators.image_classification.utils``) do
not import on Python 3.11, so their two formulas are written out here.
"""
import numpy as np
from mxnet import nd

LR_MODES = ('cosine', 'step', 'poly')
DTYPES = ('float32', 'float16', 'bfloat16')


def _stage(mode, niters, **kwargs):
    from gluoncv.utils import LRScheduler
    # GluonCV divides by (niters - 1): a one-update stage keeps its start value.
    return LRScheduler('constant' if niters == 1 else mode, niters=niters, **kwargs)


def lr_scheduler(mode, lr, epochs, steps_per_epoch, warmup_epochs=0, decay_epochs=(),
                 decay_factor=0.1, power=2):
    """GluonCV's schedule: a linear warmup from 0 to `lr` over the first
    `warmup_epochs`, then `mode` over the remaining epochs.

    With S = `steps_per_epoch`, ``W = warmup_epochs * S`` and ``M`` the
    remaining updates, the optimizer's u-th update (u = 1, 2, ... over the
    whole run) uses ``lr * u / (W - 1)`` while u < W; from u = W on, with
    ``t = min(u - W, M - 1) / (M - 1)``: cosine ``lr * (1 + cos(pi t)) / 2``,
    poly ``lr * (1 - t) ** power``, step ``lr * decay_factor ** k``, k the
    number of `decay_epochs` d with ``d * S <= u``.

    Returns
    -------
    gluoncv.utils.LRSequential
    """
    from gluoncv.utils import LRSequential
    warmup = warmup_epochs * steps_per_epoch
    main = (epochs - warmup_epochs) * steps_per_epoch
    stages = []
    if warmup:
        stages.append(_stage('linear', warmup, base_lr=0, target_lr=lr))
    steps = [(e - warmup_epochs) * steps_per_epoch for e in decay_epochs] if mode == 'step' \
        else None
    stages.append(_stage(mode, main, base_lr=lr, target_lr=0, power=power, step_iter=steps,
                         step_factor=decay_factor))
    schedule = LRSequential(stages)
    schedule.base_lr = lr       # what the Optimizer sets (and warns about when it differs)
    return schedule


def soft_labels(label, classes, smoothing=0.0, lam=1.0):
    """One-hot labels with label smoothing (`smoothing` spread evenly over
    every class), mixed with the reversed batch's: ``lam * y + (1 - lam) *
    y[::-1]`` (GluonCV's ``mixup_transform``; ``lam=1``: its ``smooth``)."""
    on, off = 1 - smoothing + smoothing / classes, smoothing / classes
    y = label.one_hot(classes, on_value=on, off_value=off)
    if lam == 1.0:
        return y
    return lam * y + (1 - lam) * label[::-1].one_hot(classes, on_value=on, off_value=off)


def mixup(data, label, classes, alpha, smoothing, rng):
    """Mix the batch with itself reversed, ``lam ~ Beta(alpha, alpha)``
    (GluonCV's classification recipe); returns data and soft labels. The
    whole global batch is mixed before it is split across devices."""
    lam = float(rng.beta(alpha, alpha))
    mixed = lam * data + (1 - lam) * data[::-1]
    return mixed, soft_labels(label, classes, smoothing, lam)


def topk_correct(scores, label, ks=(1, 5)):
    """Number of rows whose label is among the k highest scores, per k."""
    scores = scores.asnumpy() if isinstance(scores, nd.NDArray) else scores
    label = (label.asnumpy() if isinstance(label, nd.NDArray) else label).astype(np.int64)
    order = np.argsort(-scores, axis=1, kind='stable')
    hit = order == label[:, None]
    return [int(hit[:, :k].any(axis=1).sum()) for k in ks]


def as_float32(x):
    """A float32 copy of a float16/bfloat16 NDArray (astype does not know
    bfloat16)."""
    return x if x.dtype == np.float32 else nd.amp_cast(x, dtype='float32')


def amp_dtype(dtype, amp, ctx_list):
    """The AMP target type, or None for float32 training: ``--dtype``
    float16/bfloat16, or ``--amp`` alone: float16 on GPUs, bfloat16 on CPUs
    (MXNet's CPU kernels have no float16 AMP path, its GPU ones no
    bfloat16)."""
    on_gpu = ctx_list[0].device_type == 'gpu'
    if dtype == 'float32':
        return ('float16' if on_gpu else 'bfloat16') if amp else None
    if dtype == ('bfloat16' if on_gpu else 'float16'):
        raise ValueError(f'--dtype {dtype}: AMP runs float16 on GPUs and bfloat16 on CPUs')
    return dtype


def init_amp(target_dtype):
    """``amp.init``: must run before the network is built (it patches
    MXNet's operators for the whole process)."""
    from mxnet.contrib import amp
    amp.init(target_dtype=target_dtype)
    return amp

