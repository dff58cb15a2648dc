"""SyncBatchNorm: batch normalisation with the statistics of the whole batch.

Inside a parallel call, in training, the layer's computation is a graph cut
at a barrier (syncgraph/stages.py, the arithmetic in syncgraph/stats.py): before it, each
replica's per-channel sums of x and x^2 in float64 and a pivot (one sample
per channel); at the barrier the replicas hand each other their sums; after
it, every replica merges all sums weighted by their row counts (so uneven
slices are exact) and applies ``(x - pivot) * scale + shift`` with
BatchNorm's fused kernel. The merge is part of each replica's recorded
graph, so the input gradient of every replica includes what flows through
the other replicas' statistics. The gamma/beta gradients are NOT reduced
here: the Trainer sums them.

In a hybridized network the layer traces as a BatchNorm node marked with
its id (its mark, from the layer registry ``syncgraph/layers.py``); the
parallel calls (and a layer given a reducer) route Gluon's hybridized calls
through ``syncgraph/routing.py``, which runs such a graph in stages
(syncgraph/rendezvous.py) inside parallel calls. In
imperative mode the layer runs its own graph the same way, two cached
graphs per call, so both modes compute the same thing with the same code.
A layer with a reducer (e.g. synchronised across worker processes) merges
one entry instead: its process's totals, reduced over the group.

In graph mode (``DataParallel(..., graph=True)``: every replica in one
executor graph, ``gluon_parallel.graph``), the layer's marked node is
rewritten inside that graph instead: the statistics' merge, the running
statistics and their order against backward are all in
``gluon_parallel/syncgraph/in_graph.py``.

dtypes follow BatchNorm: float32; float64 throughout; float16 (or, under
AMP, bfloat16) data with float32 parameters; the sums are float64.
"""
from __future__ import annotations

import json
import os
import warnings
import weakref
from collections.abc import Callable

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

from .. import _gluon
from ..replica_context import current_replica
from ..syncgraph import (MARK, batchnorm_attrs, dtype_name, ensure_routing, layers, param_dtype,
                         run_staged, staged_graph)
from . import kernels, tracing

__all__ = ['SyncBatchNorm', 'convert_sync_batchnorm', 'revert_sync_batchnorm']

_PARAMS = ('gamma', 'beta', 'running_mean', 'running_var')
_LAYER_FLAGS = [('static_alloc', True)]     # of an imperative layer's own stages


