"""Nested arguments and outputs: the arrays inside lists, tuples and dicts.

The one walker every module uses to find the arrays of a call's arguments
or of a replica's outputs (splitting, waiting for outputs, checking where
they are, asking autograd about them), and to build structures like them
(:func:`rebuild`: one replica's slices; :func:`combine`: the outputs
gathered).
"""
import copy
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from mxnet import nd

__all__ = ['arrays', 'ndarrays', 'rebuild', 'combine']


def arrays(obj: Any, path: str = '') -> Iterator[tuple[str, Any]]:
    """Every NDArray and numpy array inside `obj`, depth first, with its
    path (``'[0][\\'boxes\\']'`` below `path`).

    Lists, tuples (named tuples included) and dicts are walked; any other
    value is a leaf that is not an array.
    """
    if isinstance(obj, (nd.NDArray, np.ndarray)):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from arrays(v, f'{path}[{i:d}]')
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from arrays(v, f'{path}[{k!r}]')


def ndarrays(obj: Any) -> Iterator[nd.NDArray]:
    """The NDArrays inside `obj` (numpy arrays left out), depth first."""
    for _, a in arrays(obj):
        if isinstance(a, nd.NDArray):
            yield a


def _is_array(obj):
    return isinstance(obj, (nd.NDArray, np.ndarray))


def _like(container, items):
    """A list, tuple or dict like `container` holding `items`: a list (of
    any list type) as a list, a tuple as its type (a named tuple through
    ``_make``), a dict as its type. A plain call of the type does not do for
    every dict subclass (defaultdict takes its factory first), so those are
    copied (keeping such attributes) and refilled."""
    if isinstance(container, list):
        return list(items)
    if isinstance(container, tuple):
        return type(container)._make(items) if hasattr(container, '_fields') \
            else type(container)(items)
    if type(container) is dict:
        return dict(items)
    new = copy.copy(container)
    new.clear()
    new.update(items)
    return new


def rebuild(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """`obj` with every array inside it (as :func:`arrays` walks them, in
    that order) replaced by ``leaf(array)``; lists, tuples and dicts rebuilt
    (:func:`_like`), any other value kept as it is."""
    if _is_array(obj):
        return leaf(obj)
    if isinstance(obj, (list, tuple)):
        return _like(obj, [rebuild(v, leaf) for v in obj])
    if isinstance(obj, dict):
        return _like(obj, ((k, rebuild(v, leaf)) for k, v in obj.items()))
    return obj


def combine(objs: list, leaf: Callable[[list], Any],
            mismatch: str = 'cannot combine structures of different lengths') -> Any:
    """One structure from `objs`, structures alike (the first one's
    decides): at each array or other leaf of the first, ``leaf(the values
    there in every one)``; lists, tuples and dicts rebuilt (:func:`_like`).
    Lists or tuples of different lengths raise ValueError(`mismatch`: the
    lengths)."""
    first = objs[0]
    if isinstance(first, (list, tuple)):
        if any(len(o) != len(first) for o in objs):
            raise ValueError(f'{mismatch}: {[len(o) for o in objs]}')
        return _like(first, [combine([o[i] for o in objs], leaf, mismatch)
                             for i in range(len(first))])
    if isinstance(first, dict):
        return _like(first, ((k, combine([o[k] for o in objs], leaf, mismatch)) for k in first))
    return leaf(objs)
