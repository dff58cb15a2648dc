"""GluonCV's task queue (``gluoncv.utils.parallel.Parallel`` and
``Parallelizable``; GluonNLP's ``gluonnlp.utils`` ones are the same code) on
gluon_parallel's persistent worker pool.

GluonCV's R-CNN training scripts put one input per device (each image of
its own size), a :class:`Parallelizable` task runs forward and backward on
it, and ``get()`` returns the task's results in completion order. The
threads here are those of a :class:`~gluon_parallel.workers.WorkerPool`, one
per device: each task runs on the worker of its input's device (the
context of the first NDArray in it), inside that context and in the
caller's autograd state at ``put``.

After the serial start, the puts go in rounds of `num_workers`: a round's
tasks run as one parallel call (a :class:`ParallelCall`, a
:class:`ReplicaContext` per task, rank = put order), started at its last
put, so :class:`gluon_parallel.nn.SyncBatchNorm` normalises them with the
statistics of the round's whole batch. A ``get()`` with no started task
left to wait for starts the round with the tasks put so far (a partial
round synchronises those). Two tasks of one round on one device run on two
workers, since one waits for the other. The serial start's tasks (and every
task with ``num_workers=0``) run in the caller one by one, each a call of
one replica: SyncBatchNorm normalises each alone there, as BatchNorm, and
says so once (the next task is not put yet: nothing to wait for).

MXNet's ``gluon.contrib.nn.SyncBatchNorm`` (GluonCV's ``--norm-layer
syncbn``), whose devices meet inside MXNet's engine, synchronises the tasks
of a round as in GluonCV, the serial start included: tasks are not waited
for (neither are GluonCV's), so the caller issues the next device's task
while the first one's operators wait for it.

Where GluonCV's ``get()`` blocks forever after a task raised (the task's
thread died), ours raises the task's own exception type, which is also a
:class:`ParallelTaskError` (task_error.py), naming its device with its
traceback, once the other tasks in flight have finished; the Parallel is
usable again after it.
"""
import collections
import functools
import queue
import threading
import time
import traceback
import warnings
from typing import Any, NamedTuple

import mxnet as mx
from mxnet import autograd

from . import joint_backward
from .barrier import ParallelAbort
from .contexts import check_ctx_list
from .nested import arrays
from .replica_context import ParallelCall, ReplicaContext, default_timeout
from .task_error import ParallelTaskError, task_error
from .syncgraph import ensure_routing
from .workers import Job, WorkerPool

__all__ = ['Parallelizable', 'Parallel', 'ParallelTaskError']


class Parallelizable:
    """A unit of work for :class:`Parallel`: subclasses implement
    :meth:`forward_backward`, called once per input put."""

    def forward_backward(self, x):
        """Forward and backward computation on one input; returns what
        ``Parallel.get()`` hands back."""
        raise NotImplementedError()


class _Put(NamedTuple):
    """A task put: its put number, its device, whether it runs on a worker."""
    index: int
    ctx: mx.Context
    threaded: bool


class _TaskResult(NamedTuple):
    """What a task gave: its output, or the exception it raised."""
    task: _Put
    ok: bool
    value: Any


def _device_of(x, default):
    """The context of the first NDArray in `x`, else `default`."""
    for _, arr in arrays(x):
        if isinstance(arr, mx.nd.NDArray):
            return arr.context
    return default


def _aborted(outcome):
    """Whether a task failed only because another task of its round did."""
    return not outcome.ok and isinstance(outcome.value, ParallelAbort)


_ALONE = {
    'serial': 'the first {n} tasks run one by one in the caller (serial_init=True: the serial '
              'start), and a task cannot wait for one not put yet. The rounds of {n} puts after '
              'it synchronise their tasks',
    'caller': 'Parallel(0, ...) runs every task in the caller, one by one',
    'round': 'its round held that task only (num_workers={n}, or get() was called with no '
             'started task left after 1 put of a round)',
}


