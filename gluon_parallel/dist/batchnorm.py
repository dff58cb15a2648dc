"""SyncBatchNorm over the workers of a dist job: the statistics of the
global batch, reduced through the kvstore."""
import threading

import mxnet as mx
from mxnet import autograd, nd

from .. import _gluon
from .kvstore import allocate_keys, dist_kv

__all__ = ['sync_batchnorm_across_workers']


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
    from ..nn.sync_batchnorm import SyncBatchNorm
    kv = dist_kv(kvstore)
    if kv is None:
        return []
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
            if b._cross_worker is None:
                b._cross_worker = _CrossWorkerMoments(kv, allocate_keys(2))
            names.append(b.name)
        stack[0:0] = list(_gluon.children(b).values())
    return names
