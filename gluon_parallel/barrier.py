"""ParallelState: a reusable N-party rendezvous with a reduction.

Pure Python (no MXNet import), so it can be tested and reused with any
values. A round has three phases: every party pushes, one party runs the
operation, every party pulls. Pushes for the next round wait until the
current round is fully pulled, so one state can be reused back to back
without a party of round k+1 overwriting a value of round k.

A thread that runs several parties one after another (the worker pool's
inline mode) must start the parties it has not run yet before one of its
parties blocks, since those are the ones it waits for:
:func:`before_first_wait` tells every ParallelState how.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ['ParallelState', 'ParallelAbort', 'before_first_wait']

_FILLING, _COMPUTING, _DONE = 0, 1, 2

_waiting = threading.local()


@contextlib.contextmanager
def before_first_wait(callback):
    """Within the block, in this thread: call `callback()` once, just before
    a party of any ParallelState would first have to wait for the others.

    Nested blocks (a parallel call made inside a party) each have their own
    callback; the outer one is back in force when the inner block exits.
    """
    outer = getattr(_waiting, 'callback', None)
    _waiting.callback = callback
    try:
        yield
    finally:
        _waiting.callback = outer


def _before_waiting():
    callback = getattr(_waiting, 'callback', None)
    if callback is not None:
        _waiting.callback = None        # once
        callback()


class ParallelAbort(RuntimeError):
    """Raised in the parties of a call that another party failed.

    The original failure is in ``__cause__``; DataParallel reports that one,
    not this.
    """


class ParallelState:
    """A reusable rendezvous of `num_parties` parties combining their values.

    Parameters
    ----------
    num_parties : int
        Number of parties per round.
    operation : callable
        Called once per round as ``operation(*values)`` with the pushed values
        in index order. If it returns a ``list`` of exactly `num_parties`
        entries, party ``idx`` receives entry ``idx``; any other value (a
        tuple included) goes whole to every party.
    timeout : float, optional
        Seconds any party waits for the others before a ``TimeoutError``
        naming the parties that never arrived. None waits forever.

    Examples
    --------
    >>> state = ParallelState(2, lambda a, b: a + b)
    >>> # in each of two threads:
    >>> idx = state.push(x)          # doctest: +SKIP
    >>> total = state.pull(idx)      # doctest: +SKIP
    """

    def __init__(self, num_parties: int, operation: Callable[..., Any],
                 timeout: float | None = None) -> None:
        num_parties = int(num_parties)
        if num_parties < 1:
            raise ValueError(f'num_parties must be at least 1, got {num_parties}')
        if not callable(operation):
            raise TypeError(f'operation must be callable, got {operation!r}')
        self._n = num_parties
        self._op = operation
        self.timeout = timeout
        self._cond = threading.Condition(threading.Lock())
        self._error = None
        self._reset_round()

    def _reset_round(self):
        self._values = [None] * self._n
        self._pushed = [False] * self._n
        self._num_pushed = 0
        self._num_pulled = 0
        self._phase = _FILLING
        self._result = None
        self._op_error = None

    def __len__(self) -> int:
        return self._n

    @property
    def num_parties(self) -> int:
        """Number of parties per round."""
        return self._n

    def _wait(self, ready, what):
        """Wait on the condition (held) until ready(); honour abort/timeout."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        if not ready():
            _before_waiting()
        while not ready():
            if self._error is not None:
                raise self._error
            if deadline is None:
                self._cond.wait()
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timeout_error(what)
                self._cond.wait(left)
        if self._error is not None:
            raise self._error

    def _timeout_error(self, what):
        missing = [i for i in range(self._n) if not self._pushed[i]]
        arrived = [i for i in range(self._n) if self._pushed[i]]
        if self._phase == _FILLING and missing:
            msg = (f'ParallelState timed out after {self.timeout:g}s waiting {what}: parties '
                   f'{missing} never arrived (arrived: {arrived})')
        else:
            msg = (f'ParallelState timed out after {self.timeout:g}s waiting {what}: '
                   f'{self._num_pulled} of {self._n} parties pulled the previous round')
        return TimeoutError(msg)

    def push(self, value: Any, idx: int | None = None) -> int:
        """Deposit this party's value for the current round.

        Parameters
        ----------
        value : object
            Anything the operation accepts.
        idx : int, optional
            The slot to fill (a replica passes its rank so errors can name
            it); default: the lowest free slot.

        Returns
        -------
        int
            This party's index, to pass to :meth:`pull`.
        """
        with self._cond:
            # A party that is already in the next round waits for the
            # current one to be drained.
            self._wait(lambda: self._phase == _FILLING and
                       (self._num_pushed < self._n if idx is None else not self._pushed[idx]),
                       'to push')
            if idx is None:
                idx = self._pushed.index(False)
            elif not 0 <= idx < self._n:
                raise IndexError(f'party index {idx} out of range for {self._n} parties')
            self._values[idx] = value
            self._pushed[idx] = True
            self._num_pushed += 1
            if self._num_pushed == self._n:
                self._cond.notify_all()
            return idx

    def pull(self, idx: int) -> Any:
        """Wait for every party, then return this party's share of the result.

        The operation runs once per round, in the first party to pull after
        the last push. After every party has pulled, the state resets.
        """
        with self._cond:
            self._wait(lambda: self._num_pushed == self._n, 'for the other parties to push')
            if self._phase == _FILLING:
                self._phase = _COMPUTING
                values = list(self._values)
                self._cond.release()      # the operation may be slow: don't hold the lock
                try:
                    result, error = self._op(*values), None
                except BaseException as e:   # handed to every party below
                    result, error = None, e
                finally:
                    self._cond.acquire()
                self._result, self._op_error = result, error
                self._phase = _DONE
                self._cond.notify_all()
            else:
                self._wait(lambda: self._phase == _DONE, 'for the operation')
            result, error = self._result, self._op_error
            self._num_pulled += 1
            if self._num_pulled == self._n:
                self._reset_round()
                self._cond.notify_all()
        if error is not None:
            raise error
        if isinstance(result, list) and len(result) == self._n:
            return result[idx]
        return result

    def abort(self, exc: BaseException | None = None) -> None:
        """Wake every waiting party (now and later) with `exc`.

        The state stays aborted until :meth:`reset`.
        """
        if exc is None:
            exc = ParallelAbort('ParallelState aborted')
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def reset(self) -> None:
        """Forget an abort and any half-finished round."""
        with self._cond:
            self._error = None
            self._reset_round()
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (f'ParallelState(num_parties={self._n}, operation={self._op!r}, '
                f'timeout={self.timeout!r})')