class Parallel:
    """Run a :class:`Parallelizable`'s ``forward_backward`` on inputs put,
    one worker thread per device; results in completion order.

    Parameters
    ----------
    num_workers : int
        As in GluonCV: how many tasks make a round (run as one parallel
        call, so SyncBatchNorm synchronises them) and, with `serial_init`,
        how many first tasks run in the caller's thread; 0 runs every task
        in the caller (for debugging). The threads themselves are one per
        device, started with the device's first threaded task: tasks of one
        device in different rounds run one after another, tasks of
        different devices concurrently.
    parallizable : Parallelizable
        Any object with a ``forward_backward(x)`` method (GluonCV's
        spelling of the argument's name is kept).
    serial_init : bool, default True
        Run tasks in the caller's thread until `num_workers` of them have
        succeeded, so that the blocks they use finish their deferred
        initialisation once, in one thread.
    ctx_list : list of Context, optional
        The devices tasks may run on (not in GluonCV): an input on another
        device raises ValueError at ``put``. Default: any device.

    Examples
    --------
    One task per device; with `serial_init` (the default) the first two
    run in the caller, so their results come in put order:

    >>> class Square(Parallelizable):
    ...     def forward_backward(self, x):
    ...         return x * x
    >>> with Parallel(2, Square()) as parallel:
    ...     for x in (mx.nd.ones(1, ctx=mx.cpu(0)), mx.nd.ones(1, ctx=mx.cpu(1))):
    ...         parallel.put(x)
    ...     [parallel.get().context for _ in range(2)]
    [cpu(0), cpu(1)]
    """

    def __init__(self, num_workers: int, parallizable: Any, serial_init: bool = True, *,
                 ctx_list=None):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) \
                or num_workers < 0:
            raise ValueError(f'num_workers must be an int >= 0, got {num_workers!r}')
        if not callable(getattr(parallizable, 'forward_backward', None)):
            raise TypeError('Parallel needs a Parallelizable (an object with a forward_backward '
                            f'method), got {parallizable!r}')
        self._num_workers = num_workers
        self._parallizable = parallizable
        self._num_serial = num_workers if serial_init else 0
        self._devices = check_ctx_list(ctx_list) if ctx_list is not None else None
        # What a SyncBatchNorm(num_devices=n) is checked against: a round's size.
        self._num_devices = len(self._devices) if self._devices else num_workers
        self._pool = WorkerPool([], name='gluon_parallel-Parallel', first_worker=0)
        self._ranks = {}                    # (device, slot in a round) -> worker
        self._seen = []                     # the devices put to, in first-put order
        self._lock = threading.Lock()
        self._done = collections.deque()    # outcomes of tasks run in the caller
        self._round = []                    # (task, input) put, not started yet
        self._threaded = {}                 # put number -> task, on the workers
        self._puts = 0
        self._warned = set()

    def put(self, x: Any) -> None:
        """Run ``parallizable.forward_backward(x)`` on the worker of `x`'s
        device, in a round of `num_workers` puts (in the caller's thread
        while the serial start lasts)."""
        if self._pool.closed:
            raise RuntimeError('this Parallel is closed')
        default = self._devices[0] if self._devices else mx.current_context()
        ctx = _device_of(x, default)
        if self._devices is not None and ctx not in self._devices:
            raise ValueError(f'Parallel.put: the input is on {ctx}, but this Parallel runs '
                             f'tasks on {self._devices} only (its ctx_list)')
        with self._lock:
            task = _Put(self._puts, ctx, self._num_serial <= 0 and self._num_workers > 0)
            self._puts += 1
            full = False
            if ctx not in self._seen:
                self._seen.append(ctx)
            if task.threaded:
                self._round.append((task, x, autograd.is_recording(), autograd.is_training()))
                full = len(self._round) == self._num_workers
        if not task.threaded:
            self._run_here(task, x)
        elif full:
            self._start_round()

    def _start_round(self):
        """The tasks put since the last round, as one parallel call."""
        with self._lock:
            tasks, self._round = self._round, []
            for task, *_ in tasks:
                self._threaded[task.index] = task
        ctxs = [task.ctx for task, *_ in tasks]
        joint_backward.install()
        ensure_routing()        # a hybridized SyncBatchNorm network runs in stages per task
        call = joint_backward.RoundCall(ctxs, self._devices or self._seen, default_timeout(),
                                        num_devices=self._num_devices,
                                        on_alone=functools.partial(self._warn_alone, 'round'))
        for rank, (task, x, recording, training) in enumerate(tasks):
            job = Job(functools.partial(call.run_task, rank, self._parallizable.forward_backward),
                      (x,), {}, recording, training, ReplicaContext(rank, call), False)
            self._pool.submit(self._rank_of(task.ctx, ctxs[:rank].count(task.ctx)), job,
                              key=task.index)

    def _rank_of(self, ctx, slot):
        """The pool's rank for the `slot`-th task of a round on `ctx`, its
        worker added on first use."""
        with self._lock:
            rank = self._ranks.get((ctx, slot))
            if rank is None:
                rank = self._ranks[ctx, slot] = self._pool.add_context(ctx)
            return rank

    def _run_here(self, task, x):
        """A task in the caller's thread, a call of one replica; its outcome
        waits for ``get()``."""
        why = 'serial' if self._num_workers else 'caller'
        ensure_routing()        # (its SyncBatchNorm layers say they normalise per device)
        call = ParallelCall([task.ctx], timeout=default_timeout(), num_devices=self._num_devices,
                            on_alone=functools.partial(self._warn_alone, why))
        try:
            # Not waited for (as in GluonCV): a task whose operators meet the
            # next devices' inside MXNet's engine (contrib SyncBatchNorm)
            # would wait here for tasks not put yet.
            with task.ctx, ReplicaContext(0, call):
                out = self._parallizable.forward_backward(x)
        except Exception as e:      # reported by get(), as a worker's are
            self._done.append(_TaskResult(task, False, e))
        else:
            self._num_serial -= 1
            self._done.append(_TaskResult(task, True, out))

    def _warn_alone(self, why):
        """A synchronising layer ran alone in a task: said once per reason."""
        if why in self._warned:
            return
        self._warned.add(why)
        warnings.warn('gluon_parallel.gluoncv.Parallel: a synchronising layer (gp.nn.'
                      'SyncBatchNorm) normalised a task\'s batch alone, on its device, as '
                      'BatchNorm: ' + _ALONE[why].format(n=self._num_workers) +
                      '. (Said once per Parallel.)', UserWarning, stacklevel=2)

    def get(self, timeout: float | None = None) -> Any:
        """The result of a finished task, the first to finish first.

        With no started task left to wait for, the round put so far starts
        first (fewer than `num_workers` tasks).

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait for one (not in GluonCV); TimeoutError after
            them. Default: until a task finishes.

        Raises
        ------
        Exception
            The task raised: its own exception type, also a
            :class:`ParallelTaskError` (its device and traceback in the
            message). The other tasks in flight are waited for and their
            results dropped first, so the next ``put`` starts afresh.
        RuntimeError
            Every task put has been got already: nothing would ever come.
        """
        outcome = self._next(timeout)
        if not outcome.ok:
            raise self._failure(outcome) from None
        return outcome.value

    def _next(self, timeout):
        with self._lock:
            if self._done:
                return self._done.popleft()
            partial = bool(self._round) and not self._threaded
        if partial:
            self._start_round()
        with self._lock:
            if not self._threaded:
                raise RuntimeError(f'Parallel.get(): no task in flight (every one of the '
                                   f'{self._puts} put so far was got or dropped): put an '
                                   'input first')
        try:
            result = self._pool.result(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f'Parallel.get(): no task finished within {timeout} s '
                               f'({len(self._threaded)} in flight)') from None
        with self._lock:
            return _TaskResult(self._threaded.pop(result.key), result.ok, result.value)

    def _failure(self, outcome):
        """The error of a failed task, once the others in flight are done
        and dropped: the failure that caused the others' aborts."""
        with self._lock:
            others = list(self._done)
            flight, self._threaded = self._threaded, {}
            self._done.clear()
        others += self._collect(flight)
        if _aborted(outcome):
            outcome = next((o for o in others if not o.ok and not _aborted(o)), outcome)
        dropped = len(others)
        e, task = outcome.value, outcome.task
        trace = ''.join(traceback.format_exception(e)).rstrip()
        where = 'in the caller' if not task.threaded else 'on its worker'
        message = (f'{e} [in Parallel task {task.index} (put #{task.index + 1}) on {task.ctx}, '
                   f'run {where}]\nThe results of the {dropped} other task(s) in flight were '
                   f'dropped; this Parallel takes new puts.\nThe task\'s traceback:\n{trace}')
        return task_error(e, message.lstrip(), ctx=task.ctx, index=task.index, dropped=dropped)

    def _collect(self, flight):
        """The outcomes of the tasks in `flight` (put number -> task), as
        they come; the workers replaced if they do not within the barrier
        timeout."""
        outcomes, grace = [], default_timeout() or threading.TIMEOUT_MAX
        deadline = time.monotonic() + grace
        for got in range(len(flight)):
            try:
                result = self._pool.result(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._pool.discard(len(flight) - got, grace=0)
                break
            outcomes.append(_TaskResult(flight[result.key], result.ok, result.value))
        return outcomes

    def close(self) -> None:
        """Stop the worker threads (tasks in flight finish first; those of
        a round not started are dropped). Idempotent."""
        self._round = []
        self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        pool = getattr(self, '_pool', None)
        if pool is not None:
            pool.close()

    def __repr__(self):
        return (f'Parallel({self._num_workers}, {self._parallizable!r}, '
                f'devices={self._seen})')
