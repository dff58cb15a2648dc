"""AMP's dynamic loss scaling with several devices.

MXNet's AMP skips a step whose scaled gradients overflowed: the check is in
``Trainer._update``. A Trainer that updates on its kvstore (Gluon's default
as soon as the parameters live on several devices) applies the update
inside the kvstore's push/pull, before that check runs, so an overflowing
step writes Inf/NaN into every weight instead of being skipped (measured,
tests/test_amp.py). Updates must stay in the Trainer
(``update_on_kvstore=False``).

:func:`check_trainers` runs before a recorded DataParallel call, so before
the first ``trainer.step``: a Trainer that left the choice to Gluon is set
to ``update_on_kvstore=False`` with a warning (its kvstore does not exist
yet, so nothing else changes); a Trainer that asked for updates on the
kvstore, or already has them, is a clear error.

:func:`bfloat16_problem` says before training whether the CPU can run
AMP's bfloat16 at all.
"""
import functools
import warnings
import weakref

from . import _gluon

__all__ = ['check_trainers', 'checked_trainers', 'bfloat16_problem']


@functools.cache
def bfloat16_problem():
    """Why MXNet cannot train in bfloat16 on this machine's CPU, or None.

    MXNet 1.9.1 computes bfloat16 convolutions, FullyConnected and
    BatchNorm on CPUs only through MKL-DNN kernels that need AVX-512; on
    other CPUs the first such operator fails with "could not create a
    primitive descriptor iterator" (measured on an AVX2-only AMD EPYC).
    One tiny convolution tells.
    """
    import numpy as np
    import mxnet as mx
    from mxnet import nd
    bf16 = np.dtype([('bfloat16', np.uint16)])      # MXNet's name for it
    try:
        x = nd.ones((1, 1, 2, 2)).astype(bf16)
        w = nd.ones((1, 1, 1, 1)).astype(bf16)
        nd.Convolution(x, w, kernel=(1, 1), num_filter=1, no_bias=True).wait_to_read()
    except mx.base.MXNetError as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        return (f'MXNet {mx.__version__} cannot compute in bfloat16 on this CPU (a bfloat16 '
                f'convolution failed: {first}); its CPU bfloat16 kernels need AVX-512. Train in '
                'float32 here')
    return None


def _needs_kvstore(trainer, config):
    """Whether `trainer` gets a kvstore at all: several devices, or a
    distributed kvstore (one device per worker)."""
    kv = config['kvstore']
    if kv is None:
        return False
    kv_type = kv if isinstance(kv, str) else getattr(kv, 'type', '')
    contexts = _gluon.trainer_params(trainer)[0].list_ctx() if _gluon.trainer_params(trainer) \
        else []
    return len(contexts) > 1 or 'dist' in kv_type


def checked_trainers():
    """An empty record of the Trainers :func:`check_trainers` settled."""
    return weakref.WeakSet()


def check_trainers(params, checked):
    """Make every AMP Trainer of `params` update outside its kvstore.

    Parameters
    ----------
    params : list of Parameter
        The trained parameters of a DataParallel's block.
    checked : weakref.WeakSet
        Trainers already settled (updated in place; from
        :func:`checked_trainers`): each one is looked at until then.

    Raises
    ------
    ValueError
        A Trainer under AMP created with ``update_on_kvstore=True``, or one
        whose kvstore already updates (it stepped before
        ``amp.init_trainer``).
    """
    for trainer in _gluon.param_trainers(params):
        if trainer in checked or _gluon.amp_loss_scaler(trainer) is None:
            continue
        p = _gluon.trainer_params(trainer)[0]
        fix = ('create the Trainer with update_on_kvstore=False: updating on the kvstore applies '
               'an overflowing step before AMP can skip it, writing Inf/NaN into the weights')
        if _gluon.trainer_kvstore_ready(trainer):
            if _gluon.trainer_updates_on_kvstore(trainer):
                raise ValueError('AMP loss scaling with a Trainer that updates on its kvstore '
                                 f'(parameter {p.name}, contexts {p.list_ctx()}): {fix}')
        else:
            config = _gluon.trainer_kvstore_config(trainer)
            if config['update_on_kvstore'] and _needs_kvstore(trainer, config):
                raise ValueError('AMP loss scaling with a Trainer created with '
                                 f'update_on_kvstore=True (parameter {p.name}, contexts '
                                 f'{p.list_ctx()}): {fix}')
            if config['update_on_kvstore'] is None and _needs_kvstore(trainer, config):
                config['update_on_kvstore'] = False
                warnings.warn('gluon_parallel set update_on_kvstore=False on the Trainer of '
                              f'parameter {p.name} (AMP loss scaling on {p.list_ctx()}): with '
                              'updates on the kvstore, an overflowing step would be applied '
                              'before AMP could skip it. Pass update_on_kvstore=False yourself to '
                              'silence this.', UserWarning, stacklevel=4)
        checked.add(trainer)
