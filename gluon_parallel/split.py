"""Splitting a batch across devices and gathering the results back.

A batch of ``B`` rows over ``N`` contexts is cut numpy.array_split style:
the first ``B % N`` slices get one extra row, and a batch smaller than the
number of contexts uses only ``B`` of them (never a zero-size slice).
A parallel call scatters its arguments as a :class:`Batch`: the sizes at
once, the slices only when a runner asks for them (graph mode copies
whole inputs into its executors and makes none).
"""
import itertools
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import mxnet as mx
from mxnet import nd

from . import _gluon
from .nested import arrays, combine, rebuild

__all__ = ['Batch', 'PerReplica', 'SplitArrays', 'SplitOnce', 'split_sizes', 'split_load_kwargs',
           'split_ndarrays', 'batch_rows', 'gather',
           'check_batch_axis', 'first_ctx']


def split_sizes(batch_size: int, num_ctx: int) -> list[int]:
    """Balanced slice sizes of a batch over `num_ctx` devices.

    Parameters
    ----------
    batch_size : int
        Number of rows in the batch; must be positive.
    num_ctx : int
        Number of devices available; must be positive.

    Returns
    -------
    list of int
        ``min(batch_size, num_ctx)`` sizes summing to `batch_size`, the
        first ``batch_size % num_ctx`` one larger than the rest.
    """
    batch_size, num_ctx = int(batch_size), int(num_ctx)
    if batch_size <= 0:
        raise ValueError(f'cannot split an empty batch (batch size {batch_size:d})')
    if num_ctx <= 0:
        raise ValueError(f'need at least one context to split over, got {num_ctx:d}')
    n = min(batch_size, num_ctx)
    base, extra = divmod(batch_size, n)
    return [base + 1] * extra + [base] * (n - extra)


class Batch:
    """One call's arguments, scattered along the batch axis: how many rows
    each replica gets, and its slices when a runner asks for them.

    Parameters
    ----------
    args : tuple
        The call's positional arguments.
    kwargs : dict
        Its keyword arguments.
    ctx_list : list of Context
        The devices to split over.
    batch_axis : int
        The axis split.

    Attributes
    ----------
    sizes : list of int
        Rows per replica (:func:`split_sizes`); ``len(sizes)`` replicas run.
    n : int
        How many replicas get rows (``len(sizes)``).
    whole : tuple of NDArray or None
        The positional NDArrays (None arguments left out, as a hybridized
        graph leaves them out), when every replica's inputs are their
        consecutive rows (:func:`batch_rows`): a runner may copy them in
        whole instead of slicing.
    plain : bool
        Every argument is a positional NDArray (`whole` is `args`).
    """

    __slots__ = ('args', 'kwargs', 'ctx_list', 'axis', 'sizes', 'n', 'whole', 'plain',
                 '_slices')

    def __init__(self, args, kwargs, ctx_list, batch_axis):
        self.args, self.kwargs, self.ctx_list, self.axis = args, kwargs, ctx_list, batch_axis
        self._slices = {}
        rows = batch_rows(args, kwargs, batch_axis)
        given = tuple(a for a in args if a is not None) if rows else ()
        self.plain = bool(rows) and len(given) == len(args)
        self.whole = None if not rows else args if self.plain else given
        if not rows:
            rows = _batch_size(args, kwargs or {}, batch_axis)
            if rows is None:
                raise ValueError('no NDArray or numpy array among the arguments: nothing to '
                                 'split')
        self.sizes = split_sizes(rows, len(ctx_list))
        self.n = len(self.sizes)

    def slices(self, load=True):
        """Every replica's (positional arguments, keyword arguments), as
        :func:`split_load_kwargs` makes them (made once per `load`)."""
        made = self._slices.get(load)
        if made is None:
            made = self._slices[load] = PerReplica(*split_load_kwargs(
                self.args, self.kwargs, self.ctx_list, self.axis, load=load))
        return made


class PerReplica(NamedTuple):
    """Every replica's arguments (:meth:`Batch.slices`)."""
    args: list          # per replica, its positional arguments (a tuple)
    kwargs: list        # per replica, its keyword arguments (a dict)


class SplitArrays(NamedTuple):
    """What :func:`split_ndarrays` gives."""
    args: list          # per device, its tuple of slices
    sizes: list         # rows per device


def _batch_size(inputs, kwargs, batch_axis):
    """The common batch dimension of every array, or None if there is none."""
    found = [*arrays(tuple(inputs), 'inputs')]
    for k, v in kwargs.items():
        found += arrays(v, k)
    size, first = None, None
    for path, arr in found:
        ndim = len(arr.shape)
        if not -ndim <= batch_axis < ndim:
            raise ValueError(f'batch_axis {batch_axis:d} is out of range for argument {path} of '
                             f'shape {tuple(arr.shape)}')
        b = arr.shape[batch_axis]
        if size is None:
            size, first = b, path
        elif b != size:
            raise ValueError(f'argument {path} has batch dimension {b:d} along axis '
                             f'{batch_axis:d}, but {first} has {size:d}')
    return size


