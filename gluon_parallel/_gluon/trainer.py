"""The Trainer's and the KVStore's state (mxnet 1.9.1; see the package
docstring)."""


__all__ = ['trainer_params', 'trainer_kvstore_ready', 'trainer_kvstore_config', 'amp_loss_scaler',
           'trainer_updates_on_kvstore', 'init_trainer_kvstore', 'init_trainer_params',
           'kvstore_barrier', 'free_kvstore', 'specialise']


def trainer_params(trainer):
    """The trainer's parameters in the order that indexes its optimizer
    state (``Trainer._params``: sorted by full name at construction)."""
    return trainer._params


def trainer_kvstore_ready(trainer):
    """``Trainer._kv_initialized``: the Trainer creates its kvstore lazily,
    at its first step (or ``_init_kvstore``)."""
    return trainer._kv_initialized


def trainer_kvstore_config(trainer):
    """``Trainer._kvstore_params``: {'kvstore': type name or KVStore,
    'update_on_kvstore': bool or None}, read when the kvstore is created;
    changing it before then changes what is created."""
    return trainer._kvstore_params


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
