"""Training on several machines: MXNet's ``dist_sync`` kvstore, made boring.

Every worker process runs the same script with its own devices; the
parameter servers sum the workers' gradients, and every worker applies the
same update to its own copy of the parameters. The DMLC environment
(``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``, ...) describes the cluster, so a script
runs unchanged under ``python -m gluon_parallel.launch`` (one machine),
MXNet's ``tools/launch.py``, dmlc-tracker, SLURM or Kubernetes::

    import mxnet as mx
    from mxnet import autograd, gluon
    import gluon_parallel as gp
    from gluon_parallel import dist

    ctx = [mx.gpu(i) for i in range(mx.context.num_gpus())] or [mx.cpu()]
    net.initialize(mx.init.Xavier(), ctx=ctx)      # shapes known (no deferred init)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {...},
                            kvstore=dist.get_kvstore(), update_on_kvstore=False)
    dist.init_trainer(trainer)       # same initial values everywhere, race-free
    loader = gluon.data.DataLoader(dist.shard(dataset), batch_size=per_worker_batch)
    for data, label in loader:
        with autograd.record():
            losses = dp_loss(dp(data), label)
        autograd.backward(losses)
        trainer.step(dist.global_batch_size(data.shape[0]))
    dist.save_checkpoint('ckpt', net, trainer, epoch=epoch)   # rank 0 writes

Alone (no DMLC environment) every helper degrades to one worker: rank 0 of
1, ``get_kvstore()`` gives ``'device'``, ``shard`` keeps everything.

Measured with mxnet 1.9.1 and handled here:

* ``update_on_kvstore=False`` raced on the first step: the Trainer
  broadcasts rank 0's initial values by ``init`` + ``pull``, and nothing
  orders that pull before another worker's first gradient push, so a late
  pull could return the summed gradient as the weight and the workers
  stayed apart for good (3 runs in 25, all with the same wrong values).
  The process's kvstore (:func:`get_kvstore`) waits for every broadcast
  pull and then holds a barrier (0 in 15 runs), and :func:`init_trainer`
  does all of it before the first forward pass, so every worker also
  computes its first gradients with rank 0's values (0 in 15 runs).
* Updates stay on the workers (``update_on_kvstore=False``): with updates on
  the servers, ``trainer.set_learning_rate`` after the first step never
  reaches them, ``trainer.save_states`` cannot save their state, and they
  would run the optimizer on every key, including the statistics that
  cross-worker SyncBatchNorm sums through the same kvstore.
* A worker that raises would hang at exit in ps-lite's finalize barrier,
  waiting for the others: :func:`get_kvstore` installs an excepthook that
  prints the traceback and exits at once with status 1, so a launcher's
  watchdog sees the failure and stops the job.
* ps-lite skips loopback interfaces when it picks its own address: when the
  scheduler is on a loopback address, workers bind ``DMLC_NODE_HOST=127.0.0.1``
  (the launcher sets it for every process).
"""
import atexit
import hashlib
import os
import sys
import threading
import warnings

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

from .launch import LAUNCH_RANK_ENV

__all__ = ['is_distributed', 'get_kvstore', 'rank', 'num_workers', 'is_root', 'barrier',
           'init_trainer', 'global_batch_size', 'shard', 'ShardSampler', 'shard_sampler',
           'save_checkpoint', 'load_checkpoint', 'sync_batchnorm_across_workers']

_lock = threading.RLock()
_kv = None                      # this process's dist kvstore, once created
# Keys of our own cross-worker reductions: far above a Trainer's (0, 1, ...
# one per parameter) and below 2**31 (the C API's int keys).
_KEY_BASE = 1 << 30
_next_key = _KEY_BASE
_ORDER_KEY = _KEY_BASE - 1      # init_trainer's check of the parameter order


def is_distributed():
    """True in a worker process of a dist job (``DMLC_ROLE=worker`` and a
    scheduler address in the environment)."""
    return (os.environ.get('DMLC_ROLE') == 'worker'
            and bool(os.environ.get('DMLC_PS_ROOT_URI')))


def _is_loopback(host):
    return host == 'localhost' or host.startswith('127.') or host == '::1'


