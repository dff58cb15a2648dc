"""GluonCV's ``gluoncv.utils.parallel``, every public name, on gluon_parallel.

Changing ``from gluoncv.utils.parallel import *`` (or ``import Parallel``)
to ``from gluon_parallel.gluoncv import ...`` is the whole migration of a
GluonCV training script (its segmentation ``train.py`` and its R-CNN
``train_faster_rcnn.py`` were the models): the same signatures (``sync``
third), the same return structures (a tuple of per-device tuples from the
model; a tuple of per-device losses from the criterion), ``.module``, and
any callable as the module (``SegEvalModel``). Underneath, a Block runs in
:class:`~gluon_parallel.DataParallel` (so SyncBatchNorm synchronises
whatever ``sync`` says), any other callable through
:func:`gluon_parallel.parallel_apply`, the criterion is a
:class:`~gluon_parallel.DataParallelLoss`, and :class:`Parallel` (module
``gluoncv_parallel``) runs its tasks on the persistent worker pool.

``sync`` keeps GluonCV's visible meaning: each device's outputs are
computed when the call returns. GluonCV needed it (a thread per device) for
its SyncBatchNorm; gluon_parallel's SyncBatchNorm synchronises either way.
GluonCV requires at least as many samples as devices; here a smaller batch
runs on fewer devices, so the tuple is shorter; an uneven batch puts its
extra rows on the first devices (GluonCV: all on the last).

Importing this module does not import GluonCV.
"""
from mxnet import autograd, gluon, nd

from . import split as _split
from .contexts import check_ctx_list
from .apply import parallel_apply as _pool_apply
from .data_parallel import DataParallel
from .gluoncv_parallel import Parallel, Parallelizable, ParallelTaskError
from .loss import DataParallelLoss
from .nested import arrays

__all__ = ['DataParallelModel', 'DataParallelCriterion', 'Parallelizable', 'Parallel',
           'ParallelTaskError', 'parallel_apply', 'criterion_parallel_apply',
           'parallel_backward', 'split_load_kwargs', 'tuple_map']


def tuple_map(obj):
    """One device's result as GluonCV returns it: an NDArray as a 1-tuple,
    a non-empty list as a tuple, anything else unchanged."""
    if isinstance(obj, nd.NDArray):
        return (obj,)
    if isinstance(obj, list) and obj:
        return tuple(obj)
    return obj


def _init(obj, module, ctx_list, sync, what):
    """The checked arguments both classes keep: `module`, `ctx_list`
    (GluonCV's "no contexts", None or empty, runs the module as is) and
    `sync`."""
    if not callable(module):
        raise TypeError(f'{what}, got {module!r}')
    if isinstance(sync, (list, tuple)):
        raise TypeError('sync must be a bool: the contexts are the second argument')
    obj.module = module
    obj.ctx_list = check_ctx_list(ctx_list) if ctx_list else None
    obj.sync = bool(sync)


class DataParallelModel:
    """Run `module` on slices of the batch, one per context.

    Parameters
    ----------
    module : callable
        A Block (run in :class:`~gluon_parallel.DataParallel`) or any
        callable, such as GluonCV's ``SegEvalModel``. As in GluonCV, the
        parameters it collects (``module.collect_params()``) are moved to
        `ctx_list` here.
    ctx_list : list of Context, optional
        Without contexts, calls run `module` directly.
    sync : bool, default False
        Return only once every device's outputs are computed.

    Returns
    -------
    tuple
        Of a call: one tuple per device that ran, its outputs.
    """

    def __init__(self, module, ctx_list=None, sync=False):
        _init(self, module, ctx_list, sync, 'DataParallelModel needs a Block or a callable')
        self._dp = None
        if self.ctx_list and hasattr(module, 'collect_params'):
            module.collect_params().reset_ctx(ctx=self.ctx_list)
        if self.ctx_list and isinstance(module, gluon.Block):
            self._dp = DataParallel(module, self.ctx_list, sync=self.sync)

    def __call__(self, *inputs, **kwargs):
        if not self.ctx_list:
            return self.module(*inputs, **kwargs)
        if self._dp is not None:
            outputs = self._dp(*inputs, **kwargs)
        else:
            args_list, kwargs_list = _split.split_load_kwargs(inputs, kwargs, self.ctx_list)
            outputs = _pool_apply(self.module, args_list, kwargs_list,
                                     ctx_list=self.ctx_list[:len(args_list)], sync=self.sync)
        return tuple(tuple_map(o) for o in outputs)

    def __repr__(self):
        return f'DataParallelModel({self.module!r}, ctx_list={self.ctx_list})'