class SyncBatchNorm(gluon.nn.BatchNorm):
    """Batch normalisation over the whole batch of a DataParallel call.

    Same arguments and parameter names as :class:`mxnet.gluon.nn.BatchNorm`.
    Inside :class:`~gluon_parallel.DataParallel` (or ``parallel_apply``), in
    training mode, it normalises with the mean and variance of the whole
    batch across all replicas, weighted by each slice's row count, and
    updates the running statistics identically on every context of the
    model (those idle in the call included). Outside a parallel call
    (unless it has a :attr:`reducer`), in predict mode, or with
    ``use_global_stats=True`` it is exactly BatchNorm.

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
    :mod:`gluon_parallel.syncgraph.stages`); elsewhere the graph is the block's
    own, with BatchNorm in place of each SyncBatchNorm. A layer with a
    :attr:`reducer` (synchronised across worker processes) works the same
    way in both modes.
    """

    def __init__(self, axis: int = 1, momentum: float = 0.9, epsilon: float = 1e-5,
                 center: bool = True, scale: bool = True, use_global_stats: bool = False,
                 beta_initializer='zeros', gamma_initializer='ones',
                 running_mean_initializer='zeros', running_variance_initializer='ones',
                 in_channels: int = 0, num_devices: int | None = None,
                 check_finite: bool | None = None, **kwargs) -> None:
        super().__init__(
            axis=axis, momentum=momentum, epsilon=epsilon, center=center, scale=scale,
            use_global_stats=use_global_stats, beta_initializer=beta_initializer,
            gamma_initializer=gamma_initializer,
            running_mean_initializer=running_mean_initializer,
            running_variance_initializer=running_variance_initializer,
            in_channels=in_channels, **kwargs)
        if num_devices is not None and int(num_devices) < 1:
            raise ValueError(f'num_devices must be positive, got {num_devices!r}')
        self.num_devices = None if num_devices is None else int(num_devices)
        if check_finite is None:
            check_finite = os.environ.get('GLUON_PARALLEL_CHECK_FINITE', '0') not in ('', '0')
        self.check_finite = bool(check_finite)
        if not layers.any_layers():
            kernels.load()          # (the first layer alive: a build there is used from now on)
        self._mark = layers.register(self)

    def check_devices(self, num_ctx: int) -> None:
        """Raise ValueError when the layer was built for another device
        count (``num_devices``) than the parallel call's `num_ctx`."""
        if self.num_devices is not None and self.num_devices != num_ctx:
            raise ValueError(f'{self.name} was built with num_devices={self.num_devices}, '
                             f'but DataParallel runs on {num_ctx} devices')

    @staticmethod
    def kernel_ops() -> kernels.Kernels | None:
        """The optional kernels' operators its graphs use (asked when a
        graph is built), or None: ``nn.kernels.available()``."""
        return kernels.available()

    def _alias(self):
        # Gluon names a block's prefix, and so its parameters, from its
        # alias: BatchNorm's ('batchnorm3_gamma'), so that a SyncBatchNorm
        # is a drop-in for BatchNorm's parameter names wherever names come
        # from the prefix (a base traced to a symbol, as GluonCV's SSD
        # builds it with norm_layer=SyncBatchNorm; files saved by name).
        return 'batchnorm'

    @property
    def reducer(self) -> Callable[[SyncBatchNorm, nd.NDArray], nd.NDArray] | None:
        """A reduction of this layer's batch statistics over a larger group
        than the devices of the parallel call (the workers of a dist job:
        :func:`gluon_parallel.dist.sync_batchnorm_across_workers` sets it),
        or None (default). With a reducer, the layer synchronises in
        training mode outside parallel calls too (as a group of one device).

        Called once per use of the layer in a training forward, per
        process, in one of the replicas' threads, as ``reducer(layer,
        totals)``: `totals` is a float64 NDArray of shape (3, C), the
        per-channel sum of x, sum of x^2 and row count of this process's
        batch, and the reducer returns those of the group's batch, same
        shape and dtype, recorded by autograd (its gradient with respect to
        `totals` is what makes the input gradients whole-group exact; an
        unrecorded result raises RuntimeError). Every member of the group
        must run the same network in the same mode (imperative or
        hybridized: a hybridized graph reaches layers that share a barrier
        in graph order), so that the calls match one for one. Set it
        between calls, not while one runs. The sums are about zero, so for
        float64 data the variance keeps about 16 - log10(mean^2 / var)
        digits (float32 data loses nothing it can show).
        """
        return self.__dict__.get('_reducer')

    def __setattr__(self, name, value):
        if name != 'reducer':
            super().__setattr__(name, value)
            return
        # Not through Block.__setattr__, which would register a Block-typed
        # reducer as a child (and then refuse to set it back to None).
        if value is not None and not callable(value):
            raise TypeError(f'{self.name}: a reducer must be callable, got {value!r}')
        self.__dict__['_reducer'] = value
        layers.set_reducer(self, value is not None)
        if value is not None:
            # A hybridized network holding it synchronises outside parallel
            # calls too: its calls are routed (syncgraph/routing.py).
            ensure_routing()

    def infer_shape(self, x, *args):
        # Deferred initialisation: every parameter has one entry per channel.
        channels = x.shape[self._kwargs['axis'] % len(x.shape)]
        for p in self._reg_params.values():
            p.shape = (channels,)

    def hybrid_forward(self, F, x, gamma, beta, running_mean, running_var):
        if F is not nd:
            # In a graph: BatchNorm, marked so that the staged runner
            # synchronises it inside parallel calls (route); unmarked
            # when the graph is for inference only.
            if self._kwargs['use_global_stats'] or tracing.exporting():
                return F.BatchNorm(x, gamma, beta, running_mean, running_var, name='fwd',
                                   **self._kwargs)
            with mx.AttrScope(**{MARK: self._mark}):
                return F.BatchNorm(x, gamma, beta, running_mean, running_var, name='fwd',
                                   **self._kwargs)
        replica = current_replica()
        # One code path inside a parallel call whatever the device count, so
        # 1, 2 and 4 devices compute the same thing; outside one, a layer
        # with a reducer is a group of one device.
        if (replica is None and self.reducer is None) or self._kwargs['use_global_stats'] \
                or not autograd.is_training():
            return super().hybrid_forward(
                F, x, gamma, beta, running_mean, running_var)
        self._check_input(x, gamma)
        # The layer's own graph, cut at the barrier: the same two cached
        # graphs and rendezvous as in a hybridized network (syncgraph).
        # static_alloc: measured 5-10 % faster per ResNet-20 step than
        # dynamic graphs (static_shape would re-plan at every uneven split).
        staged = staged_graph(self, (x,), flags=_LAYER_FLAGS)
        return run_staged(staged, (x,), replica, layers.has_reducers())[0]

    def _check_input(self, x, gamma):
        axis = self._kwargs['axis']
        channels = x.shape[axis % x.ndim]
        if gamma.shape[0] != channels:
            raise ValueError(f'{self.name} expects {gamma.shape[0]} channels on axis {axis}, '
                             f'but the input {x.shape} has {channels}')
        dtype = param_dtype(x.dtype)
        if np.dtype(gamma.dtype) != dtype:
            raise TypeError(f'{self.name}: {dtype_name(x.dtype)} input needs {dtype} parameters, '
                            f'as BatchNorm (net.cast() sets them), but they are '
                            f'{dtype_name(gamma.dtype)}')


