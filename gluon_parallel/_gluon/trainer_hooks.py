"""The Trainer's and the KVStore's state (mxnet 1.9.1; see the package
docstring)."""
import ctypes

import mxnet as mx
from mxnet import gluon

__all__ = ['TrainerHooks', 'MULTI_TENSOR_MAX', 'count_updates', 'lrs_and_wds', 'batched_pushpull',
           'trainer_params', 'trainer_kvstore_ready', 'trainer_kvstore_config', 'amp_loss_scaler',
           'trainer_compression',
           'trainer_updates_on_kvstore', 'init_trainer_kvstore', 'init_trainer_params',
           'kvstore_barrier', 'free_kvstore', 'specialise', 'trainer_optimizer',
           'trainer_device_ids', 'optimizer_index_dicts', 'device_update_counts',
           'use_device_update_counts']


def trainer_params(trainer):
    """The trainer's parameters in the order that indexes its optimizer
    state (``Trainer._params``: sorted by full name at construction)."""
    return trainer._params


def trainer_optimizer(trainer):
    """The Optimizer the trainer's updaters use (``Trainer._optimizer``;
    1.9.1: ``load_states`` replaces it by the unpickled one and points the
    updaters to it; the ``optimizer`` property raises before it is an
    Optimizer)."""
    return trainer._optimizer


def trainer_device_ids(trainer):
    """The device ids of the trainer's contexts (``Trainer._contexts``: its
    parameters' contexts, one updater each when it updates locally), in
    order."""
    return [c.device_id for c in trainer._contexts]


def trainer_kvstore_ready(trainer):
    """``Trainer._kv_initialized``: the Trainer creates its kvstore lazily,
    at its first step (or ``_init_kvstore``)."""
    return trainer._kv_initialized


def trainer_kvstore_config(trainer):
    """``Trainer._kvstore_params``: {'kvstore': type name or KVStore,
    'update_on_kvstore': bool or None}, read when the kvstore is created;
    changing it before then changes what is created."""
    return trainer._kvstore_params


def trainer_compression(trainer):
    """``Trainer._compression_params``: the kvstore's gradient compression
    (set on the kvstore when the Trainer creates it), or None."""
    return trainer._compression_params


def amp_loss_scaler(trainer):
    """``Trainer._amp_loss_scaler``, set by ``amp.init_trainer``; its
    ``Trainer._update`` skips an update whose gradients overflowed."""
    return getattr(trainer, '_amp_loss_scaler', None)


def trainer_updates_on_kvstore(trainer):
    """Whether the initialised kvstore of `trainer` applies the updates
    (``Trainer._kvstore`` and ``_update_on_kvstore``)."""
    return bool(trainer._kvstore is not None and trainer._update_on_kvstore)


def init_trainer_kvstore(trainer):
    """Create the Trainer's kvstore now (``Trainer._init_kvstore``); after
    it, ``_kvstore`` and ``_update_on_kvstore`` are set."""
    if not trainer._kv_initialized:
        trainer._init_kvstore()
    return trainer._kvstore, trainer._update_on_kvstore


def init_trainer_params(trainer):
    """Push/pull the parameters still waiting for the kvstore
    (``Trainer._params_to_init``, ``_init_params``: rank 0's values are
    broadcast)."""
    if trainer._params_to_init:
        trainer._init_params()


def kvstore_barrier(kv):
    """``KVStore._barrier()``: every worker of a dist kvstore meets."""
    kv._barrier()


def free_kvstore(kv):
    """Free a kvstore's C handle now (``MXKVStoreFree``), leaving the Python
    object with a NULL handle, which ``KVStore.__del__`` frees as a no-op.
    A dist kvstore freed while interpreter shutdown tears modules down
    aborts the process (1.9.1: "terminate called without an active
    exception")."""
    from mxnet.base import _LIB, check_call
    handle, kv.handle = kv.handle, None
    check_call(_LIB.MXKVStoreFree(handle))


def specialise(obj, cls):
    """Give a live MXNet object the methods of `cls`, a subclass of its
    class that adds no state (assigning ``__class__``: the object was made
    by MXNet or the user, not by us)."""
    assert isinstance(obj, cls.__mro__[1])
    obj.__class__ = cls


class TrainerHooks(gluon.Trainer):
    """A ``gluon.Trainer`` whose reduction and update a subclass may take
    over, step by step.

    1.9.1: ``step`` calls ``self._allreduce_grads()`` then
    ``self._update(ignore_stale_grad)``; ``allreduce_grads()`` and
    ``update()`` call the same two after initialising the kvstore. A
    subclass defines :meth:`fused_allreduce` and :meth:`fused_update`,
    which return False to leave the step to Gluon's own code.
    """

    def fused_allreduce(self):
        return False

    def fused_update(self, ignore_stale_grad):
        return False

    def _allreduce_grads(self):
        if not self.fused_allreduce():
            super()._allreduce_grads()

    def _update(self, ignore_stale_grad=False):
        if not self.fused_update(ignore_stale_grad):
            super()._update(ignore_stale_grad)

    def gluon_allreduce(self, skip=()):
        """Gluon's own reduction (``Trainer._allreduce_grads``: a push/pull
        per parameter, a row-sparse gradient pushed and pulled apart) of
        every parameter but those in `skip`, which it sees as frozen
        (``params.hidden_from_step``)."""
        from .param_arrays import hidden_from_step
        with hidden_from_step(skip):
            gluon.Trainer._allreduce_grads(self)


