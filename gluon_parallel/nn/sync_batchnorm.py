"""SyncBatchNorm: batch normalisation with the statistics of the whole batch.

Inside a parallel call every replica computes the mean of its slice and of
its square about a pivot, the replicas meet once per layer at a
ParallelState, and the per-slice moments are merged weighted by their row
counts (Chan et al.), so uneven slices are exact. The merge is made of
recorded MXNet ops (copies to one device, float64 arithmetic, copies back),
so the input gradient of every replica includes what flows through the
other replicas' statistics. The gamma/beta gradients are NOT reduced here:
the Trainer sums them.

Cost (measured on CPU, several contexts sharing the cores): per replica the
layer makes four passes over its slice in forward (shift, square, two
per-channel sums) and the fused BatchNorm kernel for the output; every other
op is per channel. The merge computes each replica's final scale and shift
in one vectorised float64 block, so a replica issues about a dozen
operations per layer. Broadcast arithmetic and ``moments`` are several
times slower on CPU and are not used. The per-(row, channel) sums are one
matrix product with a column of ones each: MKL-DNN average pooling has a
very slow backward for some shapes, and sum pooling leaked memory on every
call in MXNet 1.9.1 (measured: +18 MiB per ResNet-20 step on 4 contexts).

dtypes follow BatchNorm: float32; float64 throughout; float16 (or, under
AMP, bfloat16) data with float32 parameters, the statistics computed from
a float32 copy of the data and merged in float64.
"""
import itertools
import os
import weakref

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

from .. import _gluon
from ..replica import ParallelCall, ReplicaContext, current_replica
from . import hybrid
from .staged import MARK

__all__ = ['SyncBatchNorm', 'convert_sync_batchnorm', 'revert_sync_batchnorm']

#: Marker attribute (the layer's id) -> live layer, for hybridized graphs.
_LAYERS = weakref.WeakValueDictionary()
_IDS = itertools.count()


def layer_of(mark):
    """The SyncBatchNorm whose graph node carries `mark`, or None (a graph
    loaded from a file)."""
    try:
        return _LAYERS.get(int(mark))
    except ValueError:
        return None

_PARAMS = ('gamma', 'beta', 'running_mean', 'running_var')


_EPS = 1e-5
#: Per parameter dtype, a variance v with v + eps == 1 exactly in the
#: kernel's arithmetic, so the affine pass divides by nothing.
_UNIT_VAR = {'float32': float(np.float32(1) - np.float32(_EPS)), 'float64': 1.0 - _EPS}
assert np.float32(np.float32(_UNIT_VAR['float32']) + np.float32(_EPS)) == 1
assert _UNIT_VAR['float64'] + _EPS == 1.0


def _param_dtype(x):
    """dtype of the statistics and parameters for data `x`, as BatchNorm
    has them: float64 data keeps float64; float16 and bfloat16 data (what
    ``net.cast('float16')`` and AMP give) use float32 parameters."""
    return 'float64' if np.dtype(x.dtype) == np.float64 else 'float32'


def _dtype_name(dtype):
    dtype = np.dtype(dtype)
    return 'bfloat16' if dtype.names else dtype.name    # MXNet's bfloat16 is a record

#: Per-channel fields a replica pushes: mean of x - pivot, mean of its
#: square, pivot, gamma, beta, running mean, running variance.
_FIELDS = 7


def _affine(x, gamma, beta, mean, var, axis, eps=_EPS):
    """(x - mean) / sqrt(var + eps) * gamma + beta per channel in one fused
    pass; differentiable in x, gamma and beta (mean and var are constants)."""
    return nd.BatchNorm(x, gamma, beta, mean, var, eps=eps, fix_gamma=False,
                        use_global_stats=True, axis=axis)


_CONSTS = {}
_MAX_CONSTS = 4096


def _const(key, make):
    """A cached constant NDArray (never written to). Creating one from
    Python is a synchronous copy that waits for the device's queue, so none
    is made on the hot path."""
    arr = _CONSTS.get(key)
    if arr is None:
        if len(_CONSTS) >= _MAX_CONSTS:
            # Keys include batch splits and shapes: inputs of ever-changing
            # size must not grow the cache without bound.
            _CONSTS.clear()
        arr = _CONSTS[key] = make()
    return arr


