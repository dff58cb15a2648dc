"""``gluon_parallel.Trainer``: ``gluon.Trainer`` with the step's reduction
and update each a few Python calls, whatever the number of devices and
parameters.

``gluon.Trainer`` reduces and updates one parameter at a time, each
through several layers of Python. This Trainer is the same class (a
subclass: same constructor, methods, state and results) whose step

* keeps each device's gradients as views of flat buckets
  (:mod:`gluon_parallel.buckets`) and sums them with one batched kvstore
  push/pull of one key per bucket (one C call), and
* updates with MXNet's multi-tensor SGD operators (``multi_sgd_update``,
  ``multi_sgd_mom_update``, their ``multi_mp_`` forms for float16 weights
  with ``multi_precision``): one C call per device and chunk of weights of
  similar size (at most 60, see :func:`_size_chunks`), the
  learning rates and weight decays (scheduler, ``lr_mult``, ``wd_mult``),
  ``rescale_grad`` and ``clip_gradient`` exactly as Gluon's SGD passes them.

The optimizer state lives where Gluon keeps it (each device's ``Updater``
states, the update counts): state files go both ways between this
Trainer and Gluon's, and a step may take either path.

What runs Gluon's own code instead: :class:`Trainer`'s Notes.

MXNet 1.9.1 inherited state this class reads through ``self``:
``_params``, ``_contexts``, ``_optimizer``, ``_updaters``, ``_kvstore``,
``_update_on_kvstore``, ``_kvstore_params``, ``_contains_sparse_weight`` /
``_contains_sparse_grad`` and ``_amp_loss_scaler`` (set by
``amp.init_trainer``).
"""
from typing import NamedTuple

import numpy as np
import mxnet as mx

from . import _gluon
from .buckets import (DEFAULT_CAP_MB, FIRST_CAP_MB, LINK_MIN_BUCKETS, Buckets, check_cap,
                      order_of_use, reduction)
from .compression import check_compression
from . import progress
from .links import is_dist

__all__ = ['Trainer', 'make_buckets', 'zero_in_buckets']


class _Reduction(NamedTuple):
    """The push/pulls of one arrangement of the gradient arrays."""
    key: tuple
    pushpull: object        # callable
    summed: list            # the parameters it sums (with row-sparse gradients: Gluon the rest)


class _Chunk(NamedTuple):
    """Weights of one dtype and similar size (:func:`_size_chunks`), updated
    by one operator per device."""
    select: list            # positions in _Update.indices
    ops: list               # one _gluon.prepared_op per device


class _Update(NamedTuple):
    """The fused update of one arrangement of arrays and optimizer state."""
    key: tuple
    indices: list           # the trainer's indices of the updated parameters
    device_ids: list
    data: list              # every updated array, for the fresh-gradient marks
    chunks: list
    params: dict            # operator parameters -> their C strings (the last steps')


def _op_name(multi_precision, momentum):
    return 'multi_{}sgd_{}update'.format('mp_' if multi_precision else '',
                                         'mom_' if momentum else '')


