"""Environment variables MXNet reads when it binds an executor, set around
the bind without adding a variable to, or removing one from, the
environment of a process that runs MXNet operators.

MXNet 1.9.1 reads some settings from the environment at every bind
(``NNVM_EXEC_MATCH_RANGE`` when it plans memory, the bulk segments'
``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_FWD`` / ``_BWD``, and once
``MXNET_SUBGRAPH_VERBOSE``), and its operators read others while they run
on the engine's threads (every reduction reads ``MXNET_SAFE_ACCUMULATION``).
glibc's ``setenv`` of a variable that is not set may move the process's
environment array, and ``unsetenv`` shifts it, while ``getenv`` on another
thread walks it: a segmentation fault (measured: a loop adding and removing
20 variables while another thread ran ``nd.mean`` crashed in one 20-second
run of six; changing the values of variables already set, in none of
eight). So this module adds a variable at most once per process, after
``nd.waitall()`` (the engine idle), and from then on changes its value only:
outside a :func:`setting` block it holds what MXNet reads when the variable
is not set, or the value the user gave it. The values it writes end with a
space, which MXNet's parser (``dmlc::GetEnv``) reads past, so that a child
process inheriting them tells them from the user's.
"""
import contextlib
import os
import threading

from mxnet import nd

__all__ = ['setting', 'user_set', 'add_variable']

#: What MXNet 1.9.1 reads for a variable that is not set
#: (``dmlc::GetEnv``'s default at each read; ``None``: see _unset).
_UNSET = {'NNVM_EXEC_MATCH_RANGE': '16',                     # nnvm/plan_memory.cc
          'MXNET_SUBGRAPH_VERBOSE': '1',                     # executor/graph_executor.cc
          'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_FWD': None,   # include/mxnet/imperative.h
          'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD': None}
_lock = threading.RLock()      # the process's environment, while a bind reads it
_MARK = ' '                    # ends the values written here


def user_set(name):
    """Whether the environment gives `name` a value this module (of this
    process or of its parent) did not."""
    value = os.environ.get(name)
    return value is not None and not value.endswith(_MARK)


@contextlib.contextmanager
def setting(values):
    """Within the block the environment has `values` (name -> str, names
    of ``_UNSET``), and no other thread's block runs. After it, a variable
    the user had set gets its value back; any other holds what MXNet reads
    when it is not set."""
    with _lock:
        restore = {k: os.environ[k] if user_set(k) else None for k in values}
        _before_adding(values)
        for k, v in values.items():
            _write(k, v)
        try:
            yield
        finally:
            for k, v in restore.items():
                if v is None:
                    _write(k, _unset(k))
                else:                       # the user's again
                    os.environ[k] = v


def add_variable(name, value):
    """Set `name` to `value` (as given: no mark), first waiting for the
    engine if the environment does not have it: a variable another library
    reads once (ps-lite's ``DMLC_NODE_HOST`` when a dist kvstore starts),
    set while MXNet's engine may still run operators."""
    with _lock:
        _before_adding([name])
        os.environ[name] = value


def _before_adding(names):
    """Wait until the engine is idle if one of `names` is not set: adding a
    variable may move the environment under an operator's ``getenv``."""
    if any(k not in os.environ for k in names):
        nd.waitall()


def _write(name, value):
    os.environ[name] = value + _MARK


def _unset(name):
    """What MXNet reads for `name` when it is not set: a bulk segment length
    falls back to ``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN``, then 15."""
    value = _UNSET[name]
    if value is None:
        return os.environ.get('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN', '15').strip()
    return value
