"""SyncBatchNorm: batch normalisation with the statistics of the whole batch.

Inside a parallel call every replica computes the mean and (biased) variance
of its slice, the replicas meet once per layer at a ParallelState, and the
per-slice moments are merged weighted by their row counts (Chan et al.), so
uneven slices are exact. The merge is made of recorded MXNet ops (copies to
one device, float64 arithmetic, copies back), so the input gradient of every
replica includes what flows through the other replicas' statistics. The
gamma/beta gradients are NOT reduced here: the Trainer sums them.

Every full-size pass uses a fast MXNet kernel (measured on CPU: broadcast
arithmetic is several times slower, ``moments`` ten times): the fused
BatchNorm kernel as an exact per-channel affine map (``use_global_stats``
with a variance v such that v + eps == 1 in float32), and matrix-vector
products with a vector of ones for the per-channel sums.
"""
import os

import numpy as np
from mxnet import autograd, gluon, nd

from ..context import ParallelCall, ReplicaContext, current_replica

__all__ = ['SyncBatchNorm', 'convert_sync_batchnorm', 'revert_sync_batchnorm']

_PARAMS = ('gamma', 'beta', 'running_mean', 'running_var')


_EPS = 1e-5
_UNIT_VAR = float(np.float32(1) - np.float32(_EPS))
assert np.float32(np.float32(_UNIT_VAR) + np.float32(_EPS)) == 1


def _affine(x, gamma, beta, mean, var, axis, eps=_EPS):
    """(x - mean) / sqrt(var + eps) * gamma + beta per channel in one fused
    pass; differentiable in x, gamma and beta (mean and var are constants)."""
    return nd.BatchNorm(x, gamma, beta, mean, var, eps=eps, fix_gamma=False,
                        use_global_stats=True, axis=axis)


