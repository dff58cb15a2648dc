"""SyncBatchNorm over the workers of a dist job: the statistics of the
global batch, reduced through the kvstore."""
import threading

import mxnet as mx
from mxnet import autograd, nd

from .. import _gluon
from ..links import allocate_keys, lock
from .kvstore import dist_kv

__all__ = ['sync_batchnorm_across_workers']


class _AllReduce(autograd.Function):
    """Sum over the workers; its gradient is the sum over the workers of
    the gradients (each worker's loss depends on every worker's input)."""

    def __init__(self, reducer, keys):
        super(_AllReduce, self).__init__()
        self._reducer, self._keys = reducer, keys

    def forward(self, x):
        return self._reducer.allreduce(self._keys[0], x)

    def backward(self, dy):
        return self._reducer.allreduce(self._keys[1], dy)


class WorkerReducer(object):
    """A :attr:`SyncBatchNorm.reducer <gluon_parallel.nn.SyncBatchNorm.reducer>`
    over the workers of a dist job: it adds up every worker's totals of a
    layer (float64 sums of x and x^2 and row counts per channel) with one
    push-pull through the kvstore, and their gradients with another in
    backward, so every worker normalises with the global batch's statistics
    and gets exact input gradients.

    Each layer has one key for its forward rounds and :attr:`ROUNDS` for
    the gradients: MXNet runs the backward of autograd Functions in a pool
    of threads, so the gradient push-pulls of two uses of a layer (a layer
    called twice, or two forwards before one backward) may start in either
    order, and a worker must never add its round k to another's round k+1.
    Round r of a layer sends its gradient under key r mod ROUNDS.
    """

    #: Uses of one layer whose gradients one backward pass may reduce at once.
    ROUNDS = 8

    def __init__(self, kv):
        self.kv = kv
        self._keys = {}          # layer -> [its first key, forward rounds so far]
        self._bufs = {}
        self._lock = threading.Lock()

    def add(self, layer):
        """Give `layer` its keys: every worker adds the same layers in the
        same order, so the keys agree."""
        with self._lock:
            if layer not in self._keys:
                self._keys[layer] = [allocate_keys(1 + self.ROUNDS), 0]

    def __call__(self, layer, totals):
        self._check_servers()
        with self._lock:
            entry = self._keys.get(layer)
            if entry is None:
                raise ValueError('%s has no kvstore keys of this reducer: call '
                                 'sync_batchnorm_across_workers on its network' % layer.name)
            first, r = entry
            entry[1] += 1
            if first not in self._bufs:
                # kv.init is collective (rank 0 pushes, then a barrier): every
                # worker reaches a layer's first training forward in the same order.
                keys = list(range(first, first + 1 + self.ROUNDS))
                bufs = [nd.zeros((totals.size,), ctx=mx.cpu(), dtype='float64') for _ in keys]
                self.kv.init(keys, bufs)
                self._bufs.update(zip(keys, bufs))
        keys = (first, first + 1 + r % self.ROUNDS)
        return _AllReduce(self, keys)(totals.reshape((-1,))).reshape(totals.shape)

    def allreduce(self, key, x):
        """Sum of `x` over the workers (x: a float64 vector)."""
        buf = self._bufs[key]
        # Writing the buffer waits for the previous pull into it, so a
        # worker never pushes round k+1 of a key before it received round k.
        buf[:] = x.as_in_context(buf.context)
        self.kv.pushpull(key, buf, out=buf)
        return buf.as_in_context(x.context) if x.context != buf.context else buf.copy()

    def _check_servers(self):
        if getattr(self.kv, '_server_updates', False):
            raise RuntimeError(
                'cross-worker SyncBatchNorm sums its statistics through the kvstore, but the '
                'servers run the optimizer (the Trainer has update_on_kvstore=True): create the '
                'Trainer with update_on_kvstore=False and call gluon_parallel.dist.init_trainer')


def sync_batchnorm_across_workers(block: mx.gluon.Block,
                                  kvstore: str | mx.kv.KVStoreBase | None = None) -> list[str]:
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
    from ..nn.sync_batchnorm import SyncBatchNorm
    kv = dist_kv(kvstore)
    if kv is None:
        return []
    names, reducer = [], WorkerReducer(kv)
    stack, seen = [block], set()
    # Depth-first in registration order: every worker builds the same
    # network, so every worker gives a layer the same keys.
    while stack:
        b = stack.pop(0)
        if id(b) in seen:
            continue
        seen.add(id(b))
        if isinstance(b, SyncBatchNorm):
            with lock:      # two threads converting one net: keys once
                if b.reducer is None:
                    b.reducer = reducer
                elif not isinstance(b.reducer, WorkerReducer):
                    raise ValueError('%s already has a reducer of its own (%r): set it to None '
                                     'first' % (b.name, b.reducer))
                b.reducer.add(b)
            names.append(b.name)
        stack[0:0] = list(_gluon.children(b).values())
    return names
