"""One executor of a replicated graph: a network's or a loss's, the same
lifecycle for both.

bind (from an ExecutorSpec its builder makes: bind.py for networks,
loss_executor.py for losses; memory of its own, or shared with a base
executor, memory.py) -> forward (copy the call's inputs in, push) -> the
outputs handed out as new arrays -> backward (for the head gradients
autograd wrote) -> the running statistics of the forward pass it holds.

Its arguments are arrays owned elsewhere (the parameters' own arrays and
gradient arrays, a network executor's outputs and head gradients), so the
Trainer, kvstores and checkpoints see what they see in the per-replica
path.
"""
import itertools
import math
import os
from typing import NamedTuple

import mxnet as mx
import numpy as np
from mxnet import nd

from .. import _gluon

__all__ = ['Executor', 'ExecutorSpec', 'Trainable', 'Rows', 'Slices', 'GROUP', 'LINK_PIECE',
           'bound_inputs', 'elements', 'mkldnn_cpu']

#: Replica r's operators run on device group ``GROUP % r``.
GROUP = 'dev%d'
#: Where the gradients' reduction crosses a link, each replica's backward
#: runs as engine operations of at most this many operators (MXNet's own
#: default, what Module's executors run): a gradient bucket's push or
#: all-reduce starts as soon as the piece that writes its last gradient
#: has run, not after the whole backward. Elsewhere one operation per
#: replica (fewer engine operations: nothing to hide).
LINK_PIECE = 15


class Trainable(NamedTuple):
    """A gradient an executor's backward writes: the parameter's array on
    one context, its gradient array there, its grad_req."""
    array: object
    grad: object
    req: str


class ExecutorSpec(NamedTuple):
    """What an :class:`Executor` is bound from (bind.py's ``bind_network``
    for a network, loss_executor.py's ``bind_loss`` for a loss).

    Attributes
    ----------
    symbol : Symbol
        Every replica's outputs (`num_outputs` each, in replica order), then
        outputs nobody differentiates (a network's batch statistics).
    ctx_list : list of Context
        One per replica: device group ``GROUP % r`` runs on ``ctx_list[r]``.
    args, grads, reqs, aux : dict
        Variable name -> array to bind, gradient array, ``grad_req``,
        auxiliary state (as ``Symbol.bind`` takes them).
    num_outputs : int
        Outputs of one replica.
    inputs : Rows or Slices
        The bound arrays each call's inputs are copied into.
    record : bool
        Gradients are wanted: the replicas' outputs get head gradients.
    size : int
        What orders the executors sharing memory (memory.py): the elements
        of the arrays it is bound to besides the parameters.
    shared : Executor or None
        Bind with its memory (MXNet's ``shared_exec``: its internal arrays
        are reused, what it lacks is added to its memory pool).
    trainable : list of Trainable
        Every gradient this executor's backward writes (marked fresh for
        the Trainer).
    covered : set of int
        A loss executor's: the outputs (flat index) of the network executor
        it reads whose head gradients its backward writes.
    backward_piece : int or None
        Each replica's backward as engine operations of at most this many
        operators (:data:`LINK_PIECE`), not one.
    keep : object
        What must live as long as the executor (bind.py: the lists whose
        ids are in its key).
    running : callable or None
        Makes the running-statistics updates its forward passes feed
        (``syncgraph.in_graph.MomentumUpdates``, or None) from the bound
        outputs after every replica's own (a network's batch statistics).
    """
    symbol: object
    ctx_list: list
    args: dict
    grads: dict
    reqs: dict
    aux: dict
    num_outputs: int
    inputs: object
    record: bool
    size: int
    shared: object = None
    trainable: tuple = ()
    covered: frozenset = frozenset()
    backward_piece: int | None = None
    keep: object = ()
    running: object = None