def _merge_moments(*pushed):
    """ParallelState operation of one layer: merge the replicas' moments and
    give each replica the scale and shift of its output.

    Replica i pushes ``(v, count, (eps, momentum))`` with v the vector
    (float32, or float64 for float64 data) [m1 | m2 | pivot | gamma | beta | running_mean | running_var]
    (m1, m2: means of x - pivot and of its square over its slice). In
    float64, with d_i = mean - pivot_i,

        mean = sum_i n_i / N * (pivot_i + m1_i)
        var  = sum_i n_i / N * (m2_i - 2 d_i m1_i + d_i^2)

    and replica i gets, on its device and in v's dtype, [gamma_i * inv | beta_i -
    gamma_i * inv * d_i] (inv = 1 / sqrt(var + eps)): its output is then
    ``(x - pivot_i) * scale + shift``. In training (autograd recording) two
    more fields follow: the updated running mean and variance.
    """
    dst = pushed[0][0].context
    n, c = len(pushed), pushed[0][0].shape[0] // _FIELDS
    counts = tuple(k for _, k, _ in pushed)
    eps, momentum = pushed[0][2]
    total = float(sum(counts))
    w = _const(('w', counts, dst), lambda: nd.array(
        [[k / total for k in counts]], ctx=dst, dtype='float64'))
    rows = [v if v.context == dst else v.as_in_context(dst) for v, _, _ in pushed]
    st = nd.cast(nd.stack(*rows), 'float64').reshape((n, _FIELDS, c))
    m1, m2, pivot, gamma, beta, r_mean, r_var = nd.split(st, num_outputs=_FIELDS, axis=1,
                                                         squeeze_axis=True)
    mean = nd.dot(w, m1 + pivot)                     # (1, c)
    d = nd.broadcast_sub(mean, pivot)                # (n, c): mean - pivot_i
    var = nd.dot(w, m2 - d * (2 * m1 - d))           # (1, c): E[(x - mean)^2]
    scale = nd.broadcast_mul(gamma, nd.rsqrt(var + eps))
    parts = [scale, beta - scale * d]
    if autograd.is_recording():   # BatchNorm updates running stats only when training
        with autograd.pause():
            run = nd.concat(nd.slice_axis(r_mean, axis=0, begin=0, end=1) * momentum
                            + mean * (1 - momentum),
                            nd.slice_axis(r_var, axis=0, begin=0, end=1) * momentum
                            + var * (1 - momentum), dim=1)
            parts.append(nd.broadcast_to(run, (n, 2 * c)))
    out = nd.cast(nd.concat(*parts, dim=1), pushed[0][0].dtype)
    if n == 1:
        return [out.reshape((-1,))]
    return [r if r.context == v.context else r.as_in_context(v.context)
            for r, (v, _, _) in zip(nd.split(out, num_outputs=n, axis=0, squeeze_axis=True),
                                    pushed)]


