"""Whether the calling thread traces a network for export.

While it does, the layers that train across devices trace as their
single-device inference form: SyncBatchNorm as BatchNorm, HostEmbedding as
a plain Embedding. The flag is the thread's own, so another thread training
the same network meanwhile is unaffected.
"""
import contextlib
import threading

__all__ = ['for_export', 'exporting']

_local = threading.local()


@contextlib.contextmanager
def for_export():
    """Within the block, this thread traces for export (nestable)."""
    previous = exporting()
    _local.active = True
    try:
        yield
    finally:
        _local.active = previous


def exporting():
    """True while this thread is inside :func:`for_export`."""
    return getattr(_local, 'active', False)
