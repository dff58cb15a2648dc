"""SyncBatchNorm synchronised across worker processes, in imperative mode.

A layer that :func:`gluon_parallel.dist.sync_batchnorm_across_workers`
connected to the kvstore merges its statistics through that connection
(``layer._cross_worker``, a ParallelState operation whose interface is:
every replica pushes ``([s1 | s2 | pivot], count)`` and receives ``[mean -
pivot | var | mean]``). Every replica computes the sums of its slice about
a pivot (one sample value per channel, so 1000 + N(0, 1) loses no digits in
float32), then applies ``(x - pivot) * scale + shift`` with BatchNorm's
fused kernel. Everything else about SyncBatchNorm runs through staged.py.
"""
import numpy as np
from mxnet import autograd, nd

from . import moments

__all__ = ['cross_worker_forward']


def _affine(x, gamma, beta, mean, var, axis):
    """(x - mean) / sqrt(var + 1e-5) * gamma + beta per channel in one fused
    pass; differentiable in x, gamma and beta (mean and var are constants)."""
    return nd.BatchNorm(x, gamma, beta, mean, var, eps=1e-5, fix_gamma=False,
                        use_global_stats=True, axis=axis)


def cross_worker_forward(layer, replica, x, gamma, beta, running_mean, running_var):
    """The layer's output for this replica's slice `x`; updates its running
    statistics (on every context of the model) when recording."""
    ndim = x.ndim
    axis = layer._axis % ndim
    channels = x.shape[axis]
    ctx = x.context
    dtype = moments.param_dtype(x.dtype)
    const = moments.const
    ones = const(('full', ctx, channels, 1.0, dtype),
                 lambda: nd.ones(channels, ctx=ctx, dtype=dtype))
    zeros = const(('full', ctx, channels, 0.0, dtype),
                  lambda: nd.zeros(channels, ctx=ctx, dtype=dtype))
    unit_var = const(('full', ctx, channels, 'unit', dtype),
                     lambda: nd.full(channels, moments.UNIT_VAR[dtype], ctx=ctx, dtype=dtype))
    # float16 or bfloat16 data is widened once: no 16-bit sums.
    xw = x if np.dtype(x.dtype) == dtype else nd.amp_cast(x, dtype=dtype)
    begin, end = [0] * ndim, [1] * ndim
    begin[axis] = end[axis] = None
    pivot = nd.slice(xw, begin=tuple(begin), end=tuple(end)).reshape((channels,)).detach()
    xs = _affine(xw, ones, zeros, pivot, unit_var, axis)
    if axis == 1 and 3 <= ndim <= 5:
        # MKL-DNN leaves its output in a blocked layout that the sums below
        # would convert on every read: convert once.
        xs = nd.reshape(xs, shape=x.shape)
    count = x.size // channels
    s12 = _sums(xs, axis)
    state = replica.next_state(layer, layer._cross_worker)
    merged = state.pull(state.push((nd.concat(s12, pivot, dim=0), count), replica.rank))
    if layer.check_finite and not np.isfinite(merged.asnumpy()).all():
        raise FloatingPointError('%s: the batch mean or variance is NaN or Inf: the input of '
                                 'this layer holds non-finite values' % layer.name)
    d, var, mean = nd.split(merged, num_outputs=3, axis=0)
    g = gamma if layer._scale else ones
    scale = g * nd.rsqrt(var + layer._epsilon)
    shift = beta - scale * d
    if dtype != 'float32':
        scale, shift = nd.cast(scale, dtype), nd.cast(shift, dtype)
    out = _affine(x, scale, shift, pivot, unit_var, axis)
    if autograd.is_recording():
        m = layer._momentum
        with autograd.pause():
            new = [nd.cast(r, dtype) for r in (running_mean * m + mean * (1 - m),
                                               running_var * m + var * (1 - m))]
            for c in [ctx] + (replica.call.idle_ctx if replica.rank == 0 else []):
                if c in layer.running_mean.list_ctx():
                    new[0].copyto(layer.running_mean.data(c))
                    new[1].copyto(layer.running_var.data(c))
    return out


def _sums(x, axis):
    """[sum of x | sum of x^2] per channel over this slice, as matrix-vector
    products (dot, not FullyConnected: AMP runs the latter in 16 bits, and
    widens dot's inputs to the widest instead)."""
    shape = x.shape
    channels = shape[axis]
    pre, post = int(np.prod(shape[:axis])), int(np.prod(shape[axis + 1:]))
    ctx, dtype = x.context, x.dtype
    ones_pre = moments.const(('full', ctx, pre, 1.0, dtype),
                             lambda: nd.ones(pre, ctx=ctx, dtype=dtype))
    if post == 1:
        x2 = x.reshape((pre, channels))
        return nd.concat(nd.dot(ones_pre, x2), nd.dot(ones_pre, nd.square(x2)), dim=0)
    ones_post = moments.const(('full', ctx, post, 1.0, dtype),
                              lambda: nd.ones(post, ctx=ctx, dtype=dtype))
    x2 = x.reshape((pre * channels, post))
    s1 = nd.dot(ones_pre, nd.dot(x2, ones_post).reshape((pre, channels)))
    s2 = nd.dot(ones_pre, nd.dot(nd.square(x2), ones_post).reshape((pre, channels)))
    return nd.concat(s1, s2, dim=0)
