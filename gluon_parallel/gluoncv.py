"""GluonCV's ``gluoncv.utils.parallel`` classes, on gluon_parallel.

Changing ``from gluoncv.utils.parallel import *`` to
``from gluon_parallel.gluoncv import *`` is the whole migration of a GluonCV
training script (its segmentation ``train.py`` was the model): the same
signatures (``sync`` third), the same return structures (a tuple of
per-device tuples from the model; a tuple of per-device losses from the
criterion), ``.module``, and any callable as the module (``SegEvalModel``).
Underneath, a Block runs in :class:`~gluon_parallel.DataParallel` (so
SyncBatchNorm synchronises whatever ``sync`` says), any other callable
through :func:`~gluon_parallel.parallel_apply`, and the criterion is a
:class:`~gluon_parallel.DataParallelLoss`.

``sync`` keeps GluonCV's visible meaning: each device's outputs are
computed when the call returns. GluonCV needed it (a thread per device) for
its SyncBatchNorm; gluon_parallel's SyncBatchNorm synchronises either way.
GluonCV requires at least as many samples as devices; here a smaller batch
runs on fewer devices, so the tuple is shorter.

Importing this module does not import GluonCV.
"""
from mxnet import gluon, nd

from .apply import check_ctx_list, parallel_apply
from .data_parallel import DataParallel
from .loss import DataParallelLoss
from .split import split_load_kwargs

__all__ = ['DataParallelModel', 'DataParallelCriterion']


def _as_tuple(output):
    """One device's result as GluonCV returns it: an NDArray as a 1-tuple,
    a list as a tuple, anything else unchanged."""
    if isinstance(output, nd.NDArray):
        return (output,)
    if isinstance(output, list) and output:
        return tuple(output)
    return output


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
            args_list, kwargs_list = split_load_kwargs(inputs, kwargs, self.ctx_list)
            outputs = parallel_apply(self.module, args_list, kwargs_list,
                                     ctx_list=self.ctx_list[:len(args_list)], sync=self.sync)
        return tuple(_as_tuple(o) for o in outputs)

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
            return _as_tuple(losses[0])
        return tuple(losses)

    def __repr__(self):
        return f'DataParallelCriterion({self.module!r}, ctx_list={self.ctx_list})'
