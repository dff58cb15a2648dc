"""The arithmetic of SyncBatchNorm, written into graphs (see writer.py).

Per replica and layer: before the barrier, the per-channel sums of x and
of x^2 in float64 (one vector [S1 | S2] for all layers meeting at the same
barrier) and a pivot (one sample value per channel); after the barrier,
every replica merges all replicas' sums inside its own graph (the sums are
copied to it), and applies ``(x - pivot) * scale + shift`` with BatchNorm's
fused kernel, whose mean and variance inputs are the pivot and a variance
v with v + eps == 1 exactly, so x - pivot is exact and unscaled. The
dependence of the output on the batch statistics goes through scale and
shift, so autograd reaches every replica's sums. At a barrier where a
layer has a reducer (widening the statistics to other processes), every
replica merges one entry instead: the replicas' sums added up
(:func:`totals`), about zero for the layers with a reducer, so that they
add up across processes, and about replica 0's pivot for the others. Both
merges recentre sums with the same formula (Chan et al.).

Precision: the sums are float64 (float16, bfloat16 and float32 data are
widened first); var = S2/N - mean^2 in float64 loses about
log10(mean^2 / var) of float64's 16 digits, e.g. 6 at mean 1000, std 1,
which only float64 data about zero (that is, through a reducer) can notice.
"""
from typing import NamedTuple

import numpy as np

__all__ = ['Layer', 'Local', 'Centred', 'Centring', 'RunningEntries', 'LayerInputs',
           'MergeSettings', 'Merged', 'UNIT_VAR', 'const', 'param_dtype', 'dtype_name',
           'local_sums', 'totals', 'merge', 'running_update', 'affine', 'widen', 'fused',
           'centred_sums', 'centred_affine']


class Local(NamedTuple):
    """One replica's sums of a layer (:func:`local_sums`): the per-channel
    sums of x - q and of its square, the shift q, and the pivot of the
    output's affine map (entries)."""
    s1: list
    s2: list
    q: list
    pivot: list


class Centred(NamedTuple):
    """One replica's sums of a layer in a graph across devices
    (:func:`centred_sums`): d (what :func:`centred_affine` takes), the sums
    of x - pivot and of its square, q (the pivot) and the pivot (entries)."""
    d: list
    s1: list
    s2: list
    q: list
    pivot: list


class Centring(NamedTuple):
    """How a graph across devices centres a replica's data of a layer
    (:func:`centred_sums`, :func:`centred_affine`)."""
    zero: list                      # the variables of :func:`affine`
    unit: list
    cpu: bool = False               # every device a CPU context
    ops: object = None              # nn.kernels.Kernels, if loaded


class RunningEntries(NamedTuple):
    """A layer's running mean and variance (entries)."""
    mean: list
    var: list


class LayerInputs(NamedTuple):
    """This replica's entries of every layer :func:`merge` merges: pivot,
    gamma (ones if fixed), beta and :class:`RunningEntries` (or None:
    not recording) per layer."""
    pivot: list
    gamma: list
    beta: list
    running: list | None = None


class MergeSettings(NamedTuple):
    """How :func:`merge` merges: eps and momentum (floats, or float64 (T,)
    entries when the layers differ), the parameters' dtype; chain: per
    layer, the index of an earlier layer here whose statistics it shares
    (the same layer used twice), or None; channels: per layer, needed with
    chains; acc: the dtype of the sums and counts (float64, or see
    :func:`centred_sums`)."""
    eps: object
    momentum: object
    param_dtype: str
    chain: list | None = None
    channels: list | None = None
    acc: str = 'float64'


class Merged(NamedTuple):
    """What :func:`merge` gives: the layers' scale and shift (entries in
    the parameters' dtype), and run: their new running means then
    variances, the batch's with ``batch``, or None."""
    scale: list
    shift: list
    run: list | None

#: Per parameter dtype, a variance v with v + 1e-5 == 1 exactly in the
#: kernel's arithmetic (the kernel's own eps is fixed to 1e-5 below).
_EPS = 1e-5
UNIT_VAR = {'float32': float(np.float32(1) - np.float32(_EPS)), 'float64': 1.0 - _EPS}
assert np.float32(np.float32(UNIT_VAR['float32']) + np.float32(_EPS)) == 1
assert UNIT_VAR['float64'] + _EPS == 1.0