# ---------------------------------------------------------------- Optimizer --

# The most arrays one multi-tensor operator takes (1.9.1: the kernels'
# parameter structs hold 60 weights, MultiSGDKernelParam::N; 61 crashes
# the process, measured).
MULTI_TENSOR_MAX = 60


def count_updates(optimizer, device_ids, indices):
    """What ``Optimizer._update_count(indices)`` does on each device in
    turn, as each device's ``Updater`` does before its update, without a
    Python call per device. 1.9.1: ``_set_current_context(device_id)``
    makes ``_index_update_count`` that device's dict in
    ``_all_index_update_counts`` (created on first use); a count starts at
    ``begin_num_update``; ``num_update`` is the largest count."""
    counts = optimizer._all_index_update_counts
    begin, top = optimizer.begin_num_update, optimizer.num_update
    for dev in device_ids:
        mine = counts.get(dev)
        if mine is None:
            mine = counts[dev] = {}
        for i in indices:
            c = mine.get(i, begin) + 1
            mine[i] = c
            if c > top:
                top = c
    optimizer.num_update = top
    optimizer._index_update_count = counts[device_ids[-1]]


def optimizer_index_dicts(optimizer):
    """The dicts of `optimizer` keyed by parameter index, in this order
    (1.9.1): the current device's update counts
    (``Optimizer._index_update_count``, itself one of the next), ``idx2name``,
    ``lr_mult``, ``wd_mult``, then every device's update counts (the values
    of ``_all_index_update_counts``). An optimizer unpickled from another
    version may lack one: None in its place (the per-device ones: none)."""
    dicts = [getattr(optimizer, '_index_update_count', None), getattr(optimizer, 'idx2name', None),
             getattr(optimizer, 'lr_mult', None), getattr(optimizer, 'wd_mult', None)]
    return dicts + list(getattr(optimizer, '_all_index_update_counts', {}).values())


def device_update_counts(optimizer):
    """``Optimizer._all_index_update_counts``: {device id: {parameter index:
    update count}}, the dict itself (changing it changes the optimizer's
    counts); None when the optimizer has none (another version's)."""
    counts = getattr(optimizer, '_all_index_update_counts', None)
    return counts if isinstance(counts, dict) else None


def use_device_update_counts(optimizer, device_id):
    """Make the update counts of `device_id` (one of
    :func:`device_update_counts`) the current ones, which
    ``Optimizer._update_count`` increments and ``num_update`` follows (1.9.1:
    ``_index_update_count``, as ``_set_current_context`` sets it)."""
    optimizer._index_update_count = optimizer._all_index_update_counts[device_id]


def lrs_and_wds(optimizer, indices):
    """The learning rates and weight decays of `indices` for this update
    (``Optimizer._get_lrs`` / ``_get_wds``: the scheduler at
    ``num_update``, times each parameter's ``lr_mult`` / ``wd_mult``)."""
    return optimizer._get_lrs(indices), optimizer._get_wds(indices)


# ---------------------------------------------------------------- KVStore --

def batched_pushpull(kv, keys, values, priority=0, separate=False):
    """A callable doing ``kv.pushpull(keys, values)`` (each key's list of
    per-device arrays summed and written back to them) in one C call, or
    None for a kvstore that is not MXNet's own ``KVStore`` (Horovod's
    store sums in Python). 1.9.1: ``KVStore.pushpull`` with int keys calls
    ``MXKVStorePushPull`` with each key repeated once per value; its
    Python (``_ctype_key_value``) recurses once per key, so the arrays are
    built here once. `separate`: a push, then a pull (two C calls): a
    dist kvstore with gradient compression refuses ``MXKVStorePushPull``
    ('Compression not supported with PushPull')."""
    if not isinstance(kv, mx.kv.KVStore):
        return None
    flat_keys = [k for k, vs in zip(keys, values) for _ in vs]
    flat = [v.handle for vs in values for v in vs]
    n = len(flat)
    ckeys = (ctypes.c_int * n)(*flat_keys)
    cvals = (mx.base.NDArrayHandle * n)(*flat)
    args = (kv.handle, mx.base.mx_uint(n), ckeys, mx.base.mx_uint(n), ckeys, cvals, cvals,
            ctypes.c_int(priority))
    keep = (kv, values)

    def pushpull():
        assert keep
        mx.base.check_call(mx.base._LIB.MXKVStorePushPull(*args))

    def push_then_pull():
        assert keep
        mx.base.check_call(mx.base._LIB.MXKVStorePush(kv.handle, args[1], ckeys, cvals,
                                                      args[-1]))
        mx.base.check_call(mx.base._LIB.MXKVStorePull(kv.handle, args[1], ckeys, cvals,
                                                      args[-1]))
    return push_then_pull if separate else pushpull
