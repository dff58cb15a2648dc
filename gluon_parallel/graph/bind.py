"""Bind a network: the arrays of one replicated graph's variables, for one
input signature, and its executor.

The executor's arguments are the parameters' own per-context arrays, its
gradient arrays the parameters' own (``grad_req`` as Gluon has it: write,
add, null), so the Trainer, kvstores, checkpoints and ``gp.step`` see
exactly the arrays they see in the per-replica path. Its inputs are rows
of the call's whole inputs (:class:`executor.Rows`) or one array per
replica (:class:`executor.Slices`).
"""
import functools

from mxnet import nd

from .. import _gluon
from ..links import crosses_link
from ..syncgraph import Param
from .executor import LINK_PIECE, Executor, ExecutorSpec, Trainable, bound_inputs

__all__ = ['bind_network']


def bind_network(replicated, ctx_list, params, inputs, record, sources, shared, size):
    """The Executor of a replicated network for one input signature.

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
    sources : tuple of Context, optional
        Where each whole input is, when every replica's inputs are rows of
        them (then the executor's forward takes the whole inputs).
    shared : Executor or None
        The executor whose memory it shares (memory.py), whole inputs
        included (:class:`executor.Rows`).
    size : int
        The elements of its inputs (memory.py).
    """
    sym = replicated.symbol
    feed = _ExecutorFeed(ctx_list, params, bound_inputs(inputs, sources, ctx_list, shared))
    args, aux, grads, reqs, trainable = {}, {}, {}, {}, []
    aux_names = set(sym.list_auxiliary_states())
    for name in sym.list_inputs():
        kind = replicated.variables[name]
        arr = kind.value(feed)
        if name in aux_names:
            aux[name] = arr
            continue
        args[name] = arr
        p = params[kind.param] if isinstance(kind, Param) else None
        if record and p is not None and p.grad_req != 'null':
            grads[name] = p.grad(arr.context)
            trainable.append(Trainable(arr, grads[name], p.grad_req))
            reqs[name] = p.grad_req
        else:
            reqs[name] = 'null'
    link = trainable and crosses_link(_gluon.param_trainers(params.values()))
    return Executor(ExecutorSpec(
        symbol=sym, ctx_list=ctx_list, args=args, grads=grads, reqs=reqs, aux=aux,
        num_outputs=replicated.num_outputs, inputs=feed.inputs, record=record, size=size,
        shared=shared, trainable=trainable,
        backward_piece=LINK_PIECE if link else None,
        # The parameters' array lists, gradients' too (gp.Trainer's buckets
        # replace them): their ids are part of the executor's key, so they
        # must live as long as it does (a freed list's id could match a
        # later list).
        keep=[(p.list_data(), _gluon.grad_arrays(p)) for p in params.values()],
        running=functools.partial(replicated.batchnorms.running_updates, ctx_list=ctx_list)))


class _ExecutorFeed:
    """The arrays a network executor binds to its graph's variables
    (syncgraph's input kinds, each with the replica it belongs to)."""

    def __init__(self, ctx_list, params, inputs):
        self.ctx_list, self.params, self.inputs = ctx_list, params, inputs

    def context(self, rank):
        return self.ctx_list[rank]

    def param(self, kind):
        return self.params[kind.param].data(self.ctx_list[kind.rank])

    def data(self, kind):
        return self.inputs.view(kind.rank, kind.index)

    def scratch(self, kind):
        return nd.zeros_like(self.params[kind.param].data(self.ctx_list[kind.rank]))

    def counts(self, kind):
        return kind.array(self.ctx_list[kind.rank])
