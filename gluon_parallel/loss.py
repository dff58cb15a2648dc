"""DataParallelLoss: a loss applied replica by replica to DataParallel's
outputs, the targets split like the inputs (or, on the outputs of a
graph-mode call, as one more graph: graph/loss_executor.py)."""
from collections.abc import Sequence
from typing import Any

import mxnet as mx
from mxnet import gluon, nd

from . import _gluon
from .contexts import check_ctx_list
from .graph.loss_executor import GraphLoss
from .replica_context import annotate
from .split import SplitOnce, check_batch_axis, first_ctx, split_load_kwargs

__all__ = ['DataParallelLoss']


class DataParallelLoss:
    """Apply a loss to the outputs of :class:`DataParallel`, replica by
    replica, with the targets split the same way as the inputs.

    A replica's output that is a tuple or a list (a hybridized block returns
    its tuple as a list) is unpacked into the loss's leading positional
    arguments, ``loss(*output, *targets)``, as GluonCV's
    ``DataParallelCriterion`` does: losses of networks with auxiliary heads
    take ``(pred, aux_pred, label)``. Any other output (an NDArray, a dict)
    is passed whole, ``loss(output, *targets)``.

    Parameters
    ----------
    loss : callable
        A Gluon loss (or any callable ``loss(*outputs, *targets, **kwargs)``).
    ctx_list : list of Context, optional
        Unused for splitting (targets follow their outputs' contexts); kept
        for symmetry with DataParallel and checked when given.
    batch_axis : int, default 0
        Axis along which targets are split.
    sync : bool, default False
        Wait until every loss is computed before returning.

    Notes
    -----
    On the outputs of a recorded graph-mode call of DataParallel, a Gluon
    loss (a HybridBlock without parameters, given full-batch NDArray
    targets and no keyword arguments) runs on every replica as one
    multi-device graph reading the call's outputs where they are; its
    backward is pushed before the network's. The losses and gradients are
    those of the per-replica path.
    """

    def __init__(self, loss: gluon.loss.Loss, ctx_list: Sequence[mx.Context] | None = None,
                 batch_axis: int = 0, sync: bool = False) -> None:
        if not callable(loss):
            raise TypeError(f'loss must be callable, got {loss!r}')
        self.loss = loss
        self._ctx_list = None if ctx_list is None else check_ctx_list(ctx_list)
        self._batch_axis = check_batch_axis(batch_axis)
        self._sync = bool(sync)
        self._graph = GraphLoss(loss, self._batch_axis)
        self._graph_usable = self._graph.usable()

    @property
    def graph_loss(self) -> GraphLoss:
        """The graph-mode runner (GraphLoss; ``binds`` counts its executors)."""
        return self._graph

    def __call__(self, outputs: Sequence[Any], *targets: Any, **kwargs: Any) -> list[nd.NDArray]:
        """Return one loss NDArray per replica.

        Parameters
        ----------
        outputs : list
            What DataParallel returned: one output per replica.
        *targets : NDArray, numpy array, or list
            Full-batch targets (split like the inputs), or lists with one
            entry per replica (already split).
        **kwargs
            Passed to the loss, split like the targets.
        """
        if not isinstance(outputs, (list, tuple)) or not outputs:
            raise TypeError('outputs must be the non-empty list DataParallel returned, got '
                            f'{type(outputs).__name__}')
        # Split once: graph mode may split the targets, then decline.
        split = SplitOnce(targets, self._batch_axis, len(outputs))
        losses = self._graph_losses(outputs, targets, kwargs, split)
        if losses is None:
            ctxs = [o.context if type(o) is nd.NDArray else first_ctx(o) for o in outputs]
            if self._ctx_list is not None and ctxs != self._ctx_list[:len(outputs)]:
                raise ValueError(f'outputs are on {ctxs}, expected {self._ctx_list[:len(outputs)]}')
            args_list, kwargs_list = self._scatter(outputs, ctxs, targets, kwargs, split)
            losses = self._apply(outputs, ctxs, args_list, kwargs_list)
        return losses

    def _scatter(self, outputs, ctxs, targets, kwargs, split):
        """Every replica's targets and keyword arguments (None: none), on
        its output's context, each with its output's rows (`split`: the
        targets' SplitOnce)."""
        n = len(outputs)
        if not kwargs and _all_ndarrays(targets):
            # The common case (full-batch NDArray targets): the split's own
            # sizes give the target rows, so only the outputs' are queried.
            fast = split.on_devices(ctxs)
            if fast is not None:
                args_list, sizes = fast.args, fast.sizes
                self._check_count(sizes, n)
                _check_rows(outputs, sizes, self._batch_axis)
                return args_list, None
        presplit, full = {}, []
        for i, t in enumerate(targets):
            if isinstance(t, list):
                if len(t) != n:
                    raise ValueError(f'target {i:d} is a list of {len(t):d} pre-split entries, but '
                                     f'there are {n:d} outputs')
                presplit[i] = [x.as_in_context(c) if isinstance(x, nd.NDArray) else x
                               for x, c in zip(t, ctxs)]
            else:
                full.append(t)
        if full or kwargs:
            args_list, kwargs_list = split_load_kwargs(full, kwargs, ctxs, self._batch_axis)
            rows = [_rows(a, self._batch_axis) for a in args_list]
            self._check_count(rows, n)
            _check_rows(outputs, rows, self._batch_axis)
        else:
            args_list, kwargs_list = [()] * n, [{}] * n
        if presplit:
            args_list = [self._merge_presplit(args_list[r], presplit, r, len(targets))
                         for r in range(n)]
        return args_list, kwargs_list

    def _graph_losses(self, outputs, targets, kwargs, split):
        """The losses as one graph (graph/loss_executor.py), or None: the call runs
        replica by replica."""
        if not self._graph_usable or kwargs or not _all_ndarrays(targets):
            return None
        losses = self._graph.run(outputs, targets, self._ctx_list, split)
        if losses is not None and self._sync:
            for loss in losses:
                loss.wait_to_read()
        return losses

    @staticmethod
    def _merge_presplit(split, presplit, r, num_targets):
        """Replica r's targets in the caller's order: pre-split entries where
        given, the split full-batch ones elsewhere."""
        split = iter(split)
        return tuple(presplit[i][r] if i in presplit else next(split) for i in range(num_targets))

    @staticmethod
    def _check_count(sizes, n):
        if len(sizes) != n:
            raise ValueError(f'targets of batch size {sum(s for s in sizes if s):d} split into '
                             f'{len(sizes):d} slices, but there are {n:d} outputs')

    def _apply(self, outputs, ctxs, args_list, kwargs_list):
        losses = []
        for r, out in enumerate(outputs):
            args = (*out, *args_list[r]) if isinstance(out, (tuple, list)) \
                else (out, *args_list[r])
            try:
                with ctxs[r]:
                    if kwargs_list is None:
                        loss = self.loss(*args)
                    elif isinstance(self.loss, gluon.Block):
                        loss = _gluon.call_with_kwargs(self.loss, args, kwargs_list[r])
                    else:
                        loss = self.loss(*args, **kwargs_list[r])
                    if self._sync:
                        loss.wait_to_read()
            except BaseException as e:
                annotate(e, r, ctxs[r])
                raise
            losses.append(loss)
        return losses


def _all_ndarrays(values):
    for v in values:
        if type(v) is not nd.NDArray:
            return False
    return bool(values)


def _rows(args, axis):
    """Rows of the first array among one replica's split targets (None if
    there is none)."""
    for a in args:
        if hasattr(a, 'shape') and a.shape:
            return a.shape[axis]
    return None


def _check_rows(outputs, target_rows, axis):
    """Each replica's targets must have as many rows as its output."""
    for r, (out, rows) in enumerate(zip(outputs, target_rows)):
        first = out[0] if isinstance(out, (list, tuple)) else out
        if rows is None or not isinstance(first, nd.NDArray):
            continue
        out_shape = first.shape                          # one C call
        if out_shape and out_shape[axis] != rows:
            raise ValueError(f'replica {r:d} has {out_shape[axis]:d} output rows but {rows:d} '
                             'target rows: targets must '
                             'have the batch size of the inputs')
