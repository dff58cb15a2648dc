"""gluon_parallel: correct, fast and boring data-parallel training for MXNet Gluon."""
__version__ = '0.2.0'

# Public names load their module on first use (PEP 562), not here:
# `python -m gluon_parallel.launch` imports this package and must not import
# mxnet, which in a process with DMLC_ROLE=scheduler or server runs the
# parameter-server loop and never returns (measured: the launcher hung).
_EXPORTS = {
    'split': ('split_sizes', 'split_load_kwargs', 'gather'),
    'barrier': ('ParallelState', 'ParallelAbort'),
    'replica_context': ('ReplicaContext', 'current_replica', 'default_timeout'),
    'workers': ('WorkerPool',),
    'apply': ('parallel_apply',),
    'data_parallel': ('DataParallel',),
    'loss': ('DataParallelLoss',),
    'params': ('check_params', 'broadcast_params', 'sync_running_stats'),
    'grads': ('step',),
    'trainer': ('Trainer',),
    'checkpoint': ('save_checkpoint', 'load_checkpoint'),
    'exporting': ('export',),
}
_MODULE_OF = {name: mod for mod, names in _EXPORTS.items() for name in names}

__all__ = [name for names in _EXPORTS.values() for name in names] + ['nn', 'dist']


def __getattr__(name):
    # Imported here, not at the top: the package's namespace holds its
    # public names only (``dir(gluon_parallel)``).
    import importlib
    import importlib.util
    if name.startswith('__'):
        raise AttributeError(name)
    if name in _MODULE_OF:
        value = getattr(importlib.import_module('.' + _MODULE_OF[name], __name__), name)
    elif importlib.util.find_spec(f'{__name__}.{name}') is not None:
        value = importlib.import_module('.' + name, __name__)     # a submodule: nn, dist...
    else:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    globals()[name] = value
    return value


def __dir__():
    """The public names and the module's own dunder attributes: not the
    submodules Python binds here as they are imported (``split``,
    ``graph``, ...), which are implementation."""
    dunders = {n for n in globals() if n.startswith('__') and n.endswith('__')}
    return sorted(dunders | set(__all__))