class Trainer(_gluon.TrainerHooks):
    """A drop-in ``gluon.Trainer`` whose step is a few Python calls.

    Same parameters, methods and results as :class:`mxnet.gluon.Trainer`
    (what it fuses: the module documentation; what it does not: Notes,
    below); ``gluon_parallel.step``, AMP's
    ``amp.init_trainer`` and ``gluon_parallel.dist`` take it as they take
    Gluon's.

    **Gradient buckets.** Each device's dense gradients live in flat
    buckets (per dtype and ``grad_req``, at most `bucket_cap_mb` each),
    every bucket summed as one kvstore key: one push/pull per bucket
    (``device``/``local``; ``dist_sync``: one ps-lite message each way, or
    one per server for a bucket of ``MXNET_KVSTORE_BIGARRAY_BOUND``
    elements or more, which MXNet splits evenly over the servers; Horovod:
    one all-reduce per bucket). The buckets are made when the
    Trainer is constructed, or, while parameters wait for deferred
    initialisation, at a DataParallel's first call (else the first step);
    from then on ``p.grad()`` and ``p.list_grad()`` return views of them,
    which backward writes and the step reads. A gradient array taken
    before then is no longer the parameter's gradient: backward does not
    write it, the step does not read it, it keeps its old values (the
    Trainer warns at its next step if such an array is still referenced).
    Take gradient arrays after creating the Trainer. New arrays
    (``reset_ctx``, a new ``grad_req``, ``cast``) go in new buckets at the
    next step. See :mod:`gluon_parallel.buckets`.

    Parameters
    ----------
    params : ParameterDict, dict or list of Parameter
        The parameters to train, all on the same contexts.
    optimizer : str or Optimizer
    optimizer_params : dict, optional
    kvstore : str or KVStore, default 'device'
    compression_params : dict, optional
    update_on_kvstore : bool, optional
        None (default) updates on the devices, fused, unless the kvstore
        is a ``dist_*`` one, where Gluon chooses.
    bucket_cap_mb : float, default 25
        Each device's gradients live in flat buckets of at most this many
        megabytes (:mod:`gluon_parallel.buckets`: from the Trainer's
        construction, or as soon as the parameters are initialised,
        ``p.grad()`` returns a view of a bucket), each summed as one
        kvstore key. 0 or None: the gradients stay Gluon's own arrays,
        summed one key per parameter.
    compression : {None, 'fp16'}
        'fp16': each float32 (or float64) bucket is summed as a float16
        copy, cast back after (Horovod's ``Compression.fp16``, DDP's
        ``fp16_compress_hook``): half the bytes on the link, the sums
        rounded to float16 (11 significant bits). Needs buckets. MXNet's
        own kvstore compression (``compression_params={'type': '2bit',
        'threshold': t}``) is passed to the kvstore as Gluon's Trainer
        does.

    Raises
    ------
    ValueError
        An unknown optimizer name, parameters on different contexts, or a
        compression other than None and 'fp16' (or without buckets).

    Notes
    -----
    What runs Gluon's own code instead of the fused step (the same
    results, Gluon's speed):

    * the update of any optimizer but SGD (MXNet 1.9.1 has no multi-tensor
      operator for NAG or Adam: its ``multi_adamw_update`` decouples the
      weight decay, which is not Adam's update; LAMB and LARS keep their own
      per-chunk code), and of an SGD with ``MXNET_OPTIMIZER_AGGREGATION_SIZE=0``
      (Gluon then runs per-parameter operators); the reduction stays batched;
    * sparse weights or gradients: the update, and the reduction of the
      row-sparse gradients (the dense ones are still summed bucket by bucket);
    * updates on the kvstore: ``update_on_kvstore=True``, or a ``dist_*``
      kvstore left to choose (``gluon_parallel.dist.init_trainer`` sets
      False); a local kvstore left to choose (None) updates on the devices
      here, where Gluon would update on the kvstore: the same arithmetic;
    * a kvstore that is not MXNet's own: its reduction runs key by key (one
      key per bucket), the update stays fused; ``dist``'s Horovod store sums
      every bucket with its own all-reduce, in the order backward writes them;
    * a step where some gradient is stale: Gluon raises, or with
      ``ignore_stale_grad=True`` skips exactly the stale copies.
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore='device',
                 compression_params=None, update_on_kvstore=None, *,
                 bucket_cap_mb=DEFAULT_CAP_MB, compression=None):
        if isinstance(optimizer, str) and \
                optimizer.lower() not in mx.optimizer.Optimizer.opt_registry:
            raise ValueError('unknown optimizer {!r}: MXNet knows {}'.format(
                optimizer, ', '.join(sorted(mx.optimizer.Optimizer.opt_registry))))
        _check_same_contexts(params)
        cap = check_cap(bucket_cap_mb)
        check_compression(compression, cap)
        super().__init__(params, optimizer, optimizer_params, kvstore, compression_params,
                         update_on_kvstore)
        if update_on_kvstore is None and not is_dist(kvstore):
            self._kvstore_params['update_on_kvstore'] = False
        self._arrays_key = None
        self._reduction = None
        self._fused = None
        #: Whether the reduction crosses a link (a dist or Horovod store).
        self._over_link = is_dist(kvstore)
        first = min(cap, check_cap(FIRST_CAP_MB)) if self._over_link else None
        self._buckets = Buckets(self._contexts, cap, self, first,
                                order_of_use(params, self._params), compression,
                                LINK_MIN_BUCKETS if self._over_link else None) if cap else None
        self._make_buckets()

    # ------------------------------------------------------------ public --

    def step(self, batch_size, ignore_stale_grad=False):
        """One step: sum the gradients over the devices, then update.

        Parameters
        ----------
        batch_size : int or float
            Gradients are divided by it; positive.
        ignore_stale_grad : bool, default False
            As ``gluon.Trainer.step``.

        Raises
        ------
        ValueError
            A batch size that is not positive, or a parameter no longer on
            the Trainer's contexts; before anything is reduced or updated.
        """
        _check_batch_size(batch_size)
        self._check_arrays()
        super().step(batch_size, ignore_stale_grad)

    def update(self, batch_size, ignore_stale_grad=False):
        """``gluon.Trainer.update`` (after :meth:`allreduce_grads`), with
        the checks of :meth:`step`."""
        _check_batch_size(batch_size)
        self._check_arrays()
        super().update(batch_size, ignore_stale_grad)

    def allreduce_grads(self):
        """``gluon.Trainer.allreduce_grads``, batched."""
        self._check_arrays()
        super().allreduce_grads()

    def load_states(self, fname):
        """``gluon.Trainer.load_states``: a file of either Trainer."""
        super().load_states(fname)
        self._fused = None          # new state arrays, maybe a new optimizer

    # ------------------------------------------------------------- hooks --

    def fused_allreduce(self):
        if not self._kvstore:
            return True             # one device, or kvstore=None: nothing to sum
        if self._update_on_kvstore:
            return False
        key = (self._arrays_key, id(self._kvstore))
        sparse = self._contains_sparse_grad
        if self._reduction is None or self._reduction.key != key:
            pushpull, summed = reduction(self._kvstore, self._params, self._buckets,
                                         dense_only=sparse,
                                         separate=bool(self._compression_params))
            self._reduction = _Reduction(key, pushpull,
                                         [self._params[i] for i in summed] if sparse else [])
        if self._over_link:
            progress.reduce(id(self), self._reduction.pushpull)
        else:
            self._reduction.pushpull()
        if sparse:
            self.gluon_allreduce(skip=self._reduction.summed)
        return True

    def fused_update(self, ignore_stale_grad):
        opt = self._optimizer
        if not (type(opt) is mx.optimizer.SGD and opt.aggregate_num > 0 and opt.momentum >= 0
                and not self._contains_sparse_weight and not self._contains_sparse_grad
                and not (self._kvstore and self._update_on_kvstore)):
            return False
        plan = self._fused_update_plan(opt)
        if not all(_gluon.grads_fresh(plan.data)):
            return False            # Gluon raises, or skips the stale copies
        scaler = getattr(self, '_amp_loss_scaler', None)
        if scaler is not None and scaler.has_overflow(self._params):
            return True             # AMP skips this step
        if not plan.indices:
            return True
        _gluon.count_updates(opt, plan.device_ids, plan.indices)
        lrs, wds = _gluon.lrs_and_wds(opt, plan.indices)
        common = {'rescale_grad': opt.rescale_grad}
        if opt.momentum > 0:
            common['momentum'] = opt.momentum
        if opt.clip_gradient:
            common['clip_gradient'] = opt.clip_gradient
        for chunk in plan.chunks:
            values = (tuple([lrs[j] for j in chunk.select]),
                      tuple([wds[j] for j in chunk.select]), *common.items())
            strings = plan.params.get(values)
            if strings is None:
                # (formatted once while the learning rates stay the same)
                if len(plan.params) > 4 * len(plan.chunks):
                    plan.params.clear()
                strings = plan.params[values] = _gluon.op_params(dict(
                    num_weights=len(chunk.select), lrs=list(values[0]), wds=list(values[1]),
                    **common))
            _gluon.invoke(chunk.ops, strings)
        _gluon.set_grads_fresh(plan.data, False)
        return True

    # ---------------------------------------------------------- internals --

    def _check_arrays(self):
        """Check that every parameter is on the Trainer's contexts whenever
        its arrays changed (``initialize``, ``reset_ctx``, a new grad_req),
        and put new gradient arrays in buckets."""
        if self._buckets is not None and self._buckets.suspects:
            self._buckets.check_replaced()
        key = _gluon.param_arrays_state(self._params)
        if key != self._arrays_key:
            for p in self._params:
                if _gluon.has_data(p) and p.list_ctx() != self._contexts:
                    raise ValueError(
                        f'parameter {p.name} is on {p.list_ctx()} but the Trainer steps on '
                        f'{self._contexts}: every parameter of a Trainer must be on each of '
                        'its contexts (create the Trainer after initialize/reset_ctx)')
            if self._make_buckets():
                key = _gluon.param_arrays_state(self._params)
            self._arrays_key = key

    def _zero_in_buckets(self, params, contexts):
        """zero_in_buckets for this Trainer's parameters among `params`."""
        buckets = getattr(self, '_buckets', None)
        if buckets is None:
            return []
        index = {id(p): i for i, p in enumerate(self._params)}
        chosen = {index[id(p)] for p in params if id(p) in index}
        return [self._params[i] for i in buckets.zero(self._params, chosen, contexts)]

    def _make_buckets(self):
        """Put new gradient arrays in buckets (:mod:`gluon_parallel.buckets`),
        once every trained parameter has its arrays, on the Trainer's
        contexts. Returns whether the buckets changed."""
        if self._buckets is None:
            return False
        for p in self._params:
            if _gluon.true_grad_req(p) != 'null' and \
                    (not _gluon.has_data(p) or p.list_ctx() != self._contexts):
                return False        # (deferred initialisation: later)
        if not self._buckets.refresh(self._params):
            return False
        self._reduction = None
        return True

    def _fused_update_plan(self, opt):
        momentum, mp = opt.momentum > 0, bool(opt.multi_precision)
        key = (self._arrays_key, id(opt), momentum, mp,
               tuple([id(u.states) for u in self._updaters]))
        if self._fused is not None and self._fused.key == key:
            return self._fused
        params = self._params
        indices = [i for i, p in enumerate(params) if p.grad_req != 'null']
        data = [[params[i].list_data()[k] for i in indices] for k in range(len(self._contexts))]
        grads = [[params[i].list_grad()[k] for i in indices]
                 for k in range(len(self._contexts))]
        for updater, weights in zip(self._updaters, data):
            _ensure_states(updater, indices, weights)
        # One group per weight dtype, as Gluon's Updater; chunks of weights
        # of similar size (_size_chunks).
        groups = {}
        for j, w in enumerate(data[0] if data else []):
            groups.setdefault(np.dtype(w.dtype), []).append(j)
        chunks = []
        for dtype, positions in groups.items():
            chunk_mp = mp and dtype == np.float16
            name = _op_name(chunk_mp, momentum)
            for part in _size_chunks(positions, [data[0][j].size for j in positions]):
                ops = []
                for k, updater in enumerate(self._updaters):
                    inputs = []
                    for j in part:
                        state = updater.states[indices[j]]
                        inputs += [data[k][j], grads[k][j]] + _state_inputs(state, chunk_mp,
                                                                            momentum)
                    ops.append(_gluon.prepared_op(name, inputs, [data[k][j] for j in part]))
                chunks.append(_Chunk(part, ops))
        self._fused = _Update(key, indices, [c.device_id for c in self._contexts],
                              [a for per_device in data for a in per_device], chunks, {})
        return self._fused


