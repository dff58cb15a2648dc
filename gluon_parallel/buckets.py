"""Gradient buckets: each device's gradients as views of a few flat arrays,
so that a step sums a bucket, not a parameter, at a time.

:class:`gluon_parallel.Trainer` keeps every device's dense gradients in
buckets: flat arrays grouped by dtype and ``grad_req``, filled from the
Trainer's last parameter back (the order backward writes the gradients of
a network whose parameters are listed in the order of use, as Gluon's
``collect_params`` lists a model zoo's) up to ``bucket_cap_mb`` megabytes
each (25, as PyTorch DDP's; a larger gradient has a bucket of its own;
where the reduction crosses a link, each group's first bucket at most
``FIRST_CAP_MB``, as DDP's), every parameter's gradient a view at an
offset aligned to 64 bytes. The buckets are summed in that order, so the
first one's reduction can start while backward still writes the others
(graph mode's backward is cut into engine operations for that where
there is a link: :mod:`gluon_parallel.graph.executor`). Row-sparse
gradients stay as they are. The step sums each bucket over the devices
(and workers) as one kvstore key: one push/pull per bucket, where Gluon
makes one per parameter (PyTorch DDP's ``gradient_as_bucket_view``,
Horovod's tensor fusion). With ``dist_sync`` a key is one ps-lite message
each way; MXNet splits a key of ``MXNET_KVSTORE_BIGARRAY_BOUND`` elements
or more (default 10**6) evenly over the servers, one message each, and
sends a smaller one whole to one server (key x 9973 mod servers), so a
model smaller than the bound is summed on one server. A parameter that
``gp.step`` hides from a step (no replica used it) adds zeros to its
bucket's sum and keeps its own gradient values, as Gluon leaves its key
alone: summed, a stale gradient would grow by the device count at every
step it stays unused.

The contract
------------
The buckets are made once: when the Trainer is constructed if every
trained parameter has its arrays, else when a DataParallel's first call
has finished their deferred initialisation, else at the Trainer's first
``step`` / ``allreduce_grads`` (the gradients then are copied in). From
then on ``p.grad(ctx)`` and ``p.list_grad()`` return the views: the arrays
backward writes and the step reads, so ``clip_global_norm``, AMP's loss
scaler, ``zero_grad()`` and ``grad_req='add'`` work on them as on Gluon's.

An array taken before the buckets exist (``g = p.grad()`` before the
Trainer was created, or before a deferred network's first call) is no
longer the parameter's gradient: backward no longer writes it, the step
no longer reads it, and it keeps the values it had. The Trainer warns at
its first step if such an array is still referenced anywhere. Take
gradient arrays after creating the Trainer (or afresh every step).

``initialize(force_reinit=True)``, ``reset_ctx``, ``cast`` or a new
``grad_req`` give a parameter new gradient arrays (Gluon's, as without
buckets): until the next step puts them in new buckets (their values
copied), that parameter is summed on its own; the other parameters keep
their views.
"""
import sys
import warnings
from typing import NamedTuple

import numpy as np
import mxnet as mx
from mxnet import nd

from . import _gluon
from .compression import Wire, casting
from .links import allocate_keys

__all__ = ['DEFAULT_CAP_MB', 'FIRST_CAP_MB', 'LINK_MIN_BUCKETS', 'ALIGN_BYTES', 'Slot',
           'BucketLayout', 'Bucket', 'Buckets',
           'check_cap', 'order_of_use', 'plan', 'backward_order',
           'bucketable', 'reduction']

#: Bucket size cap in megabytes (PyTorch DDP's ``bucket_cap_mb``).
DEFAULT_CAP_MB = 25
#: The first bucket's cap where the reduction crosses a link (DDP's first
#: bucket): the last layers' gradients, written first by backward, are on
#: the wire while backward still runs.
FIRST_CAP_MB = 1
#: Where the reduction crosses a link, a model has at least this many
#: buckets (each at most its gradients' bytes over this): ResNet-20's 1 MB
#: of gradients in one 25 MB bucket could only be sent once backward ends.
LINK_MIN_BUCKETS = 8
#: Each gradient starts at a multiple of this many bytes in its bucket (a
#: cache line, and MKL-DNN's preferred alignment).
ALIGN_BYTES = 64


class Slot(NamedTuple):
    """One parameter's gradient in a bucket."""
    index: int              # the Trainer's index of the parameter
    offset: int             # its first element in the bucket
    shape: tuple


class BucketLayout(NamedTuple):
    """One bucket: its dtype, grad_req, slots, and length in elements."""
    dtype: np.dtype
    grad_req: str
    slots: tuple
    size: int


