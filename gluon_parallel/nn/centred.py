"""SyncBatchNorm's arithmetic in one graph across devices (graph mode):
the centred sums each replica sends, and the affine map it applies once
the merged statistics come back (``moments.merge`` in between).

Graph mode cannot give BatchNorm's kernel the pivot as its mean, as the
staged graphs do (a mutable input downstream of a cross-device copy cannot
be placed), so the data is centred first; on CPU contexts with the optional
kernels (nn/kernels) the kernels take x itself and subtract the pivot in
float64.
"""
from . import moments

__all__ = ['fused', 'centred_sums', 'centred_affine']


def fused(layer, cpu):
    """Whether a graph across devices computes the layer with the kernels:
    every device a CPU context (they are CPU operators), data of a dtype
    they take, channels on an axis that reshaping brings second."""
    return (cpu and moments.KERNEL is not None and moments.AFFINE is not None
            and layer.dtype in ('float16', 'float32', 'float64')
            and layer.axis in (1, layer.ndim - 1))


def centred_sums(g, x, layer, cpu=False):
    """Entries (d, S1, S2, q, pivot) for a graph spanning devices: the
    per-channel sums of x - pivot and of its square (pivot: x's first
    sample per channel, no gradient), the pivot as q and as pivot, all in
    the parameters' dtype, and d, what :func:`centred_affine` takes.

    With `cpu` (every device a CPU context) and the kernels loaded, the
    kernel sums x - pivot in one pass each way, in float64, and d is x:
    the affine kernel subtracts the pivot itself, in float64 (MXNet's
    ``sum`` over the batch and spatial axes was most of the graph's
    SyncBatchNorm time; the centring, a broadcast operator each way, and
    BatchNorm's kernel for the affine map were the rest of what a fused
    BatchNorm does not pay). Otherwise d = x - pivot (one broadcast operator
    in x's dtype), summed by MXNet's operators; graph mode runs
    SyncBatchNorm on CPU contexts only with MKL-DNN off, so the float64
    caveat below does not arise there.

    Sums of centred data lose about one digit to the merge's cancellation
    (two for a pivot far out in the tail), so float32 ones are about as
    accurate as float32 BatchNorm's own statistics. Graphs spanning CPU
    contexts keep float64 away from float32 data: MKL-DNN (MXNet 1.9.1)
    leaves its layout on pooled executor memory that a later float64 array
    may reuse, and MKL-DNN-capable operators (FullyConnected, Concat, add_n,
    cross-device copies) then fail on it. Either way the statistics are
    those of exactly the values normalised (x - pivot, exact in float64; or
    d itself).
    """
    acc = layer.param_dtype
    if fused(layer, cpu):
        c = layer.channels
        out = g.op(moments.KERNEL, moments.widen(g, x, layer))    # [S1 | S2 | q], float64
        s1, s2, q = [g.slice_axis(out, 0, k * c, (k + 1) * c) for k in range(3)]
        if acc != 'float64':
            s1, s2, q = g.cast(s1, acc), g.cast(s2, acc), g.cast(q, acc)   # q: exact
        pivot = g.op('BlockGrad', q)
        return x, s1, s2, pivot, pivot
    begin = tuple(None if i == layer.axis else 0 for i in range(layer.ndim))
    end = tuple(None if i == layer.axis else 1 for i in range(layer.ndim))
    p = g.op('BlockGrad', g.op('slice', x, begin=begin, end=end))
    d = g.op('broadcast_sub', x, p)
    x3 = moments.widen(g, d, layer)                              # (pre, C, post)
    if layer.dtype not in (acc, 'bfloat16', 'unknown'):
        x3 = g.cast(x3, acc)
    s1, s2 = [g.op('sum', v, axis=(0, 2)) for v in (x3, g.op('square', x3))]
    pivot = g.reshape(p, (-1,))
    if layer.dtype in ('bfloat16', 'unknown'):
        pivot = g.op('amp_cast', pivot, dtype=acc)
    elif layer.dtype != acc:
        pivot = g.cast(pivot, acc)
    pivot = g.op('BlockGrad', pivot)
    return d, s1, s2, pivot, pivot


def centred_affine(g, d, scale, shift, zero, unit, layer, pivot, cpu=False):
    """``(x - pivot) * scale + shift`` per channel, of :func:`centred_sums`'
    d: with the kernels (d is x), the affine kernel; otherwise (d is x -
    pivot) BatchNorm's kernel (:func:`moments.affine`), whose mean and
    variance are the variables `zero` and `unit`: in one graph across
    devices, a mutable
    input (BatchNorm's mean) downstream of a cross-device copy cannot be
    placed (MXNet 1.9.1, nnvm PlaceDevice). Returns an entry."""
    if fused(layer, cpu):
        y = g.op(moments.AFFINE, moments.widen(g, d, layer), pivot, scale, shift)
        return g.op('reshape_like', y, d)
    return moments.affine(g, d, scale, shift, zero, unit, layer)
