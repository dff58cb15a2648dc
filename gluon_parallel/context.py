"""Former name of :mod:`gluon_parallel.replica` (kept for old imports)."""
from .replica import (TIMEOUT_ENV, ParallelCall, ReplicaContext, current_replica,  # noqa: F401
                      default_timeout)

__all__ = ['ReplicaContext', 'ParallelCall', 'current_replica', 'default_timeout']
