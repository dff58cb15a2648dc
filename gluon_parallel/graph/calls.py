"""The recorded graph-mode calls whose backward may still come, and what
runs right after autograd's backward pass: the backward of every call it
reached (recording.py explains why there and then).

An executor holds one forward pass, so a recorded call keeps its executor
(and the memory it shares, memory.py) until its backward was pushed;
a later call takes another arena (two forwards, then one backward over both
losses, is exact). A recorded call whose backward never comes (a metric
computed under ``record()``) keeps it until its arena is needed again; a
backward that reaches such a call afterwards raises instead of computing
wrong gradients.
"""
import collections
import contextlib
import operator
import threading

from mxnet import autograd

from .. import _gluon
from ..syncgraph.in_graph import push_after_backward

__all__ = ['Call', 'RecordedCalls', 'REUSED', 'MAX_PENDING']

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
    returned : list or None
        A network call's outputs as DataParallel returned them (one entry
        per replica): a loss on exactly that list finds the call without a
        search (:attr:`RecordedCalls.latest`).
    """

    __slots__ = ('executor', 'outputs', 'followers', 'handles', 'hit', 'covered', 'returned')

    def __init__(self, executor, outputs, covered=(), returned=None):
        self.executor, self.outputs, self.followers = executor, outputs, []
        self.covered, self.returned = covered, returned
        self.handles = None         # a follower's: its outputs' handle values
        self.hit = None             # a follower's outputs RecordedCalls.heads_only served

    def take_fresh(self, skipped=False):
        """Which outputs the last backward pass wrote a gradient of (then
        forgotten, for a second backward with ``retain_graph``). `skipped`:
        the pass was :meth:`RecordedCalls.heads_only`'s, which marks the outputs
        it served in ``hit`` (MXNet's pass marks the arrays' own flags,
        which every call's ``take_fresh`` leaves false)."""
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
        :meth:`RecordedCalls.heads_only`'s (else MXNet's pass wrote the
        followers' head gradients it reached)."""
        fresh = self.take_fresh(skipped)
        for f in self.followers:
            flags = f.take_fresh(skipped)
            if not any(flags):
                continue
            for head, used in zip(f.executor.head_grads, flags):
                if not used:
                    _gluon.zero(head)
            heads = self.executor.head_grads
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


class RecordedCalls:
    """The recorded graph-mode calls of the process whose backward may
    still come, in call order, and those that gave their executor up. One
    per installed backward hook (recording.py's
    :class:`~gluon_parallel.graph.recording.BackwardHook`, which hands it
    ``_gluon.after_backward``'s calls): :meth:`heads_only` before a plain
    backward pass and :meth:`after_backward` right after every pass (one
    autograd backward pass may reach the calls of every DataParallel).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._calls = []                                        # Calls in call order
        self._given_up = collections.deque(maxlen=2 * MAX_PENDING)  # and their followers
        #: The pending call added last (what a loss on a call's outputs
        #: reads first), or None: never a served call, which would keep its
        #: executor, and the memory it held, alive.
        self.latest = None

    @property
    def idle(self):
        """No recorded call waits for a backward."""
        return not self._calls

    def add(self, executor, outputs, returned):
        """Hold the call of `executor` that returned `outputs` (flat; as
        DataParallel returned them: `returned`) until its backward (the
        oldest beyond MAX_PENDING gives its executor up)."""
        call = Call(executor, outputs, returned=returned)
        with self._lock:
            executor.call = call
            self._calls.append(call)
            self.latest = call
            while len(self._calls) > MAX_PENDING:
                self._give_up(self._calls[0])

    def _give_up(self, call):
        """Release the executor to a later call: a backward reaching this
        call (or its followers) from now on raises."""
        self._calls.remove(call)
        self._latest_pending()
        call.release()
        call.executor = None                    # (only its outputs are checked)
        self._given_up.append(call)
        self._given_up.extend(call.followers)

    def _latest_pending(self):
        self.latest = self._calls[-1] if self._calls else None

    def give_up_oldest(self, held):
        """Make the oldest of the calls `held` (or of the calls they follow)
        give its executor up (memory.Arenas.find: every arena is busy)."""
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

    def follow(self, call, executor, outputs):
        """Make `outputs` of `executor` (a loss executor reading `call`'s
        outputs, writing the head gradients of those in its ``covered``;
        autograd variables already) pushed before `call`'s backward."""
        follower = Call(executor, outputs, executor.covered)
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
        :meth:`heads_only`, has just returned in this thread); returns
        whether no call waits now (:attr:`idle`)."""
        if self._calls or self._given_up:
            with _not_recording():
                self._serve(retain_graph, skipped)
        return not self._calls

    def _serve(self, retain_graph, skipped):
        with self._lock:
            # (heads_only serves pending calls only: MXNet's pass did this)
            if not skipped and any(any(c.take_fresh()) for c in list(self._given_up)):
                raise RuntimeError(REUSED)
            served = [(c, f) for c, f in ((c, c.served(skipped)) for c in self._calls)
                      if any(f)]
            if not retain_graph:
                for c, _ in served:
                    self._calls.remove(c)
                self._latest_pending()
        try:
            for i, (c, fresh) in enumerate(served):
                for head, f in zip(c.executor.head_grads, fresh):
                    if not f:               # an output the loss did not use
                        _gluon.zero(head)
                # Two calls of one backward (two losses): the later ones add.
                c.executor.backward(accumulate=i > 0)
            push_after_backward([c.executor for c, _ in served])
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
