"""GluonCV's task queue (``gluoncv.utils.parallel.Parallel`` and
``Parallelizable``) on gluon_parallel's persistent worker pool.

GluonCV's R-CNN training scripts put one input per device (each image of
its own size), a :class:`Parallelizable` task runs forward and backward on
it, and ``get()`` returns the task's results in completion order. The
threads here are those of a :class:`~gluon_parallel.workers.WorkerPool`, one
per device: each task runs on the worker of its input's device (the
context of the first NDArray in it), inside that context and in the
caller's autograd state at ``put``.

Where GluonCV's ``get()`` blocks forever after a task raised (the task's
thread died), ours raises :class:`ParallelTaskError` (the task's exception
type, its device and its traceback in the message), once the other tasks
in flight have finished; the Parallel is usable again after it.

Inside a task, no parallel call is running (the tasks of one round are not
told about each other), so :class:`gluon_parallel.nn.SyncBatchNorm`
normalises with each device's own batch statistics there, as plain
BatchNorm: it never waits for a round that cannot be known. MXNet's
``gluon.contrib.nn.SyncBatchNorm`` (GluonCV's ``--norm-layer syncbn``),
whose devices meet inside MXNet's engine, synchronises the tasks of a
round as in GluonCV, the serial start included: tasks are not waited for
(neither are GluonCV's), so the caller issues the next device's task while
the first one's operators wait for it.
"""
import collections
import queue
import threading
import traceback
from typing import Any, NamedTuple

import mxnet as mx
from mxnet import autograd

from .contexts import check_ctx_list
from .nested import arrays
from .workers import WorkerPool
from .replica_context import default_timeout

__all__ = ['Parallelizable', 'Parallel', 'ParallelTaskError']


class Parallelizable:
    """A unit of work for :class:`Parallel`: subclasses implement
    :meth:`forward_backward`, called once per input put."""

    def forward_backward(self, x):
        """Forward and backward computation on one input; returns what
        ``Parallel.get()`` hands back."""
        raise NotImplementedError()


class ParallelTaskError(RuntimeError):
    """A task of :class:`Parallel` raised.

    Attributes
    ----------
    exception : BaseException
        The task's exception (with its traceback).
    ctx : Context
        The device the task ran on.
    index : int
        Which put it was, counted from 0 over the Parallel's life.
    dropped : int
        Results of the other tasks in flight, dropped.
    """

    def __init__(self, message, exception, ctx, index, dropped):
        super().__init__(message)
        self.exception, self.ctx, self.index, self.dropped = exception, ctx, index, dropped


class _Task(NamedTuple):
    """A task put: its put number, its device, whether it runs on a worker."""
    index: int
    ctx: mx.Context
    threaded: bool


class _Outcome(NamedTuple):
    """What a task gave: its output, or the exception it raised."""
    task: _Task
    ok: bool
    value: Any


def _device_of(x, default):
    """The context of the first NDArray in `x`, else `default`."""
    for _, arr in arrays(x):
        if isinstance(arr, mx.nd.NDArray):
            return arr.context
    return default


class Parallel:
    """Run a :class:`Parallelizable`'s ``forward_backward`` on inputs put,
    one worker thread per device; results in completion order.

    Parameters
    ----------
    num_workers : int
        As in GluonCV: with `serial_init`, how many first tasks run in the
        caller's thread; 0 runs every task in the caller (for debugging).
        The threads themselves are one per device, started with the
        device's first threaded task: tasks of one device run one after
        another, tasks of different devices concurrently.
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
        self._pool = WorkerPool([], name='gluon_parallel-Parallel', first_worker=0)
        self._lock = threading.Lock()
        self._done = collections.deque()    # outcomes of tasks run in the caller
        self._threaded = {}                 # put number -> task, on the workers
        self._puts = 0

    def put(self, x: Any) -> None:
        """Run ``parallizable.forward_backward(x)`` on the worker of `x`'s
        device (in the caller's thread while the serial start lasts)."""
        if self._pool.closed:
            raise RuntimeError('this Parallel is closed')
        default = self._devices[0] if self._devices else mx.current_context()
        ctx = _device_of(x, default)
        if self._devices is not None and ctx not in self._devices:
            raise ValueError(f'Parallel.put: the input is on {ctx}, but this Parallel runs '
                             f'tasks on {self._devices} only (its ctx_list)')
        with self._lock:
            task = _Task(self._puts, ctx, self._num_serial <= 0 and self._num_workers > 0)
            self._puts += 1
            if task.threaded:
                self._threaded[task.index] = task
        if task.threaded:
            job = (self._parallizable.forward_backward, (x,), {}, autograd.is_recording(),
                   autograd.is_training(), None, False)
            self._pool.submit(self._rank_of(ctx), job, key=task.index)
        else:
            self._run_here(task, x)

    def _rank_of(self, ctx):
        """The pool's rank for `ctx`, its worker added on first use."""
        with self._lock:
            if ctx in self._pool.ctx_list:
                return self._pool.ctx_list.index(ctx)
            return self._pool.add_context(ctx)

    def _run_here(self, task, x):
        """A task in the caller's thread; its outcome waits for ``get()``."""
        try:
            # Not waited for (as in GluonCV): a task whose operators meet the
            # next devices' inside MXNet's engine (contrib SyncBatchNorm)
            # would wait here for tasks not put yet.
            with task.ctx:
                out = self._parallizable.forward_backward(x)
        except Exception as e:      # reported by get(), as a worker's are
            self._done.append(_Outcome(task, False, e))
        else:
            self._num_serial -= 1
            self._done.append(_Outcome(task, True, out))

    def get(self, timeout: float | None = None) -> Any:
        """The result of a finished task, the first to finish first.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait for one (not in GluonCV); TimeoutError after
            them. Default: until a task finishes.

        Raises
        ------
        ParallelTaskError
            The task raised. The other tasks in flight are waited for and
            their results dropped first, so the next ``put`` starts afresh.
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
            if not self._threaded:
                raise RuntimeError(f'Parallel.get(): no task in flight (every one of the '
                                   f'{self._puts} put so far was got or dropped): put an '
                                   'input first')
        try:
            key, ok, value = self._pool.result(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f'Parallel.get(): no task finished within {timeout} s '
                               f'({len(self._threaded)} in flight)') from None
        with self._lock:
            return _Outcome(self._threaded.pop(key), ok, value)

    def _failure(self, outcome):
        """The error of a failed task, once the others in flight are done
        and dropped."""
        with self._lock:
            dropped = len(self._done) + len(self._threaded)
            pending, self._threaded = len(self._threaded), {}
            self._done.clear()
        self._pool.discard(pending, grace=default_timeout() or threading.TIMEOUT_MAX)
        e, task = outcome.value, outcome.task
        trace = ''.join(traceback.format_exception(e)).rstrip()
        where = 'in the caller' if not task.threaded else 'on its worker'
        message = (f'{type(e).__name__} in Parallel task {task.index} (put #{task.index + 1}) on '
                   f'{task.ctx}, run {where}: {e}\n'
                   f'The results of the {dropped} other task(s) in flight were dropped; this '
                   f'Parallel takes new puts.\nThe task\'s traceback:\n{trace}')
        return ParallelTaskError(message, e, task.ctx, task.index, dropped)

    def close(self) -> None:
        """Stop the worker threads (tasks in flight finish first).
        Idempotent."""
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
                f'devices={self._pool.ctx_list})')