def _exit_on_uncaught_exception():
    """An uncaught exception would leave this worker blocked at exit in
    ps-lite's finalize barrier: print it, then exit at once."""
    previous = sys.excepthook
    if getattr(previous, '_gluon_parallel', False):
        return

    def hook(exc_type, exc, tb):
        try:
            previous(exc_type, exc, tb)
            sys.stderr.write('gluon_parallel.dist: uncaught %s in a dist worker: exiting now '
                             '(ps-lite would wait for the other workers forever)\n'
                             % exc_type.__name__)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(1)

    hook._gluon_parallel = True
    sys.excepthook = hook


def _finalize_kvstore():
    """atexit: shut the dist kvstore down (ps-lite's finalize: a barrier with
    the other workers) while MXNet's engine still runs. This handler is
    registered after MXNet's own, so it runs before it; a kvstore destroyed
    later, when modules are torn down, aborts the process (measured:
    "terminate called without an active exception", status 134)."""
    global _kv
    kv, _kv = _kv, None
    if kv is None or not kv.handle:
        return
    from mxnet.base import _LIB, check_call
    nd.waitall()
    handle, kv.handle = kv.handle, None     # KVStore.__del__ then frees NULL: a no-op
    check_call(_LIB.MXKVStoreFree(handle))


def _default_layout(value):
    """A copy of CPU arrays: a weight that ran through an MKL-DNN operator in
    predict mode keeps MKL-DNN's layout, which the dist kvstore cannot send
    (measured: "We can't generate TBlob for MKLDNN data" on the first
    broadcast after a predict-mode forward pass); a copy has the default one."""
    if isinstance(value, (list, tuple)):
        return [_default_layout(v) for v in value]
    if isinstance(value, nd.NDArray) and value.context.device_type == 'cpu':
        return value.copy()
    return value


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
        self._barrier()


def _register(kv):
    """Make `kv` the process's dist kvstore (first one wins)."""
    global _kv
    with _lock:
        if _kv is None:
            if type(kv) is mx.kv.KVStore:
                kv.__class__ = _DistKVStore
            _kv = kv
            atexit.register(_finalize_kvstore)
            _exit_on_uncaught_exception()
            expected = os.environ.get(LAUNCH_RANK_ENV)
            if expected is not None and expected != str(kv.rank):
                warnings.warn('this process was launched as worker %s but ps-lite gave it rank '
                              '%d (a port it was given was taken): its output is prefixed '
                              '[worker %s]' % (expected, kv.rank, expected))
        elif _kv is not kv:
            raise RuntimeError('this process already has a dist kvstore (%s): ps-lite supports '
                               'one per process; pass that one' % _kv.type)
    return kv


def get_kvstore(kvstore=None):
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
    if isinstance(kvstore, mx.kv.KVStore):
        return _register(kvstore) if 'dist' in kvstore.type else kvstore
    if kvstore is None:
        kvstore = 'dist_sync' if is_distributed() else 'device'
    if 'dist' not in str(kvstore):
        return kvstore
    with _lock:
        if _kv is not None:
            if _kv.type != kvstore:
                raise RuntimeError('this process already has a %s kvstore, asked for %s'
                                   % (_kv.type, kvstore))
            return _kv
        if not is_distributed():
            raise RuntimeError(
                'kvstore %r needs the DMLC environment of a dist job (DMLC_ROLE=worker, '
                'DMLC_PS_ROOT_URI, ...): run the script under "python -m gluon_parallel.launch '
                '-n WORKERS -s SERVERS -- python SCRIPT" or another DMLC launcher' % kvstore)
        if (_is_loopback(os.environ.get('DMLC_PS_ROOT_URI', ''))
                and not os.environ.get('DMLC_NODE_HOST') and not os.environ.get('DMLC_INTERFACE')):
            os.environ['DMLC_NODE_HOST'] = '127.0.0.1'
        return _register(mx.kv.create(kvstore))


def _dist_kv(kvstore=None):
    """The dist kvstore to use, or None when running alone."""
    if isinstance(kvstore, mx.kv.KVStore):
        return _register(kvstore) if 'dist' in kvstore.type else None
    if kvstore is not None and 'dist' not in str(kvstore):
        return None
    if _kv is not None:
        return _kv
    if not is_distributed():
        return None
    return get_kvstore(kvstore)


def rank(kvstore=None):
    """This worker's rank, 0 .. num_workers() - 1 (0 when running alone).

    Ranks are assigned by the scheduler when the workers connect: the first
    call in a dist job creates the kvstore (see :func:`get_kvstore`).
    """
    kv = _dist_kv(kvstore)
    return 0 if kv is None else kv.rank


