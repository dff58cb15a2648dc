"""A persistent pool of worker threads, one per device.

Threads are created once and reused on every call: creating them per call
(as GluonCV does) costs more than a small network's forward pass. The calling
thread runs replica 0 itself, which saves one hand-off per call; workers run
replicas 1..n-1. Each worker enters its device's context once for good (the
current context is thread-local in MXNet) and takes the caller's autograd
state (recording, train mode) with every job, since that is thread-local too.

``run(..., threads='auto')`` first tries the cheaper way: the caller runs
the replicas one after another. MXNet's engine is asynchronous, so the devices
still compute concurrently, and no GIL hand-off between threads is paid per
operator (on few cores that hand-off costs a third of a small network's
step). The moment a replica has to wait for another one at a ParallelState
(SyncBatchNorm), the replicas not started yet go to the worker threads, which
are only created then. ``threads=True`` hands replicas 1..n-1 to the
workers at once. ``call.used_threads`` tells afterwards which way a call
went.
"""
import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from mxnet import autograd, gluon

from ._gluon import call_with_kwargs
from .barrier import ParallelAbort, before_first_wait
from .nested import ndarrays
from .replica_context import ParallelCall, ReplicaContext, annotate

__all__ = ['WorkerPool', 'Job', 'Result', 'check_threads', 'wait_all']

_live = weakref.WeakSet()       # every pool, stopped at exit
_STOP = object()


def check_threads(threads):
    """`threads` if it names a thread mode: 'auto' (the caller issues the
    replicas until one waits) or True (the workers from the start)."""
    if threads is True or threads == 'auto':
        return threads
    raise ValueError(f"threads must be 'auto' or True, got {threads!r}")


def wait_all(obj):
    """wait_to_read every NDArray inside a nested output."""
    for a in ndarrays(obj):
        a.wait_to_read()


class Job(NamedTuple):
    """What a worker runs: ``fn(*args, **kwargs)`` (a Block as
    ``block(*args, **kwargs)`` on one device) in the caller's autograd
    state, inside `replica` (None: outside any parallel call, as a task of
    gluoncv.Parallel), waiting for its outputs with `sync`."""
    fn: Callable
    args: tuple
    kwargs: dict
    recording: bool
    training: bool
    replica: ReplicaContext | None
    sync: bool


class Result(NamedTuple):
    """What a worker reports: its job's key (the replica's rank, or the
    submitter's), and the output, or the exception the job raised."""
    key: Any
    ok: bool
    value: Any


def _run_job(fn, args, kwargs, replica, sync, on_wait=None):
    # Both restore what was there: a parallel call made inside a replica
    # leaves the outer replica (and its hand-off) in place. A job without a
    # replica (a task of gluoncv.Parallel) runs outside any parallel call.
    scope = replica if replica is not None else contextlib.nullcontext()
    with scope, before_first_wait(on_wait):
        # Gluon 1.x Block.__call__ takes no keyword arguments.
        out = call_with_kwargs(fn, args, kwargs) if isinstance(fn, gluon.Block) \
            else fn(*args, **kwargs)
        if sync:
            wait_all(out)
        return out


def _worker(ctx, jobs, results):
    ctx.__enter__()         # this thread works on ctx for its whole life
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        key, job = job
        try:
            autograd.set_recording(job.recording)
            autograd.set_training(job.training)
            out = _run_job(job.fn, job.args, job.kwargs, job.replica, job.sync)
        except BaseException as e:   # reported to the caller, never printed
            if job.replica is not None:
                job.replica.call.abort(e)     # wake the others before reporting
            results.put(Result(key, False, e))
        else:
            results.put(Result(key, True, out))
        finally:
            job = out = None        # drop references while idle


