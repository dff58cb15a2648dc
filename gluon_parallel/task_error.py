"""The error ``gluoncv.Parallel.get()`` raises for a task that raised: the
task's own exception type (so ``except ValueError:`` around ``get()`` keeps
catching a task's ValueError, as around a DataParallel call), which is also a
:class:`ParallelTaskError` carrying the task's device and put number.

The error is a new object of a subclass of both (one per exception type,
named as the task's type, so a traceback reads ``ValueError: ...``), rebuilt
from the task's exception as pickle rebuilds one (its ``__reduce__``): the
same ``args`` and attributes. An exception that cannot be rebuilt so, or a
BaseException that is not an Exception (KeyboardInterrupt), is raised itself,
with a note naming the task.
"""
import threading
from typing import Any

__all__ = ['ParallelTaskError', 'task_error']


class ParallelTaskError(Exception):
    """Base of the error ``Parallel.get()`` raises for a failed task, next to
    the task's own exception type: ``except ParallelTaskError`` and ``except
    <the task's type>`` both catch it.

    Attributes
    ----------
    exception : BaseException
        The task's exception itself (with its traceback).
    ctx : Context
        The device the task ran on.
    index : int
        Which put it was, counted from 0 over the Parallel's life.
    dropped : int
        Results of the other tasks in flight, dropped.
    """

    def __str__(self):
        return self.__dict__.get('_message', super().__str__())

    def __reduce__(self):
        # Pickled (to another process, a log handler) as the task's own
        # exception: the subclass exists in this process only.
        exception = self.__dict__.get('exception')
        return exception.__reduce__() if exception is not None else super().__reduce__()


_kinds = {}         # exception type -> its subclass with ParallelTaskError
_lock = threading.Lock()


def _kind_of(cls):
    with _lock:
        kind = _kinds.get(cls)
        if kind is None:
            kind = _kinds[cls] = type(cls.__name__, (cls, ParallelTaskError), {
                '__module__': cls.__module__, '__qualname__': cls.__qualname__,
                '__doc__': f'A Parallel task\'s {cls.__name__}, raised by get().',
                '__str__': ParallelTaskError.__str__,
                '__reduce__': ParallelTaskError.__reduce__})
        return kind


def _rebuilt(exc):
    """`exc` rebuilt as its ParallelTaskError subclass, or None."""
    if not isinstance(exc, Exception):
        return None
    try:
        rebuild, args, *state = exc.__reduce__()
        if rebuild is not type(exc):
            return None
        err = _kind_of(type(exc))(*args)
        if state and state[0]:
            err.__setstate__(state[0])
        err.args = exc.args     # an __init__ that formats its arguments formatted them again
    except Exception:       # a type whose construction pickle's way fails
        return None
    return err


def task_error(exc: BaseException, message: str, **info: Any) -> BaseException:
    """The error to raise for a task's exception `exc`: str() gives
    `message`; `info` (ctx, index, dropped) become attributes, with
    ``exception`` (`exc`). `exc` itself, with `message` as a note, if it
    cannot be rebuilt."""
    err = _rebuilt(exc)
    if err is None:
        try:
            exc.add_note(message)
        except Exception:   # an exception type refusing attributes
            pass
        return exc
    err.__dict__.update(info, exception=exc, _message=message)
    return err