def param_dtype(dtype):
    """dtype of the statistics and parameters for data of `dtype`, as
    BatchNorm has them: float64 data keeps float64; float16 and bfloat16
    data (what ``net.cast('float16')`` and AMP give) use float32."""
    return 'float64' if np.dtype(dtype) == np.float64 else 'float32'


def dtype_name(dtype):
    dtype = np.dtype(dtype)
    return 'bfloat16' if dtype.names else dtype.name    # MXNet's bfloat16 is a record


CONSTS = {}
MAX_CONSTS = 4096


def const(key, make):
    """A cached constant (never written to), as an array of its own that
    shares the cached memory. Creating one from Python is a synchronous
    copy that waits for the device's queue, so none is made on the hot
    path. A fresh array per use: autograd records an array's place in a
    graph on the array itself, and a backward pass clears it, so one array
    in two graphs (two models training concurrently on a device) would
    break the other graph's backward."""
    arr = CONSTS.get(key)
    if arr is None:
        if len(CONSTS) >= MAX_CONSTS:
            # Keys include batch splits and shapes: inputs of ever-changing
            # size must not grow the cache without bound.
            CONSTS.clear()
        arr = CONSTS[key] = make()
    return arr.detach()


class Layer:
    """What the graphs need to know of one SyncBatchNorm use."""

    __slots__ = ('channels', 'axis', 'ndim', 'dtype', 'param_dtype', 'eps', 'momentum',
                 'fix_gamma', 'block')

    def __init__(self, channels, axis, ndim, dtype, param_dtype, eps, momentum, fix_gamma,
                 block=None):
        self.channels, self.ndim = int(channels), int(ndim)
        self.axis = int(axis) % self.ndim
        self.dtype, self.param_dtype = str(dtype), str(param_dtype)
        self.eps, self.momentum, self.fix_gamma = float(eps), float(momentum), bool(fix_gamma)
        self.block = block


def widen(g, x, layer):
    """x as float64, the channel axis second: (pre, C, post)."""
    if layer.dtype in ('bfloat16', 'unknown'):
        x = g.op('amp_cast', x, dtype='float32' if layer.dtype == 'bfloat16' else
                 layer.param_dtype)
    if layer.axis == layer.ndim - 1:
        x3 = g.reshape(x, (-1, layer.channels, 1))
    else:
        if layer.axis != 1:
            x = g.op('SwapAxis', x, dim1=1, dim2=layer.axis)
        x3 = g.reshape(x, (0, 0, -1))
    return x3


def local_sums(g, x, layer, ops=None):
    """A :class:`Local` of entries (S1, S2, q, pivot): per-channel sums of x - q and of its
    square over this replica's slice (float64, shape (C,) each), the shift q
    they were taken about (float64), and the pivot of the output's affine map
    (x's first sample per channel, in the parameters' dtype; no gradient).

    q is the pivot with the kernel, and for float64 data; float16 and
    float32 data are summed about q = 0: their squares are exact in float64,
    so only the merge's cancellation (about 16 - log10(mean^2 / var) digits
    left) limits the variance, far below float32's own rounding. float64
    data would lose those digits against float64 BatchNorm: it pays one
    broadcast pass for the shift.
    """
    x3 = widen(g, x, layer)
    pivot = g.reshape(g.op('slice', x3, begin=(0, None, 0), end=(1, None, 1)), (-1,))
    if layer.dtype not in (layer.param_dtype, 'bfloat16', 'unknown'):
        pivot = g.cast(pivot, layer.param_dtype)
    pivot = g.op('BlockGrad', pivot)
    c = layer.channels
    if ops is not None and layer.dtype in ('float16', 'float32', 'float64'):
        # One pass each way (dx = dS1 + 2 dS2 (x - q)), float64 accumulators;
        # the kernel takes q = x[0, c, 0] itself: [S1 | S2 | q].
        out = g.op(ops.sums, x3)
        s1, s2, q = [g.slice_axis(out, 0, k * c, (k + 1) * c) for k in range(3)]
        return Local(s1, s2, g.op('BlockGrad', q), pivot)
    if layer.dtype != 'float64':
        x2 = g.cast(g.reshape(x3, (-3, -1)), 'float64')         # (pre * C, post)
        q = g.op('zeros_like', g.cast(pivot, 'float64'))
    else:
        q = pivot
        x2 = g.reshape(g.op('broadcast_sub', x3, g.reshape(q, (1, c, 1))), (-3, -1))
    s1, s2 = _row_sums(g, x2, c)
    return Local(s1, s2, g.op('BlockGrad', q), pivot)


