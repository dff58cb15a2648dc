"""A persistent pool of worker threads, one per device.

Threads are created once and reused on every call: creating them per call
(as GluonCV does) costs more than a small network's forward pass. The calling
thread runs replica 0 itself, which saves one hand-off per call; workers run
replicas 1..n-1. Each worker enters its device's context once for good (the
current context is thread-local in MXNet) and takes the caller's autograd
state (recording, train mode) with every job, since that is thread-local too.

``run(..., inline=True)`` first tries the cheaper way: the caller runs the
replicas one after another. MXNet's engine is asynchronous, so the devices
still compute concurrently, and no GIL hand-off between threads is paid per
operator (on few cores that hand-off costs a third of a small network's
step). The moment a replica has to wait for another one at a ParallelState
(SyncBatchNorm), the replicas not started yet go to the worker threads, which
are only created then.
"""
import atexit
import queue
import threading
import time
import weakref

from mxnet import autograd, nd

from .context import ParallelCall, ReplicaContext, _local
from .state import ParallelAbort, _blocking

__all__ = ['WorkerPool', 'ReplicaError']

_pools = weakref.WeakSet()
_STOP = object()


class ReplicaError(RuntimeError):
    """A failure of a replica whose exception could not be re-raised as is."""


def _wait_all(obj):
    """wait_to_read every NDArray inside a nested output."""
    if isinstance(obj, nd.NDArray):
        obj.wait_to_read()
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _wait_all(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            _wait_all(o)


def _run_job(fn, args, kwargs, replica, sync, on_block=None):
    # Restore, not clear: a parallel call made inside a replica must leave
    # the outer replica's context (and its blocking hook) in place.
    outer, outer_hook = getattr(_local, 'replica', None), getattr(_blocking, 'hook', None)
    _local.replica, _blocking.hook = replica, on_block
    try:
        out = fn(*args, **kwargs)
        if sync:
            _wait_all(out)
        return out
    finally:
        _local.replica, _blocking.hook = outer, outer_hook


def _worker(ctx, jobs, results):
    ctx.__enter__()         # this thread works on ctx for its whole life
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        rank, fn, args, kwargs, recording, training, replica, sync = job
        try:
            autograd.set_recording(recording)
            autograd.set_training(training)
            out = _run_job(fn, args, kwargs, replica, sync)
        except BaseException as e:   # reported to the caller, never printed
            if replica is not None:
                replica.call.abort(e)     # wake the others before reporting
            results.put((rank, False, e))
        else:
            results.put((rank, True, out))
        finally:
            job = out = args = kwargs = None   # drop references while idle


def _annotate(exc, rank, ctx):
    """Name the failing replica in the exception message, keeping its type
    and traceback."""
    where = 'in replica %d on %s' % (rank, ctx)
    try:
        if exc.args and isinstance(exc.args[0], str):
            exc.args = ('%s [%s]' % (exc.args[0], where),) + tuple(exc.args[1:])
        elif not exc.args:
            exc.args = (where,)
        else:
            exc.add_note(where)
    except Exception:   # an exception type with read-only args
        pass
    return exc


class WorkerPool(object):
    """Persistent worker threads, one per context after the first.

    Parameters
    ----------
    ctx_list : list of Context
        The devices; replica ``i`` of a call runs on ``ctx_list[i]``.
    name : str, optional
        Prefix of the thread names.
    lazy : bool, default False
        Create the threads when a call first needs them, not now.
    """

    def __init__(self, ctx_list, name='gluon_parallel', lazy=False):
        self.ctx_list = list(ctx_list)
        self._name = name
        self._lock = threading.Lock()
        self._closed = False
        self._threads = []
        if not lazy:
            self._start()
        _pools.add(self)

    def _start(self):
        self._results = queue.SimpleQueue()
        self._queues = [queue.SimpleQueue() for _ in self.ctx_list[1:]]
        self._threads = []
        for i, (ctx, q) in enumerate(zip(self.ctx_list[1:], self._queues), 1):
            t = threading.Thread(target=_worker, args=(ctx, q, self._results),
                                 name='%s-%d-%s' % (self._name, i, ctx), daemon=True)
            t.start()
            self._threads.append(t)

    @property
    def threads(self):
        """The worker threads (one per context but the first)."""
        return list(self._threads)

    def run(self, fns, args_list, kwargs_list=None, call=None, sync=False, inline=False):
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
        inline : bool
            Run the replicas one after another in the calling thread until
            one waits at a ParallelState; hand the rest to the workers then.
            ``call.threaded`` tells afterwards whether that happened.

        Returns
        -------
        list
            The outputs in context order.
        """
        n = len(args_list)
        if not 0 < n <= len(self.ctx_list):
            raise ValueError('%d replicas do not fit the %d contexts of this pool'
                             % (n, len(self.ctx_list)))
        if not isinstance(fns, (list, tuple)):
            fns = [fns] * n
        if kwargs_list is None:
            kwargs_list = [{}] * n
        if call is None:
            call = ParallelCall(self.ctx_list[:n])
        with self._lock:
            if self._closed:
                raise RuntimeError('this worker pool is closed')
            recording, training = autograd.is_recording(), autograd.is_training()
            handed = [n]            # replicas handed[0]..n-1 go to the workers

            def hand_off(first):
                if not self._threads:
                    self._start()
                handed[0] = first
                call.threaded = True
                for i in range(first, n):
                    self._queues[i - 1].put((i, fns[i], args_list[i], kwargs_list[i], recording,
                                             training, ReplicaContext(i, call), sync))

            if not inline:
                hand_off(1)
            outputs, errors, received, rank = [None] * n, {}, 0, 0
            try:
                while rank < handed[0]:
                    # An inline replica that blocks hands off the ones after it.
                    hook = (lambda r=rank: hand_off(r + 1)) if inline and rank + 1 < n else None
                    try:
                        with self.ctx_list[rank]:
                            outputs[rank] = _run_job(fns[rank], args_list[rank],
                                                     kwargs_list[rank], ReplicaContext(rank, call),
                                                     sync and not inline, hook)
                    except Exception as e:
                        call.abort(e)
                        errors[rank] = e
                        break           # start nothing more in the caller
                    rank += 1
                rank = None
                if sync and inline:     # now that every device has its work
                    _wait_all(outputs[:handed[0]])
                while received < n - handed[0]:
                    r, ok, value = self._results.get()
                    received += 1
                    if ok:
                        outputs[r] = value
                    else:
                        errors[r] = value
            except BaseException as e:
                # Ctrl-C (or another BaseException) in the caller's replica or
                # while waiting: do not wait for slow replicas; give them a
                # short grace, then replace the workers.
                call.abort(e)
                self._recover(n - handed[0] - received)
                if rank is not None:
                    _annotate(e, rank, self.ctx_list[rank])
                raise
        if errors:
            self._raise(errors)
        return outputs

    def _recover(self, pending, grace=2.0):
        """After an interrupted call: collect the outstanding results, or
        replace workers that do not finish within `grace` seconds."""
        deadline = time.monotonic() + grace
        try:
            while pending > 0:
                self._results.get(timeout=max(0.0, deadline - time.monotonic()))
                pending -= 1
        except (queue.Empty, BaseException):
            if self._threads:
                self._stop_threads(join=0)
                self._start()

    def _raise(self, errors):
        # Report the failure that caused the others, not the aborts it caused.
        rank = min(errors, key=lambda r: (isinstance(errors[r], ParallelAbort), r))
        raise _annotate(errors[rank], rank, self.ctx_list[rank])

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
    for pool in list(_pools):
        try:
            pool._closed = True
            pool._stop_threads(join=0.5)
        except Exception:
            pass
