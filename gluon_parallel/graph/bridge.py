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

An executor holds one forward pass, so a recorded call keeps its executor
(and the memory pool it shares, memory.py) until its backward was pushed;
a later call takes another pool (two forwards, then one backward over both
losses, is exact). A recorded call whose backward never comes (a metric
computed under ``record()``) keeps it until its pool is needed again; a
backward that reaches such a call afterwards raises instead of computing
wrong gradients.
"""
import collections
import contextlib
import operator
import threading

from mxnet import autograd

from .. import _gluon

__all__ = ['Call', 'Pending', 'REUSED', 'pending', 'run']

#: At most this many recorded calls wait for a backward, process-wide (the
#: oldest gives its executor up first): each keeps an executor's memory.
MAX_PENDING = 8

REUSED = ('a backward pass reached the outputs of a graph-mode call whose executor a later '
          'call has reused (more recorded calls waited for a backward than graph mode keeps '
          'executors for): call backward before the next recorded call, compute metrics '
          'outside autograd.record(), or use DataParallel(..., graph=False)')


class Call:
    """A recorded call whose backward may still come.

    Attributes
    ----------
    executor : executor.Executor
        Its executor (``executor.call`` is this call until released).
    outputs : list of NDArray
        The outputs returned (autograd variables), every replica's in order.
    followers : list of Call
        Calls of executors reading this call's outputs (graph-mode losses,
        loss.py): their backward writes this call's head gradients, so it
        is pushed first.
    covered : set of int
        A follower's: the outputs (flat index) of the call it follows whose
        gradient its backward writes.
    """

    __slots__ = ('executor', 'outputs', 'followers', 'handles', 'hit', 'covered')

    def __init__(self, executor, outputs, covered=()):
        self.executor, self.outputs, self.followers = executor, outputs, []
        self.covered = covered
        self.handles = None         # a follower's: its outputs' handle values
        self.hit = None             # a follower's outputs Pending.heads_only served

    def fresh(self, skipped=False):
        """Which outputs the last backward pass wrote a gradient of (then
        forgotten, for a second backward with ``retain_graph``). `skipped`:
        the pass was :meth:`Pending.heads_only`'s, which marks the outputs
        it served in ``hit`` (MXNet's pass marks the arrays' own flags,
        which every call's ``fresh`` leaves false)."""
        if skipped:
            hit, self.hit = self.hit, None
            return hit or [False] * len(self.outputs)
        flags = _gluon.grads_fresh(self.outputs)
        _gluon.set_grads_fresh(self.outputs, False)
        return flags

    def served(self, skipped):
        """Push the backward of every follower the backward pass reached
        (the gradients of the outputs each covers, written into this
        call's head gradients: adding what autograd wrote there itself);
        returns which outputs have a gradient now. `skipped`: the pass was
        :meth:`Pending.heads_only`'s (else MXNet's pass wrote the
        followers' head gradients it reached)."""
        fresh = self.fresh(skipped)
        for f in self.followers:
            flags = f.fresh(skipped)
            if not any(flags):
                continue
            for head, used in zip(f.executor.heads, flags):
                if not used:
                    _gluon.zero(head)
            heads = self.executor.heads
            kept = [(heads[i], _gluon.copy(heads[i])) for i in f.covered if fresh[i]]
            f.executor.backward()
            for head, old in kept:
                _gluon.add_into(head, old)
            for i in f.covered:
                fresh[i] = True
        return fresh

    def release(self):
        """Free its executor, and its followers', for other calls."""
        self.executor.call = None
        for f in self.followers:
            f.executor.call = None


class Pending:
    """The recorded graph-mode calls of the process whose backward may
    still come, in call order, and those that gave their executor up: the
    backward hook itself. One per process (:func:`pending`), installed as
    ``_gluon.after_backward``'s hook, which calls :meth:`heads_only` before
    a plain backward pass and :meth:`after_backward` right after every pass:
    one autograd backward pass may reach the calls of every DataParallel.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._calls = []                                        # Calls in call order
        self._given_up = collections.deque(maxlen=2 * MAX_PENDING)  # and their followers

    def add(self, call):
        """Hold `call` until its backward (the oldest beyond MAX_PENDING
        gives its executor up)."""
        with self._lock:
            call.executor.call = call
            self._calls.append(call)
            while len(self._calls) > MAX_PENDING:
                self._give_up(self._calls[0])

    def _give_up(self, call):
        """Release the executor to a later call: a backward reaching this
        call (or its followers) from now on raises."""
        self._calls.remove(call)
        call.release()
        call.executor = None                    # (only its outputs are checked)
        self._given_up.append(call)
        self._given_up.extend(call.followers)

    def give_up_oldest(self, held):
        """Make the oldest of the calls `held` (or of the calls they follow)
        give its executor up (memory.Pools.find: every pool is busy)."""
        with self._lock:
            held = set(map(id, held))
            oldest = next(c for c in self._calls
                          if id(c) in held or any(id(f) in held for f in c.followers))
            self._give_up(oldest)

    def call_of(self, outputs):
        """The pending call that returned exactly `outputs` (every replica's,
        as DataParallel returned them: arrays, or flat lists of arrays), or
        None."""
        flat = []
        for out in outputs:
            if isinstance(out, (list, tuple)):
                flat.extend(out)
            else:
                flat.append(out)
        with self._lock:
            for call in reversed(self._calls):
                if len(call.outputs) == len(flat) and \
                        all(map(operator.is_, call.outputs, flat)):
                    return call
        return None

    def follow(self, call, executor, outputs, covered):
        """Make `outputs` of `executor` (a loss executor reading `call`'s
        outputs, writing the head gradients of those in `covered`) autograd
        variables whose backward pass is pushed before `call`'s."""
        executor.mark_outputs(outputs)
        follower = Call(executor, outputs, covered)
        follower.handles = [o.handle.value for o in outputs]
        with self._lock:
            executor.call = follower
            call.followers.append(follower)
        return outputs

    def heads_only(self, handles):
        """Do a plain backward pass (``_gluon.after_backward``) whose heads,
        by their `handles`, are all the outputs of followers (graph-mode
        losses): autograd variables, whose gradient MXNet's pass would set
        to ones and nothing else. Writes the ones into the followers' head
        gradients (prepared operators, a C call each) and notes the
        outputs served in their follower's ``hit`` (where MXNet's pass sets
        the arrays' fresh flags); returns whether it did (False: MXNet's
        pass runs)."""
        with self._lock:
            index = {h: (f, i) for c in self._calls for f in c.followers
                     for i, h in enumerate(f.handles)}
        hits = [index.get(h) for h in handles]
        if None in hits or len(set(handles)) < len(handles):
            return False                # (a head twice: MXNet's pass decides)
        for f, i in hits:
            if f.hit is None:
                f.hit = [False] * len(f.outputs)
            f.hit[i] = True
        with _not_recording():
            _gluon.invoke([f.executor.fill_ones[i] for f, i in hits], _NO_PARAMS)
        return True

    def after_backward(self, retain_graph, skipped=False):
        """Push the executor's backward of every call the backward pass
        reached (MXNet's backward call, or `skipped` for it
        :meth:`heads_only`, has just returned in this thread)."""
        if not self._calls and not self._given_up:
            return
        with _not_recording():
            self._serve(retain_graph, skipped)

    def _serve(self, retain_graph, skipped):
        with self._lock:
            # (heads_only serves pending calls only: MXNet's pass did this)
            if not skipped and any(any(c.fresh()) for c in list(self._given_up)):
                raise RuntimeError(REUSED)
            served = [(c, f) for c, f in ((c, c.served(skipped)) for c in self._calls)
                      if any(f)]
            if not retain_graph:
                for c, _ in served:
                    self._calls.remove(c)
        try:
            for i, (c, fresh) in enumerate(served):
                for head, f in zip(c.executor.heads, fresh):
                    if not f:               # an output the loss did not use
                        _gluon.zero(head)
                # Two calls of one backward (two losses): the later ones add.
                c.executor.backward(accumulate=i > 0)
            # Gluon's BatchNorm updates the running statistics in its
            # backward pass, which meets the later call first.
            for c, _ in reversed(served):
                c.executor.update_running()
        finally:
            if not retain_graph:
                for c, _ in served:
                    c.release()


_NO_PARAMS = _gluon.op_params({})


def _not_recording():
    """What the backward hook pushes is not autograd's to record (a
    backward pass called inside ``record()``): a pause when recording, else
    nothing (the pause costs C calls every step)."""
    return autograd.pause() if autograd.is_recording() else contextlib.nullcontext()


def pending(install=True):
    """The process's Pending: the hook ``_gluon.after_backward`` holds. With
    `install`, it is made and installed first if it is not (the first
    graph-mode call; again if it was removed), else None then."""
    hook = _gluon.after_backward_hook()
    if isinstance(hook, Pending):
        return hook
    if not install:
        return None
    hook = Pending()
    _gluon.after_backward(hook)
    return hook


def run(executor, inputs, train, calls, record=True, idle_ctx=(), leader=None):
    """Run `executor` (free: ``executor.call is None``) on `inputs` (what
    its ``forward`` takes: every replica's flat list of NDArrays, or the
    whole inputs). A recorded call is added to `calls` (the Pending); a
    loss executor's follows the network's call `leader` whose outputs it
    read.

    Returns
    -------
    list of NDArray
        Every replica's outputs in order, new arrays (the executor's own
        are reused by its next call); when recorded, autograd variables
        whose gradient the next backward pass hands to the executor's.
    """
    with autograd.pause(train_mode=train):
        executor.forward(inputs, train, idle_ctx)
        flat = executor.copy_outputs()
    if leader is not None:
        return calls.follow(leader, executor, flat, executor.covered)
    if record and executor.trainable:
        executor.mark_outputs(flat)
        calls.add(Call(executor, flat))
    return flat
