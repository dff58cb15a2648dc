"""The backward passes of a ``gluoncv.Parallel`` round's tasks, run as one.

GluonCV's tasks call ``backward()`` each in its own thread. Once a
SyncBatchNorm has met the round's other tasks, each task's recorded graph
reaches into theirs (every task merges every task's sums, so that the
input gradients hold what flows through the other tasks' statistics), and
one backward pass over the round's heads gives every task its gradient, as
one ``autograd.backward(losses)`` does after a DataParallel call: separate
passes would walk (and free) each other's graph from several threads. So,
in a :class:`RoundCall` that synchronised, a task's ``backward`` waits in
its own thread (never inside MXNet's engine) until every task of the round
has called it or finished, and the last one runs MXNet's backward once over
every head, in rank order; each task's call returns after that pass is
pushed, as its own would. A round that never synchronised runs its tasks'
backward passes as they come.
"""
import threading
import time

from . import _gluon
from .barrier import ParallelAbort
from .replica_context import ParallelCall, current_replica

__all__ = ['RoundCall', 'JointBackward', 'install']


class _Heads:
    """One task's backward call: its heads, their gradients, its flags."""

    def __init__(self, heads, head_grads, retain_graph, train_mode, original):
        self.heads, self.original = heads, original
        self.head_grads = list(head_grads) if head_grads is not None else [None] * len(heads)
        self.retain_graph, self.train_mode = bool(retain_graph), bool(train_mode)


class JointBackward:
    """The rendezvous of a round's backward calls (one pass per time every
    task of the round has called backward or finished)."""

    def __init__(self, size, timeout=None):
        self._size, self._timeout = size, timeout
        self._cond = threading.Condition()
        self._waiting = {}      # rank -> _Heads, for the next pass
        self._finished = set()
        self._passes = 0
        self._failure = None    # the last pass's exception
        self._error = None      # the round's abort

    def backward(self, rank, heads, head_grads, retain_graph, train_mode, original):
        """Task `rank`'s backward call: returns once the pass holding it is
        pushed (run by the last of the round to call backward or finish)."""
        with self._cond:
            if self._error is not None:
                raise self._error
            self._waiting[rank] = _Heads(heads, head_grads, retain_graph, train_mode, original)
            batch, number = self._complete(), self._passes
            if batch is None:
                self._wait_for(number)
                return
        self._run(batch)

    def finish(self, rank):
        """Task `rank` returned (or raised): the others wait for it no more."""
        with self._cond:
            self._finished.add(rank)
            batch = self._complete() if self._error is None else None
        if batch is not None:
            self._run(batch)

    def abort(self, exc):
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def _complete(self):
        """The calls of the next pass if every task has called or finished
        (the lock held), else None."""
        if self._waiting and len(self._waiting) + len(self._finished - set(self._waiting)) \
                >= self._size:
            batch, self._waiting = self._waiting, {}
            return batch
        return None

    def _wait_for(self, number):
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while self._passes == number and self._error is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                missing = sorted(set(range(self._size)) - set(self._waiting) - self._finished)
                raise TimeoutError(f'Parallel round: the tasks {missing} neither called backward '
                                   f'nor finished within {self._timeout:g} s, so the round\'s '
                                   'backward pass (one over all its tasks) cannot run')
            self._cond.wait(left)
        if self._passes == number:
            raise self._error
        if self._failure is not None:
            raise ParallelAbort(f'the round\'s backward pass failed: {self._failure}') \
                from self._failure

    def _run(self, batch):
        calls = [batch[r] for r in sorted(batch)]
        failure = None
        try:
            if len({c.train_mode for c in calls}) > 1:
                raise ValueError('the tasks of a Parallel round called backward with different '
                                 'train_mode values: one pass cannot serve them')
            heads = [h for c in calls for h in c.heads]
            grads = [g for c in calls for g in c.head_grads]
            calls[0].original(heads, None if all(g is None for g in grads) else grads,
                     any(c.retain_graph for c in calls), calls[0].train_mode)
        except BaseException as e:
            failure = e
        with self._cond:
            self._failure = failure
            self._passes += 1
            self._cond.notify_all()
        if failure is not None:
            raise failure


class RoundCall(ParallelCall):
    """The parallel call of a Parallel round: its tasks' backward passes run
    as one once it synchronised (:class:`JointBackward`)."""

    def __init__(self, ctx_list, *args, **kwargs):
        super().__init__(ctx_list, *args, **kwargs)
        self.joint_backward = JointBackward(len(self.ctx_list), self.timeout)

    def abort(self, exc):
        super().abort(exc)
        self.joint_backward.abort(self.error)

    def run_task(self, rank, fn, x):
        """``fn(x)`` as task `rank`: the others stop waiting for its backward
        when it returns, and are woken when it raises."""
        try:
            return fn(x)
        except BaseException as e:
            self.abort(e)
            raise
        finally:
            self.joint_backward.finish(rank)


def route(heads, head_grads, retain_graph, train_mode, original):
    """Every Python backward call: a synchronised round's task joins the
    round's pass; any other runs MXNet's at once."""
    replica = current_replica()
    call = None if replica is None else replica.call
    if not isinstance(call, RoundCall) or not call.synchronised:
        return original(heads, head_grads, retain_graph, train_mode)
    return call.joint_backward.backward(replica.rank, heads, head_grads, retain_graph,
                                        train_mode, original)


def install():
    """Route the backward calls through :func:`route` (the first round of a
    Parallel; ``_gluon.unroute_backward`` removes it)."""
    if _gluon.backward_route() is not route:
        _gluon.route_backward(route)