#: A chunk may do this many element steps more than its weights' sizes
#: (see _size_chunks).
SLACK = 4096


def _size_chunks(positions, sizes, limit=None):
    """`positions` cut into the chunks of one multi-tensor operator each:
    sorted by size, at most `limit` (MXNet's 60) per chunk, and a chunk
    grows only while its count times its largest size stays within twice
    its total size (+ SLACK). MXNet 1.9.1's multi-tensor SGD kernel
    (``MultiSGDKernel``) visits every weight of the operator at each index
    up to the largest size, so an operator costs count x largest, not the
    sum of the sizes: ResNet-20's 65 weights in their own order as chunks
    of 60 took 4.0 ms per device, sorted into 4 chunks 1.7 ms (Gluon's
    groups of four: 2.7 ms)."""
    limit = limit or _gluon.MULTI_TENSOR_MAX
    chunks, part, total = [], [], 0
    for size, j in sorted(zip(sizes, positions)):
        if part and (len(part) == limit or (len(part) + 1) * size > 2 * (total + size) + SLACK):
            chunks.append(part)
            part, total = [], 0
        part.append(j)
        total += size
    if part:
        chunks.append(part)
    return chunks


def _state_inputs(state, multi_precision, momentum):
    """The optimizer-state arrays the multi-tensor operator reads after a
    weight and its gradient (SGD's state: the momentum or None; with
    multi-precision, (momentum or None, float32 weight))."""
    if multi_precision:
        return ([state[0]] if momentum else []) + [state[1]]
    return [state] if momentum else []


