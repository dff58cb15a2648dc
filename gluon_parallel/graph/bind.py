"""Bind: one executor of the replicated graph for one input signature.

The executor's arguments are the parameters' own per-context arrays, its
gradient arrays the parameters' own (``grad_req`` as Gluon has it: write,
add, null), so the Trainer, kvstores, checkpoints and ``gp.step`` see
exactly the arrays they see in the per-replica path. Its backward is pushed
in the caller's thread right after autograd's (bridge.py), so it is
ordered before the Trainer's reads like any gradient of Gluon's.
"""
import itertools

from mxnet import nd

from .. import _gluon
from ..syncgraph import Param, write_running
from .replicate import GROUP

__all__ = ['Bound', 'signature_of']


class Bound:
    """The executor of one signature, with its inputs and outputs.

    Parameters
    ----------
    replicated : replicate.Replicated
    ctx_list : list of Context
        One per replica.
    params : dict
        Parameter name -> Parameter.
    inputs : list of list of (shape, dtype)
        Every replica's data inputs.
    record : bool
        Gradients are wanted: trainable parameters bind their gradients.

    Attributes
    ----------
    call : bridge.Call or None
        The recorded call whose backward may still come (the executor's
        arrays hold its forward pass).
    """

    def __init__(self, replicated, ctx_list, params, inputs, record):
        self.replicated = rep = replicated
        self.ctx_list = ctx_list
        # The parameters' array lists: their ids are part of the cache key.
        self.keep = [p.list_data() for p in params.values()]
        sym = rep.symbol
        args, aux, grads, req = {}, {}, {}, {}
        self.data = [[None] * len(inputs[0]) for _ in inputs]
        self.trainable = []                 # (parameter's array, its gradient, grad_req)
        self.call = None
        aux_names = set(sym.list_auxiliary_states())
        feed = _Feed(self, params, inputs)
        for name in sym.list_inputs():
            kind = rep.variables[name]
            arr = kind.value(feed)
            p = params[kind.param] if isinstance(kind, Param) else None
            if record and p is not None and p.grad_req != 'null' and name not in aux_names:
                grads[name] = p.grad(arr.context)
                self.trainable.append((arr, grads[name], p.grad_req))
                req[name] = p.grad_req
            elif name not in aux_names:
                req[name] = 'null'
            (aux if name in aux_names else args)[name] = arr
        self.trained = [t[0] for t in self.trainable]
        group2ctx = {GROUP % r: c for r, c in enumerate(ctx_list)}
        self.executor = sym.bind(ctx_list[0], args, args_grad=grads, grad_req=req,
                                 aux_states=aux, group2ctx=group2ctx)
        n, k = len(ctx_list), rep.num_outputs
        outs = self.executor.outputs
        self.outputs = [outs[r * k:(r + 1) * k] for r in range(n)]
        self.running = [None] * n
        extra = iter(outs[n * k:])
        for r in range(n):
            if rep.running[r]:
                self.running[r] = (next(extra), [p.shape[0] for p in rep.running[r]])
        # Head gradients: the replicas' outputs' (bridge.py has autograd
        # write them), then the running-statistics outputs' (never used).
        self.heads = [nd.zeros(o.shape, ctx=o.context, dtype=o.dtype) for o in outs[:n * k]] \
            if record else None
        self.zero_heads = [nd.zeros(o.shape, ctx=o.context, dtype=o.dtype) for o in outs[n * k:]]

    def forward(self, args_list, train):
        """Copy every replica's inputs into the bound arrays and push the
        forward pass; returns the outputs (the executor's own arrays).

        Waits until the previous forward pass of this executor has run:
        MXNet's engine has no back-pressure, and a loop that never reads a
        value would otherwise queue steps without bound (memory, and a
        Ctrl-C that waits for all of them); the caller stays one step ahead
        of the devices, as with the per-replica path's arrays."""
        self.outputs[0][0].wait_to_read()
        dsts = getattr(self, '_dsts', None)
        if dsts is None:        # (an input the graph does not read has no array)
            flat = list(itertools.chain.from_iterable(self.data))
            self._used = [d is not None for d in flat]
            dsts = self._dsts = [d for d in flat if d is not None]
        _gluon.copy_into(itertools.compress(itertools.chain.from_iterable(args_list), self._used),
                         dsts)
        _gluon.executor_forward(self.executor, train)
        return self.outputs

    def store_running(self, idle_ctx):
        """Write every replica's new running statistics into the parameters
        on its context, and replica 0's SyncBatchNorm statistics into the
        contexts idle in the call (a BatchNorm's are per device: an idle
        device keeps its own, as in the per-replica path)."""
        writes = getattr(self, '_writes', None)
        if writes is None:      # the same arrays every call: prepared once
            groups = {}         # split sizes -> (one op per replica, their parameters)
            for r, run in enumerate(self.running):
                if run is not None:
                    op, split = _gluon.prepared_split(run[0], run[1], [
                        p.data(self.ctx_list[r]) for p in self.replicated.running[r]])
                    groups.setdefault(tuple(run[1]), ([], split))[0].append(op)
            writes = self._writes = list(groups.values())
        for ops, split in writes:
            _gluon.invoke(ops, split)
        if idle_ctx and self.running[0] is not None:
            out, sizes = self.running[0]
            params = self.replicated.running[0]
            k = self.replicated.synced
            if k < len(params):
                write_running(out[sum(sizes[:k]):] if k else out, params[k:], idle_ctx)

    def backward(self, accumulate=False):
        """Push the backward pass for the head gradients in ``heads`` and
        mark the gradients fresh for the Trainer. `accumulate`: add to the
        gradients this backward pass wrote already (a second call of one
        pass) instead of replacing them."""
        kept = [(g, _gluon.copy(g)) for _, g, req in self.trainable if req == 'write'] \
            if accumulate else ()
        self.executor.backward(self.heads + self.zero_heads)
        for g, old in kept:
            _gluon.add_into(g, old)
        _gluon.mark_grads_fresh(self.trained)


class _Feed:
    """The arrays a Bound binds to its graph's variables (syncgraph's
    input kinds, each with the replica it belongs to)."""

    def __init__(self, bound, params, inputs):
        self.bound, self.params, self.inputs = bound, params, inputs

    def context(self, rank):
        return self.bound.ctx_list[rank]

    def param(self, kind):
        return self.params[kind.param].data(self.context(kind.rank))

    def data(self, kind):
        shape, dtype = self.inputs[kind.rank][kind.index]
        arr = self.bound.data[kind.rank][kind.index] = nd.empty(
            shape, ctx=self.context(kind.rank), dtype=dtype)
        return arr

    def scratch(self, kind):
        return nd.zeros_like(self.params[kind.param].data(self.context(kind.rank)))

    def counts(self, kind):
        return kind.array(self.context(kind.rank))


def signature_of(args_list):
    """The shapes and dtypes of every replica's inputs."""
    return _gluon.signature(args_list)
