"""The Horovod engine: ring all-reduce between the workers instead of
parameter servers, behind the same ``gluon_parallel.dist`` calls.

A worker started by ``horovodrun`` (or ``python -m gluon_parallel.launch
--engine horovod``, which runs it) has ``HOROVOD_RANK`` and
``HOROVOD_SIZE`` in its environment; :func:`gluon_parallel.dist.get_kvstore`
then returns this process's :class:`HorovodStore` instead of a ``dist_sync``
kvstore, and the training loop does not change.

:class:`HorovodStore` is a ``KVStoreBase`` that ``gluon.Trainer`` drives as
any kvstore that cannot run an optimizer (updates stay on the workers, as
``gluon_parallel.dist`` keeps them with ``dist_sync`` too):

* ``broadcast(key, value, out)``: rank 0's ``value`` to every worker
  (``hvd.broadcast``), then into each of this worker's contexts;
* ``pushpull(key, values, out)``: this worker's per-context arrays summed on
  the first context, that sum all-reduced over the workers
  (``hvd.allreduce``, a sum), the result written to every context (one
  context's flat array, a gradient bucket, is all-reduced in place);
* ``pushpull_group(keys, values)``: the same for several keys, one
  all-reduce each, in the order given: ``gluon_parallel.Trainer`` sums its
  gradient buckets so, in the order backward writes them. Each all-reduce
  is an engine operation that starts when its bucket is written, so the
  first buckets are on the wire while backward still runs; Horovod's
  background cycle fuses those that are ready together (a grouped
  all-reduce, ``hvd.grouped_allreduce_``, would wait for every bucket).

horovod.mxnet's own ``DistributedTrainer`` reduces the first context's
gradient only, so it cannot serve a worker with several devices. Horovod
runs its collectives as asynchronous MXNet engine operations completed by
its own background thread: nothing waits inside the engine.

Horovod is imported on first use only: gluon_parallel imports without it.
"""
import itertools
import os
import threading

from mxnet import nd
from mxnet.kvstore import KVStoreBase

from .. import progress
from ..nn import kernels

__all__ = ['is_horovod_job', 'HorovodStore']

ENV = ('HOROVOD_RANK', 'HOROVOD_SIZE')
_lock = threading.Lock()
_hvd = None


def is_horovod_job():
    """True in a worker of a Horovod job (``HOROVOD_RANK`` and
    ``HOROVOD_SIZE`` set, no dist_sync role)."""
    return all(os.environ.get(k) for k in ENV) and not os.environ.get('DMLC_ROLE')


def horovod():
    """``horovod.mxnet``, initialised once per process."""
    global _hvd
    with _lock:
        if _hvd is None:
            # MXNet 1.9.1 cannot load an operator library once horovod.mxnet's
            # is loaded: SyncBatchNorm's optional kernels go first.
            kernels.load()
            try:
                import horovod.mxnet as hvd
            except ImportError as e:
                raise ImportError(
                    'this is a Horovod job (%s are set) but horovod.mxnet does not import (%s): '
                    'build Horovod with MXNet support as the README\'s "Horovod" section says'
                    % (' and '.join(ENV), e))
            hvd.init()
            _hvd = hvd
    return _hvd


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _local_sum(values):
    """A new array on the first one's context: the sum of `values` (in the
    default layout: an MKL-DNN one cannot be sent)."""
    total = values[0].copy()
    for v in values[1:]:
        total += v.as_in_context(total.context)
    return total


def _to_reduce(values):
    """What this worker all-reduces for the per-context arrays `values`,
    written back into them: the only array itself where it can be sent as
    it is (one context, a flat array such as a gradient bucket: MKL-DNN
    lays out no 1-D array its own way), else :func:`_local_sum`."""
    if len(values) == 1 and values[0].ndim == 1:
        return values[0]
    return _local_sum(values)


def _write_back(total, outs):
    for o in outs:
        if o is not total:
            total.copyto(o)


class HorovodStore(KVStoreBase):
    """This process's Horovod all-reduce, as a kvstore for ``gluon.Trainer``
    and for cross-worker SyncBatchNorm (see the module documentation)."""

    def __init__(self):
        self._hvd = horovod()
        self._barriers = itertools.count()

    @property
    def type(self):
        return 'horovod'

    @property
    def rank(self):
        return self._hvd.rank()

    @property
    def num_workers(self):
        return self._hvd.size()

    @staticmethod
    def is_capable(capability):
        """No optimizer runs in the store: updates stay on the workers."""
        return capability.lower() != KVStoreBase.OPTIMIZER

    def init(self, key, value):
        """Nothing to set up: an all-reduce needs no server-side state."""

    def broadcast(self, key, value, out, priority=0):
        src = value.copy()          # the default layout (an MKL-DNN one cannot be sent)
        self._hvd.broadcast_(src, root_rank=0, name='gp.broadcast.%s' % key, priority=priority)
        for o in _as_list(out):
            src.copyto(o)

    def pushpull(self, key, value, out=None, priority=0):
        progress.reduce(key, lambda: self._allreduce(key, value, out, priority))

    def _allreduce(self, key, value, out, priority):
        values = _as_list(value)
        total = _to_reduce(values) if out is None else _local_sum(values)
        # The sum, not the average: the Trainer's step(global batch) scales.
        self._hvd.allreduce_(total, average=False, name='gp.pushpull.%s' % key,
                             priority=priority)
        _write_back(total, values if out is None else _as_list(out))

    def pushpull_group(self, keys, values, priority=0):
        """:meth:`pushpull` of every key of `keys` (each one's per-context
        arrays in `values`, written back in place), one all-reduce per key
        in this order (see the module documentation)."""
        def each():
            for key, value in zip(keys, values):
                self._allreduce(key, value, None, priority)
        progress.reduce(keys[0] if keys else None, each)

    def barrier(self):
        """Every worker meets here (after its pending MXNet work)."""
        nd.waitall()
        token = nd.zeros((1,))
        self._hvd.allreduce_(token, average=False, name='gp.barrier.%d' % next(self._barriers))
        token.wait_to_read()

    def set_optimizer(self, optimizer):
        raise NotImplementedError('the Horovod engine keeps updates on the workers: create the '
                                  'Trainer with update_on_kvstore=False (or None)')

    def save_optimizer_states(self, fname, dump_optimizer=False):
        raise NotImplementedError('the Trainer holds the optimizer state (trainer.save_states)')

    def load_optimizer_states(self, fname):
        raise NotImplementedError('the Trainer holds the optimizer state (trainer.load_states)')