def check_cap(bucket_cap_mb):
    """The cap in bytes (0: no buckets), or ValueError."""
    if bucket_cap_mb is None or bucket_cap_mb is False:
        return 0
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not bucket_cap_mb >= 0 or bucket_cap_mb == float('inf'):
        raise ValueError(f'bucket_cap_mb must be a finite number >= 0 (0 or None: no buckets), '
                         f'got {bucket_cap_mb!r}')
    return int(bucket_cap_mb * 1024 * 1024)


def order_of_use(given, params):
    """The indices of `params` (the Trainer's list: gluon.Trainer sorts a
    dict's by name) in the order `given` (the constructor's argument)
    lists them: ``collect_params()`` lists a block's parameters as its
    layers were added, for a model zoo's network their order of use."""
    listed = list(given.values()) if hasattr(given, 'values') else list(given)
    rank = {id(p): k for k, p in enumerate(listed)}
    return sorted(range(len(params)), key=lambda i: rank.get(id(params[i]), len(listed) + i))


def bucketable(p, owner=None):
    """Whether `p`'s gradients go in a bucket: arrays exist, dense weight
    and gradient, ``grad_req`` 'write' or 'add' (hidden from this step by
    ``gluon_parallel.step`` or not), not empty; with `owner`, only a
    parameter whose last Trainer is `owner` (a parameter two Trainers
    share goes in the later one's buckets)."""
    return (_gluon.grad_arrays(p) is not None
            and _gluon.true_grad_req(p) in ('write', 'add')
            and not _gluon.is_row_sparse(p) and not _gluon.has_sparse_grad(p)
            and int(np.prod(p.shape)) > 0
            and (owner is None or _gluon.param_trainer(p) is owner))


