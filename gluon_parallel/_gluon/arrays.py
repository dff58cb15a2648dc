"""Array operators called as MXNet registers them, which AMP's patched
``mx.nd`` functions would get wrong for bfloat16; an operator library loaded
without regenerating ``mx.nd`` (mxnet 1.9.1; see the package docstring)."""
import ctypes

import mxnet as mx

__all__ = ['split_into', 'copy', 'to_context', 'zero', 'add_into', 'load_operator_library']


def split_into(src, sizes, outs):
    """Write consecutive pieces of the vector `src` (lengths `sizes`) into
    the arrays `outs`, in one operator: the registered ``_split_v2`` takes
    the start indices and an ``out`` list (``nd.split_v2``, its wrapper,
    takes no ``out``)."""
    starts, pos = [], 0
    for k in sizes:
        starts.append(pos)
        pos += k
    mx.nd._internal._split_v2(src, indices=tuple(starts), axis=0, out=list(outs))


_RAW_OPS = {}


def _raw_op(name):
    """MXNet's own NDArray function of operator `name`, built the way
    ``base._init_op_module`` builds ``mx.nd``'s (``NNGetOpHandle``, then
    ``ndarray.register._make_ndarray_function``): untouched by what
    ``amp.init()`` patched in ``mx.nd`` (see :func:`copy`)."""
    fn = _RAW_OPS.get(name)
    if fn is None:
        from mxnet.ndarray.register import _make_ndarray_function
        handle = mx.base.OpHandle()
        mx.base.check_call(mx.base._LIB.NNGetOpHandle(mx.base.c_str(name),
                                                      ctypes.byref(handle)))
        fn = _RAW_OPS[name] = _make_ndarray_function(handle, name, name)
    return fn


def copy(src, dst=None, ctx=None):
    """Copy `src` into `dst` (default: a new array of its shape and dtype on
    `ctx`, default its context), bfloat16 included under AMP.

    ``amp.init(target_dtype='bfloat16')`` replaces ``mx.nd._internal._copyto``
    (what ``NDArray.copy``, ``copyto`` and ``as_in_context`` call) with a
    wrapper that casts its inputs to float32, ``out`` included: a bfloat16
    array's copy comes back float32, and a copy *into* a bfloat16 array
    writes a float32 temporary, leaving the destination unchanged (MXNet
    1.9.1: ``_copyto`` is in ``contrib/amp/lists/symbol_bf16.py``'s
    FP32_FUNCS; the float16 lists leave it alone)."""
    if dst is None:
        dst = mx.nd.empty(src.shape, ctx=ctx or src.context, dtype=src.dtype)
    # (a dict look-up first: a copy per replica and output is on the hot path)
    return (_RAW_OPS.get('_copyto') or _raw_op('_copyto'))(src, out=dst)


def to_context(arr, ctx):
    """``arr.as_in_context(ctx)`` keeping its dtype, bfloat16 included under
    AMP (see :func:`copy`; sparse arrays, never bfloat16, as MXNet copies
    them)."""
    if arr.context == ctx:
        return arr
    if type(arr) is not mx.nd.NDArray:      # sparse: a subclass (stype costs a C call)
        return arr.as_in_context(ctx)
    return copy(arr, ctx=ctx)


def zero(arr):
    """``arr[:] = 0``, bfloat16 included under AMP (``__setitem__`` calls
    ``_full``, which AMP's bfloat16 wrapper gives a float32 ``out``: MXNet
    then refuses the bfloat16 array)."""
    _raw_op('zeros_like')(arr, out=arr)


def add_into(dst, src):
    """``dst += src`` for arrays of one dtype, bfloat16 included under AMP
    (the same wrappers as :func:`zero`)."""
    _raw_op('elemwise_add')(dst, src, out=dst)


def load_operator_library(path):
    """Register the operators of an extension library (``mx.library``'s
    MXLoadLib) for graphs that name them. ``mx.library.load`` would also
    regenerate every ``mx.nd``/``mx.sym`` function, which undoes AMP's
    patched functions (``amp.init()``) and any other patch of them."""
    mx.base.check_call(mx.base._LIB.MXLoadLib(ctypes.c_char_p(path.encode('utf-8')),
                                              mx.base.mx_uint(0)))