def _merge_moments(*pushed):
    """ParallelState operation: merge per-replica (sum | sum of squares |
    pivot, count), in float64, into the global statistics. Replica i gets,
    on its device, [global mean - its pivot | global var | global mean] in
    float32."""
    dst = pushed[0][0].context
    n, c = len(pushed), pushed[0][0].shape[0] // 3
    counts = [k for _, k in pushed]
    stacked = nd.cast(nd.stack(*[v.as_in_context(dst) for v, _ in pushed]), 'float64')
    s1, s2, pivot = nd.split(stacked, num_outputs=3, axis=1)
    cnt = nd.array(counts, ctx=dst, dtype='float64').reshape((n, 1))
    mean_s = nd.broadcast_div(s1, cnt)              # per replica, relative to its pivot
    var = nd.broadcast_div(s2, cnt) - nd.square(mean_s)
    means = mean_s + pivot
    w = cnt / float(sum(counts))
    mean = nd.sum(nd.broadcast_mul(w, means), axis=0, keepdims=True)
    # total M2 / N = sum_i n_i/N * (var_i + (mean_i - mean)^2)
    spread = nd.square(nd.broadcast_sub(means, mean))
    var = nd.sum(nd.broadcast_mul(w, var + spread), axis=0, keepdims=True)
    out = nd.cast(nd.concat(nd.broadcast_sub(mean, pivot), nd.broadcast_to(var, (n, c)),
                            nd.broadcast_to(mean, (n, c)), dim=1), 'float32')
    rows = nd.split(out, num_outputs=n, axis=0, squeeze_axis=True) if n > 1 else [out.reshape(-1)]
    return [r.as_in_context(v.context) for r, (v, _) in zip(rows, pushed)]


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
    The cross-device reduction runs in imperative mode: ``hybridize()`` on a
    network containing SyncBatchNorm raises instead of building a graph that
    would silently normalise per device. Hybridize the sub-blocks without
    it, or call :func:`revert_sync_batchnorm` for single-device inference
    and export.
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
        self._consts = {}

    #: Optional drop-in for _merge_moments that also reduces across worker
    #: processes (set by gluon_parallel.dist.sync_batchnorm_across_workers).
    _cross_worker = None

    def hybridize(self, active=True, **kwargs):
        if active:
            raise RuntimeError(
                '%s: SyncBatchNorm synchronises across devices in imperative mode only, and a '
                'hybridized graph would silently normalise each device on its own. Hybridize '
                'the sub-blocks that contain no SyncBatchNorm, or call '
                'gluon_parallel.nn.revert_sync_batchnorm(net) first for single-device '
                'inference and export.' % self.name)
        super(SyncBatchNorm, self).hybridize(active, **kwargs)

    def infer_shape(self, x, *args):
        # Deferred initialisation: every parameter has one entry per channel.
        channels = x.shape[self._axis % len(x.shape)]
        for p in self._reg_params.values():
            p.shape = (channels,)

    def hybrid_forward(self, F, x, gamma, beta, running_mean, running_var):
        if F is not nd:
            raise RuntimeError('%s is inside a hybridized block: SyncBatchNorm cannot '
                               'synchronise in a graph (see SyncBatchNorm.hybridize)' % self.name)
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
        ones = self._ones(x.context, channels)
        zeros, unit_var = self._ones(x.context, channels, 0.0), self._ones(x.context, channels, _UNIT_VAR)
        # Work relative to one sample value per channel (the pivot): with
        # inputs like 1000 + N(0, 1), float32 sums and x - mean would lose the
        # digits that matter. x - pivot is exact.
        begin, end = [0] * ndim, [1] * ndim
        begin[axis] = end[axis] = None
        pivot = nd.slice(x, begin=tuple(begin), end=tuple(end)).reshape((channels,)).detach()
        xs = _affine(x, ones, zeros, pivot, unit_var, axis)
        s1, s2 = self._channel_sums(xs, axis)

        state = replica.next_state(self, self._cross_worker or _merge_moments)
        local = nd.concat(s1, s2, pivot, dim=0)
        merged = state.pull(state.push((local, x.size // channels), replica.rank))
        if self.check_finite and not np.isfinite(merged.asnumpy()).all():
            raise FloatingPointError('%s: the batch mean or variance is NaN or Inf: the input of '
                                     'this layer holds non-finite values' % self.name)
        mean_s, var, mean = nd.split(merged.reshape((3, channels)), num_outputs=3, axis=0,
                                     squeeze_axis=True)

        # The kernel treats its mean and variance as constants; the output's
        # dependence on them goes through gamma and beta instead, which equal
        # gamma and beta exactly in value:
        #   gamma' = gamma * inv / inv_c,  beta' = beta + gamma * (mean_c - mean) * inv
        inv = nd.rsqrt(var + self._epsilon)
        inv_c, mean_c = inv.detach(), mean_s.detach()
        g = gamma if self._scale else ones
        gamma_eff = g * (inv / inv_c)
        beta_eff = beta + g * (mean_c - mean_s) * inv
        out = _affine(xs, gamma_eff, beta_eff, mean_c, var.detach(), axis, self._epsilon)

        if autograd.is_recording():     # BatchNorm updates running stats only when training
            self._update_running(replica, mean, var, running_mean, running_var)
        return out

    def _ones(self, ctx, size, value=1.0):
        """A cached constant vector (never written to)."""
        key = (ctx, size, value)
        arr = self._consts.get(key)
        if arr is None:
            arr = self._consts[key] = nd.full(size, value, ctx=ctx)
        return arr

    def _channel_sums(self, x, axis):
        """Per-channel sum and sum of squares, as matrix-vector products."""
        shape = x.shape
        channels = shape[axis]
        pre = int(np.prod(shape[:axis]))
        post = int(np.prod(shape[axis + 1:]))
        ones_pre = self._ones(x.context, pre)
        if post == 1:
            x2 = x.reshape((pre, channels))
            return nd.dot(ones_pre, x2), nd.dot(ones_pre, nd.square(x2))
        ones_post = self._ones(x.context, post)
        x2 = x.reshape((pre * channels, post))
        s1 = nd.dot(ones_pre, nd.dot(x2, ones_post).reshape((pre, channels)))
        s2 = nd.dot(ones_pre, nd.dot(nd.square(x2), ones_post).reshape((pre, channels)))
        return s1, s2

    def _update_running(self, replica, mean, var, running_mean, running_var):
        m = self._momentum
        with autograd.pause():
            new_mean = running_mean * m + mean * (1 - m)
            new_var = running_var * m + var * (1 - m)
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
    for key, child in list(block._children.items()):
        active = ancestors_active or getattr(block, '_active', False)
        if is_source(child):
            if active:
                raise RuntimeError('%s is inside a hybridized block: call hybridize(False) '
                                   'before converting its BatchNorm layers' % child.name)
            new = make(child)
            for name in _PARAMS:
                p = getattr(child, name)
                new._reg_params[name] = p     # Block.__setattr__ refuses to re-bind
                object.__setattr__(new, name, p)
                new.params._params[p.name] = p
            block._children[key] = new
            for attr, value in list(vars(block).items()):
                if value is child:
                    object.__setattr__(block, attr, new)
        else:
            _swap_batchnorm(child, is_source, make, active)
    return block


def _bn_config(bn):
    kw = bn._kwargs
    return dict(axis=kw['axis'], momentum=kw['momentum'], epsilon=kw['eps'],
                center=bn.beta._differentiable, scale=not kw['fix_gamma'],
                use_global_stats=kw['use_global_stats'], in_channels=bn.gamma.shape[0],
                prefix=bn.prefix)


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
        return _swap_batchnorm(holder, is_bn, make)._children['bn']
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
        return _swap_batchnorm(holder, is_sync, make)._children['bn']
    return _swap_batchnorm(block, is_sync, make)
