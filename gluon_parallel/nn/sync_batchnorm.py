"""SyncBatchNorm: batch normalisation with the statistics of the whole batch.

Inside a parallel call every replica computes the mean and (biased) variance
of its slice, the replicas meet once per layer at a ParallelState, and the
per-slice moments are merged weighted by their row counts (Chan et al.), so
uneven slices are exact. The merge is made of recorded MXNet ops (copies to
one device, float64 arithmetic, copies back), so the input gradient of every
replica includes what flows through the other replicas' statistics. The
gamma/beta gradients are NOT reduced here: the Trainer sums them.
"""
import os

import numpy as np
from mxnet import autograd, gluon, nd

from ..context import current_replica

__all__ = ['SyncBatchNorm', 'convert_sync_batchnorm', 'revert_sync_batchnorm']

_PARAMS = ('gamma', 'beta', 'running_mean', 'running_var')


def _merge_moments(*pushed):
    """ParallelState operation: merge per-replica (mean|var, count), float64,
    into the global mean|var, returned to every replica on its own device."""
    dst = pushed[0][0].context
    counts = [c for _, c in pushed]
    n, c2 = len(pushed), pushed[0][0].shape[0]
    c = c2 // 2
    stacked = nd.stack(*[v.as_in_context(dst) for v, _ in pushed])
    w = nd.array(counts, ctx=dst, dtype='float64').reshape((n, 1)) / float(sum(counts))
    means = nd.slice_axis(stacked, axis=1, begin=0, end=c)
    variances = nd.slice_axis(stacked, axis=1, begin=c, end=c2)
    mean = nd.sum(nd.broadcast_mul(w, means), axis=0)
    # total M2 / N = sum_i n_i/N * (var_i + (mean_i - mean)^2)
    spread = nd.square(nd.broadcast_sub(means, mean.reshape((1, c))))
    var = nd.sum(nd.broadcast_mul(w, variances + spread), axis=0)
    merged = nd.concat(mean, var, dim=0)
    return [merged.as_in_context(v.context) for v, _ in pushed]


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
        axes = tuple(i for i in range(ndim) if i != axis)
        shape = [1] * ndim
        shape[axis] = channels
        # Work relative to one sample value per channel: with inputs like
        # 1000 + N(0, 1), float32 moments and x * scale + shift would lose
        # the digits that matter. The shift is a constant for autograd.
        pivot = x
        for a in axes:
            pivot = nd.slice_axis(pivot, axis=a, begin=0, end=1)
        pivot = nd.stop_gradient(pivot)
        xs = nd.broadcast_sub(x, pivot)
        mean_s, var = nd.moments(xs, axes=axes)
        pivot64 = nd.cast(pivot.reshape((channels,)), 'float64')
        local = nd.concat(nd.cast(mean_s, 'float64') + pivot64, nd.cast(var, 'float64'), dim=0)

        state = replica.next_state(self, _merge_moments)
        merged = state.pull(state.push((local, x.size // channels), replica.rank))
        if self.check_finite and not np.isfinite(merged.asnumpy()).all():
            raise FloatingPointError('%s: the batch mean or variance is NaN or Inf: the input of '
                                     'this layer holds non-finite values' % self.name)
        mean64, var64 = nd.split(merged.reshape((2, channels)), num_outputs=2, axis=0,
                                 squeeze_axis=True)
        mean_s = nd.cast(mean64 - pivot64, 'float32')      # global mean, shifted
        var = nd.cast(var64, 'float32')

        inv_std = nd.rsqrt(var + self._epsilon)
        scale = gamma * inv_std if self._scale else inv_std
        shift = beta - mean_s * scale
        out = nd.broadcast_add(nd.broadcast_mul(xs, scale.reshape(shape)), shift.reshape(shape))

        if autograd.is_recording():     # BatchNorm updates running stats only when training
            self._update_running(replica, nd.cast(mean64, 'float32'), var,
                                 running_mean, running_var)
        return out

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