class Executor:
    """A bound multi-device executor, with its inputs, outputs and head
    gradients, made complete from an :class:`ExecutorSpec`.

    Parameters
    ----------
    spec : ExecutorSpec
        What it binds, and what it keeps (nothing is set on it afterwards;
        :meth:`when_closed` registers a callback).

    Attributes
    ----------
    bound : mxnet.executor.Executor
        MXNet's executor of every replica's graph.
    running : syncgraph.in_graph.MomentumUpdates or None
        The running-statistics updates its forward pass feeds (a network
        executor's), pushed after the call's backward (calls.py).
    call : calls.Call or None
        The recorded call whose backward may still come: the executor holds
        its forward pass (and with it, the memory it shares).
    """

    def __init__(self, spec):
        ctx_list = spec.ctx_list
        self.symbol, self.ctx_list = spec.symbol, ctx_list
        self.inputs = spec.inputs
        self.trainable = list(spec.trainable)
        self.trained = [t.array for t in self.trainable]
        self.covered = spec.covered
        self.call = None
        self.keep = spec.keep
        self.size = spec.size
        self._on_close = []
        group2ctx = {GROUP % r: c for r, c in enumerate(ctx_list)}
        shared = None if spec.shared is None else spec.shared.bound
        with _gluon.quiet_bind(), _gluon.exact_size_plan(mkldnn_cpu(ctx_list)):
            self.bound = _gluon.bind_replicas(spec.symbol, len(ctx_list), lambda: spec.symbol.bind(
                ctx_list[0], spec.args, args_grad=spec.grads, grad_req=spec.reqs,
                aux_states=spec.aux, group2ctx=group2ctx, shared_exec=shared),
                spec.backward_piece)
        _gluon.share_symbol(self.bound, spec.symbol)
        outs = self.bound.outputs
        n, k = len(ctx_list), spec.num_outputs
        #: Every replica's outputs (the executor's own arrays, overwritten
        #: by its next forward pass).
        self.outputs = [outs[r * k:(r + 1) * k] for r in range(n)]
        #: Every replica's outputs as new arrays (what a call returns).
        self.copy_outputs = _gluon.Copier(outs[:n * k])
        #: Head gradients of the replicas' outputs (autograd writes them),
        #: then the undifferentiated outputs' zeros.
        self.head_grads = [_zeros_like(o) for o in outs[:n * k]] if spec.record else None
        self._all_head_grads = None if not spec.record else \
            self.head_grads + [_zeros_like(o) for o in outs[n * k:]]
        #: Makes the returned outputs autograd variables of ``head_grads``.
        self.mark_outputs = _gluon.VariableMarker(self.head_grads) if spec.record else None
        self._fill_ones = None
        self.running = None if spec.running is None else spec.running(outs[n * k:])
        #: The forward pass it holds: in training mode, and the contexts
        #: without rows in its call (they take its synchronised running
        #: statistics).
        self.train, self.idle_ctx = False, ()

    def forward(self, inputs, train, idle_ctx=()):
        """Copy a call's `inputs` in (what ``self.inputs.copy_in`` takes)
        and push the forward pass; returns every replica's outputs (the
        executor's own arrays). `idle_ctx`: the contexts without rows in
        the call (they take its synchronised running statistics).

        Waits until the executor's previous forward pass has run: MXNet's
        engine has no back-pressure, and a loop that never reads a value
        would otherwise queue steps without bound (memory, and a Ctrl-C
        that waits for all of them); the caller stays one step ahead of the
        devices, as with the per-replica path's arrays."""
        self.outputs[0][0].wait_to_read()
        self.inputs.copy_in(inputs)
        _gluon.executor_forward(self.bound, train)
        self.train, self.idle_ctx = train, idle_ctx
        return self.outputs

    def backward(self, accumulate=False):
        """Push the backward pass for the head gradients in ``head_grads``.
        `accumulate`: add to the gradients an earlier call of this backward
        pass wrote (two calls, one loss) instead of replacing them."""
        kept = [(t.grad, _gluon.copy(t.grad)) for t in self.trainable if t.req == 'write'] \
            if accumulate else ()
        self.bound.backward(self._all_head_grads)
        for g, old in kept:
            _gluon.add_into(g, old)
        if self.trained:
            _gluon.mark_grads_fresh(self.trained)

    def when_closed(self, callback):
        """Call `callback()` when the executor is dropped (a loss executor
        bound to this one's outputs is dropped with it)."""
        self._on_close.append(callback)

    def close(self):
        """The executor is dropped by its arena (a call holding it keeps
        using it): tell those bound to it."""
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()

    @property
    def fill_ones(self):
        """A prepared ``ones_like`` into each of ``head_grads``: what MXNet's
        backward pass writes into a head's gradient when given none
        (calls.RecordedCalls.heads_only)."""
        if self._fill_ones is None:
            self._fill_ones = [_gluon.prepared_op('ones_like', [h], [h]) for h in self.head_grads]
        return self._fill_ones


def mkldnn_cpu(ctx_list):
    """Whether MXNet runs MKL-DNN kernels on some of these contexts: CPU
    contexts, a build with MKL-DNN, not disabled by MXNET_MKLDNN_ENABLED=0
    (read once per process by MXNet)."""
    if not any(c.device_type == 'cpu' for c in ctx_list):
        return False
    if os.environ.get('MXNET_MKLDNN_ENABLED', '1') == '0':
        return False
    return mx.runtime.Features().is_enabled('MKLDNN')


