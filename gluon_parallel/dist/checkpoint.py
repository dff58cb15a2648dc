"""Checkpoints in a dist job: rank 0 writes, every worker loads; each
checkpoint records the layout of every attempt of the job that led to it."""
import os
import sys
from collections.abc import Sequence
from typing import Any

import mxnet as mx
from mxnet import gluon

from .. import _gluon
from ..progress import declared
from ..launch.elastic import GROW_STATUS, should_leave
from ..launch.process import RESTART_ENV
from ..params import unwrap
from .kvstore import barrier, dist_kv, is_root, num_workers
from .trainer_init import init_trainer, keep_updates_local

__all__ = ['save_checkpoint', 'load_checkpoint', 'layouts_of']

# The layouts recorded in the checkpoint this process loaded (its job's
# earlier attempts), which every checkpoint it saves carries on.
_loaded_layouts = []


def layout(block):
    """This attempt's layout: its number (``GLUON_PARALLEL_RESTART``), the
    workers, rank 0's devices and the engine."""
    kv = dist_kv()
    params = list(_gluon.structural_params(unwrap(block)).values())
    contexts = params[0].list_ctx() if params and _gluon.has_data(params[0]) else []
    return {'attempt': int(os.environ.get(RESTART_ENV) or 0), 'workers': num_workers(),
            'devices': [str(c) for c in contexts], 'engine': kv.type if kv is not None else 'local'}


def layouts(block):
    """The layouts of the job's attempts, this one last."""
    mine = layout(block)
    return [x for x in _loaded_layouts if x.get('attempt') != mine['attempt']] + [mine]


@declared('saving a checkpoint')
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

    ``prefix.json`` records the layout of every attempt of the job so far
    (number, workers, rank 0's devices, engine), the earlier ones from the
    checkpoint :func:`load_checkpoint` loaded (:func:`layouts_of` reads
    them).

    Returns
    -------
    The value of :func:`gluon_parallel.save_checkpoint` on rank 0, None
    elsewhere.
    """
    from ..checkpoint import save_with_record
    result = None
    if is_root():
        result = save_with_record(prefix, block, trainer, meta, {'layouts': layouts(block)})
    barrier()
    if should_leave():
        sys.stdout.flush()
        sys.stderr.write(f'gluon_parallel: checkpoint {os.fspath(prefix)} saved; the job goes on '
                         'at a larger size: leaving (exit status %d)\n' % GROW_STATUS)
        sys.exit(GROW_STATUS)
    return result


@declared('loading a checkpoint')
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
    _loaded_layouts[:] = layouts_of(prefix)
    if trainer is not None:
        init_trainer(trainer)
    else:
        barrier()
    return meta


def layouts_of(prefix: str | os.PathLike) -> list[dict]:
    """The layouts of the attempts a dist checkpoint records, in order:
    ``[{'attempt': 0, 'workers': 3, 'devices': ['cpu(0)'], 'engine':
    'dist_sync'}, ...]`` ([] for a checkpoint of ``gluon_parallel.save_checkpoint``)."""
    from ..checkpoint import read_record
    return list(read_record(prefix).get('layouts', []))