def _slice(arr, begin, end, axis):
    if isinstance(arr, np.ndarray):
        index = [slice(None)] * arr.ndim
        index[axis] = slice(begin, end)
        return arr[tuple(index)]
    if axis % arr.ndim == 0:
        return arr[begin:end]          # a view: no copy before the transfer
    return nd.slice_axis(arr, axis=axis, begin=begin, end=end)


def _load(arr, ctx):
    if isinstance(arr, np.ndarray):
        return nd.array(arr, ctx=ctx, dtype=arr.dtype)
    return _gluon.to_context(arr, ctx)


def _split_struct(obj, bounds, ctx_list, axis):
    """Per-device copies of a nested structure, arrays sliced and loaded
    (non-array values go to every device)."""
    slices = [[_load(_slice(a, b, e, axis), ctx) for (b, e), ctx in zip(bounds, ctx_list)]
              for _, a in arrays(obj)]
    return [rebuild(obj, _taking([s[i] for s in slices])) for i in range(len(bounds))]


def _taking(values):
    """A leaf function for :func:`nested.rebuild` giving `values` in turn."""
    values = iter(values)
    return lambda _: next(values)


def split_ndarrays(inputs, ctx_list, batch_axis, load=True):
    """The common case on the hot path: positional NDArrays only. One shape
    query per array, no walk of the structure; None for anything else, which
    then takes the general path (the one that explains what is wrong).
    Returns a :class:`SplitArrays`: the per-device argument tuples and the
    slice sizes (without `load`, the slices stay where the inputs are)."""
    shapes = []
    for x in inputs:
        if type(x) is not nd.NDArray:
            return None
        shape = x.shape
        if not -len(shape) <= batch_axis < len(shape):
            return None
        shapes.append(shape)
    size = shapes[0][batch_axis]
    for shape in shapes:
        if shape[batch_axis] != size:
            return None
    sizes = split_sizes(size, len(ctx_list))
    n = len(sizes)
    args = [[] for _ in range(n)]
    for x, shape in zip(inputs, shapes):
        axis = batch_axis % len(shape)
        if n == 1:
            parts = [x]             # the whole batch: no slice to make
        elif axis == 0:
            parts = _gluon.row_slices(x, sizes)     # x[b:e] each, without its Python
        else:
            ends = itertools.accumulate(sizes)
            parts = [nd.slice_axis(x, axis=axis, begin=end - k, end=end)
                     for k, end in zip(sizes, ends)]
        for i, part in enumerate(parts):
            args[i].append(_gluon.to_context(part, ctx_list[i]) if load else part)
    return SplitArrays([tuple(a) for a in args], sizes)


class SplitOnce:
    """Positional NDArrays (DataParallelLoss's targets) split at most once
    (:func:`split_ndarrays`) for whichever path asks: a graph's slices left
    where the arrays are (:meth:`where_they_are`), and the same slices loaded
    to the devices (:meth:`on_devices`) when the call then runs replica by
    replica.

    Parameters
    ----------
    arrays : tuple
        The targets.
    batch_axis : int
    n : int
        The replicas they are for.

    Attributes
    ----------
    whole_sizes : list of int or None
        Every replica's rows when the targets can be copied in whole
        (:func:`batch_rows`: nothing to slice), else None.
    """

    __slots__ = ('arrays', 'axis', 'whole_sizes', '_made')

    def __init__(self, arrays, batch_axis, n):
        self.arrays, self.axis = arrays, batch_axis
        self._made = self       # (self: nothing split yet; None: not split_ndarrays' case)
        rows = batch_rows(arrays, None, batch_axis)
        self.whole_sizes = split_sizes(rows, n) if rows else None

    def where_they_are(self, ctx_list):
        """``split_ndarrays(arrays, ctx_list, axis, load=False)``."""
        self._made = split_ndarrays(self.arrays, ctx_list, self.axis, load=False)
        return self._made

    def on_devices(self, ctx_list):
        """``split_ndarrays(arrays, ctx_list, axis)``: the slices already
        made, loaded, when they were made for as many devices (as many
        slices: the same sizes, see :func:`split_sizes`)."""
        made = self._made
        if made is None:
            return None
        if made is self or len(made.args) != min(len(ctx_list), sum(made.sizes)):
            return split_ndarrays(self.arrays, ctx_list, self.axis)
        return SplitArrays([tuple(_gluon.to_context(a, c) for a in args)
                            for args, c in zip(made.args, ctx_list)], made.sizes)


def batch_rows(inputs, kwargs, batch_axis):
    """The batch size if ``split_load_kwargs(inputs, kwargs, ..., load=False)``
    gives every device consecutive rows of each input, in device order, left
    where the inputs are (positional NDArrays only, or None, of one batch
    size, split along axis 0); else 0."""
    if not inputs or kwargs:
        return 0
    rows = set()
    for x in inputs:
        if type(x) is not nd.NDArray:
            if x is None:
                continue
            return 0
        shape = x.shape
        if not shape or batch_axis not in (0, -len(shape)):
            return 0
        rows.add(shape[0])
    return rows.pop() if len(rows) == 1 else 0


