"""The numpy names mxnet 1.9.1 reads and current numpy removed, provided
just before mxnet's first import.

mxnet 1.9.1 (its last release) reads, when it is imported or used:

- ``numpy.bool`` and ``numpy.int``, aliases of the builtins removed in numpy
  1.24: mxnet/numpy/utils.py (at import), mxnet/numpy/multiarray.py,
  mxnet/ndarray/numpy/_op.py, mxnet/symbol/numpy/_symbol.py (boolean
  indexing, ``mx.np`` comparisons), mxnet/test_utils.py (``np.int``). The
  other four aliases (``float``, ``complex``, ``object``, ``str``) are given
  with them, as numpy 1.23 had them.
- ``PZERO``, ``NZERO``, ``PINF``, ``NINF``, ``NAN``, ``NaN`` (removed in numpy
  2.0): mxnet/numpy/utils.py, at import; ``Inf``:
  mxnet/gluon/contrib/estimator/event_handler.py, at import.
- ``alltrue`` and ``msort`` (removed in numpy 2.0), and the financial
  functions ``mirr``, ``npv``, ``pmt``, ``ppmt``, ``pv``, ``rate`` (removed in
  numpy 1.20: numpy 1.x still answers them with a function that raises,
  numpy 2 with AttributeError): mxnet/numpy/fallback.py, at import.
- ``sometrue``, ``product`` and ``round_`` (removed in numpy 2.0):
  mxnet/numpy_dispatch_protocol.py, at import (it registers ``mx.np``'s
  operators for numpy's functions of these names). Each is given as its
  own function calling the current one (``any``, ``prod``, ``round``), as
  numpy 1.x had it, so that registering it leaves the current one's
  registration alone.
- ``in1d`` and ``trapz`` (removed in numpy 2.4): mxnet/numpy/fallback.py, at
  import; given as ``isin`` of the flattened first argument and as
  ``trapezoid``.
- ``numpy.compat.basestring`` (the module is gone in numpy 2.0):
  mxnet/ndarray/numpy/_op.py and mxnet/symbol/numpy/_symbol.py (``mx.np.pad``).

mxnet also imports ``distutils`` (mxnet/numpy_op_fallback.py,
mxnet/numpy_dispatch_protocol.py), gone from Python 3.12's standard library:
setuptools provides it there (a requirement of this project on 3.12+).

:func:`install` puts a finder at the front of ``sys.meta_path``. It does
nothing for any import but mxnet's; when mxnet's import starts, it removes
itself and sets on numpy each of the names above that numpy lacks, with the
value numpy 1.23 had. A name numpy still has is never changed, so under
numpy 1.23 nothing is set. The project's ``gluon_parallel_numpy_compat.pth``
calls :func:`install` when Python starts, so that a script importing mxnet
before gluon_parallel works too; ``GLUON_PARALLEL_NUMPY_COMPAT=0`` turns it
off.
"""
import builtins
import importlib.abc
import math
import os
import sys
import types
import warnings

__all__ = ['OFF_ENV', 'NAMES', 'install', 'uninstall', 'installed', 'missing_names', 'patch_numpy']

OFF_ENV = 'GLUON_PARALLEL_NUMPY_COMPAT'
FINANCIAL = ('mirr', 'npv', 'pmt', 'ppmt', 'pv', 'rate')
# Every name this module may set (the keys of _values).
NAMES = ('bool', 'int', 'float', 'complex', 'object', 'str',
         'PZERO', 'NZERO', 'PINF', 'NINF', 'Inf', 'NAN', 'NaN',
         'alltrue', 'sometrue', 'product', 'round_', 'msort', 'in1d', 'trapz',
         'compat') + FINANCIAL


def _alias(numpy, name, current, **fixed):
    """numpy 1.x's `name`: a function of its own that calls numpy's `current`."""
    def alias(*args, **kwargs):
        return getattr(numpy, current)(*args, **fixed, **kwargs)
    alias.__name__ = name
    return alias


def _in1d(numpy):
    """numpy 1.x's in1d: isin on the flattened first argument."""
    def in1d(ar1, ar2, *args, **kwargs):
        return numpy.isin(numpy.ravel(ar1), ar2, *args, **kwargs)
    return in1d


def _removed_function(name):
    """numpy 1.20-1.26's answer for a financial function: one that raises."""
    def removed(*args, **kwargs):
        raise RuntimeError(f'numpy.{name} was removed from numpy 1.20 (NEP 32); '
                           'numpy_financial has it')
    removed.__name__ = name
    return removed


def _compat_module():
    """The one name of the removed ``numpy.compat`` that mxnet reads."""
    module = types.ModuleType('numpy.compat', 'basestring: what mxnet 1.9.1 reads of it')
    module.basestring = str
    return module


def _values(numpy):
    """Every name this module may set, with numpy 1.23's value."""
    return {
        'bool': builtins.bool, 'int': builtins.int, 'float': builtins.float,
        'complex': builtins.complex, 'object': builtins.object, 'str': builtins.str,
        'PZERO': 0.0, 'NZERO': -0.0, 'PINF': math.inf, 'NINF': -math.inf, 'Inf': math.inf,
        'NAN': math.nan, 'NaN': math.nan,
        'alltrue': _alias(numpy, 'alltrue', 'all'), 'sometrue': _alias(numpy, 'sometrue', 'any'),
        'product': _alias(numpy, 'product', 'prod'), 'round_': _alias(numpy, 'round_', 'round'),
        # numpy 1.x's msort: a copy sorted along the first axis.
        'msort': _alias(numpy, 'msort', 'sort', axis=0), 'in1d': _in1d(numpy),
        'trapz': _alias(numpy, 'trapz', 'trapezoid'), 'compat': _compat_module(),
        **{name: _removed_function(name) for name in FINANCIAL},
    }


def _has(numpy, name):
    # numpy 1.20-1.23 still answer the builtin aliases, with a warning.
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return hasattr(numpy, name)


def missing_names(numpy):
    """The names mxnet 1.9.1 reads that `numpy` (the module) lacks."""
    return [name for name in NAMES if not _has(numpy, name)]


def patch_numpy(numpy=None):
    """Set on numpy the names of :func:`missing_names`.

    Parameters
    ----------
    numpy : module, optional
        The module to patch; default: numpy, imported.

    Returns
    -------
    list of str
        The names set (empty where numpy has them all).
    """
    if numpy is None:
        import numpy
    values = _values(numpy)
    assert tuple(values) == NAMES
    names = missing_names(numpy)
    for name in names:
        setattr(numpy, name, values[name])
    return names


class _MxnetFinder(importlib.abc.MetaPathFinder):
    """Patches numpy when mxnet's import starts; finds nothing itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == 'mxnet':
            uninstall()
            patch_numpy()
        return None     # the next finders import mxnet


_FINDER = _MxnetFinder()


def installed():
    """Whether the finder waits for mxnet's import."""
    return _FINDER in sys.meta_path


def install():
    """Wait for mxnet's first import, unless OFF_ENV is '0' or mxnet was
    imported already (then numpy is patched at once)."""
    if os.environ.get(OFF_ENV, '1') == '0':
        return
    if 'mxnet' in sys.modules:
        patch_numpy()
    elif not installed():
        sys.meta_path.insert(0, _FINDER)


def uninstall():
    """Stop waiting for mxnet (names already set stay)."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
