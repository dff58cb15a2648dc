"""Parameters across devices: the checks DataParallel relies on, and the
values of replicated parameters (broadcast, running-statistics average, one
value to save).

The one rule for a parameter deliberately kept on a single context (a
HostEmbedding table, which replicas read through) is
:func:`gluon_parallel.nn.embedding.is_pinned`; every other parameter has a
copy on every device of a parallel call.
"""
import warnings

import numpy as np
import mxnet as mx
from mxnet import autograd, nd

from . import _gluon
from .nn.embedding import is_pinned

__all__ = ['check_params', 'broadcast_params', 'sync_running_stats']

_WRAPPERS = []


def register_wrapper(cls):
    """Let :func:`unwrap` see through instances of `cls` (a Block holding
    the model as ``.block``, as DataParallel does)."""
    _WRAPPERS.append(cls)
    return cls


def unwrap(block):
    """The model inside a DataParallel, whose own parameter names carry a
    ``_block.`` prefix that a plain model would not recognise."""
    while isinstance(block, tuple(_WRAPPERS)):
        block = block.block
    return block


def check_params(block, ctx_list):
    """Check that every parameter of `block` is ready for data-parallel use.

    Raises ValueError naming the parameter (and the context) when one is
    uninitialised, missing on a context of `ctx_list`, or on a context twice,
    or when one Parameter object appears under two names. Deferred
    initialisation counts as initialised on the contexts it was given, so
    this runs before any forward pass; an initialised parameter whose shape
    MXNet left unset (a SymbolBlock's, loaded) takes its arrays'. A
    parameter kept on one context on
    purpose (:func:`~gluon_parallel.nn.embedding.is_pinned`: a HostEmbedding
    table, which replicas read through) is allowed; any other parameter on
    fewer contexts than `ctx_list` is an error.

    Parameters
    ----------
    block : Block
    ctx_list : list of Context
    """
    ctx_list = list(ctx_list)
    if len(set(ctx_list)) != len(ctx_list):
        raise ValueError(f'ctx_list lists a context twice: {ctx_list}')
    seen = {}
    for name, p in block.collect_params().items():
        if id(p) in seen:
            raise ValueError(f'parameter {name} is listed twice, also as {seen[id(p)]}')
        seen[id(p)] = name
        if not _gluon.has_data(p) and not _gluon.is_deferred(p):
            raise ValueError(f'parameter {name} is not initialized: call '
                             f'initialize(ctx={ctx_list}) first')
        _settle_shape(p)
        pctx = p.list_ctx()
        if len(set(pctx)) != len(pctx):
            raise ValueError(f'parameter {name} is initialized on a context twice: {pctx}')
        if is_pinned(p):
            continue            # replicas read through it from their own devices
        missing = [c for c in ctx_list if c not in pctx]
        if missing:
            raise ValueError(f'parameter {name} is not on context {missing[0]} (it is on {pctx}): '
                             f'initialize the block with ctx={ctx_list}')


def _settle_shape(p):
    """Give an initialised parameter whose shape is unset the shape of its
    arrays. MXNet 1.9.1 leaves it None on a SymbolBlock's parameters after
    ``load_parameters`` (their shapes come from the file), and graph mode
    reads shapes from the parameters (channels, sizes)."""
    if _gluon.has_data(p) and (p.shape is None or 0 in p.shape):
        p.shape = p.list_data()[0].shape


def broadcast_params(block, root_ctx=None):
    """Copy every parameter's value (running statistics included) from
    `root_ctx` to all its other contexts.

    Parameters
    ----------
    block : Block
        The model (a DataParallel is unwrapped).
    root_ctx : Context, optional
        Default: each parameter's first context.
    """
    with autograd.pause():
        for name, p in unwrap(block).collect_params().items():
            if not _gluon.has_data(p):
                continue
            ctxs = p.list_ctx()
            src = root_ctx if root_ctx is not None else ctxs[0]
            if src not in ctxs:
                if is_pinned(p):
                    continue        # one copy only: nothing to broadcast
                raise ValueError(f'parameter {name} is not on root context {src} (it is on {ctxs})')
            value = p.data(src)
            for c, d in zip(ctxs, p.list_data()):
                if c != src:
                    value.copyto(d)


