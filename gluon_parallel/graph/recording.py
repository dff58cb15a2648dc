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
use it: the first recorded call of a runner installs it (the hook object
itself is what MXNet's patched backward calls, and it calls down into
calls.py: nothing of graph/ is called back from below), and it is removed
once the last runner using it has closed and no recorded call waits for
its backward (a call recorded before its DataParallel closed still gets
its backward).
"""
import threading
import weakref

from mxnet import autograd

from .. import _gluon
from .calls import RecordedCalls

__all__ = ['BACKWARD_HOOK', 'BackwardHook', 'run']


class BackwardHook:
    """The graph-mode backward hook: the object ``_gluon.after_backward``
    calls (:meth:`heads_only` before a plain pass, :meth:`after_backward`
    after every pass, :meth:`removed`), each handed down to its
    :class:`RecordedCalls` (calls.py), the process's recorded calls while
    it is installed (``calls``, else None).

    MXNet has one backward function per process, so there is one hook,
    :data:`BACKWARD_HOOK`, owned here: the graph-mode runners hold it (a
    GraphMode per DataParallel: :meth:`acquire` at each recorded call,
    which installs it if it is not, again after a removal; :meth:`release`
    when it closes; a runner dropped without closing stops counting too,
    ``users`` holds weak references), and a graph-mode loss finds the
    network's call it reads among its ``calls``. It removes itself once no
    runner holds it and no recorded call waits.
    """

    def __init__(self):
        self._lock = threading.Lock()
        #: The RecordedCalls while the hook is installed, else None.
        self.calls = None
        self.users = weakref.WeakSet()      # the runners holding it

    def acquire(self, runner):
        """The RecordedCalls (the hook installed first if need be), with
        `runner` among its users."""
        calls = self.calls
        if calls is None:
            with self._lock:
                calls = self.calls
                if calls is None:
                    calls = RecordedCalls()
                    _gluon.after_backward(self)
                    self.calls = calls
        self.users.add(runner)
        return calls

    def release(self, runner):
        """`runner` no longer uses the hook: it is removed if that was the
        last user and no recorded call waits (else once the last is
        served)."""
        self.users.discard(runner)
        self._remove_if_unused()

    def heads_only(self, handles):
        """``_gluon.after_backward``'s call before a plain pass:
        ``RecordedCalls.heads_only``."""
        return self.calls.heads_only(handles)

    def after_backward(self, retain_graph, skipped):
        """``_gluon.after_backward``'s call after every pass:
        ``RecordedCalls.after_backward``, then the hook removed if no call
        waits and no runner holds it."""
        if self.calls.after_backward(retain_graph, skipped):
            self._remove_if_unused()

    def removed(self):
        """``_gluon.after_backward``'s call once the hook is no longer
        called (removed, or replaced)."""
        self.calls = None

    def _remove_if_unused(self):
        calls = self.calls
        if self.users or calls is None or not calls.idle:
            return
        with self._lock:
            if not self.users and calls.idle and self.calls is calls:
                _gluon.remove_after_backward()


#: The process's one backward hook.
BACKWARD_HOOK = BackwardHook()


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