def _swap_batchnorm(block, is_source, make, rewrite, ancestors_active=False):
    """Replace every child for which is_source(child) by make(child),
    sharing the child's Parameter objects (values, contexts, gradients);
    rewrite(block) the graph of every symbol block. Returns how many
    layers changed."""
    if _gluon.is_symbol_block(block):
        return rewrite(block)
    children, changed = _gluon.children(block), 0
    for key, child in list(children.items()):
        active = ancestors_active or _gluon.is_active_hybrid(block)
        if _gluon.is_symbol_block(child) and active:
            raise RuntimeError(f'{child.name} is inside a hybridized block: call '
                               'hybridize(False) before converting its BatchNorm layers')
        if is_source(child):
            if active:
                raise RuntimeError(f'{child.name} is inside a hybridized block: call '
                                   'hybridize(False) before converting its BatchNorm layers')
            new = make(child)
            for name in _PARAMS:
                _gluon.replace_param(new, name, getattr(child, name))
            children[key] = new
            for attr, value in list(vars(block).items()):
                if value is child:
                    object.__setattr__(block, attr, new)
            changed += 1
        else:
            changed += _swap_batchnorm(child, is_source, make, rewrite, active)
    return changed


def _bn_config(bn):
    return dict(_gluon.batchnorm_config(bn), in_channels=bn.gamma.shape[0], prefix=bn.prefix)


def convert_sync_batchnorm(block: gluon.Block, num_devices: int | None = None) -> gluon.Block:
    """Replace every ``gluon.nn.BatchNorm`` inside `block` by a SyncBatchNorm
    with the same configuration and the same Parameter objects (so values,
    contexts and parameter names are kept), in place. Inside a symbol-built
    block (``gluon.SymbolBlock``: GluonCV's SSD base, a network loaded
    from a symbol file), each BatchNorm operator of its symbol becomes a
    SyncBatchNorm's, on the same parameters.

    Parameters
    ----------
    block : Block
        Must not be hybridized (convert first, or ``hybridize(False)``);
        a symbol block may be.
    num_devices : int, optional
        Passed to every SyncBatchNorm.

    Returns
    -------
    Block
        `block` itself (a lone BatchNorm is returned converted).

    Warns
    -----
    UserWarning
        When a BatchNorm operator of a symbol cannot be converted (its
        parameters are not the block's), naming it, or when `block` holds
        no BatchNorm at all.
    """
    def is_bn(b):
        return isinstance(b, gluon.nn.BatchNorm) and not isinstance(b, SyncBatchNorm)

    def make(bn):
        return SyncBatchNorm(num_devices=num_devices, **_bn_config(bn))

    if is_bn(block):
        holder = gluon.Block(prefix='')
        holder.register_child(block, 'bn')
        _swap_batchnorm(holder, is_bn, make, None)
        return _gluon.children(holder)['bn']
    if not _swap_batchnorm(block, is_bn, make, lambda b: _mark_symbol(b, num_devices)):
        warnings.warn(f'convert_sync_batchnorm: {block.name} holds no BatchNorm layer or '
                      'operator: nothing converted', stacklevel=2)
    return block


