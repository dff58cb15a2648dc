"""Progress reports: a worker of a launched job tells the launcher that it
is moving, so that the launcher can tell a job that stalls
(``--stall-timeout``, :mod:`gluon_parallel.launch.stall`) from one that
is slow.

What counts: a reduction across workers that completes (a Trainer's step
through ``dist.get_kvstore()``, dist_sync or Horovod; this library's own
reductions), a DataParallel call, and the end of a :func:`busy` phase.
Where the worker is: its completed reductions and steps, whether it waits
in one now, the reason of the :func:`busy` phase it is in, and whether it
is past the end of its program (at exit, where ps-lite's finalisation
waits for the others).

The hot path only counts (a few attribute writes); one message a second
at most goes out, from the caller when the last one is a second old, else
from a daemon thread that sends what changed (and, every few seconds,
that nothing did: the launcher knows then that the process still runs).
Outside a launched job every call is a no-op. This module imports only
the standard library.
"""
import atexit
import collections
import contextlib
import functools
import os
import statistics
import threading
import time
from collections.abc import Iterator

from . import channel

__all__ = ['entering', 'done', 'reduce', 'called', 'busy', 'declared', 'reporter']

#: Seconds between two messages of a worker, at least.
INTERVAL = 1.0
#: Seconds after which a worker that has nothing new says so.
QUIET = 5.0
_WINDOW = 20                # steps of the running median of a step's own time


class Reporter:
    """What one worker process tells the launcher."""

    def __init__(self, client):
        self.client = client
        self.pid = os.getpid()
        self.steps = self.reductions = self.calls = self.busy_ends = 0
        self.depth = 0              # reductions entered, nested (one store calls another)
        self.first_key = None       # the key whose reductions count the steps
        self.busy_reason, self.busy_depth = None, 0
        self.exiting = False
        self._own = collections.deque(maxlen=_WINDOW)   # each step's time outside reductions
        self._step_at = self._waited = None
        self._entered_at = 0.0
        self._sent_at = self._changed_at = 0.0
        self._dirty = False
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name='gluon_parallel progress', daemon=True).start()
        atexit.register(self.at_exit)

    # -- the hot path ---------------------------------------------------------

    def entering(self, key):
        self.depth += 1
        if self.depth > 1:
            return
        now = time.monotonic()
        self._entered_at = now
        if self.first_key is None:
            self.first_key = key
        if key == self.first_key:
            if self._step_at is not None:
                self._own.append(max(0.0, now - self._step_at - self._waited))
            self.steps += 1
            self._step_at, self._waited = now, 0.0
        self._changed(now)

    def done(self):
        self.depth -= 1
        if self.depth:
            return
        now = time.monotonic()
        self.reductions += 1
        if self._waited is not None:
            self._waited += now - self._entered_at
        self._changed(now, first=self.reductions == 1)

    def called(self):
        self.calls += 1
        self._changed(time.monotonic(), first=self.calls == 1)

    def _changed(self, now, first=False):
        if os.getpid() != self.pid:     # a forked child (a DataLoader's worker)
            return
        # The first completed reduction or call at once: the launcher
        # then knows this worker is past its start-up.
        if first or now - self._sent_at >= INTERVAL:
            self.send(now)
        else:
            self._dirty = True

    # -- busy -------------------------------------------------------------------

    def enter_busy(self, reason):
        self.busy_depth += 1
        if self.busy_depth == 1:
            self.busy_reason = reason
            self.send(time.monotonic())     # at once: the launcher must not count it stalled

    def leave_busy(self):
        self.busy_depth -= 1
        if self.busy_depth == 0:
            self.busy_reason = None
            self.busy_ends += 1
            self.send(time.monotonic())

    # -- messages ---------------------------------------------------------------

    def state(self):
        """The fields of a ``progress`` message."""
        own = statistics.median(self._own) if self._own else None
        return dict(steps=self.steps, reductions=self.reductions, calls=self.calls,
                    reducing=self.depth > 0, busy=self.busy_reason, busy_ends=self.busy_ends,
                    exiting=self.exiting, own=own, restart=os.environ.get(
                        'GLUON_PARALLEL_RESTART', '0'))

    def send(self, now):
        if os.getpid() != self.pid:
            return
        with self._lock:
            self._sent_at, self._dirty = now, False
            self.client.send('progress', **self.state())

    def _run(self):
        while True:
            time.sleep(INTERVAL)
            now = time.monotonic()
            if self._dirty or now - self._sent_at >= QUIET:
                self.send(now)

    def at_exit(self):
        """The program has ended: what follows (ps-lite's finalisation)
        waits for the other workers."""
        self.exiting = True
        self.send(time.monotonic())


class _Nobody:
    """The reporter of a process no launcher watches: every call a no-op."""

    def entering(self, key):
        pass

    def done(self):
        pass

    def called(self):
        pass

    def enter_busy(self, reason):
        pass

    def leave_busy(self):
        pass


_NOBODY = _Nobody()
_reporter = None
_made = threading.Lock()


def reporter() -> Reporter | _Nobody:
    """This process's reporter: made on first use from the environment the
    launcher gave the process (a no-op one outside a launched job)."""
    global _reporter
    if _reporter is None:
        with _made:
            if _reporter is None:
                c = channel.client()
                _reporter = _NOBODY if c is None else Reporter(c)
    return _reporter


def entering(key) -> None:
    """A reduction across workers starts (`key`: its kvstore key, or the
    Trainer's; the reductions of the first key a process reduces count
    its steps)."""
    (_reporter or reporter()).entering(key)


def done() -> None:
    """The reduction started last has completed."""
    (_reporter or reporter()).done()


def reduce(key, run):
    """``run()``, a reduction across workers (:func:`entering`, then
    :func:`done` however it ends); its result."""
    r = _reporter or reporter()
    r.entering(key)
    try:
        return run()
    finally:
        r.done()


def called() -> None:
    """A DataParallel call has run."""
    (_reporter or reporter()).called()


def declared(reason):
    """A decorator: the function runs inside :func:`busy` (`reason`)."""
    def wrap(function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            with busy(reason):
                return function(*args, **kwargs)
        return run
    return wrap


@contextlib.contextmanager
def busy(reason: str) -> Iterator[None]:
    """``with gluon_parallel.dist.busy('evaluating'):`` declares a phase
    with no steps that may be long (evaluation, data preparation, a
    checkpoint): while this worker is inside, the launcher's
    ``--stall-timeout`` does not count the job as stalled, and leaving
    counts as progress.

    Parameters
    ----------
    reason : str
        Shown in the launcher's stall report. Nested, the outer one is
        kept. Outside a launched job this does nothing.
    """
    r = _reporter or reporter()
    r.enter_busy(str(reason))
    try:
        yield
    finally:
        r.leave_busy()
