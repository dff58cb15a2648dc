"""Array operators called as MXNet registers them, which AMP's patched
``mx.nd`` functions would get wrong for bfloat16; an operator library loaded
without regenerating ``mx.nd`` (mxnet 1.9.1; see the package docstring)."""
import ctypes
import itertools

import mxnet as mx

from .invoke import op_handle

__all__ = ['split_into', 'copy_into', 'signature', 'row_signature', 'copies', 'Copier',
           'row_slices', 'copy', 'to_context', 'zero', 'add_into', 'load_operator_library']


def split_into(src, sizes, outs):
    """Write consecutive pieces of the vector `src` (lengths `sizes`) into
    the arrays `outs`, in one operator: the registered ``_split_v2`` takes
    the start indices and an ``out`` list (``nd.split_v2``, its wrapper,
    takes no ``out``)."""
    mx.nd._internal._split_v2(src, indices=_starts(sizes), axis=0, out=list(outs))


def _starts(sizes):
    starts, pos = [], 0
    for k in sizes:
        starts.append(pos)
        pos += k
    return tuple(starts)


_RAW_OPS = {}


def _raw_op(name):
    """MXNet's own NDArray function of operator `name`, built the way
    ``base._init_op_module`` builds ``mx.nd``'s (``NNGetOpHandle``, then
    ``ndarray.register._make_ndarray_function``): untouched by what
    ``amp.init()`` patched in ``mx.nd`` (see :func:`copy`)."""
    fn = _RAW_OPS.get(name)
    if fn is None:
        from mxnet.ndarray.register import _make_ndarray_function
        fn = _RAW_OPS[name] = _make_ndarray_function(op_handle(name), name, name)
    return fn


def copy_into(srcs, dsts):
    """:func:`copy` of each array of `srcs` into the array of `dsts` at
    the same position, one C call each and no Python frame per copy: the
    ``MXImperativeInvokeEx`` of ``_copyto`` that ``mx.nd``'s function
    pushes (1.9.1, ``_ctypes/ndarray._imperative_invoke``). Graph mode
    copies every replica's slices this way once per call."""
    call, op = mx.base._LIB.MXImperativeInvokeEx, ctypes.c_void_p(op_handle('_copyto').value)
    ins, outs = (mx.base.NDArrayHandle * 1)(), (mx.base.NDArrayHandle * 1)()
    out_ptr = ctypes.cast(outs, ctypes.POINTER(mx.base.NDArrayHandle))
    one, zero, count = ctypes.c_int(1), ctypes.c_int(0), ctypes.c_int(1)
    stypes = ctypes.POINTER(ctypes.c_int)()
    args = (ctypes.byref(count), ctypes.byref(out_ptr), zero, None, None, ctypes.byref(stypes))
    for src, dst in zip(srcs, dsts):
        ins[0], outs[0] = src.handle, dst.handle
        if call(op, one, ins, *args) != 0:
            mx.base.check_call(-1)


def _describe(arrays):
    """(shape, dtype code, device type, device id) of each array, in C
    calls only (1.9.1: ``MXNDArrayGetShapeEx`` without large-tensor
    support, ``MXNDArrayGetDType``, ``MXNDArrayGetContext``: what the
    ``shape``/``dtype``/``context`` properties call)."""
    lib, out = mx.base._LIB, []
    ndim, pdata = ctypes.c_int(), ctypes.POINTER(ctypes.c_int)()
    dtype, dev_type, dev_id = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    refs = ctypes.byref(ndim), ctypes.byref(pdata)
    for a in arrays:
        h = a.handle
        if lib.MXNDArrayGetShapeEx(h, *refs) != 0 or \
                lib.MXNDArrayGetDType(h, ctypes.byref(dtype)) != 0 or \
                lib.MXNDArrayGetContext(h, ctypes.byref(dev_type), ctypes.byref(dev_id)) != 0:
            mx.base.check_call(-1)
        shape = tuple(pdata[:ndim.value]) if ndim.value >= 0 else None
        out.append((shape, dtype.value, dev_type.value, dev_id.value))
    return out


def signature(args_list):
    """``tuple(tuple((a.shape, a.dtype) for a in args) for args in
    args_list)`` through :func:`_describe` (and the ``_DTYPE_MX_TO_NP``
    table the ``dtype`` property reads), without two property calls per
    array."""
    table = mx.ndarray.ndarray._DTYPE_MX_TO_NP
    args_list = list(args_list)
    flat = [(shape, table[code]) for shape, code, _, _ in
            _describe(itertools.chain.from_iterable(args_list))]
    out, pos = [], 0
    for args in args_list:
        out.append(tuple(flat[pos:pos + len(args)]))
        pos += len(args)
    return tuple(out)


def row_signature(whole, sizes):
    """What :func:`signature` gives for every replica's slices when replica
    r gets ``sizes[r]`` rows of each array of `whole`, without slicing."""
    described = signature([whole])[0]
    return tuple(tuple(((k,) + shape[1:], dtype) for shape, dtype in described)
                 for k in sizes)


def copies(srcs):
    """A new array with a :func:`copy` of each of `srcs` (same shape,
    dtype, context): :func:`_describe`, then :class:`Copier`."""
    srcs = list(srcs)
    return Copier(srcs)()


class Copier:
    """New copies of the same arrays, again and again (an executor's
    outputs), in two C calls per array and no other Python frame: what
    each array needs is read once (:func:`_describe`), then per call
    ``MXNDArrayCreateEx`` (what ``nd.empty`` calls, 1.9.1) and
    :func:`copy_into`.

    Parameters
    ----------
    srcs : list of NDArray
        The arrays copied on each call (their shapes, dtypes and contexts
        must not change).
    """

    def __init__(self, srcs):
        self.srcs = list(srcs)
        self._create = [((mx.base.mx_uint * len(shape))(*shape), mx.base.mx_uint(len(shape)),
                         ctypes.c_int(dev_type), ctypes.c_int(dev_id), ctypes.c_int(0),
                         ctypes.c_int(dtype))
                        for shape, dtype, dev_type, dev_id in _describe(self.srcs)]

    def __call__(self):
        """New arrays holding copies of the arrays' current values."""
        create, cls, out = mx.base._LIB.MXNDArrayCreateEx, mx.nd.NDArray, []
        for args in self._create:
            handle = mx.base.NDArrayHandle()
            if create(*args, ctypes.byref(handle)) != 0:
                mx.base.check_call(-1)
            out.append(cls(handle))
        copy_into(self.srcs, out)
        return out


def row_slices(arr, sizes):
    """Consecutive row ranges of `arr`, of lengths `sizes`, sharing its
    memory: what ``arr[begin:end]`` returns (1.9.1 ``NDArray._slice``:
    ``MXNDArraySlice``, then the class on the new handle), one C call and
    one constructor each, without ``__getitem__``'s Python."""
    cls, slice_, out, begin = type(arr), mx.base._LIB.MXNDArraySlice, [], 0
    for k in sizes:
        handle = mx.base.NDArrayHandle()
        if slice_(arr.handle, mx.base.mx_uint(begin), mx.base.mx_uint(begin + k),
                  ctypes.byref(handle)) != 0:
            mx.base.check_call(-1)
        out.append(cls(handle=handle, writable=arr.writable))
        begin += k
    return out


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
