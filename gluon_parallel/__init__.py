"""gluon_parallel: correct, fast and boring data-parallel training for MXNet Gluon."""
__version__ = '0.1.0'

from .split import split_sizes, split_load_kwargs, gather
from .state import ParallelState, ParallelAbort
from .context import ReplicaContext, current_replica, default_timeout
from .pool import WorkerPool
from .data_parallel import DataParallel, DataParallelLoss, parallel_apply
from .training import check_params, broadcast_params
from . import nn

__all__ = ['split_sizes', 'split_load_kwargs', 'gather',
           'ParallelState', 'ParallelAbort',
           'ReplicaContext', 'current_replica', 'default_timeout',
           'WorkerPool',
           'DataParallel', 'DataParallelLoss', 'parallel_apply',
           'check_params', 'broadcast_params',
           'nn']