class DataParallelCriterion:
    """Apply `module` (a loss) to each device's outputs of
    :class:`DataParallelModel`, with the targets split the same way:
    ``module(*outputs_i, *targets_i)``.

    Parameters
    ----------
    module : callable
        The loss, e.g. GluonCV's ``MixSoftmaxCrossEntropyLoss``.
    ctx_list : list of Context, optional
        Without contexts, calls run ``module(outputs, *targets)`` directly.
    sync : bool, default False
        Return only once every loss is computed.

    Returns
    -------
    tuple
        Of a call: one loss per device (with a single context, that device's result
        as a tuple, as GluonCV returns it).
    """

    def __init__(self, module, ctx_list=None, sync=False):
        _init(self, module, ctx_list, sync, 'DataParallelCriterion needs a callable loss')
        self._loss = DataParallelLoss(module, self.ctx_list, sync=self.sync) \
            if self.ctx_list else None

    def __call__(self, inputs, *targets, **kwargs):
        if not self.ctx_list:
            return self.module(inputs, *targets, **kwargs)
        losses = self._loss(list(inputs), *targets, **kwargs)
        if len(self.ctx_list) == 1:
            return tuple_map(losses[0])
        return tuple(losses)

    def __repr__(self):
        return f'DataParallelCriterion({self.module!r}, ctx_list={self.ctx_list})'


def split_load_kwargs(inputs, kwargs, ctx_list, batch_axis=0):
    """Split positional and keyword arguments along `batch_axis` onto
    `ctx_list`, as GluonCV's function of this name returns them.

    NDArrays (also inside lists, tuples and dicts) are split, other values
    given to every device; an argument list without any array goes whole
    to every device.

    Returns
    -------
    (tuple of tuple, tuple of dict)
        Each device's positional arguments and keyword arguments, the
        shorter of the two padded with ``()`` or ``{}``; ``((), ())`` when
        there are no arguments at all.
    """
    inputs, kwargs = tuple(inputs or ()), dict(kwargs or {})
    if not inputs and not kwargs:
        return (), ()
    ctx_list = check_ctx_list(ctx_list)
    if next(arrays((inputs, kwargs)), None) is None:
        return (tuple(inputs for _ in ctx_list) if inputs else tuple(() for _ in ctx_list),
                tuple(dict(kwargs) for _ in ctx_list))
    args_list, kwargs_list = _split.split_load_kwargs(inputs, kwargs, ctx_list, batch_axis)
    return tuple(tuple(a) for a in args_list), tuple(dict(k) for k in kwargs_list)


def _apply(module, args_list, kwargs_list, sync):
    """`module` on each device's arguments: concurrently on the worker pool
    when they are on distinct devices, else one after another here (as
    GluonCV's sync=False runs them)."""
    if not args_list:
        return []
    devices = [_split.first_ctx(a) for a in args_list]
    if len(set(devices)) == len(devices):
        return _pool_apply(module, list(args_list), list(kwargs_list), ctx_list=devices,
                           sync=sync)
    return [module(*a, **k) for a, k in zip(args_list, kwargs_list)]


def _kwargs_for(inputs, kwargs_tup):
    if not kwargs_tup:
        return [{} for _ in inputs]
    if len(kwargs_tup) != len(inputs):
        raise ValueError(f'{len(kwargs_tup)} kwargs dicts for {len(inputs)} devices\' inputs')
    return list(kwargs_tup)


def parallel_apply(module, inputs, kwargs_tup=None, sync=False):
    """``module(*inputs[i], **kwargs_tup[i])`` for every device i.

    Parameters
    ----------
    module : callable
        A Block (deferred initialisation finished once, before the devices
        run it) or any callable.
    inputs : sequence of tuple
        Each device's positional arguments.
    kwargs_tup : sequence of dict, optional
        Each device's keyword arguments.
    sync : bool, default False
        Return once every output is computed.

    Returns
    -------
    tuple of tuple
        Each device's outputs, as :func:`tuple_map` makes them.
    """
    inputs = [tuple(x) for x in inputs]
    outputs = _apply(module, inputs, _kwargs_for(inputs, kwargs_tup), sync)
    return tuple(tuple_map(o) for o in outputs)


def criterion_parallel_apply(module, inputs, targets, kwargs_tup=None, sync=False):
    """``module(*inputs[i], *targets[i], **kwargs_tup[i])`` for every device
    i (a loss on :func:`parallel_apply`'s outputs).

    Returns
    -------
    tuple
        Each device's loss, as `module` returns it.
    """
    pairs = list(zip(inputs, targets))
    args_list = [tuple(x) + tuple(t) for x, t in pairs]
    return tuple(_apply(module, args_list, _kwargs_for(pairs, kwargs_tup), sync))


def parallel_backward(losses, sync=True):
    """Backward from every device's loss, in one ``autograd.backward``
    call (MXNet's engine runs the devices' backward passes concurrently; the
    threads GluonCV uses are not needed). `sync` is GluonCV's and changes
    nothing here."""
    if isinstance(losses, nd.NDArray):
        losses = [losses]
    autograd.backward(list(losses))
