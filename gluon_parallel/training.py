"""Former home of the training helpers, now in :mod:`gluon_parallel.params`,
:mod:`gluon_parallel.grads` and :mod:`gluon_parallel.checkpoint` (kept for
old imports)."""
from .checkpoint import load_checkpoint, save_checkpoint
from .grads import step
from .params import broadcast_params, check_params, sync_running_stats

__all__ = ['check_params', 'broadcast_params', 'sync_running_stats', 'step',
           'save_checkpoint', 'load_checkpoint']
