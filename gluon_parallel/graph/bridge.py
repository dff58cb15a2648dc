"""Bridge: one executor call as one autograd node, and the order of calls.

The forward pass runs in the caller; autograd records one node from the
trainable parameters' arrays to the replicas' outputs. MXNet runs that
node's backward later, on its custom-operator thread, once the loss's
gradient is computed: there the executor's backward is pushed and its
gradient buffers are copied (or, for ``grad_req='add'``, added) into the
arrays autograd hands over, which are ordered before the Trainer's reads.

An executor's arrays hold one forward pass at a time, so a forward must not
start on an executor (or one sharing its memory: a :class:`Slot`) before the
backward of the slot's last recorded forward was pushed, or the two race in
the engine (the process dies). If that backward has not been pushed yet,
everything pushed so far is waited for (a requested backward has then been
pushed); a recorded forward whose backward still has not come (a metric
computed under ``autograd.record()``, or several forwards before one
backward) keeps its slot, and the call takes another, up to a bound.
"""
import atexit
import threading

from mxnet import autograd, nd

from .. import _gluon

__all__ = ['Slot', 'Slots', 'run']

_WRITE, _INPLACE, _ADD = 1, 2, 3            # MXNet's OpReqType


@atexit.register
def _drain():
    """Let every requested backward run while Python can still run its
    callback: MXNet's own exit hook (registered earlier, so run later)
    waits for the engine with the interpreter half torn down, and a pending
    graph-mode backward then never runs (measured: the process hangs)."""
    nd.waitall()


class Slot(object):
    """Memory that one forward pass at a time may use."""

    def __init__(self):
        self.base = None          # the first Bound of the slot (its memory)
        self.pending = None       # Event: the last recorded forward's backward pushed

    def free(self):
        return self.pending is None or self.pending.is_set()



class Slots(object):
    """The slots of one DataParallel.

    Parameters
    ----------
    limit : int
        Recorded forward passes that may wait for their backward at once.
    """

    def __init__(self, limit=4):
        self.slots = []
        self.limit = limit
        self.lock = threading.Lock()

    def acquire(self):
        """A free slot (waiting for the engine if every slot is taken)."""
        with self.lock:
            slot = self._first_free()
            if slot is None and self.slots:
                nd.waitall()            # pushes every requested backward
                slot = self._first_free()
            if slot is None:
                if len(self.slots) >= self.limit:
                    raise RuntimeError(
                        'graph mode: %d recorded forward passes still wait for their backward '
                        'pass; call backward on them (or leave autograd.record() for '
                        'forward passes that need none) before recording more' % self.limit)
                slot = Slot()
                self.slots.append(slot)
            # Taken until this call's forward is pushed, or, when it is
            # recorded, until its backward is (bridge.run sets it).
            slot.pending = threading.Event()
            return slot

    def _first_free(self):
        for slot in self.slots:
            if slot.free():
                return slot
        return None


def run(bound, slot, inputs, train, record, idle_ctx):
    """Run `bound` on every replica's inputs (flat lists of NDArrays), in
    `slot` (taken by Slots.acquire).

    Returns
    -------
    list of list of NDArray
        Each replica's outputs, new arrays (the executor's own are reused
        by its next call), recorded by autograd when `record`.
    """
    done, recorded = slot.pending, False
    try:
        with autograd.pause(train_mode=train):
            outs = bound.forward(inputs, train)
            if train:
                bound.store_running(idle_ctx)
            copies = [[o.copy() for o in per] for per in outs]
        if record and bound.trainable:
            def backward(out_grads, in_grads, reqs):
                try:
                    bound.backward(out_grads)
                    for (_, _, grad), dst, req in zip(bound.trainable, in_grads, reqs):
                        if req in (_WRITE, _INPLACE):
                            grad.copyto(dst)
                        elif req == _ADD:
                            nd.elemwise_add(dst, grad, out=dst)
                finally:
                    done.set()

            _gluon.record_function([t[0] for t in bound.trainable],
                                   [c for per in copies for c in per], backward, done.set)
            recorded = True
    finally:
        if not recorded:
            done.set()
    return copies
