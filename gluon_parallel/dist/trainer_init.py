"""A Trainer ready for dist_sync: updates on the workers, rank 0's initial
values everywhere, race-free, and the same parameters on every worker."""
import hashlib

import numpy as np
import mxnet as mx
from mxnet import nd

from .. import _gluon
from ..links import ORDER_KEY, is_dist
from .kvstore import get_kvstore, meet, register

__all__ = ['init_trainer']


def init_trainer(trainer: mx.gluon.Trainer) -> None:
    """Initialise `trainer`'s kvstore and parameters before the first step,
    so every worker starts from rank 0's values, without a race.

    Call it on every worker after the parameters are initialised (shapes
    known: give ``in_units``/``in_channels`` or run one forward pass) and
    before the first forward pass that is trained. It

    * keeps the updates on the workers (``update_on_kvstore=False``, set if
      the Trainer was created with None; True raises);
    * broadcasts rank 0's parameter values (running statistics included,
      when they are in the trainer) to every worker;
    * waits for those values to arrive and holds a kvstore barrier, so no
      worker pushes a gradient before every worker pulled its initial
      values (without it, measured: 3 runs in 25 diverged).

    Alone or with a local kvstore it only initialises the kvstore.

    Parameters
    ----------
    trainer : gluon.Trainer
        Created with ``kvstore=dist.get_kvstore()`` (a ``'dist_sync'``
        type name works too: it is replaced by the process's kvstore).

    Returns
    -------
    gluon.Trainer
        `trainer`.
    """
    keep_updates_local(trainer)
    pending = [p.name for p in _gluon.trainer_params(trainer) if _gluon.is_deferred(p)]
    if pending:
        raise ValueError('parameters %s wait for deferred initialisation: give their layers '
                         'in_units/in_channels, or run one forward pass (e.g. under '
                         'autograd.predict_mode()) before init_trainer' % ', '.join(pending[:5]))
    kv, on_servers = _gluon.init_trainer_kvstore(trainer)
    if kv is not None and is_dist(kv):
        if on_servers:
            raise ValueError('the Trainer updates its parameters on the servers '
                             '(update_on_kvstore=True): create it with update_on_kvstore=False '
                             'before its first step; gluon_parallel.dist keeps updates on the '
                             'workers (see the module documentation)')
        if 'async' in kv.type:
            raise ValueError('%s needs updates on the servers; use dist_sync' % kv.type)
        register(kv)
        if not _gluon.trainer_compression(trainer):
            # (MXNet's gradient compression would quantise the digest)
            _check_same_parameters(trainer, kv)
    _gluon.init_trainer_params(trainer)
    if kv is not None and is_dist(kv):
        nd.waitall()            # every broadcast pull has landed ...
        meet(kv)                # ... on every worker, before any gradient push
    return trainer


def _check_same_parameters(trainer, kv):
    """The kvstore matches parameters across workers by Trainer index, and
    the Trainer orders them by full name, which carries Gluon's global
    counters: a worker that built other blocks first ('dense10_' sorts
    before 'dense9_') could silently exchange the gradients of two
    equal-shaped parameters. Compare a digest of the names, in order, over
    the workers: the sum of the digest bytes and of their squares equals
    num_workers times one worker's only if every worker has the same."""
    params = _gluon.trainer_params(trainer)
    text = '\n'.join('%s %s' % (p.name, p.shape) for p in params)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:16], np.uint8)
    # float32, exact for these sums up to 258 workers: MXNet's gradient
    # compression (compression_params) refuses a key of any other type.
    local = np.concatenate([digest, digest.astype(np.float64) ** 2]).astype(np.float32)
    buf = nd.array(local, ctx=mx.cpu(), dtype='float32')
    kv.init(ORDER_KEY, nd.zeros_like(buf))
    kv.pushpull(ORDER_KEY, buf, out=buf)
    if not np.array_equal(buf.asnumpy(), local * kv.num_workers):
        raise ValueError(
            'the workers\' Trainers hold parameters with different names (worker %d: %s ... %s): '
            'the kvstore pairs parameters by their position in name order, so the workers '
            'could exchange the gradients of different parameters. Build the same model, the '
            'same way, on every worker before any other block (Gluon numbers blocks globally), '
            'or give it a fixed prefix' % (kv.rank, params[0].name, params[-1].name))


def keep_updates_local(trainer):
    """Before the Trainer creates its kvstore: make a dist one the
    process's single dist kvstore, with updates on the workers."""
    if _gluon.trainer_kvstore_ready(trainer):
        return
    config = _gluon.trainer_kvstore_config(trainer)
    kv = config['kvstore']
    if isinstance(kv, mx.kv.KVStoreBase) or is_dist(kv):
        # A type name would make the Trainer create a second dist kvstore.
        config['kvstore'] = kv = get_kvstore(kv)
    if isinstance(kv, mx.kv.KVStoreBase) and is_dist(kv) \
            and config['update_on_kvstore'] is None:
        config['update_on_kvstore'] = False