def num_workers(kvstore=None):
    """Number of worker processes in the job (1 when running alone)."""
    kv = _dist_kv(kvstore)
    return 1 if kv is None else kv.num_workers


def is_root(kvstore=None):
    """True on rank 0, the worker that writes checkpoints and logs."""
    return rank(kvstore) == 0


def barrier(kvstore=None):
    """Wait until every worker gets here (after finishing its pending MXNet
    work). A no-op when running alone."""
    kv = _dist_kv(kvstore)
    nd.waitall()
    if kv is not None:
        kv._barrier()


def global_batch_size(local_batch_size, kvstore=None):
    """The batch size to pass to ``trainer.step``: the servers sum the
    gradients of every worker, so it is the per-worker batch size times the
    number of workers (exact with :func:`shard`, whose parts have equal
    lengths, so every worker's batches have the same sizes)."""
    return int(local_batch_size) * num_workers(kvstore)


def init_trainer(trainer):
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
    _keep_updates_local(trainer)
    pending = [p.name for p in trainer._params if p._deferred_init]
    if pending:
        raise ValueError('parameters %s wait for deferred initialisation: give their layers '
                         'in_units/in_channels, or run one forward pass (e.g. under '
                         'autograd.predict_mode()) before init_trainer' % ', '.join(pending[:5]))
    if not trainer._kv_initialized:
        trainer._init_kvstore()
    kv = trainer._kvstore
    if kv is not None and 'dist' in kv.type:
        if trainer._update_on_kvstore:
            raise ValueError('the Trainer updates its parameters on the servers '
                             '(update_on_kvstore=True): create it with update_on_kvstore=False '
                             'before its first step; gluon_parallel.dist keeps updates on the '
                             'workers (see the module documentation)')
        if 'async' in kv.type:
            raise ValueError('%s needs updates on the servers; use dist_sync' % kv.type)
        _register(kv)
        _check_same_parameters(trainer, kv)
    if trainer._params_to_init:
        trainer._init_params()
    if kv is not None and 'dist' in kv.type:
        nd.waitall()            # every broadcast pull has landed ...
        kv._barrier()           # ... on every worker, before any gradient push
    return trainer


def _check_same_parameters(trainer, kv):
    """The kvstore matches parameters across workers by Trainer index, and
    the Trainer orders them by full name, which carries Gluon's global
    counters: a worker that built other blocks first ('dense10_' sorts
    before 'dense9_') could silently exchange the gradients of two
    equal-shaped parameters. Compare a digest of the names, in order, over
    the workers: the sum of the digest bytes and of their squares equals
    num_workers times one worker's only if every worker has the same."""
    text = '\n'.join('%s %s' % (p.name, p.shape) for p in trainer._params)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:16], np.uint8)
    local = np.concatenate([digest, digest.astype(np.float64) ** 2]).astype(np.float64)
    buf = nd.array(local, ctx=mx.cpu(), dtype='float64')
    kv.init(_ORDER_KEY, nd.zeros_like(buf))
    kv.pushpull(_ORDER_KEY, buf, out=buf)
    if not np.array_equal(buf.asnumpy(), local * kv.num_workers):
        raise ValueError(
            'the workers\' Trainers hold parameters with different names (worker %d: %s ... %s): '
            'the kvstore pairs parameters by their position in name order, so the workers '
            'could exchange the gradients of different parameters. Build the same model, the '
            'same way, on every worker before any other block (Gluon numbers blocks globally), '
            'or give it a fixed prefix' % (kv.rank, trainer._params[0].name,
                                           trainer._params[-1].name))


def _keep_updates_local(trainer):
    """Before the Trainer creates its kvstore: make a dist one the
    process's single dist kvstore, with updates on the workers."""
    if trainer._kv_initialized:
        return
    config = trainer._kvstore_params
    kv = config['kvstore']
    if isinstance(kv, mx.kv.KVStore) or 'dist' in str(kv):
        # A type name would make the Trainer create a second dist kvstore.
        config['kvstore'] = kv = get_kvstore(kv)
    if isinstance(kv, mx.kv.KVStore) and 'dist' in kv.type \
            and config['update_on_kvstore'] is None:
        config['update_on_kvstore'] = False


