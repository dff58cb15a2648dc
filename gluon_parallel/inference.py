"""Former name of :mod:`gluon_parallel.exporting` (kept for old imports)."""
from .exporting import export

__all__ = ['export']
