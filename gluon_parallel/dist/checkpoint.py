"""Checkpoints in a dist job: rank 0 writes, every worker loads."""
from .kvstore import barrier, is_root
from .trainer import init_trainer, keep_updates_local

__all__ = ['save_checkpoint', 'load_checkpoint']


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
    from ..checkpoint import save_checkpoint as save
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
    from ..checkpoint import load_checkpoint as load
    if trainer is not None:
        keep_updates_local(trainer)
    meta = load(prefix, block, trainer, ctx_list=ctx_list)
    if trainer is not None:
        init_trainer(trainer)
    else:
        barrier()
    return meta