class _Run:
    """One call of :meth:`WorkerPool.run`: which replicas the caller issues
    and which the workers run, and what came back."""

    def __init__(self, pool, fns, args_list, kwargs_list, call, sync, threads):
        self.pool, self.call, self.sync = pool, call, sync
        self.auto = threads == 'auto'       # the caller issues replicas until one waits
        self.n = n = len(args_list)
        self.fns = fns if isinstance(fns, (list, tuple)) else [fns] * n
        self.args_list = args_list
        self.kwargs_list = kwargs_list if kwargs_list is not None else [{}] * n
        # The workers take the caller's autograd state (it is thread-local).
        self.recording, self.training = autograd.is_recording(), autograd.is_training()
        self.handed = n                 # replicas handed..n-1 run on the workers
        self.running = None             # the replica the caller is running
        self.outputs, self.errors, self.received = [None] * n, {}, 0

    def hand_off(self, first):
        """Replicas first..n-1 go to the workers (created now if needed)."""
        self.handed = first
        self.call.used_threads = True
        for i in range(first, self.n):
            self.pool.submit(i, Job(self.fns[i], self.args_list[i], self.kwargs_list[i],
                                    self.recording, self.training, ReplicaContext(i, self.call),
                                    self.sync))

    def run_in_caller(self):
        """Run replicas 0, 1, ... in the calling thread until the workers have
        the rest. Inline, a replica about to wait at a ParallelState hands
        off the ones after it first: they are the ones it waits for."""
        for rank in range(self.n):
            if rank >= self.handed:
                break
            on_wait = (lambda r=rank: self.hand_off(r + 1)) \
                if self.auto and rank + 1 < self.n else None
            self.running = rank
            try:
                with self.pool.ctx_list[rank]:
                    self.outputs[rank] = _run_job(
                        self.fns[rank], self.args_list[rank], self.kwargs_list[rank],
                        ReplicaContext(rank, self.call), self.sync and not self.auto, on_wait)
            except Exception as e:
                self.call.abort(e)
                self.errors[rank] = e
                break           # start nothing more in the caller
        self.running = None
        if self.sync and self.auto:     # now that every device has its work
            wait_all(self.outputs[:self.handed])

    def collect(self):
        """The workers' results, as they come."""
        while self.pending:
            result = self.pool.result()
            self.received += 1
            if result.ok:
                self.outputs[result.key] = result.value
            else:
                self.errors[result.key] = result.value

    @property
    def pending(self):
        """Replicas handed to the workers that have not reported yet."""
        return self.n - self.handed - self.received