def _row_sums(g, x2, c, dot=False):
    """Per-channel sums of x2 and of its square, x2 (pre * C, post) float64.
    Row sums as one matrix-vector product each (FullyConnected with a row
    of ones): several times faster than sum() over the spatial axes on
    CPU, backward included. `dot`: the product by ``dot`` instead, for
    float32 data with MKL-DNN, whose FullyConnected (MXNet 1.9.1) left
    its layout on memory the executor's plan reused: "size of NDArray
    doesn't match the requested MKLDNN memory desc" from the second step
    on (a small CNN on 8x8 images, 4 CPU contexts)."""
    ones = g.op('BlockGrad', g.op('ones_like', g.slice_axis(x2, 0, 0, 1)))
    sums = []
    for v in (x2, g.op('square', x2)):
        if dot:
            rows = g.op('dot', v, ones, transpose_b=True)
        else:
            rows = g.op('FullyConnected', v, ones, no_bias=True, num_hidden=1)
        sums.append(g.op('sum', g.reshape(rows, (-1, c)), axis=0))
    return sums


def _split(g, sums):
    """(S1, S2, q), each (n, T), of n entries [S1 | S2 | q] (3T each)."""
    n = len(sums)
    st = g.op('stack', *sums, axis=0, num_args=n) if n > 1 else g.reshape(sums[0], (1, -1))
    st = g.reshape(st, (0, 3, -1))                               # (n, 3, T)
    return g.op('SliceChannel', st, axis=1, num_outputs=3, squeeze_axis=True, outputs=3)


def _recentre(g, counts, d, s1, s2=None):
    """From the sums of x - q (S1, and S2 of its square; all (n, T)): the
    sum of x - q - d, S1 - n d, or with s2 that of its square,
    S2 - d (2 S1 - n d) (Chan et al.)."""
    nd_ = g.op('broadcast_mul', counts, d)
    if s2 is None:
        return g.op('broadcast_sub', s1, nd_)
    return g.op('broadcast_sub', s2, g.op('broadcast_mul', d, g.op(
        'broadcast_sub', g.op('_mul_scalar', s1, scalar='2'), nd_)))


def totals(g, sums, counts, ref):
    """The sums of x - ref and of its square and the row counts over all
    entries, per channel: (3, T) float64 ``[S1; S2; N]``. sums, counts: as
    for :func:`merge`; ref: a (T,) entry, zero where the totals must add
    up with other processes' (SyncBatchNorm.reducer), else a pivot, which
    keeps the digits that sums about zero lose for float64 data."""
    s1, s2, q = _split(g, sums)
    d = g.op('broadcast_sub', g.reshape(ref, (1, -1)), q)
    return g.op('stack', g.op('sum', _recentre(g, counts, d, s1), axis=0),
                g.op('sum', _recentre(g, counts, d, s1, s2), axis=0),
                g.op('sum', counts, axis=0), axis=0, num_args=3)


