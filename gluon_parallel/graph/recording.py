"""Bridge: a graph-mode call inside Gluon's autograd.

A recorded call returns copies of the executor's outputs that are autograd
*variables*, their gradient buffers the executor's head gradients (an
output the loss does not use gets zeros). ``autograd.backward``
writes the loss's gradient into those buffers as into any variable's.
Right after MXNet's backward call returns, in the same thread and before
the caller can push anything else (``_gluon.after_backward``), the
executor's backward is pushed for every call whose outputs got a gradient.
It writes the parameters' own gradient arrays (Gluon's ``grad_req`` per
parameter), which are then marked fresh for the Trainer. Every operation
of a step is pushed from the caller's thread in program order, so the
engine orders them exactly as it orders Gluon's own.

Why not one ``autograd.Function`` node (earlier versions): MXNet runs its
backward on the custom-operator thread *inside the node's engine
operation*, so the executor's backward would be pushed from inside it. An
operation pushed in the meantime that reads the gradients and takes
temporary workspace (``clip_global_norm``'s norms: MXNet 1.9.1 keeps one
workspace pool per device type, 4 copies on CPU, 1 per GPU, shared by every
operator) waits for the node, and the node for an operator of the executor
queued behind it on that workspace: a deadlock. Measured: every time with
``clip_global_norm`` between backward and step; freeing an executor (cache
eviction, ``close``) queued the same wait, which was the intermittent hang.

The hook (:class:`BackwardHook`) belongs to the graph-mode runners that
use it: the first recorded call of a runner installs it, and it is removed
once the last runner using it has closed and no recorded call waits for
its backward (a call recorded before its DataParallel closed still gets
its backward).
"""
import functools
import threading

from mxnet import autograd

from .. import _gluon
from .calls import RecordedCalls

__all__ = ['BackwardHook', 'run']


class BackwardHook:
    """The process's graph-mode backward hook (one :class:`RecordedCalls`,
    which ``_gluon.after_backward`` calls), held by the runners that use
    it (a GraphMode per DataParallel).

    MXNet has one backward function per process, so there is one hook: a
    runner asks for it with :meth:`acquire` at each recorded call (which
    installs it if it is not, again after a removal) and gives it back with
    :meth:`release` when it closes; a runner dropped without closing stops
    counting too (``RecordedCalls.users`` holds weak references).
    """

    _lock = threading.Lock()

    @classmethod
    def acquire(cls, runner):
        """The installed RecordedCalls (installed first if need be), with
        `runner` among its users."""
        calls = cls.current()
        if calls is None:
            with cls._lock:
                calls = cls.current()
                if calls is None:
                    calls = RecordedCalls()
                    calls.on_idle = functools.partial(cls._remove_if_unused, calls)
                    _gluon.after_backward(calls)
        calls.users.add(runner)
        return calls

    @classmethod
    def release(cls, runner):
        """`runner` no longer uses the hook: it is removed if that was the
        last user and no recorded call waits (else once the last is
        served)."""
        calls = cls.current()
        if calls is not None:
            calls.users.discard(runner)
            cls._remove_if_unused(calls)

    @staticmethod
    def current():
        """The installed RecordedCalls, or None."""
        calls = _gluon.after_backward_hook()
        return calls if isinstance(calls, RecordedCalls) else None

    @classmethod
    def _remove_if_unused(cls, calls):
        if calls.users or not calls.idle:
            return
        with cls._lock:
            if not calls.users and calls.idle and cls.current() is calls:
                _gluon.remove_after_backward()


def run(executor, inputs, train, mark, idle_ctx=()):
    """Run `executor` (free: ``executor.call is None``) on `inputs` (what
    its ``forward`` takes: every replica's flat list of NDArrays, or the
    whole inputs); the runner then hands a recorded call to the
    RecordedCalls (``add``, a loss's ``follow``).

    Returns
    -------
    list of NDArray
        Every replica's outputs in order, new arrays (the executor's own
        are reused by its next call); with `mark`, autograd variables whose
        gradient the next backward pass hands to the executor's.
    """
    with autograd.pause(train_mode=train):
        executor.forward(inputs, train, idle_ctx)
        flat = executor.copy_outputs()
    if mark:
        executor.mark_outputs(flat)
    return flat