# ----------------------------------------------------------------------------
# Data

class _Shard(gluon.data.Dataset):
    def __init__(self, dataset, indices):
        self._dataset = dataset
        self._indices = indices

    def __len__(self):
        return len(self._indices)

    def __getitem__(self, idx):
        return self._dataset[self._indices[idx]]


def _part(num_parts, part_index):
    if num_parts is None:
        num_parts = num_workers()
    if part_index is None:
        part_index = rank() if num_parts > 1 else 0
    num_parts, part_index = int(num_parts), int(part_index)
    if num_parts < 1 or not 0 <= part_index < num_parts:
        raise ValueError('part_index %d out of range for %d parts' % (part_index, num_parts))
    return num_parts, part_index


def shard(dataset, num_parts=None, part_index=None):
    """This worker's part of `dataset`: items ``part_index``,
    ``part_index + num_parts``, ...

    Every part has ``len(dataset) // num_parts`` items (the last
    ``len(dataset) % num_parts`` items are left out), so every worker runs
    the same number of steps: a worker with one batch more would wait for
    the others forever at its gradient push. Interleaving makes the k-th
    batches of all the workers together the k-th batch of
    ``num_parts * batch_size`` that one process would read.

    Parameters
    ----------
    dataset : Dataset (anything with ``len`` and ``[]``)
    num_parts : int, optional
        Default: :func:`num_workers`.
    part_index : int, optional
        Default: :func:`rank`.

    Returns
    -------
    gluon.data.Dataset
    """
    num_parts, part_index = _part(num_parts, part_index)
    length = len(dataset) // num_parts
    if length == 0:
        raise ValueError('a dataset of %d items cannot give %d workers one item each'
                         % (len(dataset), num_parts))
    return _Shard(dataset, range(part_index, length * num_parts, num_parts))


class ShardSampler(gluon.data.Sampler):
    """Sample this worker's part of a dataset, shuffled the same way on
    every worker.

    Each pass draws one permutation of all ``length`` indices from
    ``seed + epoch`` (the same on every worker) and yields its items
    ``part_index::num_parts``, ``length // num_parts`` of them, so the
    workers' parts are disjoint, of equal lengths, and their k-th batches
    together are the k-th batch of one process shuffling with that
    permutation. The epoch advances by one after every pass;
    :meth:`set_epoch` sets it.

    Parameters
    ----------
    length : int
        Length of the dataset.
    num_parts, part_index : int, optional
        Default: :func:`num_workers`, :func:`rank`.
    shuffle : bool, default False
    seed : int, default 0

    Examples
    --------
    >>> sampler = dist.ShardSampler(len(dataset), shuffle=True)
    >>> loader = gluon.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    """

    def __init__(self, length, num_parts=None, part_index=None, shuffle=False, seed=0):
        self._length = int(length)
        self._num_parts, self._part_index = _part(num_parts, part_index)
        if self._length // self._num_parts == 0:
            raise ValueError('a dataset of %d items cannot give %d workers one item each'
                             % (self._length, self._num_parts))
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch):
        """Use the permutation of `epoch` for the next pass."""
        self.epoch = int(epoch)

    def __len__(self):
        return self._length // self._num_parts

    def __iter__(self):
        if self._shuffle:
            order = np.random.RandomState(self._seed + self.epoch).permutation(self._length)
        else:
            order = np.arange(self._length)
        self.epoch += 1
        used = len(self) * self._num_parts
        return iter(order[self._part_index:used:self._num_parts].tolist())


class _ShardedSampler(gluon.data.Sampler):
    def __init__(self, sampler, num_parts, part_index):
        self._sampler = sampler
        self._num_parts, self._part_index = num_parts, part_index

    def __len__(self):
        return len(self._sampler) // self._num_parts

    def __iter__(self):
        used = len(self) * self._num_parts
        for i, item in enumerate(self._sampler):
            if i >= used:
                break
            if i % self._num_parts == self._part_index:
                yield item

    def __getattr__(self, name):        # set_epoch and the like reach the sampler
        return getattr(self.__dict__['_sampler'], name)


