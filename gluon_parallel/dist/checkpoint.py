"""Checkpoints in a dist job: rank 0 writes, every worker loads."""
import os
import sys
from collections.abc import Sequence
from typing import Any

import mxnet as mx
from mxnet import gluon

from ..launch.elastic import GROW_STATUS, should_leave
from .kvstore import barrier, is_root
from .trainer import init_trainer, keep_updates_local

__all__ = ['save_checkpoint', 'load_checkpoint']


def save_checkpoint(prefix: str | os.PathLike, block: gluon.Block,
                    trainer: gluon.Trainer | Sequence[gluon.Trainer] | None = None,
                    **meta: Any) -> dict[str, str] | None:
    """Write a checkpoint on rank 0; every worker must call it.

    Rank 0 calls :func:`gluon_parallel.save_checkpoint`; then every worker
    waits at a barrier, so when this returns, anywhere, the files are
    complete. The other workers' parameters and optimizer states equal rank
    0's (same initial values, same summed gradients, same updates).

    In an elastic job (``python -m gluon_parallel.launch -n MIN:MAX
    --discover CMD``) that has more slots than workers, every worker then
    exits (``sys.exit`` with the launcher's reserved status, 75), and the
    launcher starts the job again at the larger size.

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
    if should_leave():
        sys.stdout.flush()
        sys.stderr.write(f'gluon_parallel: checkpoint {os.fspath(prefix)} saved; the job goes on '
                         'at a larger size: leaving (exit status %d)\n' % GROW_STATUS)
        sys.exit(GROW_STATUS)
    return result


def load_checkpoint(prefix: str | os.PathLike, block: gluon.Block,
                    trainer: gluon.Trainer | Sequence[gluon.Trainer] | None = None,
                    ctx_list: mx.Context | Sequence[mx.Context] | None = None) -> dict[str, Any]:
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
