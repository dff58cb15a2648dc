"""Former name of :mod:`gluon_parallel.barrier` (kept for old imports)."""
from .barrier import ParallelAbort, ParallelState

__all__ = ['ParallelState', 'ParallelAbort']