def shard_sampler(sampler, num_parts=None, part_index=None):
    """This worker's part of every pass of `sampler`: the items it yields at
    positions ``part_index``, ``part_index + num_parts``, ...

    For a sampler that must yield more than indices (e.g. ``(index, seed)``
    keys for reproducible augmentation): it must yield the same sequence on
    every worker (seed it identically). As with :func:`shard`, every part
    has ``len(sampler) // num_parts`` items. Attributes such as
    ``set_epoch`` are those of `sampler`. With one part, `sampler` itself is
    returned.

    Parameters
    ----------
    sampler : gluon.data.Sampler (anything with ``len`` and ``iter``)
    num_parts, part_index : int, optional
        Default: :func:`num_workers`, :func:`rank`.

    Returns
    -------
    gluon.data.Sampler
    """
    num_parts, part_index = _part(num_parts, part_index)
    if num_parts == 1:
        return sampler
    if len(sampler) // num_parts == 0:
        raise ValueError('a sampler of %d items cannot give %d workers one item each'
                         % (len(sampler), num_parts))
    return _ShardedSampler(sampler, num_parts, part_index)


# ----------------------------------------------------------------------------
# Checkpoints

def save_checkpoint(prefix, block, trainer=None, **meta):
    """Write a checkpoint on rank 0; every worker must call it.

    Rank 0 calls :func:`gluon_parallel.save_checkpoint`; then every worker
    waits at a barrier, so when this returns, anywhere, the files are
    complete. The other workers' parameters and optimizer states equal rank
    0's (same initial values, same summed gradients, same updates).

    Returns
    -------
    The value of :func:`gluon_parallel.save_checkpoint` on rank 0, None
    elsewhere.
    """
    from .checkpoint import save_checkpoint as save
    result = None
    if is_root():
        result = save(prefix, block, trainer, **meta)
    barrier()
    return result


def load_checkpoint(prefix, block, trainer=None, ctx_list=None):
    """Load a checkpoint on every worker; every worker must call it.

    The files must be readable by every worker (a shared file system, or
    copies). Use this instead of :func:`init_trainer` when resuming: it
    keeps the updates on the workers, loads the parameters and the trainer
    state, then initialises the kvstore race-free as :func:`init_trainer`
    does.

    Returns
    -------
    dict
        The checkpoint's meta data.
    """
    from .checkpoint import load_checkpoint as load
    if trainer is not None:
        _keep_updates_local(trainer)
    meta = load(prefix, block, trainer, ctx_list=ctx_list)
    if trainer is not None:
        init_trainer(trainer)
    else:
        barrier()
    return meta


# ----------------------------------------------------------------------------
# SyncBatchNorm across workers

class _AllReduce(autograd.Function):
    """Sum over the workers; its gradient is the sum over the workers of
    the gradients (each worker's loss depends on every worker's input)."""

    def __init__(self, reducer):
        super(_AllReduce, self).__init__()
        self._reducer = reducer

    def forward(self, x):
        return self._reducer.allreduce(0, x)

    def backward(self, dy):
        return self._reducer.allreduce(1, dy)


