"""Operators pushed through MXNet's C API with no Python frame per call:
the ``MXImperativeInvokeEx`` arguments that ``mx.nd``'s functions build on
every call (mxnet 1.9.1, ``_ctypes/ndarray._imperative_invoke``), built once
and reused on the hot path (graph mode's per-call copies, gp.Trainer's
multi-tensor updates)."""
import contextlib
import ctypes
import itertools
import threading

import mxnet as mx

from .environment import setting, user_set

__all__ = ['op_handle', 'op_params', 'prepared_op', 'invoke', 'invoke_each', 'executor_forward',
           'quiet_bind']

_OP_HANDLES = {}


def op_handle(name):
    """The C handle of operator `name` (``NNGetOpHandle``)."""
    handle = _OP_HANDLES.get(name)
    if handle is None:
        handle = _OP_HANDLES[name] = mx.base.OpHandle()
        mx.base.check_call(mx.base._LIB.NNGetOpHandle(mx.base.c_str(name),
                                                      ctypes.byref(handle)))
    return handle


def op_params(params):
    """An operator's parameters as the two C string arrays
    ``MXImperativeInvokeEx`` takes: ``str`` of each value, as ``mx.nd``'s
    functions format them (1.9.1, ``_imperative_invoke``)."""
    keys = [k.encode() for k in params]
    vals = [str(v).encode() for v in params.values()]
    return (ctypes.c_int(len(keys)), (ctypes.c_char_p * len(keys))(*keys),
            (ctypes.c_char_p * len(vals))(*vals))


def prepared_op(name, inputs, outputs):
    """One operator on fixed input and output arrays, for :func:`invoke`:
    the ``MXImperativeInvokeEx`` arguments ``mx.nd``'s function would
    build on every call (1.9.1, ``_ctypes/ndarray._imperative_invoke``),
    built once. The arrays are kept alive with it."""
    handle = ctypes.c_void_p(op_handle(name).value)
    ins = (mx.base.NDArrayHandle * len(inputs))(*[a.handle for a in inputs])
    outs = (mx.base.NDArrayHandle * len(outputs))(*[a.handle for a in outputs])
    nout = ctypes.c_int(len(outputs))
    out_ptr = ctypes.cast(outs, ctypes.POINTER(mx.base.NDArrayHandle))
    stypes = ctypes.POINTER(ctypes.c_int)()
    return ((handle, ctypes.c_int(len(inputs)), ins, ctypes.byref(nout), ctypes.byref(out_ptr)),
            ctypes.byref(stypes), (inputs, outputs, outs, nout, out_ptr, stypes))


def invoke(ops, params):
    """Run every :func:`prepared_op` in `ops` with the :func:`op_params`
    `params`: one C call each, pushed to MXNet's engine as ``mx.nd``'s
    function would, no Python frame per operator."""
    invoke_each(zip(ops, itertools.repeat(params)))


def invoke_each(pairs):
    """Run each :func:`prepared_op` of `pairs` with its own
    :func:`op_params`, in order (see :func:`invoke`)."""
    call = mx.base._LIB.MXImperativeInvokeEx
    for (head, stypes, _), (n, keys, vals) in pairs:
        if call(*head, n, keys, vals, stypes) != 0:
            mx.base.check_call(-1)


def executor_forward(executor, train):
    """``executor.forward(is_train=train)`` without re-wrapping its outputs.
    1.9.1: ``Executor.forward`` calls ``MXExecutorForward`` and then builds
    a new NDArray for every output (``_get_outputs``), which are the same
    arrays after every forward pass (a bound graph allocates them once):
    the ``outputs`` read after bind stay valid."""
    mx.base.check_call(mx.base._LIB.MXExecutorForward(executor.handle, ctypes.c_int(int(train))))


SUBGRAPH_VERBOSE_ENV = 'MXNET_SUBGRAPH_VERBOSE'
_bind_lock = threading.Lock()
_bound_once = []


@contextlib.contextmanager
def quiet_bind():
    """Around ``Symbol.bind``: no ``Subgraph backend MKLDNN is activated.``
    log line. 1.9.1's ``Executor::Bind`` (``graph_executor.cc``) logs it at
    every bind while ``MXNET_SUBGRAPH_BACKEND`` is set (the CPU wheel's
    default is ``MKLDNN``) and ``MXNET_SUBGRAPH_VERBOSE``, which it reads
    into a static at the process's first bind, is not 0. So the first bind
    made here runs with ``MXNET_SUBGRAPH_VERBOSE=0`` unless the user set it
    (environment.setting: MXNet's default, 1, after it); the backend is
    left as it is. A process whose first bind was another (a Module's)
    keeps what that bind read."""
    if _bound_once:
        yield
        return
    with _bind_lock:
        if _bound_once or user_set(SUBGRAPH_VERBOSE_ENV):
            _bound_once.append(True)
            yield
            return
        with setting({SUBGRAPH_VERBOSE_ENV: '0'}):
            yield
        _bound_once.append(True)
