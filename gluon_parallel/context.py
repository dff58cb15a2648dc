"""Former name of :mod:`gluon_parallel.replica` (kept for old imports)."""
from .replica import ParallelCall, ReplicaContext, current_replica, default_timeout

__all__ = ['ReplicaContext', 'ParallelCall', 'current_replica', 'default_timeout']