class SyncBatchNorm(gluon.nn.BatchNorm):
    """Batch normalisation over the whole batch of a DataParallel call.

    Same arguments and parameter names as :class:`mxnet.gluon.nn.BatchNorm`.
    Inside :class:`~gluon_parallel.DataParallel` (or ``parallel_apply``), in
    training mode, it normalises with the mean and variance of the whole
    batch across all replicas, weighted by each slice's row count, and
    updates the running statistics identically on every context of the
    model (those idle in the call included). Outside a parallel call, in
    predict mode, or with ``use_global_stats=True`` it is exactly BatchNorm.

    Parameters
    ----------
    axis : int, default 1
        The channel axis.
    momentum : float, default 0.9
        ``running = running * momentum + batch * (1 - momentum)``.
    epsilon : float, default 1e-5
    center, scale, use_global_stats : bool
        As in BatchNorm.
    beta_initializer, gamma_initializer, running_mean_initializer,
    running_variance_initializer : str or Initializer
    in_channels : int, default 0
        Number of channels; 0 infers it on the first call.
    num_devices : int, optional
        Accepted for drop-in compatibility with
        ``mxnet.gluon.contrib.nn.SyncBatchNorm``: the device count is taken
        from the parallel call. If given, it must equal the number of
        devices of the DataParallel.
    check_finite : bool, optional
        Raise FloatingPointError naming the layer when the batch statistics
        are NaN or Inf, instead of propagating them silently. Costs a device
        synchronisation per layer. Default: ``$GLUON_PARALLEL_CHECK_FINITE``
        (``1`` enables it), else off.

    Notes
    -----
    ``hybridize()`` (with or without ``static_alloc``/``static_shape``)
    works: inside a parallel call, in training mode, the hybridized graph
    runs in stages cut at the SyncBatchNorm layers, each stage one cached
    graph, and the replicas meet between stages in their own threads (see
    :mod:`gluon_parallel.nn.staged`); elsewhere the graph is the block's
    own, with BatchNorm in place of each SyncBatchNorm. Networks that
    synchronise across worker processes
    (:func:`gluon_parallel.dist.sync_batchnorm_across_workers`) run in
    imperative mode only.
    """

    def __init__(self, axis=1, momentum=0.9, epsilon=1e-5, center=True, scale=True,
                 use_global_stats=False, beta_initializer='zeros', gamma_initializer='ones',
                 running_mean_initializer='zeros', running_variance_initializer='ones',
                 in_channels=0, num_devices=None, check_finite=None, **kwargs):
        super(SyncBatchNorm, self).__init__(
            axis=axis, momentum=momentum, epsilon=epsilon, center=center, scale=scale,
            use_global_stats=use_global_stats, beta_initializer=beta_initializer,
            gamma_initializer=gamma_initializer,
            running_mean_initializer=running_mean_initializer,
            running_variance_initializer=running_variance_initializer,
            in_channels=in_channels, **kwargs)
        if num_devices is not None and int(num_devices) < 1:
            raise ValueError('num_devices must be positive, got %r' % (num_devices,))
        self.num_devices = None if num_devices is None else int(num_devices)
        if check_finite is None:
            check_finite = os.environ.get('GLUON_PARALLEL_CHECK_FINITE', '0') not in ('', '0')
        self.check_finite = bool(check_finite)
        self._axis = axis
        self._momentum = momentum
        self._epsilon = epsilon
        self._scale = scale
        self._mark = str(next(_IDS))
        _LAYERS[int(self._mark)] = self

    #: The cross-worker reduction of this layer's statistics, set by
    #: gluon_parallel.dist.sync_batchnorm_across_workers (see
    #: _cross_worker_params for what it takes and gives).
    _cross_worker = None

    def infer_shape(self, x, *args):
        # Deferred initialisation: every parameter has one entry per channel.
        channels = x.shape[self._axis % len(x.shape)]
        for p in self._reg_params.values():
            p.shape = (channels,)

    def hybrid_forward(self, F, x, gamma, beta, running_mean, running_var):
        if F is not nd:
            # In a graph: BatchNorm, marked so that the staged runner
            # synchronises it inside parallel calls (hybrid.py).
            if self._kwargs['use_global_stats']:
                return F.BatchNorm(x, gamma, beta, running_mean, running_var, name='fwd',
                                   **self._kwargs)
            with mx.AttrScope(**{MARK: self._mark}):
                return F.BatchNorm(x, gamma, beta, running_mean, running_var, name='fwd',
                                   **self._kwargs)
        replica = current_replica()
        if replica is None and self._cross_worker is not None:
            replica = ReplicaContext(0, ParallelCall([x.context]))   # this worker: one device
        # One code path inside a parallel call whatever the device count, so
        # 1, 2 and 4 devices compute the same thing.
        if replica is None or self._kwargs['use_global_stats'] or not autograd.is_training():
            return super(SyncBatchNorm, self).hybrid_forward(
                F, x, gamma, beta, running_mean, running_var)
        return self._sync_forward(replica, x, gamma, beta, running_mean, running_var)

    def _sync_forward(self, replica, x, gamma, beta, running_mean, running_var):
        ndim = x.ndim
        axis = self._axis % ndim
        channels = x.shape[axis]
        if gamma.shape[0] != channels:
            raise ValueError('%s expects %d channels on axis %d, but the input %s has %d'
                             % (self.name, gamma.shape[0], self._axis, x.shape, channels))
        if self.num_devices is not None and self.num_devices != len(replica.call.all_ctx):
            raise ValueError('%s was built with num_devices=%d, but DataParallel runs on %d '
                             'devices' % (self.name, self.num_devices, len(replica.call.all_ctx)))
        ctx = x.context
        dtype = _param_dtype(x)
        if np.dtype(gamma.dtype) != dtype:
            raise TypeError('%s: %s input needs %s parameters, as BatchNorm (net.cast() '
                            'sets them), but they are %s' % (
                                self.name, _dtype_name(x.dtype), dtype,
                                _dtype_name(gamma.dtype)))
        ones = _const(('full', ctx, channels, 1.0, dtype),
                      lambda: nd.ones(channels, ctx=ctx, dtype=dtype))
        zeros = _const(('full', ctx, channels, 0.0, dtype),
                       lambda: nd.zeros(channels, ctx=ctx, dtype=dtype))
        unit_var = _const(('full', ctx, channels, 'unit', dtype),
                          lambda: nd.full(channels, _UNIT_VAR[dtype], ctx=ctx, dtype=dtype))
        # The statistics are computed in the parameters' dtype: float16 or
        # bfloat16 data is widened once, so sums never accumulate in 16 bits
        # (and no 16-bit matrix product is asked of the CPU, which has none).
        xw = x if np.dtype(x.dtype) == dtype else nd.amp_cast(x, dtype=dtype)
        # Work relative to one sample value per channel (the pivot): with
        # inputs like 1000 + N(0, 1), float32 sums and x - mean would lose the
        # digits that matter. x - pivot is exact.
        begin, end = [0] * ndim, [1] * ndim
        begin[axis] = end[axis] = None
        pivot = nd.slice(xw, begin=tuple(begin), end=tuple(end)).reshape((channels,)).detach()
        xs = _affine(xw, ones, zeros, pivot, unit_var, axis)
        if axis == 1 and 3 <= ndim <= 5:
            # The MKL-DNN kernels leave their output in a blocked layout that
            # the (native) sums below would convert on every read: convert
            # once. The output pass reads x itself, in its own layout.
            xs = nd.reshape(xs, shape=x.shape)
        count = x.size // channels
        moments = self._local_moments(xs, axis, count)      # [m1 | m2], in dtype
        g = gamma if self._scale else ones
        recording = autograd.is_recording()

        if self._cross_worker is not None:
            scale, shift, run = self._cross_worker_params(replica, moments, count, pivot, g,
                                                          beta, running_mean, running_var)
            if dtype != 'float32':
                scale, shift = nd.cast(scale, dtype), nd.cast(shift, dtype)
                run = tuple(nd.cast(r, dtype) for r in run)
        else:
            state = replica.next_state(self, _merge_moments)
            local = nd.concat(moments, pivot, g, beta, running_mean, running_var, dim=0)
            merged = state.pull(state.push((local, count, (self._epsilon, self._momentum)),
                                           replica.rank))
            if self.check_finite:
                self._check_finite(merged)
            parts = nd.split(merged, num_outputs=4 if recording else 2, axis=0)
            scale, shift, run = parts[0], parts[1], parts[2:]
        # (x - pivot) * scale + shift. The kernel treats its mean and
        # variance as constants (the pivot and a variance v with v + eps == 1,
        # so x - pivot is exact and unscaled): the output's dependence on the
        # batch statistics goes through scale and shift. It reads x in its
        # own dtype (float16 data, float32 parameters, as BatchNorm).
        out = _affine(x, scale, shift, pivot, unit_var, axis)
        if recording:
            self._store_running(replica, run[0], run[1], running_mean, running_var)
        return out

    def _local_moments(self, xs, axis, count):
        """[mean of xs | mean of xs^2] per channel over this slice, float32."""
        if axis == 1 and 3 <= xs.ndim <= 5:
            # Sums per (row, channel) as one matrix product each, then over
            # the rows (small). dot, not FullyConnected: AMP runs the latter
            # in 16 bits, and widens dot's inputs to the widest instead.
            rows, channels = xs.shape[0], xs.shape[1]
            post = count // rows
            ctx, dtype = xs.context, xs.dtype
            ones = _const(('col', ctx, post, dtype), lambda: nd.ones((post, 1), ctx=ctx,
                                                                    dtype=dtype))
            x2 = xs.reshape((rows * channels, post))
            s1 = nd.dot(x2, ones)
            s2 = nd.dot(nd.square(x2), ones)
            both = nd.concat(s1, s2, dim=0).reshape((2, rows, channels))
            return nd.sum(both, axis=1).reshape((-1,)) * (1.0 / count)
        s1, s2 = self._channel_sums(xs, axis)
        return nd.concat(s1, s2, dim=0) * (1.0 / count)

    def _channel_sums(self, x, axis):
        """Per-channel sum and sum of squares, as matrix-vector products."""
        shape = x.shape
        channels = shape[axis]
        pre = int(np.prod(shape[:axis]))
        post = int(np.prod(shape[axis + 1:]))
        ctx, dtype = x.context, x.dtype
        ones_pre = _const(('full', ctx, pre, 1.0, dtype), lambda: nd.ones(pre, ctx=ctx, dtype=dtype))
        if post == 1:
            x2 = x.reshape((pre, channels))
            return nd.dot(ones_pre, x2), nd.dot(ones_pre, nd.square(x2))
        ones_post = _const(('full', ctx, post, 1.0, dtype),
                           lambda: nd.ones(post, ctx=ctx, dtype=dtype))
        x2 = x.reshape((pre * channels, post))
        s1 = nd.dot(ones_pre, nd.dot(x2, ones_post).reshape((pre, channels)))
        s2 = nd.dot(ones_pre, nd.dot(nd.square(x2), ones_post).reshape((pre, channels)))
        return s1, s2

    def _check_finite(self, merged):
        if not np.isfinite(merged.asnumpy()).all():
            raise FloatingPointError('%s: the batch mean or variance is NaN or Inf: the input of '
                                     'this layer holds non-finite values' % self.name)

    def _cross_worker_params(self, replica, moments, count, pivot, g, beta,
                             running_mean, running_var):
        """Scale, shift and new running statistics from the cross-worker
        merge (interface: push ``([s1 | s2 | pivot], count)``, receive
        ``[mean - pivot | var | mean]``)."""
        state = replica.next_state(self, self._cross_worker)
        local = nd.concat(moments * float(count), pivot, dim=0)
        merged = state.pull(state.push((local, count), replica.rank))
        if self.check_finite:
            self._check_finite(merged)
        d, var, mean = nd.split(merged, num_outputs=3, axis=0)
        scale = g * nd.rsqrt(var + self._epsilon)
        shift = beta - scale * d
        m = self._momentum
        with autograd.pause():
            run = (running_mean * m + mean * (1 - m), running_var * m + var * (1 - m))
        return scale, shift, run

    def _store_running(self, replica, new_mean, new_var, running_mean, running_var):
        with autograd.pause():
            new_mean.copyto(running_mean)
            new_var.copyto(running_var)
            if replica.rank == 0:
                # Contexts idle in this call get the same values, so every
                # copy of the model stays identical.
                for ctx in replica.call.idle_ctx:
                    if ctx in self.running_mean.list_ctx():
                        new_mean.copyto(self.running_mean.data(ctx))
                        new_var.copyto(self.running_var.data(ctx))


