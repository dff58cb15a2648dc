"""The process's one dist kvstore (ps-lite allows one per process): its
creation, its guards, its shutdown, and the worker's rank. In a Horovod job
(horovod.py) that store is a :class:`~.horovod.HorovodStore`."""
import atexit
import os
import warnings

import mxnet as mx
from mxnet import nd

from .. import _gluon, progress
from ..links import ORDER_KEY, is_dist, lock
from ..nested import rebuild
from .horovod import HorovodStore, is_horovod_job

__all__ = ['is_distributed', 'get_kvstore', 'rank', 'num_workers', 'is_root', 'barrier',
           'global_batch_size']

_kv = None                      # this process's dist kvstore, once created


def is_distributed() -> bool:
    """True in a worker process of a dist job: ``DMLC_ROLE=worker`` and a
    scheduler address in the environment (dist_sync), or a Horovod job's
    ``HOROVOD_RANK`` and ``HOROVOD_SIZE``."""
    return ((os.environ.get('DMLC_ROLE') == 'worker'
             and bool(os.environ.get('DMLC_PS_ROOT_URI'))) or is_horovod_job())


def meet(kv):
    """A barrier of every worker of `kv`."""
    if isinstance(kv, HorovodStore):
        kv.barrier()
    else:
        _gluon.kvstore_barrier(kv)


def _is_loopback(host):
    return host == 'localhost' or host.startswith('127.') or host == '::1'


def _finalize_kvstore():
    """atexit: shut the dist kvstore down (ps-lite's finalize: a barrier with
    the other workers) while MXNet's engine still runs. This handler is
    registered after MXNet's own, so it runs before it; a kvstore destroyed
    later, when modules are torn down, aborts the process (measured:
    "terminate called without an active exception", status 134). A process
    ending with a non-zero ``sys.exit`` status exits at once instead: the
    barrier would wait for workers that wait for it."""
    global _kv
    from ..launch import failfast
    failfast.exit_now_if_failing()
    kv, _kv = _kv, None
    if kv is None or not getattr(kv, 'handle', None):     # (Horovod shuts itself down)
        return
    nd.waitall()
    _gluon.free_kvstore(kv)


def _default_layout(value):
    """A copy of CPU arrays: a weight that ran through an MKL-DNN operator in
    predict mode keeps MKL-DNN's layout, which the dist kvstore cannot send
    (measured: "We can't generate TBlob for MKLDNN data" on the first
    broadcast after a predict-mode forward pass); a copy has the default one.
    `value`: an array, or a list or tuple of them (per device; per key)."""
    return rebuild(value, _default_layout_array)


def _default_layout_array(a):
    return a.copy() if isinstance(a, nd.NDArray) and a.context.device_type == 'cpu' else a


class _DistKVStore(mx.kv.KVStore):
    """The process's dist kvstore: an ``mx.kv.KVStore`` with two guards."""

    _server_updates = False

    def set_optimizer(self, optimizer):
        # Recorded so that cross-worker SyncBatchNorm can refuse to sum its
        # statistics through servers that would run the optimizer on them.
        self._server_updates = True
        super(_DistKVStore, self).set_optimizer(optimizer)

    def init(self, key, value):
        super(_DistKVStore, self).init(key, _default_layout(value))

    def pushpull(self, key, value, out=None, priority=0):
        if key == ORDER_KEY:        # init_trainer's check: start-up, not a step
            return super(_DistKVStore, self).pushpull(key, value, out, priority)
        progress.reduce(key, lambda: super(_DistKVStore, self).pushpull(key, value, out,
                                                                         priority))

    def push(self, key, value, priority=0):
        # (Sparse gradients: push, then pull; the push is the reduction.)
        progress.reduce(key, lambda: super(_DistKVStore, self).push(key, value, priority))

    def broadcast(self, key, value, out, priority=0):
        # The Trainer broadcasts rank 0's initial values by init + pull, and
        # nothing orders that pull before another worker's first gradient
        # push: a late pull could return the summed gradient as the weight
        # (measured: 3 runs in 25 diverged). Wait for the pull, then meet
        # the other workers, so no gradient is pushed before every worker
        # has its initial values.
        super(_DistKVStore, self).broadcast(key, _default_layout(value), out, priority)
        for o in (out if isinstance(out, (list, tuple)) else [out]):
            o.wait_to_read()
        _gluon.kvstore_barrier(self)


def register(kv):
    """Make `kv` the process's dist kvstore (first one wins)."""
    global _kv
    # The launcher's modules only in a dist job (one machine loads none).
    from ..launch import LAUNCH_RANK_ENV, failfast
    with lock:
        if _kv is None:
            if type(kv) is mx.kv.KVStore:
                _gluon.specialise(kv, _DistKVStore)
            _kv = kv
            # Fail fast (also without the launcher's start-up hook): an
            # uncaught exception or sys.exit(N) would leave this worker
            # waiting at exit in ps-lite's finalize barrier.
            failfast.install()
            atexit.register(_finalize_kvstore)
            expected = os.environ.get(LAUNCH_RANK_ENV)
            if expected is not None and expected != str(kv.rank):
                warnings.warn('this process was launched as worker %s but ps-lite gave it rank '
                              '%d (a port it was given was taken): its output is prefixed '
                              '[worker %s]' % (expected, kv.rank, expected))
        elif _kv is not kv:
            raise RuntimeError('this process already has a dist kvstore (%s): ps-lite supports '
                               'one per process; pass that one' % _kv.type)
    return kv