def plan(params, cap_bytes, owner=None, skip=(), first_cap_bytes=None, order=None,
         min_buckets=None):
    """The buckets of `params` (a Trainer's list; see :func:`bucketable`)
    but the indices in `skip`, in the order backward writes them: for each
    (dtype, grad_req), consecutive gradients *from the last parameter used
    back* (`order`: the indices of `params` in their order of use; default
    the list's), until the next would pass `cap_bytes` (`first_cap_bytes`,
    when given, for each group's first bucket: DDP's small first bucket,
    whose reduction can start early in backward); the buckets in that
    order, the last parameters' first. `min_buckets`: the caps are at most
    the gradients' bytes over this (but not below twice the largest
    gradient: buckets of one gradient each, or smaller, leave only
    fragments between them), so that a model smaller than `min_buckets`
    caps still has buckets to reduce one after the other."""
    order = range(len(params)) if order is None else order
    chosen = [i for i in reversed(order) if i not in skip and bucketable(params[i], owner)]
    if min_buckets and chosen:
        sizes = [int(np.prod(params[i].shape)) * np.dtype(params[i].dtype).itemsize
                 for i in chosen]
        cap_bytes = min(cap_bytes, max(sum(sizes) // min_buckets, 2 * max(sizes)))
        first_cap_bytes = min(first_cap_bytes or cap_bytes, cap_bytes)
    done, open_ = [], {}
    for i in chosen:
        p = params[i]
        dtype, req = np.dtype(p.dtype), _gluon.true_grad_req(p)
        slots, end, cap = open_.get((dtype, req), ((), 0, first_cap_bytes or cap_bytes))
        align = max(1, ALIGN_BYTES // dtype.itemsize)
        start = -(-end // align) * align
        size = int(np.prod(p.shape))
        if slots and (start + size) * dtype.itemsize > cap:
            done.append(BucketLayout(dtype, req, slots, end))
            slots, start, cap = (), 0, cap_bytes
        open_[(dtype, req)] = (slots + (Slot(i, start, tuple(p.shape)),), start + size, cap)
    done += [BucketLayout(dtype, req, slots, end)
             for (dtype, req), (slots, end, _) in open_.items()]
    return sorted(done, key=backward_order(order))


def backward_order(order):
    """Sort key of bucket layouts (:func:`plan`'s `order`): the bucket
    holding the parameters used last first."""
    rank = {i: k for k, i in enumerate(order)}
    return lambda layout: -rank[layout.slots[0].index]


class Bucket:
    """One bucket: a flat array per context whose views are its parameters'
    gradient arrays, installed with the values the old arrays held.

    Parameters
    ----------
    params : list of Parameter
        The Trainer's parameters, in its order.
    layout : BucketLayout
        From :func:`plan`.
    contexts : list of Context

    Attributes
    ----------
    arrays : list of NDArray
        One flat array per context.
    key : int or None
        Its key in `kvstore` once that kvstore knows it.
    replaced : list of (str, list of NDArray)
        Each parameter's name and the gradient arrays the views replaced.
    """

    def __init__(self, params, layout, contexts, compression=None):
        self.layout = layout
        self.arrays = [nd.zeros((layout.size,), ctx=c, dtype=layout.dtype) for c in contexts]
        #: What is summed: the arrays, or their float16 copies.
        self.wire = Wire(self.arrays, compression)
        self.key = self.kvstore = None
        self._lists = {}                # Trainer index -> the installed list
        self.replaced = []
        for slot in layout.slots:
            p = params[slot.index]
            size = int(np.prod(slot.shape))
            views = [a[slot.offset:slot.offset + size].reshape(slot.shape) for a in self.arrays]
            old = _gluon.grad_arrays(p)
            _gluon.copy_into(old, views)            # (accumulated or stale values kept)
            _gluon.replace_grads(p, views)
            self._lists[slot.index] = _gluon.grad_arrays(p)
            self.replaced.append((p.name, old))

    def live(self, params):
        """The Trainer indices of the parameters whose gradient arrays are
        still this bucket's views (Gluon gives a parameter new arrays on
        ``reset_ctx``, ``cast``, a new ``grad_req``...)."""
        return [i for i, lst in self._lists.items() if _gluon.grad_arrays(params[i]) is lst]


class Buckets:
    """A Trainer's buckets on its contexts (see the module documentation).

    Parameters
    ----------
    contexts : list of Context
    cap_bytes : int
    owner : Trainer
        Only parameters whose last Trainer is `owner` go in (see
        :func:`bucketable`).
    first_cap_bytes : int, optional
        The cap of each group's first bucket (:func:`plan`).
    order : list of int, optional
        The Trainer's indices in the parameters' order of use (:func:`plan`).
    compression : {None, 'fp16'}
        'fp16': float32 and float64 buckets are summed as float16 copies
        (:func:`reduction`).
    min_buckets : int, optional
        :func:`plan`'s.
    """

    def __init__(self, contexts, cap_bytes, owner, first_cap_bytes=None, order=None,
                 compression=None, min_buckets=None):
        self.contexts, self.cap_bytes, self.owner = contexts, cap_bytes, owner
        self.first_cap_bytes, self.order = first_cap_bytes, order
        self.compression, self.min_buckets = compression, min_buckets
        self.buckets = []
        self._suspects = []

    @property
    def layouts(self):
        return [b.layout for b in self.buckets]

    def refresh(self, params):
        """Put every bucketable gradient that is not a live view yet in new
        buckets; a bucket none of whose parameters still has its views is
        dropped. A view stays its parameter's gradient as long as Gluon
        does not replace it: no parameter's arrays change because another's
        did. Returns whether anything changed."""
        live = [b.live(params) for b in self.buckets]
        keep = [b for b, indices in zip(self.buckets, live) if indices]
        layouts = plan(params, self.cap_bytes, self.owner,
                       skip={i for indices in live for i in indices},
                       first_cap_bytes=self.first_cap_bytes, order=self.order,
                       min_buckets=self.min_buckets)
        if not layouts and len(keep) == len(self.buckets):
            return False
        new = [Bucket(params, layout, self.contexts, self.compression) for layout in layouts]
        if not self.buckets:
            # Gluon's own arrays, which the user may have taken before the
            # buckets existed (arrays Gluon gives anew later are not looked
            # at: an executor bound since holds them). Kept until
            # check_replaced if something references them now: a reference
            # only held over this step (the step's own) is gone by then.
            self._suspects = [(name, old) for b in new for name, old in b.replaced
                              if _held(old)]
        for b in new:
            b.replaced = []
        key = backward_order(self.order or range(len(params)))
        self.buckets = sorted(keep + new, key=lambda b: key(b.layout))
        return True

    def summed(self, params, kv):
        """(the buckets, indices covered) to sum through `kv`: every bucket
        with a live view, given its key on first use:
        keys of this library's own range (``links.allocate_keys``,
        the same on every worker), so that no Trainer's parameter key nor
        another bucket's can clash. A dist kvstore's ``init`` is a barrier
        of the workers: every worker makes the same buckets and first sums
        them in the same step."""
        live = [b.live(params) for b in self.buckets]
        used = [b for b, indices in zip(self.buckets, live) if indices]
        fresh = [b for b in used if b.kvstore is not kv]
        if fresh:
            first = allocate_keys(len(fresh))
            for k, b in enumerate(fresh):
                b.key, b.kvstore = first + k, kv
            if isinstance(kv, mx.kv.KVStore):
                kv.init([b.key for b in fresh], [b.wire.arrays[0] for b in fresh])
            else:
                for b in fresh:
                    kv.init(b.key, b.wire.arrays[0])
        return used, {i for indices in live for i in indices}

    def zero(self, params, chosen, contexts):
        """Zero, a whole bucket at a time, the gradients on `contexts` of
        the 'write' buckets whose every live parameter is in `chosen` (a set
        of Trainer indices): one operation per bucket and context instead
        of one per parameter. Returns the indices whose gradients it
        zeroed."""
        done = set()
        where = [self.contexts.index(c) for c in contexts if c in self.contexts]
        for b in self.buckets:
            live = b.live(params)
            if live and b.layout.grad_req == 'write' and chosen.issuperset(live):
                for k in where:
                    b.arrays[k][:] = 0
                done.update(live)
        return done

    @property
    def suspects(self):
        """Whether :meth:`check_replaced` has something to check."""
        return bool(self._suspects)

    def check_replaced(self):
        """Warn, once, about replaced gradient arrays something still
        references (taken before the buckets existed: no longer the
        gradients); then forget them."""
        suspects, self._suspects = self._suspects, []
        held = [name for name, old in suspects if _held(old)]
        if held:
            warnings.warn(
                f'gradient arrays of {", ".join(held[:5])}{" ..." if len(held) > 5 else ""} '
                'taken before gluon_parallel.Trainer put the gradients in buckets are still '
                'referenced: they are no longer the gradients (backward does not write them, '
                'the step does not read them; they keep their old values). Take p.grad() / '
                'p.list_grad() after creating the Trainer, or create it with bucket_cap_mb=0. '
                '(A graph-mode executor bound by a recorded call before the Trainer existed '
                'holds them too, harmlessly: create the Trainer first to avoid both)',
                UserWarning, stacklevel=4)


def _held(arrays):
    """Whether something else references the list `arrays` or one of its
    arrays. Called as ``_held(old)`` in a comprehension over (name, old)
    tuples: the list's references are the tuple's, the loop variable's, the
    argument's and getrefcount's own; an array's, the list's and
    getrefcount's."""
    return sys.getrefcount(arrays) > 4 or \
        any(sys.getrefcount(arrays[k]) > 2 for k in range(len(arrays)))


def reduction(kv, params, buckets, dense_only=False, separate=False):
    """(a callable, the indices it sums): the callable sums every trained
    gradient of `params` (a Trainer's list) over the devices and workers
    through `kv`, in place: one key per bucket of `buckets` (a
    :class:`Buckets` or None) with a live view, in the order backward
    writes them, and every other trained gradient under its Trainer index
    (Gluon's key for it); `dense_only` leaves row-sparse gradients out
    (Gluon's code pushes and pulls them). MXNet's KVStore: one batched
    push/pull, a C call; a store with ``pushpull_group`` (the Horovod
    store): one call, an all-reduce per key; any other: a push/pull per
    key, as Gluon's. A bucket with float16 copies (``compression='fp16'``)
    is cast to them before and back after: what crosses the link is half
    the bytes. `separate`: MXNet's KVStore pushes, then pulls (its
    gradient compression refuses a push/pull)."""
    keys, values, covered, casts = [], [], set(), []
    if buckets is not None:
        used, covered = buckets.summed(params, kv)
        keys, values = [b.key for b in used], [b.wire.arrays for b in used]
        casts = [b.wire for b in used if b.wire.compressed]
    # A bucket's parameter the Trainer does not reduce now (gp.step hid it:
    # no replica used it) keeps its gradients, as with Gluon's keys.
    kept = [g for i in sorted(covered) if params[i].grad_req == 'null'
            for g in _gluon.grad_arrays(params[i])]
    for i, p in enumerate(params):
        if i not in covered and p.grad_req != 'null' and _gluon.grad_arrays(p) is not None \
                and not (dense_only and _gluon.has_sparse_grad(p)):
            keys.append(i)
            values.append(p.list_grad())
            covered.add(i)
    pushpull = _pushpull(kv, keys, values, separate)
    if casts:
        pushpull = casting(pushpull, casts)
    return (_keeping(pushpull, kept) if kept else pushpull), covered


def _keeping(pushpull, grads):
    """`pushpull` that leaves `grads` (views in buckets) as they were: they
    add zeros to the sums (every worker pushes the same keys), and get their
    own values back after."""
    def run():
        saved = [_gluon.copy(g) for g in grads]
        for g in grads:
            _gluon.zero(g)
        pushpull()
        for old, g in zip(saved, grads):
            _gluon.copy(old, g)
    return run


def _pushpull(kv, keys, values, separate):
    if not keys:
        return lambda: None
    pushpull = _gluon.batched_pushpull(kv, keys, values, separate=separate)
    if pushpull is not None:
        return pushpull
    group = getattr(kv, 'pushpull_group', None)
    if group is not None:
        return lambda: group(keys, values)

    def each():
        for k, v in zip(keys, values):
            kv.pushpull(k, v)
    return each