def _ensure_states(updater, indices, weights):
    """Create or move to its device each parameter's optimizer state, as
    Gluon's ``Updater`` does on its first call after creation or
    ``set_states``."""
    for i, w in zip(indices, weights):
        if i not in updater.states:
            updater.states[i] = updater.optimizer.create_state_multi_precision(i, w)
            updater.states_synced[i] = True
        elif not updater.states_synced[i]:
            updater.states[i] = updater.sync_state_context(updater.states[i], w.context)
            updater.states_synced[i] = True


def _check_batch_size(batch_size):
    if not batch_size > 0:
        raise ValueError(f'batch_size must be positive, got {batch_size!r}: gradients are '
                         'divided by it')


def _check_same_contexts(params):
    """gluon.Trainer asserts this; a ValueError that names both contexts."""
    plist = [params[k] for k in sorted(params.keys())] if hasattr(params, 'keys') else params
    first = None
    for p in plist if isinstance(plist, (list, tuple)) else []:
        if isinstance(p, mx.gluon.Parameter) and (_gluon.has_data(p) or _gluon.is_deferred(p)):
            ctx = p.list_ctx()
            if first is None:
                first = (p, ctx)
            elif ctx != first[1]:
                raise ValueError(f'parameter {p.name} is on {ctx} but {first[0].name} on '
                                 f'{first[1]}: a Trainer\'s parameters must all be on the '
                                 'same contexts')


def make_buckets(params):
    """Have the ``gluon_parallel.Trainer`` of `params` put their gradients in
    buckets now if it can (DataParallel's first call, after the deferred
    initialisation: before graph mode binds the gradient arrays)."""
    for trainer in _gluon.param_trainers(params):
        if isinstance(trainer, Trainer):
            trainer._make_buckets()


def zero_in_buckets(params, contexts):
    """Zero the gradients of `params` on `contexts` that the
    ``gluon_parallel.Trainer`` of `params` holds in 'write' buckets of these
    parameters only, a bucket at a time; returns the parameters done."""
    done = []
    for trainer in _gluon.param_trainers(params):
        if isinstance(trainer, Trainer):
            done += trainer._zero_in_buckets(params, contexts)
    return done
