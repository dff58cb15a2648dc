"""Executors of replicated graphs whose operators MXNet bulks one engine
operation per replica and pass (mxnet 1.9.1; see the package docstring).

MXNet's executor groups consecutive nodes into bulk segments, each pushed
to the engine as one operation (``GraphExecutor::InitOpSegs`` at bind:
forward and backward nodes cut every ``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_FWD``
/ ``_BWD`` operators, default 15, counting from the first; a node that is
not synchronous, a cross-device copy, ends a segment early). A segment
whose nodes are on two devices is not bulked at all
(``CreateCachedSegOpr``): in a graph of n replicas on n devices, 15-node
segments straddle the replicas and most of them run node by node (a tiny
MLP on 4 devices: 60 engine operations for its network and loss executors
where 16 would do). When the graph's operators come replica by replica,
each replica's the same sequence, a segment of exactly one replica's count
bulks each replica whole (operators after the replicas' run in
segments of that length, straddling devices or not).
"""
import json
import os
import re
from typing import NamedTuple

from .environment import setting, user_set

__all__ = ['bind_replicas', 'replica_period', 'share_symbol', 'FORWARD_ENV', 'BACKWARD_ENV']

FORWARD_ENV = 'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_FWD'
BACKWARD_ENV = 'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD'
#: Settings of MXNet's that, when the user gives them, we leave alone.
_USER_SETTINGS = (FORWARD_ENV, BACKWARD_ENV, 'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN')
_OP = re.compile(r'^Op:([^,]+), Name=', re.M)
class _Known(NamedTuple):
    """A graph's segment lengths. They depend on the graph only, so the
    executors of its other input signatures bind once."""
    symbol: object          # kept so that its handle is not reused
    settings: dict | None   # None: MXNet's own


#: A symbol's handle -> its _Known.
_SETTINGS = {}
_MAX_SETTINGS = 256


def replica_period(ops, replicas):
    """The number of operators per replica m if `ops` (operator names in the
    executor's order) starts with one sequence of m operators repeated
    `replicas` times (the largest such m, at least half of the operators:
    what follows, e.g. graph mode's batch-statistics outputs, is run by
    MXNet in segments of its own), else None."""
    for m in range(len(ops) // replicas, 0, -1):
        if 2 * m * replicas < len(ops):
            return None
        if all(ops[i] == ops[i - m] for i in range(m, m * replicas)):
            return m
    return None


def bind_replicas(symbol, replicas, bind, backward_piece=None):
    """``bind()`` (a ``Symbol.bind`` of `symbol`, a graph of `replicas`
    copies of one network on as many devices), bound so that MXNet bulks
    each replica's forward and each replica's backward operators into one
    engine operation each when it can; with `backward_piece`, each
    replica's backward into engine operations of at most that many
    operators instead (MXNet cuts a pass only every N operators, counting
    from its first: a piece that straddles two replicas runs operator by
    operator), so that what reads a gradient can start before the
    replica's whole backward has run.

    1.9.1: the segment lengths are read from the environment by every bind
    (``Imperative::BulkExecMaxNodeTrainFwd``); an executor's node order is
    what ``Executor.debug_str()`` lists, the forward graph's operators
    first. The graph is bound once to read that order, and again with the
    per-replica lengths if its forward or backward operators come replica
    by replica (else the first executor is kept: bulking then changes
    nothing). Bulking off (``MXNET_EXEC_BULK_EXEC_TRAIN=0``) or segment
    lengths the user set are left alone."""
    if replicas < 2 or os.environ.get('MXNET_EXEC_BULK_EXEC_TRAIN', '1') == '0' or \
            any(user_set(k) for k in _USER_SETTINGS):
        return bind()
    key = symbol.handle.value
    if key not in _SETTINGS:
        executor = bind()
        ops = _OP.findall(executor.debug_str())
        forward = sum(1 for node in json.loads(symbol.tojson())['nodes'] if node['op'] != 'null')
        settings = {FORWARD_ENV: replica_period(ops[:forward], replicas),
                    BACKWARD_ENV: replica_period(ops[forward:], replicas)}
        if len(_SETTINGS) >= _MAX_SETTINGS:
            _SETTINGS.clear()
        _SETTINGS[key] = _Known(symbol, settings if any(settings.values()) else None)
        if _SETTINGS[key].settings is None and not backward_piece:
            return executor
        del executor            # (its memory, before the second bind takes as much)
    settings = _SETTINGS[key].settings
    if backward_piece:
        settings = dict(settings or {}, **{BACKWARD_ENV: backward_piece})
    if settings is None:
        return bind()
    with setting({k: str(v) for k, v in settings.items() if v}):
        return bind()


def share_symbol(executor, symbol):
    """Let `executor` (a ``Symbol.bind`` of `symbol`) keep `symbol` itself,
    not a copy of it. 1.9.1: ``mxnet.executor.Executor.__init__`` keeps
    ``copy.deepcopy(symbol)`` as ``_symbol`` (read only for the names of
    its arguments, states and outputs), a copy of every node of the graph
    (``NNSymbolCopy``) kept as long as the executor: about 0.1 MiB for a
    two-layer BERT on two devices, once per executor, where graph mode binds
    the executors of every input signature from one symbol that nothing
    changes once bound."""
    executor._symbol = symbol