def merge(g, sums, counts, layers, settings, batch=False):
    """This replica's scale and shift for all layers of one barrier, and
    their new running statistics: a :class:`Merged`.

    sums: entries of every replica's [S1 | S2 | q] (float64, 3T, sums of
    x - q and its square; in rank order), or one entry of :func:`totals`;
    counts: entry (n, T), float64 row counts per replica and channel;
    layers: this replica's :class:`LayerInputs`; settings: a
    :class:`MergeSettings`; batch: run holds the batch's means, then
    variances (2T) instead of updated running statistics (graph mode
    updates them when the backward pass is pushed). The entries are in the
    parameters' dtype: run holds the new running means, then variances, of
    the layers no later one chains to (all of them, 2T, without chains), or
    is None when ``layers.running`` is and not `batch`.

    Every binary operator is a broadcast one: in MXNet 1.9.1 a static_alloc
    graph loses the gradient of an elemwise_add operand whose other operand
    needs none (measured; scalar and broadcast operators are unaffected).
    """
    eps, momentum, acc = settings.eps, settings.momentum, settings.acc
    s1, s2, q = _split(g, sums)
    # The mean relative to the first entry's q (the same on every replica),
    # so a large mean never meets the small sums in one rounding; the
    # variance from the sums about the mean, each replica's recentred from
    # its own q (no cancellation beyond that of q's distance from the mean).
    q0 = g.reshape(g.slice_axis(q, 0, 0, 1), (-1,))
    dq = g.op('broadcast_sub', q, q0)                          # q_r - q0
    total = g.op('sum', counts, axis=0)
    t1 = _recentre(g, counts, g.op('negative', dq), s1)
    rel = g.op('broadcast_div', g.op('sum', t1, axis=0), total)     # mean - q0
    m2 = _recentre(g, counts, g.op('broadcast_sub', rel, dq), s1, s2)
    var = g.op('broadcast_div', g.op('sum', m2, axis=0), total)
    inv = g.op('rsqrt', _add(g, var, eps))

    def wide(entries):
        return g.concat(*[g.cast(e, acc) for e in entries])
    scale = g.op('broadcast_mul', wide(layers.gamma), inv)
    d = g.op('broadcast_sub', rel, g.op('broadcast_sub', wide(layers.pivot), q0))
    shift = g.op('broadcast_sub', wide(layers.beta), g.op('broadcast_mul', scale, d))
    mean = g.op('broadcast_add', rel, q0)
    run = None
    if batch:
        run = g.cast(g.op('BlockGrad', g.concat(mean, var)), settings.param_dtype)
    elif layers.running is not None:
        old = [wide([r.mean for r in layers.running]), wide([r.var for r in layers.running])]
        if not any(k is not None for k in settings.chain or ()):
            new = [running_update(g, o, v, momentum) for o, v in zip(old, (mean, var))]
        else:
            new = _chained(g, old, (mean, var), momentum, settings.chain, settings.channels)
        run = g.cast(g.op('BlockGrad', g.concat(*new)), settings.param_dtype)
    return Merged(g.cast(scale, settings.param_dtype), g.cast(shift, settings.param_dtype), run)


def running_update(g, old, batch, momentum):
    """old * momentum + batch * (1 - momentum): a running statistic's update."""
    return g.op('broadcast_add', _mul(g, old, momentum), _mul(g, batch, momentum, one_minus=True))


def _chained(g, old, batch, momentum, chain, sizes):
    """[means | variances] of the last use of each layer, when a layer is
    used several times at one barrier (chain[k]: the index of the previous
    use of layer k's statistics, or None): each use updates what the
    previous one left, as in call order."""
    ends = np.cumsum(sizes)

    def cut(e, k):
        return g.slice_axis(e, 0, int(ends[k] - sizes[k]), int(ends[k]))
    last = [k for k in range(len(sizes)) if k not in chain]
    out = []
    for o, b in zip(old, batch):
        new = []
        for k in range(len(sizes)):
            start = cut(o, k) if chain[k] is None else new[chain[k]]
            m = momentum if isinstance(momentum, float) else cut(momentum, k)
            new.append(running_update(g, start, cut(b, k), m))
        out.extend(new[k] for k in last)
    return out


def _add(g, x, c):
    if isinstance(c, float):
        return g.op('_plus_scalar', x, scalar=repr(c))
    return g.op('broadcast_add', x, c)


def _mul(g, x, c, one_minus=False):
    if isinstance(c, float):
        return g.op('_mul_scalar', x, scalar=repr(1.0 - c if one_minus else c))
    if one_minus:
        c = g.op('_rminus_scalar', c, scalar='1')
    return g.op('broadcast_mul', x, c)


def affine(g, x, scale, shift, pivot, unit, layer):
    """(x - pivot) * scale + shift per channel, BatchNorm's fused kernel
    (pivot and unit must be graph variables: the kernel's mean and variance
    inputs are mutable)."""
    return g.op('BatchNorm', x, scale, shift, pivot, unit, eps=_EPS, fix_gamma=False,
                use_global_stats=True, axis=layer.axis)


# ------------------------------------------------- one graph across devices
# (graph mode) Graph mode cannot give BatchNorm's kernel the pivot as its
# mean, as the staged graphs do (a mutable input downstream of a
# cross-device copy cannot be placed), so the data is centred first; on CPU
# contexts with the optional kernels they take x itself and subtract the
# pivot in float64.

def fused(layer, cpu, ops):
    """Whether a graph across devices computes the layer with the kernels
    (`ops`): every device a CPU context (they are CPU operators), data of a
    dtype they take, channels on an axis that reshaping brings second."""
    return (cpu and ops is not None
            and layer.dtype in ('float16', 'float32', 'float64')
            and layer.axis in (1, layer.ndim - 1))