def _swap_batchnorm(block, is_source, make, ancestors_active=False):
    """Replace every child for which is_source(child) by make(child),
    sharing the child's Parameter objects (values, contexts, gradients)."""
    children = _gluon.children(block)
    for key, child in list(children.items()):
        active = ancestors_active or _gluon.is_active_hybrid(block)
        if is_source(child):
            if active:
                raise RuntimeError('%s is inside a hybridized block: call hybridize(False) '
                                   'before converting its BatchNorm layers' % child.name)
            new = make(child)
            for name in _PARAMS:
                _gluon.replace_param(new, name, getattr(child, name))
            children[key] = new
            for attr, value in list(vars(block).items()):
                if value is child:
                    object.__setattr__(block, attr, new)
        else:
            _swap_batchnorm(child, is_source, make, active)
    return block


def _bn_config(bn):
    return dict(_gluon.batchnorm_config(bn), in_channels=bn.gamma.shape[0], prefix=bn.prefix)


def convert_sync_batchnorm(block, num_devices=None):
    """Replace every ``gluon.nn.BatchNorm`` inside `block` by a SyncBatchNorm
    with the same configuration and the same Parameter objects (so values,
    contexts and parameter names are kept), in place.

    Parameters
    ----------
    block : Block
        Must not be hybridized (convert first, or ``hybridize(False)``).
    num_devices : int, optional
        Passed to every SyncBatchNorm.

    Returns
    -------
    Block
        `block` itself (a lone BatchNorm is returned converted).
    """
    def is_bn(b):
        return isinstance(b, gluon.nn.BatchNorm) and not isinstance(b, SyncBatchNorm)

    def make(bn):
        return SyncBatchNorm(num_devices=num_devices, **_bn_config(bn))

    if is_bn(block):
        holder = gluon.Block(prefix='')
        holder.register_child(block, 'bn')
        return _gluon.children(_swap_batchnorm(holder, is_bn, make))['bn']
    return _swap_batchnorm(block, is_bn, make)


def revert_sync_batchnorm(block):
    """Replace every SyncBatchNorm inside `block` by a ``gluon.nn.BatchNorm``
    sharing its parameters, in place, e.g. to hybridize and export a trained
    network for single-device inference. Returns `block`."""
    def is_sync(b):
        return isinstance(b, SyncBatchNorm)

    def make(bn):
        return gluon.nn.BatchNorm(**_bn_config(bn))

    if is_sync(block):
        holder = gluon.Block(prefix='')
        holder.register_child(block, 'bn')
        return _gluon.children(_swap_batchnorm(holder, is_sync, make))['bn']
    return _swap_batchnorm(block, is_sync, make)


hybrid.install(_const, layer_of)
