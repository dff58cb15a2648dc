"""Nested arguments and outputs: the arrays inside lists, tuples and dicts.

The one walker every module uses to find the arrays of a call's arguments
or of a replica's outputs (splitting, waiting for outputs, checking where
they are, asking autograd about them).
"""
from collections.abc import Iterator
from typing import Any

import numpy as np
from mxnet import nd

__all__ = ['arrays', 'ndarrays']


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