def check_batch_axis(batch_axis: int) -> int:
    """`batch_axis` itself, or a TypeError for anything but an int.

    A bool is refused by name: GluonCV's ``DataParallelModel(module,
    ctx_list, sync)`` takes ``sync`` third, where DataParallel takes
    ``batch_axis``, and ``True`` would silently split along axis 1.
    """
    if isinstance(batch_axis, bool):
        raise TypeError(f'batch_axis={batch_axis!r} is a bool: GluonCV\'s third argument is sync, '
                        f'gluon_parallel\'s is batch_axis. Pass sync={batch_axis!r} by keyword, or '
                        'use gluon_parallel.gluoncv.DataParallelModel/DataParallelCriterion, '
                        'which take GluonCV\'s arguments')
    if not isinstance(batch_axis, numbers.Integral):
        raise TypeError(f'batch_axis must be an int, got {batch_axis!r}')
    return int(batch_axis)


def split_load_kwargs(inputs: Sequence[Any], kwargs: Mapping[str, Any] | None,
                      ctx_list: Sequence[mx.Context], batch_axis: int = 0,
                      load: bool = True) -> tuple[list[tuple], list[dict]]:
    """Split positional and keyword arguments along the batch axis and load
    each slice onto its context.

    Parameters
    ----------
    inputs : tuple
        Positional arguments. NDArrays and numpy arrays (also inside nested
        lists, tuples and dicts) are split; other values are passed unchanged.
    kwargs : dict or None
        Keyword arguments, split like `inputs`.
    ctx_list : list of Context
        Devices to split over.
    batch_axis : int, default 0
        Axis along which every array is split.
    load : bool, default True
        False: when the arguments are positional NDArrays only, their
        slices may stay on the inputs' own contexts (a caller that copies
        them into arrays of its own saves a copy); anything else is loaded.

    Returns
    -------
    (list of tuple, list of dict)
        One positional tuple and one kwargs dict per device that gets rows;
        ``min(batch_size, len(ctx_list))`` of each.
    """
    inputs = tuple(inputs)
    if not ctx_list:
        raise ValueError('ctx_list is empty')
    if not kwargs and inputs:
        fast = split_ndarrays(inputs, ctx_list, batch_axis, load)
        if fast is not None:
            return fast.args, [{} for _ in fast.sizes]
    kwargs = dict(kwargs or {})
    size = _batch_size(inputs, kwargs, batch_axis)
    if size is None:
        raise ValueError('no NDArray or numpy array among the arguments: nothing to split')
    sizes = split_sizes(size, len(ctx_list))
    bounds, begin = [], 0
    for s in sizes:
        bounds.append((begin, begin + s))
        begin += s
    ctxs = list(ctx_list)[:len(sizes)]
    per_input = [_split_struct(x, bounds, ctxs, batch_axis) for x in inputs]
    per_kw = {k: _split_struct(v, bounds, ctxs, batch_axis) for k, v in kwargs.items()}
    args = [tuple(p[i] for p in per_input) for i in range(len(sizes))]
    kws = [{k: per_kw[k][i] for k in kwargs} for i in range(len(sizes))]
    return args, kws


def gather(outputs: Sequence[Any], ctx: mx.Context | None = None, batch_axis: int = 0) -> Any:
    """Concatenate per-device outputs into one structure on one context.

    Parameters
    ----------
    outputs : list
        One entry per device: NDArrays, or matching nested tuples, lists or
        dicts of NDArrays (non-array leaves must be equal and are kept once).
    ctx : Context, optional
        Where the result lives; default: the context of the first array.
    batch_axis : int, default 0
        Axis to concatenate along.
    """
    outputs = list(outputs)
    if not outputs:
        raise ValueError('gather needs at least one output')
    first = outputs[0]
    if ctx is None:
        ctx = first.context if isinstance(first, nd.NDArray) else first_ctx(first)

    def concat(parts):
        if isinstance(parts[0], nd.NDArray):
            # (as_in_context would make bfloat16 float32 under AMP: _gluon.copy)
            parts = [_gluon.to_context(o, ctx) for o in parts]
            return parts[0] if len(parts) == 1 else nd.concat(*parts, dim=batch_axis)
        if isinstance(parts[0], np.ndarray):
            return np.concatenate(parts, axis=batch_axis)
        return parts[0]
    return combine(outputs, concat, 'cannot gather outputs of different lengths')


def first_ctx(obj):
    """The context of the first NDArray in `obj` (the current context if
    there is none)."""
    for _, arr in arrays(obj):
        if isinstance(arr, nd.NDArray):
            return arr.context
    return mx.current_context()
