"""Bridge: one executor call as one autograd node, and the order of calls.

The forward pass runs in the caller; autograd records one node from the
trainable parameters' arrays to the replicas' outputs. MXNet runs that
node's backward later, on its custom-operator thread, once the loss's
gradient is computed: there the executor's backward is pushed and its
gradient buffers are copied (or, for ``grad_req='add'``, added) into the
arrays autograd hands over, which are ordered before the Trainer's reads.

An executor's arrays hold one forward pass at a time, and a DataParallel
runs one call at a time (a :class:`Slot`), so a forward must not start
before the backward of the last recorded forward was pushed, or the two race
in the engine (the process dies). If that backward has not been pushed yet,
everything pushed so far is waited for (a requested backward has then been
pushed). A recorded forward whose backward still has not come (a metric
computed under ``autograd.record()`` with its outputs still in use, or
several forwards before one backward) keeps the slot: a predict call then
runs per replica, a recorded one raises (one backward through this call's
node and another recorded use of the same parameters, by a second executor
or per replica, hung in MXNet 1.9.1's engine: measured).
"""
import atexit
import threading

from mxnet import autograd, nd

from .. import _gluon

__all__ = ['Slot', 'run']

_WRITE, _INPLACE, _ADD = 1, 2, 3            # MXNet's OpReqType


@atexit.register
def _drain():
    """Let every requested backward run while Python can still run its
    callback: MXNet's own exit hook (registered earlier, so run later)
    waits for the engine with the interpreter half torn down, and a pending
    graph-mode backward then never runs (measured: the process hangs)."""
    nd.waitall()


class Slot(object):
    """The executors' memory of one DataParallel: one forward pass at a
    time, a recorded one until its backward was pushed."""

    def __init__(self):
        self.pending = None       # Event: the last call's forward/backward pushed
        self.lock = threading.Lock()

    def acquire(self):
        """True once the slot is free (waiting for the engine if the last
        recorded forward's backward was requested but not yet pushed);
        False if that backward has not come at all (a recorded forward
        whose outputs are still in use: the call runs per replica)."""
        with self.lock:
            if self.pending is not None and not self.pending.is_set():
                nd.waitall()            # pushes every requested backward
                if not self.pending.is_set():
                    return False
            # Taken until this call's forward is pushed, or, when it is
            # recorded, until its backward is (bridge.run sets it).
            self.pending = threading.Event()
            return True


def run(bound, slot, inputs, train, record, idle_ctx):
    """Run `bound` on every replica's inputs (flat lists of NDArrays), in
    `slot` (taken by Slot.acquire).

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
                    for (_, grad), dst, req in zip(bound.trainable, in_grads, reqs):
                        if req in (_WRITE, _INPLACE):
                            grad.copyto(dst)
                        elif req == _ADD:
                            nd.elemwise_add(dst, grad, out=dst)
                except BaseException:
                    # MXNet reports the failure where the gradients are read,
                    # but the Trainer's update still runs on the node's
                    # gradient arrays, unwritten pool memory (measured: NaN
                    # weights, sometimes). Zeros cost the step, not the model.
                    for dst, req in zip(in_grads, reqs):
                        if req in (_WRITE, _INPLACE):
                            dst[:] = 0
                    raise
                finally:
                    done.set()

            _gluon.record_function([t[0] for t in bound.trainable],
                                   [c for per in copies for c in per], backward, done.set)
            recorded = True
    finally:
        if not recorded:
            done.set()
    return copies