def settle():
    """Wait for every operation MXNet has been given, before a parameter's
    value is read on the host.

    Waiting for the parameter's own pending writes (what ``asnumpy`` and
    ``nd.save`` do) is not enough in MXNet 1.9.1 with MKL-DNN: a
    convolution in a predict-mode forward reorders its weight to its own
    layout in place, in an operation the running convolution pushes
    itself, so a read can start before that write exists and overlap it.
    Measured right after such a forward: the read raised "We can't generate
    TBlob for MKLDNN data", or returned a scrambled weight
    (tests/predict_race.py). Likewise a ``static_shape`` CachedOp's
    BatchNorm backward writes the running statistics without the engine
    knowing: read right after a step, they were those from before it
    (measured under bfloat16 AMP; tests/amp_loop.py). ``nd.waitall`` also
    waits for operations pushed while it waits.
    """
    nd.waitall()


def _copies(p):
    return [d.asnumpy() for d in p.list_data()]


def _differs(copies):
    return any(not np.array_equal(copies[0], c) for c in copies[1:])


def _mean(copies):
    return np.mean(np.stack(copies), axis=0, dtype=np.float64).astype(copies[0].dtype)


def sync_running_stats(block):
    """Average, over its contexts, every replicated parameter that gets no
    gradient (``grad_req='null'``: BatchNorm running mean and variance,
    frozen layers) wherever the copies differ, in place.

    A plain ``gluon.nn.BatchNorm`` inside DataParallel updates its running
    statistics from its own device's slice, so the copies drift apart (a
    SyncBatchNorm keeps them identical and needs none of this). Call this
    before evaluating on several devices; :func:`save_checkpoint` calls it,
    so a saved model, and the one that keeps training after the save, hold
    the same statistics on every device. With equal slices, the average of
    the per-device running means is the running mean of the whole batches,
    but the average of the running variances misses the spread between
    slices: use SyncBatchNorm when exact statistics matter.

    Parameters
    ----------
    block : Block

    Returns
    -------
    list of str
        Structural names (as in ``save_parameters``) of the parameters whose
        copies differed, and were averaged.
    """
    changed, seen = [], set()
    settle()
    with autograd.pause():
        for name, p in _gluon.structural_params(unwrap(block)).items():
            if id(p) in seen or p.grad_req != 'null' or not _gluon.has_data(p) \
                    or len(p.list_ctx()) < 2 or _gluon.is_row_sparse(p):
                continue
            seen.add(id(p))
            copies = _copies(p)
            if _differs(copies):
                value = _mean(copies)
                for d in p.list_data():
                    d[:] = value
                changed.append(name)
    return changed


def param_value(name, p):
    """One CPU copy of `p`'s value, read after :func:`settle`: that of its
    first context, exactly, when the copies agree, else their average (as
    Gluon's save_parameters does), with a warning for a trained parameter,
    whose copies never differ in a correct data-parallel loop."""
    if _gluon.is_row_sparse(p):
        return _gluon.reduced_value(p)      # the trainer's kvstore holds it
    datas = p.list_data()
    if len(datas) == 1:         # e.g. a large table on one context: no extra copy
        return datas[0] if datas[0].context.device_type == 'cpu' else datas[0].copyto(mx.cpu())
    copies = _copies(p)
    if not _differs(copies):
        return datas[0].copyto(mx.cpu())
    if p.grad_req != 'null':
        dev = max(float(np.max(np.abs(c.astype(np.float64) - copies[0]))) for c in copies[1:])
        warnings.warn(f'parameter {name} differs between its contexts {p.list_ctx()} (by up to '
                      f'{dev:g}): saving '
                      'the average. Something wrote to one copy only', RuntimeWarning, stacklevel=3)
    value = _mean(copies)
    return nd.array(value, ctx=mx.cpu(), dtype=value.dtype)