def centred_sums(g, x, layer, centring):
    """A :class:`Centred` of entries (d, S1, S2, q, pivot) for a graph
    spanning devices (`centring`: a :class:`Centring`): the per-channel sums
    of x - pivot and of its square (pivot: x's first sample per channel, no
    gradient), the pivot as q and as pivot, all in the parameters' dtype,
    and d, what :func:`centred_affine` takes.

    With ``centring.cpu`` (every device a CPU context) and the kernels, the
    kernel sums x - pivot in one pass each way, in float64, and d is x:
    the affine kernel subtracts the pivot itself, in float64. Otherwise
    d = x - pivot, computed by BatchNorm's kernel (gamma 1, beta -pivot,
    mean 0, variance v with v + eps == 1: exactly x - pivot rounded once,
    as a subtraction gives it), whose backward is one pass; a broadcast
    subtraction's backward also reduces over the whole tensor for the
    pivot's (discarded) gradient, and MXNet's ``sum`` over the batch and
    spatial axes is slow on CPU: the sums are matrix-vector products
    (:func:`_row_sums`). Measured on ResNet-20, 4 CPU contexts with
    MKL-DNN: the subtraction and ``sum`` were two thirds of the step.

    Sums of centred data lose about one digit to the merge's cancellation
    (two for a pivot far out in the tail), so float32 ones are about as
    accurate as float32 BatchNorm's own statistics. Graphs spanning CPU
    contexts keep float64 away from float32 data: MKL-DNN (MXNet 1.9.1)
    leaves its layout on pooled executor memory that a later float64 array
    may reuse, and MKL-DNN-capable operators (FullyConnected, Concat, add_n,
    cross-device copies) then fail on it. Either way the statistics are of
    exactly the values normalised (x - pivot, exact in float64; or d).
    """
    acc = layer.param_dtype
    if fused(layer, centring.cpu, centring.ops):
        c = layer.channels
        out = g.op(centring.ops.sums, widen(g, x, layer))    # [S1 | S2 | q], float64
        s1, s2, q = [g.slice_axis(out, 0, k * c, (k + 1) * c) for k in range(3)]
        if acc != 'float64':
            s1, s2, q = g.cast(s1, acc), g.cast(s2, acc), g.cast(q, acc)   # q: exact
        pivot = g.op('BlockGrad', q)
        return Centred(x, s1, s2, pivot, pivot)
    begin = tuple(None if i == layer.axis else 0 for i in range(layer.ndim))
    end = tuple(None if i == layer.axis else 1 for i in range(layer.ndim))
    pivot = g.reshape(g.op('slice', x, begin=begin, end=end), (-1,))
    if layer.dtype in ('bfloat16', 'unknown'):
        pivot = g.op('amp_cast', pivot, dtype=acc)
    elif layer.dtype != acc:
        pivot = g.cast(pivot, acc)                       # exact: a wider type
    pivot = g.op('BlockGrad', pivot)
    d = g.op('BatchNorm', x, g.op('ones_like', pivot), g.op('negative', pivot), centring.zero,
             centring.unit, eps=_EPS, fix_gamma=True, use_global_stats=True, axis=layer.axis)
    x3 = widen(g, d, layer)                              # (pre, C, post)
    if layer.dtype not in (acc, 'bfloat16', 'unknown'):
        x3 = g.cast(x3, acc)
    s1, s2 = _row_sums(g, g.reshape(x3, (-3, -1)), layer.channels, dot=True)
    return Centred(d, s1, s2, pivot, pivot)


def centred_affine(g, sums, merged, layer, centring):
    """``(x - pivot) * scale + shift`` per channel (`merged`'s) of the d of
    `sums` (:func:`centred_sums`' with the same `centring`): with the
    kernels (d is x), the affine kernel; otherwise (d is x - pivot)
    BatchNorm's kernel (:func:`affine`) with ``centring.zero`` and ``unit``
    as mean and variance: in one graph across devices, a mutable input
    downstream of a cross-device copy cannot be placed (MXNet 1.9.1, nnvm
    PlaceDevice). Returns an entry."""
    if fused(layer, centring.cpu, centring.ops):
        y = g.op(centring.ops.affine, widen(g, sums.d, layer), sums.pivot, merged.scale,
                 merged.shift)
        return g.op('reshape_like', y, sums.d)
    return affine(g, sums.d, merged.scale, merged.shift, centring.zero, centring.unit, layer)
