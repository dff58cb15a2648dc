"""Training helpers: parameter checks and broadcasting across devices."""
from mxnet import autograd

__all__ = ['check_params', 'broadcast_params']


def check_params(block, ctx_list):
    """Check that every parameter of `block` is ready for data-parallel use.

    Raises ValueError naming the parameter (and the context) when one is
    uninitialised, missing on a context of `ctx_list`, or on a context twice,
    or when one Parameter object appears under two names. A parameter kept
    on a single context on purpose (a large embedding that replicas read
    through) is allowed.

    Parameters
    ----------
    block : Block
    ctx_list : list of Context
    """
    ctx_list = list(ctx_list)
    if len(set(ctx_list)) != len(ctx_list):
        raise ValueError('ctx_list lists a context twice: %s' % ctx_list)
    seen = {}
    for name, p in block.collect_params().items():
        if id(p) in seen:
            raise ValueError('parameter %s is listed twice, also as %s' % (name, seen[id(p)]))
        seen[id(p)] = name
        if p._data is None and not p._deferred_init:
            raise ValueError('parameter %s is not initialized: call initialize(ctx=%s) first'
                             % (name, ctx_list))
        pctx = p.list_ctx()
        if len(set(pctx)) != len(pctx):
            raise ValueError('parameter %s is initialized on a context twice: %s' % (name, pctx))
        if len(pctx) == 1 and len(ctx_list) > 1:
            continue            # deliberately on one context; replicas read through
        missing = [c for c in ctx_list if c not in pctx]
        if missing:
            raise ValueError('parameter %s is not on context %s (it is on %s): initialize '
                             'the block with ctx=%s' % (name, missing[0], pctx, ctx_list))


def broadcast_params(block, root_ctx=None):
    """Copy every parameter's value (running statistics included) from
    `root_ctx` to all its other contexts.

    Parameters
    ----------
    block : Block
    root_ctx : Context, optional
        Default: each parameter's first context.
    """
    with autograd.pause():
        for name, p in block.collect_params().items():
            if p._data is None:
                continue
            ctxs = p.list_ctx()
            src = root_ctx if root_ctx is not None else ctxs[0]
            if src not in ctxs:
                raise ValueError('parameter %s is not on root context %s (it is on %s)'
                                 % (name, src, ctxs))
            value = p.data(src)
            for c, d in zip(ctxs, p.list_data()):
                if c != src:
                    value.copyto(d)