def revert_sync_batchnorm(block: gluon.Block) -> gluon.Block:
    """Replace every SyncBatchNorm inside `block` by a ``gluon.nn.BatchNorm``
    sharing its parameters (in a symbol block: its SyncBatchNorm operators
    by BatchNorm's), in place, e.g. to hybridize and export a trained
    network for single-device inference. Returns `block`."""
    def is_sync(b):
        return isinstance(b, SyncBatchNorm)

    def make(bn):
        return gluon.nn.BatchNorm(**_bn_config(bn))

    if is_sync(block):
        holder = gluon.Block(prefix='')
        holder.register_child(block, 'bn')
        _swap_batchnorm(holder, is_sync, make, None)
        return _gluon.children(holder)['bn']
    _swap_batchnorm(block, is_sync, make, _unmark_symbol)
    return block


#: symbol block -> the SyncBatchNorm layers its marked operators name (kept
#: alive for syncgraph.layers.layer_of: their num_devices, reducer and checks).
_SYMBOL_LAYERS = weakref.WeakKeyDictionary()


def _mark_symbol(block, num_devices):
    """Mark every BatchNorm operator of a symbol block's graph as a new
    SyncBatchNorm's, on the operator's own parameters (those with fixed
    statistics stay: a SyncBatchNorm with them is BatchNorm). Returns how
    many BatchNorm operators the graph holds."""
    graph = json.loads(_gluon.symbol_graph(block).tojson())
    nodes, params = graph['nodes'], block.collect_params()
    found, made, skipped = 0, [], []
    for node in nodes:
        attrs = node.setdefault('attrs', {})
        if node['op'] != 'BatchNorm':
            continue
        found += 1
        if MARK in attrs or batchnorm_attrs(attrs).use_global_stats:
            continue
        inputs = [nodes[e[0]] for e in node['inputs'][1:]]
        if any(n['op'] != 'null' or n['name'] not in params for n in inputs):
            skipped.append(node['name'])
            continue
        layer = SyncBatchNorm(**_node_config(attrs), num_devices=num_devices,
                              prefix=node['name'].rsplit('fwd', 1)[0])
        for attr, n in zip(_PARAMS, inputs):
            _gluon.replace_param(layer, attr, params[n['name']])
        attrs[MARK] = layer._mark
        made.append(layer)
    if skipped:
        warnings.warn(f'convert_sync_batchnorm: in {block.name}, the BatchNorm operators '
                      f'{", ".join(skipped)} read parameters that are not the block\'s own: '
                      'left as BatchNorm', stacklevel=4)
    if made:
        _SYMBOL_LAYERS.setdefault(block, []).extend(made)
        _gluon.set_symbol_graph(block, mx.sym.load_json(json.dumps(graph)))
    return found


def _unmark_symbol(block):
    graph = json.loads(_gluon.symbol_graph(block).tojson())
    marked = [n for n in graph['nodes'] if MARK in n.get('attrs', {})]
    for node in marked:
        del node['attrs'][MARK]
    if marked:
        _gluon.set_symbol_graph(block, mx.sym.load_json(json.dumps(graph)))
    _SYMBOL_LAYERS.pop(block, None)
    return len(marked)


def _node_config(attrs):
    """SyncBatchNorm's arguments from a BatchNorm operator's attributes."""
    bn = batchnorm_attrs(attrs)
    return dict(axis=bn.axis, momentum=bn.momentum, epsilon=bn.eps, scale=not bn.fix_gamma,
                use_global_stats=bn.use_global_stats)