def get_kvstore(kvstore: str | mx.kv.KVStoreBase | None = None) -> str | mx.kv.KVStoreBase:
    """The kvstore to give ``gluon.Trainer``.

    Parameters
    ----------
    kvstore : str or KVStore, optional
        A ``dist_*`` type (``'dist_sync'``, ``'dist_device_sync'``...) or a
        dist KVStore: the process's one dist kvstore, created on the first
        call (ps-lite allows one per process). A local type (``'device'``,
        ``'local'``, None outside a dist job) is returned unchanged, for
        the Trainer to create. Default: ``'dist_sync'`` in a dist job, else
        ``'device'``.

    Returns
    -------
    KVStore or str
    """
    if isinstance(kvstore, mx.kv.KVStoreBase):
        return register(kvstore) if is_dist(kvstore) else kvstore
    if kvstore is None:
        kvstore = ('horovod' if is_horovod_job() else 'dist_sync') if is_distributed() \
            else 'device'
    if not is_dist(kvstore):
        return kvstore
    with lock:
        if _kv is not None:
            if _kv.type != kvstore:
                raise RuntimeError('this process already has a %s kvstore, asked for %s'
                                   % (_kv.type, kvstore))
            return _kv
        if kvstore == 'horovod':
            if not is_horovod_job():
                raise RuntimeError('kvstore \'horovod\' needs a Horovod job (HOROVOD_RANK, '
                                   'HOROVOD_SIZE): run the script under horovodrun or "python '
                                   '-m gluon_parallel.launch --engine horovod"')
            return register(HorovodStore())
        if not is_distributed() or is_horovod_job():
            raise RuntimeError(
                'kvstore %r needs the DMLC environment of a dist job (DMLC_ROLE=worker, '
                'DMLC_PS_ROOT_URI, ...): run the script under "python -m gluon_parallel.launch '
                '-n WORKERS -s SERVERS -- python SCRIPT" or another DMLC launcher' % kvstore)
        if (_is_loopback(os.environ.get('DMLC_PS_ROOT_URI', ''))
                and not os.environ.get('DMLC_NODE_HOST') and not os.environ.get('DMLC_INTERFACE')):
            _gluon.add_variable('DMLC_NODE_HOST', '127.0.0.1')
        return register(mx.kv.create(kvstore))


def dist_kv(kvstore=None):
    """The dist kvstore to use, or None when running alone."""
    if isinstance(kvstore, mx.kv.KVStoreBase):
        return register(kvstore) if is_dist(kvstore) else None
    if kvstore is not None and not is_dist(kvstore):
        return None
    if _kv is not None:
        return _kv
    if not is_distributed():
        return None
    return get_kvstore(kvstore)


def rank(kvstore: str | mx.kv.KVStoreBase | None = None) -> int:
    """This worker's rank, 0 .. num_workers() - 1 (0 when running alone).

    Ranks are assigned by the scheduler when the workers connect: the first
    call in a dist job creates the kvstore (see :func:`get_kvstore`).
    """
    kv = dist_kv(kvstore)
    return 0 if kv is None else kv.rank


def num_workers(kvstore: str | mx.kv.KVStoreBase | None = None) -> int:
    """Number of worker processes in the job (1 when running alone)."""
    kv = dist_kv(kvstore)
    return 1 if kv is None else kv.num_workers


def is_root(kvstore: str | mx.kv.KVStoreBase | None = None) -> bool:
    """True on rank 0, the worker that writes checkpoints and logs."""
    return rank(kvstore) == 0


def barrier(kvstore: str | mx.kv.KVStoreBase | None = None) -> None:
    """Wait until every worker gets here (after finishing its pending MXNet
    work). A no-op when running alone."""
    kv = dist_kv(kvstore)
    nd.waitall()
    if kv is not None:
        progress.reduce('barrier', lambda: meet(kv))


def global_batch_size(local_batch_size: int,
                      kvstore: str | mx.kv.KVStoreBase | None = None) -> int:
    """The batch size to pass to ``trainer.step``: the servers sum the
    gradients of every worker, so it is the per-worker batch size times the
    number of workers (exact with :func:`shard`, whose parts have equal
    lengths, so every worker's batches have the same sizes; with
    :class:`GlobalBatchSampler`, whose parts may differ by one, pass its
    ``global_batch_size(step)`` instead)."""
    return int(local_batch_size) * num_workers(kvstore)