class WorkerPool:
    """Persistent worker threads, one per context after the first.

    Parameters
    ----------
    ctx_list : list of Context
        The devices; replica ``i`` of a call runs on ``ctx_list[i]``.
    name : str, optional
        Prefix of the thread names.
    first_worker : {1, 0}, default 1
        The first context with a worker thread: 1, the caller runs replica
        0 (:meth:`run`); 0, every context has one (a queue of jobs fed
        through :meth:`submit` by a caller that runs none, as
        ``gluoncv.Parallel``).

    The threads are created when a call first hands a replica to them.
    """

    def __init__(self, ctx_list, name='gluon_parallel', first_worker=1):
        if first_worker not in (0, 1):
            raise ValueError(f'first_worker must be 0 or 1, got {first_worker!r}')
        self.ctx_list = list(ctx_list)
        self.first_worker = first_worker
        self._name = name
        self._lock = threading.Lock()
        self._closed = False
        self._threads = []
        _live.add(self)

    def submit(self, rank, job, key=None):
        """Hand replica `rank`'s :class:`Job` to its worker (the threads
        started first if they are not); its :class:`Result` is reported
        under `key` (default: `rank`)."""
        if not self._threads:
            self._start()
        self._queues[rank - self.first_worker].put((rank if key is None else key, job))

    def add_context(self, ctx):
        """Add a context (with its worker, started if the others are);
        returns its rank."""
        with self._lock:
            if self._closed:
                raise RuntimeError('this worker pool is closed')
            self.ctx_list.append(ctx)
            if self._threads:
                self._start_worker(len(self.ctx_list) - 1)
            return len(self.ctx_list) - 1

    def result(self, timeout=None):
        """The next :class:`Result` a worker reports."""
        return self._results.get(timeout=timeout)

    def _start(self):
        self._results = queue.SimpleQueue()
        self._queues, self._threads = [], []
        for i in range(self.first_worker, len(self.ctx_list)):
            self._start_worker(i)

    def _start_worker(self, i):
        ctx, q = self.ctx_list[i], queue.SimpleQueue()
        t = threading.Thread(target=_worker, args=(ctx, q, self._results),
                             name=f'{self._name}-{i}-{ctx}', daemon=True)
        t.start()
        self._queues.append(q)
        self._threads.append(t)

    @property
    def threads(self):
        """The worker threads (one per context but the first)."""
        return list(self._threads)

    def run(self, fns, args_list, kwargs_list=None, call=None, sync=False, threads=True):
        """Run ``fns[i](*args_list[i], **kwargs_list[i])`` on context i.

        Parameters
        ----------
        fns : callable or list of callables
            One callable for every replica, or one per replica.
        args_list : list of tuple
            Positional arguments per replica; its length is the number of
            replicas n (at most ``len(ctx_list)``).
        kwargs_list : list of dict, optional
        call : ParallelCall, optional
            Shared state of the call; aborted when a replica fails. Default:
            a new one over the first n contexts.
        sync : bool
            Wait until every output NDArray is computed before returning.
        threads : 'auto' or True, default True
            'auto': run the replicas one after another in the calling thread
            until one waits at a ParallelState, and hand the rest to the
            workers then (``call.used_threads`` tells afterwards whether
            that happened); True: replicas 1..n-1 go to the workers at once.

        Returns
        -------
        list
            The outputs in context order.
        """
        if self.first_worker != 1:
            raise RuntimeError('run() needs a pool whose caller runs replica 0 (first_worker=1)')
        n = len(args_list)
        if not 0 < n <= len(self.ctx_list):
            raise ValueError(f'{n} replicas do not fit the {len(self.ctx_list)} contexts of '
                             'this pool')
        if call is None:
            call = ParallelCall(self.ctx_list[:n])
        with self._lock:
            if self._closed:
                raise RuntimeError('this worker pool is closed')
            run = _Run(self, fns, args_list, kwargs_list, call, sync, check_threads(threads))
            if not run.auto:
                run.hand_off(1)
            try:
                run.run_in_caller()
                run.collect()
            except BaseException as e:
                # Ctrl-C (or another BaseException) in the caller's replica or
                # while waiting: do not wait for slow replicas; give them a
                # short grace, then replace the workers.
                call.abort(e)
                self.discard(run.pending)
                if run.running is not None:
                    annotate(e, run.running, self.ctx_list[run.running])
                raise
        if run.errors:
            self._raise(run.errors)
        return run.outputs

    def discard(self, pending, grace=2.0):
        """Collect and drop `pending` outstanding results (after an
        interrupted call), or replace the workers if they do not all come
        within `grace` seconds."""
        deadline = time.monotonic() + grace
        try:
            while pending > 0:
                self.result(timeout=max(0.0, deadline - time.monotonic()))
                pending -= 1
        except (queue.Empty, BaseException):
            if self._threads:
                self._stop_threads(join=0)
                self._start()

    def _raise(self, errors):
        # Report the failure that caused the others, not the aborts it caused.
        rank = min(errors, key=lambda r: (isinstance(errors[r], ParallelAbort), r))
        raise annotate(errors[rank], rank, self.ctx_list[rank])

    def _stop_threads(self, join=5.0):
        for q in getattr(self, '_queues', ()):
            q.put(_STOP)
        deadline = time.monotonic() + join
        for t in self._threads:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if t is not threading.current_thread():
                t.join(left)

    def close(self):
        """Stop and join the worker threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop_threads()

    @property
    def closed(self):
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self._closed = True
                self._stop_threads(join=0)
        except Exception:
            pass


@atexit.register
def _close_all():
    # Idle workers are daemon threads blocked on their queue; stopping them
    # explicitly keeps MXNet from being torn down under a running thread.
    for pool in list(_live):
        try:
            pool._closed = True
            pool._stop_threads(join=0.5)
        except Exception:
            pass


_shared = {}
_shared_lock = threading.Lock()


def shared_pool(ctx_list, depth=0):
    """The lazily started pool of parallel_apply for these contexts.

    One per nesting depth: a parallel call made inside a replica of another
    one on the same contexts must not wait for the outer call's pool, which
    is busy until that very replica returns.
    """
    key = (tuple(ctx_list), depth)
    with _shared_lock:
        pool = _shared.get(key)
        if pool is None or pool.closed:
            pool = _shared[key] = WorkerPool(key[0], name='gluon_parallel-apply')
        return pool
