"""What the core and :mod:`gluon_parallel.dist` share about reductions
across workers: whether a kvstore spans them, and this library's own
kvstore keys.

The core (Trainer, buckets, graph binding) asks these questions on every
machine, also with no dist job; this module imports nothing of
:mod:`gluon_parallel.dist` nor of :mod:`gluon_parallel.launch`, so a
one-machine program loads neither.
"""
import threading

import mxnet as mx

from . import _gluon

__all__ = ['is_dist', 'crosses_link', 'allocate_keys', 'ORDER_KEY', 'lock']

lock = threading.RLock()      # guards the process's dist kvstore and the key counter
# Keys of our own cross-worker reductions: far above a Trainer's (0, 1, ...
# one per parameter) and below 2**31 (the C API's int keys).
_KEY_BASE = 1 << 30
_next_key = _KEY_BASE
ORDER_KEY = _KEY_BASE - 1       # init_trainer's check of the parameter order


def allocate_keys(count):
    """`count` consecutive kvstore keys of this library's own, the same on
    every worker that allocates in the same order."""
    global _next_key
    with lock:
        first, _next_key = _next_key, _next_key + count
    return first


def is_dist(kvstore):
    """Whether `kvstore` (a KVStore or a type name) spans the workers."""
    name = kvstore.type if isinstance(kvstore, mx.kv.KVStoreBase) else str(kvstore)
    return 'dist' in name or name == 'horovod'


def crosses_link(trainers):
    """Whether one of `trainers` sums its gradients across workers: its
    kvstore (the one given to it, created at its first step) is a dist or
    Horovod store."""
    return any(is_dist(_gluon.trainer_kvstore_config(t)['kvstore']) for t in trainers)