class _CrossWorkerMoments(object):
    """The statistics merge of one SyncBatchNorm layer, over the replicas of
    this worker and over the workers.

    A drop-in for ``nn.sync_batchnorm._merge_moments`` (same arguments and
    result): it takes the replicas' ``([s1 | s2 | pivot], count)`` (sums of
    ``x - pivot`` and of its square per channel) and gives replica i
    ``[mean - pivot_i | var | mean]`` in float32 on its device, where mean
    and var are those of the global batch of every worker. Each worker adds
    up, in float64, its replicas' counts, sums and sums of squares; one
    push-pull through the kvstore adds up those of all workers. That
    reduction is an autograd Function whose backward push-pulls the
    gradients the same way, so input gradients are exact on every worker.
    """

    def __init__(self, kv, key):
        self.kv = kv
        self.keys = (key, key + 1)      # forward values, backward gradients
        self._bufs = {}
        self._lock = threading.Lock()

    def allreduce(self, which, x):
        """Sum of `x` over the workers (x: a float64 vector)."""
        key = self.keys[which]
        buf = self._bufs[key]
        # Writing the buffer waits for the previous pull into it, so a
        # worker never pushes round k+1 before it received round k: the
        # servers can never mix two rounds of one key.
        buf[:] = x.as_in_context(buf.context)
        self.kv.pushpull(key, buf, out=buf)
        return buf.as_in_context(x.context) if x.context != buf.context else buf.copy()

    def _ensure_keys(self, size):
        if getattr(self.kv, '_server_updates', False):
            raise RuntimeError(
                'cross-worker SyncBatchNorm sums its statistics through the kvstore, but the '
                'servers run the optimizer (the Trainer has update_on_kvstore=True): create the '
                'Trainer with update_on_kvstore=False and call gluon_parallel.dist.init_trainer')
        # kv.init is collective (rank 0 pushes, then a barrier): every
        # worker reaches a layer's first training forward in the same order.
        with self._lock:
            if self._bufs:
                return
            for key in self.keys:
                buf = nd.zeros((size,), ctx=mx.cpu(), dtype='float64')
                self.kv.init(key, buf)
                self._bufs[key] = buf

    def __call__(self, *pushed):
        dst = pushed[0][0].context
        n, c = len(pushed), pushed[0][0].shape[0] // 3
        counts = [k for _, k in pushed]
        stacked = nd.cast(nd.stack(*[v.as_in_context(dst) for v, _ in pushed]), 'float64')
        s1, s2, pivot = nd.split(stacked, num_outputs=3, axis=1)         # (n, c) each
        cnt = nd.array(counts, ctx=dst, dtype='float64').reshape((n, 1))
        # Sums of x and x^2 about zero, in float64: the variance
        # E[x^2] - mean^2 then keeps about 16 - 2 log10(|mean| / std) digits,
        # far more than float32 needs.
        pc = nd.broadcast_mul(cnt, pivot)
        t1 = s1 + pc
        t2 = s2 + 2 * pivot * s1 + pc * pivot
        total = nd.array([float(sum(counts))], ctx=dst, dtype='float64')
        local = nd.concat(nd.sum(t1, axis=0), nd.sum(t2, axis=0), total, dim=0)
        self._ensure_keys(2 * c + 1)
        summed = _AllReduce(self)(local)
        count = nd.slice_axis(summed, axis=0, begin=2 * c, end=2 * c + 1)
        mean = nd.broadcast_div(nd.slice_axis(summed, axis=0, begin=0, end=c), count)
        var = nd.broadcast_div(nd.slice_axis(summed, axis=0, begin=c, end=2 * c), count)
        var = nd.relu(var - nd.square(mean))
        mean, var = mean.reshape((1, c)), var.reshape((1, c))
        out = nd.cast(nd.concat(nd.broadcast_sub(mean, pivot), nd.broadcast_to(var, (n, c)),
                                nd.broadcast_to(mean, (n, c)), dim=1), 'float32')
        rows = nd.split(out, num_outputs=n, axis=0, squeeze_axis=True) if n > 1 \
            else [out.reshape((-1,))]
        return [r.as_in_context(v.context) for r, (v, _) in zip(rows, pushed)]


def sync_batchnorm_across_workers(block, kvstore=None):
    """Make every SyncBatchNorm in `block` normalise with the statistics of
    the global batch of all workers, not only of this worker's devices.

    Every worker must call it on the same network, and then run the same
    training-mode forward and backward passes (as data-parallel training
    does): each layer meets the other workers once per forward and once per
    backward, through two keys of the trainer's kvstore, so the trainer must
    keep the updates on the workers (:func:`init_trainer` does). Outside a
    dist job it does nothing. Output, input gradients and running
    statistics then equal those of BatchNorm on the global batch on one
    device. A SyncBatchNorm used outside DataParallel takes part as a
    single device.

    Parameters
    ----------
    block : Block
    kvstore : KVStore, optional
        Default: the process's dist kvstore (:func:`get_kvstore`).

    Returns
    -------
    list of str
        Names of the layers now synchronised across workers.
    """
    from .nn.sync_batchnorm import SyncBatchNorm
    kv = _dist_kv(kvstore)
    if kv is None:
        return []
    global _next_key
    names = []
    stack, seen = [block], set()
    # Depth-first in registration order: every worker builds the same
    # network, so every worker gives a layer the same keys.
    while stack:
        b = stack.pop(0)
        if id(b) in seen:
            continue
        seen.add(id(b))
        if isinstance(b, SyncBatchNorm):
            with _lock:
                if b._cross_worker is None:
                    b._cross_worker = _CrossWorkerMoments(kv, _next_key)
                    _next_key += 2
            names.append(b.name)
        stack[0:0] = list(b._children.values())
    return names