def _zeros_like(arr):
    return nd.zeros(arr.shape, ctx=arr.context, dtype=arr.dtype)


def elements(signature):
    """Elements of the arrays of a signature (every replica's (shape,
    dtype) of each input)."""
    return sum(math.prod(shape) for per in signature for shape, _ in per)


def bound_inputs(sig, sources, ctx_list, shared=None):
    """What an executor's inputs are bound to: every replica's `sig` as
    :class:`Rows` of the whole inputs on `sources` (sharing the inputs of
    `shared`, the executor whose memory it shares) or, without `sources`,
    :class:`Slices` on `ctx_list`."""
    if sources:
        return Rows(sig, sources, shared and shared.inputs)
    return Slices(sig, ctx_list)


class Rows:
    """An executor's inputs as rows of whole arrays: input k of every
    replica is a view of one array on `sources[k]` (the caller's batch's
    context), its rows in replica order. A call copies each whole input
    in once, not once per replica; the executor copies each replica's rows
    to its device itself (MXNet 1.9.1: a bound variable lives where its
    array does, and the executor inserts the cross-device copy to its
    consumers).

    Parameters
    ----------
    inputs : list of list of (shape, dtype)
        Every replica's inputs; input k's shapes differ in their rows only.
    sources : tuple of Context
        Where each whole input is.
    shared : Rows, optional
        The inputs of the executor whose memory this one's shares
        (memory.py): each whole input is a view of the first elements of
        its array where that is as large, on the same context, of the same
        type (as BucketingModule reshapes its largest bucket's input
        arrays). The executors of one arena never hold two calls at once,
        and MXNet's engine orders the writes and reads of views of one
        array, so a call's inputs are never overwritten while read.
    """

    def __init__(self, inputs, sources, shared=None):
        self.whole, self.views = [], []
        for k, ctx in enumerate(sources):
            rows = [per[k][0][0] for per in inputs]
            shape, dtype = inputs[0][k]
            shape = (sum(rows),) + tuple(shape[1:])
            arr = _view_of(shared.whole[k], shape, ctx, dtype) \
                if isinstance(shared, Rows) and k < len(shared.whole) else None
            if arr is None:
                arr = nd.empty(shape, ctx=ctx, dtype=dtype)
            self.whole.append(arr)
            self.views.append(_gluon.row_slices(arr, rows))
        self.used = [False] * len(sources)

    def view(self, rank, index):
        """Replica `rank`'s input `index` (bound: from now on copied in)."""
        self.used[index] = True
        return self.views[index][rank]

    def copy_in(self, whole):
        """Copy the whole inputs the graph reads into their arrays."""
        _gluon.copy_into(itertools.compress(whole, self.used),
                         itertools.compress(self.whole, self.used))


def _view_of(arr, shape, ctx, dtype):
    """`shape`'s view of the first elements of `arr`, or None where `arr`
    is smaller, elsewhere or of another type."""
    count = math.prod(shape)
    if arr.context != ctx or np.dtype(arr.dtype) != np.dtype(dtype) or arr.size < count:
        return None
    return arr.reshape((-1,))[:count].reshape(shape)


class Slices:
    """An executor's inputs as one array per replica and input, on the
    replica's device: a call copies every replica's slices in.

    Parameters
    ----------
    inputs : list of list of (shape, dtype)
        Every replica's inputs.
    ctx_list : list of Context
        Replica r's arrays are on ``ctx_list[r]``.
    """

    def __init__(self, inputs, ctx_list):
        self.inputs, self.ctx_list = inputs, ctx_list
        self.arrays = [[None] * len(per) for per in inputs]
        self._used = self._dsts = None

    def view(self, rank, index):
        """Replica `rank`'s array of input `index`, made when bound (an
        input the graph does not read has none)."""
        shape, dtype = self.inputs[rank][index]
        arr = self.arrays[rank][index] = nd.empty(shape, ctx=self.ctx_list[rank], dtype=dtype)
        return arr

    def copy_in(self, args_list):
        """Copy every replica's inputs (`args_list`: a flat list of arrays
        per replica) into the arrays bound."""
        if self._dsts is None:
            flat = list(itertools.chain.from_iterable(self.arrays))
            self._used = [a is not None for a in flat]
            self._dsts = [a for a in flat if a is not None]
        _gluon.copy_into(itertools.compress(itertools.chain.from_iterable(args_list),
                                            self._used), self._dsts)
