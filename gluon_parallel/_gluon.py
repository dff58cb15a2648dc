"""The one place that touches MXNet/Gluon private attributes (mxnet 1.9.1).

Every helper names the 1.9.1 behaviour it relies on, so that a new MXNet
release is checked here and nowhere else. Other modules call these and
read or write no underscored attribute of an MXNet object; the package's
subclasses of Gluon classes (SyncBatchNorm, HostEmbedding) use their own
inherited state through ``self``, as Gluon's subclasses do. The one other
exception is the optimizer-state pickle, opened in
``checkpoint/trainer_state.py`` only.
"""
import contextlib
import ctypes
import itertools

import mxnet as mx
from mxnet import autograd, gluon

__all__ = []


# ---------------------------------------------------------------- Parameter --

def has_data(p):
    """``Parameter._data`` is None until the arrays exist (before
    ``initialize``, and while initialisation is deferred)."""
    return p._data is not None


def is_deferred(p):
    """``Parameter._deferred_init`` is a non-empty tuple (init, ctx list,
    default init, data) while the shape waits for the first forward pass."""
    return bool(p._deferred_init)


def is_row_sparse(p):
    """``Parameter._stype`` is 'row_sparse' for sparse weights, whose value a
    kvstore holds; ``Parameter._reduce()`` fetches it."""
    return p._stype != 'default'


def has_sparse_grad(p):
    """``Parameter._grad_stype`` is 'row_sparse' for a sparse gradient
    (``Embedding(sparse_grad=True)``)."""
    return p._grad_stype != 'default'


def reduced_value(p):
    """The value of a row-sparse parameter (``Parameter._reduce``)."""
    return p._reduce()


def load_init(p, value, ctx):
    """``Parameter._load_init(data, ctx)`` initialises an uninitialised or
    deferred parameter from a value (what ``load_parameters`` uses)."""
    p._load_init(value, ctx)


def grad_is_fresh(array):
    """``NDArray._fresh_grad``: set by backward, cleared by ``Trainer.step``
    (without update_on_kvstore); a stale gradient is one not written since."""
    return array._fresh_grad


def set_grad_fresh(array, fresh):
    array._fresh_grad = fresh


def mark_grads_fresh(arrays):
    """Mark every array's gradient fresh, as autograd's backward does.
    ``NDArray._fresh_grad = True`` is ``MXNDArraySetGradState(handle, 1)``
    (1.9.1); called directly, one C call per array and no Python frame
    (graph mode runs this per parameter and device every step)."""
    set_grads_fresh(arrays, True)


def set_grads_fresh(arrays, fresh):
    """``a._fresh_grad = fresh`` for every array, one C call each
    (``MXNDArraySetGradState``, see :func:`mark_grads_fresh`)."""
    setter, state = mx.base._LIB.MXNDArraySetGradState, ctypes.c_int(int(fresh))
    for a in arrays:
        if setter(a.handle, state) != 0:
            mx.base.check_call(-1)              # raises MXNet's last error


def grads_fresh(arrays):
    """``[a._fresh_grad for a in arrays]`` through ``MXNDArrayGetGradState``
    (what the property calls in 1.9.1), one C call each, no Python frame."""
    getter, state = mx.base._LIB.MXNDArrayGetGradState, ctypes.c_int()
    ref, out = ctypes.byref(state), []
    for a in arrays:
        if getter(a.handle, ref) != 0:
            mx.base.check_call(-1)
        out.append(bool(state.value))
    return out


@contextlib.contextmanager
def hidden_from_step(params):
    """Within the block, `params` have ``grad_req == 'null'`` for the
    Trainer, which then neither reduces nor updates them. Written through
    ``Parameter._grad_req``: the public setter would drop the gradient
    arrays."""
    saved = [(p, p._grad_req) for p in params]
    try:
        for p, _ in saved:
            p._grad_req = 'null'
        yield
    finally:
        for p, req in saved:
            p._grad_req = req


class PinnedParameter(gluon.Parameter):
    """A Parameter that stays on one context whatever context list its model
    is initialised, loaded or reset on (``net.initialize(ctx=ctx_list)``,
    ``net.load_parameters(f, ctx=ctx_list)``). Resetting it to a single
    context moves it there.

    Relies on (1.9.1): ``Block.initialize`` and ``load_parameters`` reach a
    parameter through ``initialize(ctx=...)`` and ``_load_init(data, ctx)``,
    ``reset_ctx`` through ``reset_ctx``; ``_data`` / ``_deferred_init`` tell
    whether it exists yet."""

    def __init__(self, name, ctx, **kwargs):
        super().__init__(name, **kwargs)
        self._pinned_ctx = ctx

    @property
    def pinned_ctx(self):
        """The one context of the parameter."""
        return self._pinned_ctx

    def initialize(self, init=None, ctx=None,
                   default_init=mx.init.Uniform(),      # noqa: B008 (Parameter's own default)
                   force_reinit=False):
        super().initialize(init, self._pinned_ctx, default_init,
                                                 force_reinit)

    def reset_ctx(self, ctx):
        if ctx is None:
            ctx = mx.current_context()
        if isinstance(ctx, mx.Context):
            self._pinned_ctx = ctx
        elif len(ctx) == 1:
            self._pinned_ctx = ctx[0]
        super().reset_ctx(self._pinned_ctx)

    def _load_init(self, data, ctx, cast_dtype=False, dtype_source='current'):
        # Where it already is (or will be, once deferred shapes are known).
        ctx = None if self._data is not None or self._deferred_init else self._pinned_ctx
        super()._load_init(data, ctx, cast_dtype, dtype_source)


# ---------------------------------------------------------------- Block --

def structural_params(block):
    """{structural name ('features.0.weight'): Parameter}, the names
    ``save_parameters`` writes (``Block._collect_params_with_prefix``)."""
    return block._collect_params_with_prefix()


def children(block):
    """The child blocks in registration order (``Block._children``, an
    OrderedDict of name -> block)."""
    return block._children


def is_active_hybrid(block):
    """A HybridBlock whose ``hybridize()`` is in force (``_active``): its
    children run inside its graph."""
    return isinstance(block, gluon.HybridBlock) and block._active


def has_forward_hooks(block):
    """``Block._forward_pre_hooks`` / ``_forward_hooks``: what
    ``register_forward_pre_hook`` / ``register_forward_hook`` add, run by
    ``Block.__call__`` (a hybridized child's never run: CachedOp)."""
    return bool(block._forward_pre_hooks or block._forward_hooks)


def call_with_kwargs(block, args, kwargs):
    """``block(*args, **kwargs)``. Gluon 1.x ``Block.__call__`` takes no
    keyword arguments, so those go to ``forward``, with the forward hooks
    (``_forward_pre_hooks``, ``_forward_hooks``) run here as ``__call__``
    would."""
    if not kwargs:
        return block(*args)
    for hook in block._forward_pre_hooks.values():
        hook(block, args)
    out = block.forward(*args, **kwargs)
    for hook in block._forward_hooks.values():
        hook(block, args, out)
    return out


def owns_param(block, param):
    """True if `param` was created by `block` itself, not shared from
    another block (``block.params._params`` holds a block's own ones)."""
    return block.params._params.get(param.name) is param


def replace_param(block, attr, param):
    """Make `param` the block's parameter `attr` (e.g. 'weight'), in its
    ParameterDict too. ``Block.__setattr__`` refuses to re-bind a
    registered parameter, so this writes ``_reg_params``, the
    ``params._params`` entry and the attribute directly."""
    old = getattr(block, attr)
    block.params._params.pop(old.name, None)
    block.params._params[param.name] = param
    block._reg_params[attr] = param
    object.__setattr__(block, attr, param)


def batchnorm_config(bn):
    """The constructor arguments of a ``gluon.nn.BatchNorm`` (or subclass)
    that define its computation, read from ``_kwargs`` (axis, eps, momentum,
    fix_gamma, use_global_stats) and beta's ``_differentiable`` (center)."""
    kw = bn._kwargs
    return dict(axis=kw['axis'], momentum=kw['momentum'], epsilon=kw['eps'],
                center=bn.beta._differentiable, scale=not kw['fix_gamma'],
                use_global_stats=kw['use_global_stats'])


# ------------------------------------------------------- HybridBlock graph --

def traced_graph(block, args):
    """(handle, data input names, output Symbol, CachedOp flags) of an active
    HybridBlock's graph. ``_build_cache(*args)`` traces it into
    ``_cached_graph = (data symbols, output symbol)`` and creates
    ``_cached_op`` (None until then, and again after ``hybridize()`` or a
    cast); ``_flags`` holds the hybridize() flags. The handle (the CachedOp)
    tells a rebuilt graph from the one seen before."""
    if block._cached_op is None:
        block._build_cache(*args)
    data, out = block._cached_graph
    return block._cached_op, [d.name for d in data], out, list(block._flags)


def graph_handle(block):
    """The current CachedOp of a HybridBlock (see traced_graph), or None:
    ``HybridBlock._cached_op`` is None until the first hybridized call
    builds the graph (and again after ``hybridize()``)."""
    return block._cached_op


def flat_inputs(args):
    """A hybridized call's NDArray inputs in graph order: ``gluon.block._flatten``
    (nested lists to a flat list) without the None entries it keeps."""
    return [a for a in gluon.block._flatten(args, 'input')[0] if a is not None]


def flat_inputs_all(args_list):
    """:func:`flat_inputs` of every replica's arguments; when they are all
    NDArrays already (the common case), without a Python call per replica."""
    if set(map(type, itertools.chain.from_iterable(args_list))) == {mx.nd.NDArray}:
        return list(map(list, args_list))
    return [flat_inputs(a) for a in args_list]


def nested_outputs(block, flat):
    """The flat outputs of a block's graph in the nesting its hybrid_forward
    returned (``_out_format``, restored by ``gluon.block._regroup``)."""
    return gluon.block._regroup(flat, block._out_format)


def nested_outputs_all(block, flats):
    """:func:`nested_outputs` of every replica's flat outputs; for a block
    returning one NDArray (``_out_format`` 0, 1.9.1), without a Python call
    per replica."""
    if block._out_format == 0:
        return [flat[0] for flat in flats]
    return [nested_outputs(block, flat) for flat in flats]


def route_cached_op_calls(route):
    """Make every hybridized call go through ``route(block, args, original)``
    until :func:`unroute_cached_op_calls`. MXNet 1.9.1's
    ``HybridBlock.forward`` calls ``self._call_cached_op(*args)`` for an
    active block; route gets the original method to fall back on.
    Replaces an earlier route."""
    original = getattr(gluon.HybridBlock._call_cached_op, '_gp_original',
                       gluon.HybridBlock._call_cached_op)

    def _call_cached_op(self, *args):
        return route(self, args, original)
    _call_cached_op._gp_original = original
    _call_cached_op._gp_route = route
    gluon.HybridBlock._call_cached_op = _call_cached_op


def cached_op_route():
    """The route installed by :func:`route_cached_op_calls`, or None."""
    return getattr(gluon.HybridBlock._call_cached_op, '_gp_route', None)


def unroute_cached_op_calls():
    """Give ``HybridBlock._call_cached_op`` back MXNet's own method."""
    original = getattr(gluon.HybridBlock._call_cached_op, '_gp_original', None)
    if original is not None:
        gluon.HybridBlock._call_cached_op = original


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
        fn = _RAW_OPS[name] = _make_ndarray_function(_op_handle(name), name, name)
    return fn


_OP_HANDLES = {}


def _op_handle(name):
    """The C handle of operator `name` (``NNGetOpHandle``)."""
    handle = _OP_HANDLES.get(name)
    if handle is None:
        handle = _OP_HANDLES[name] = mx.base.OpHandle()
        mx.base.check_call(mx.base._LIB.NNGetOpHandle(mx.base.c_str(name),
                                                      ctypes.byref(handle)))
    return handle


def copy_into(srcs, dsts):
    """:func:`copy` of each array of `srcs` into the array of `dsts` at
    the same position, one C call each and no Python frame per copy: the
    ``MXImperativeInvokeEx`` of ``_copyto`` that ``mx.nd``'s function
    pushes (1.9.1, ``_ctypes/ndarray._imperative_invoke``). Graph mode
    copies every replica's slices this way once per call."""
    call, op = mx.base._LIB.MXImperativeInvokeEx, ctypes.c_void_p(_op_handle('_copyto').value)
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


def copies(srcs):
    """A new array with a :func:`copy` of each of `srcs` (same shape,
    dtype, context), with one constructor call per array and no other
    Python frame: :func:`_describe`, ``MXNDArrayCreateEx`` (what
    ``nd.empty`` calls, 1.9.1) and :func:`copy_into`."""
    srcs, create, out = list(srcs), mx.base._LIB.MXNDArrayCreateEx, []
    for shape, dtype, dev_type, dev_id in _describe(srcs):
        handle = mx.base.NDArrayHandle()
        if create((mx.base.mx_uint * len(shape))(*shape), mx.base.mx_uint(len(shape)),
                  ctypes.c_int(dev_type), ctypes.c_int(dev_id), ctypes.c_int(0),
                  ctypes.c_int(dtype), ctypes.byref(handle)) != 0:
            mx.base.check_call(-1)
        out.append(mx.nd.NDArray(handle))
    copy_into(srcs, out)
    return out


def executor_forward(executor, train):
    """``executor.forward(is_train=train)`` without re-wrapping its outputs.
    1.9.1: ``Executor.forward`` calls ``MXExecutorForward`` and then builds
    a new NDArray for every output (``_get_outputs``), which are the same
    arrays after every forward pass (a bound graph allocates them once):
    the ``outputs`` read after bind stay valid."""
    mx.base.check_call(mx.base._LIB.MXExecutorForward(executor.handle, ctypes.c_int(int(train))))


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


# ---------------------------------------------------------------- autograd --

def after_backward(callback):
    """Run ``callback(retain_graph)`` in the calling thread right after
    every autograd backward pass has been pushed, before the caller can
    push anything else, until :func:`remove_after_backward`. Replaces an
    earlier callback.

    1.9.1: ``autograd.backward``, ``autograd.grad`` and ``NDArray.backward``
    all call ``MXAutogradBackwardEx`` through ``mxnet.base._LIB`` at call
    time (a ctypes library whose function attributes can be replaced); its
    sixth argument is ``retain_graph``. The C call returns once the pass's
    operations are pushed (not run), so an operation pushed by the callback
    is ordered after them and before whatever the caller pushes next.
    """
    lib = mx.base._LIB
    original = getattr(lib.MXAutogradBackwardEx, '_gp_original', lib.MXAutogradBackwardEx)

    def backward_ex(*args):
        status = original(*args)
        if status == 0:
            callback(bool(getattr(args[5], 'value', args[5])) if len(args) > 5 else False)
        return status
    backward_ex._gp_original = original
    backward_ex._gp_callback = callback
    lib.MXAutogradBackwardEx = backward_ex


def after_backward_callback():
    """The callback :func:`after_backward` installed, or None."""
    return getattr(mx.base._LIB.MXAutogradBackwardEx, '_gp_callback', None)


def remove_after_backward():
    """Give ``MXAutogradBackwardEx`` back MXNet's own function."""
    lib = mx.base._LIB
    original = getattr(lib.MXAutogradBackwardEx, '_gp_original', None)
    if original is not None:
        lib.MXAutogradBackwardEx = original


# ---------------------------------------------------------------- Trainer --

def trainer_params(trainer):
    """The trainer's parameters in the order that indexes its optimizer
    state (``Trainer._params``: sorted by full name at construction)."""
    return trainer._params


def trainer_kvstore_ready(trainer):
    """``Trainer._kv_initialized``: the Trainer creates its kvstore lazily,
    at its first step (or ``_init_kvstore``)."""
    return trainer._kv_initialized


def trainer_kvstore_config(trainer):
    """``Trainer._kvstore_params``: {'kvstore': type name or KVStore,
    'update_on_kvstore': bool or None}, read when the kvstore is created;
    changing it before then changes what is created."""
    return trainer._kvstore_params


def param_trainers(params):
    """The Trainers of `params` (``Parameter._trainer``: the last Trainer
    built over a parameter, set by ``Trainer.__init__`` through
    ``_set_trainer``). One comprehension: this runs on every recorded call."""
    return {p._trainer for p in params if p._trainer is not None}


def param_arrays_state(params):
    """(ids of the array lists, grad_req) of each parameter: ``Parameter._data``
    and ``_grad`` are the lists ``list_data()`` and ``list_grad()`` return,
    replaced by ``initialize``, ``reset_ctx``, ``cast`` and a new grad_req. One
    comprehension: this runs on every call."""
    return tuple([(id(p._data), id(p._grad), p._grad_req) for p in params])


def amp_loss_scaler(trainer):
    """``Trainer._amp_loss_scaler``, set by ``amp.init_trainer``; its
    ``Trainer._update`` skips an update whose gradients overflowed."""
    return getattr(trainer, '_amp_loss_scaler', None)


def trainer_updates_on_kvstore(trainer):
    """Whether the initialised kvstore of `trainer` applies the updates
    (``Trainer._kvstore`` and ``_update_on_kvstore``)."""
    return bool(trainer._kvstore is not None and trainer._update_on_kvstore)


def init_trainer_kvstore(trainer):
    """Create the Trainer's kvstore now (``Trainer._init_kvstore``); after
    it, ``_kvstore`` and ``_update_on_kvstore`` are set."""
    if not trainer._kv_initialized:
        trainer._init_kvstore()
    return trainer._kvstore, trainer._update_on_kvstore


def init_trainer_params(trainer):
    """Push/pull the parameters still waiting for the kvstore
    (``Trainer._params_to_init``, ``_init_params``: rank 0's values are
    broadcast)."""
    if trainer._params_to_init:
        trainer._init_params()


class TrainerHooks(gluon.Trainer):
    """A ``gluon.Trainer`` whose reduction and update a subclass may take
    over, step by step.

    1.9.1: ``step`` calls ``self._allreduce_grads()`` then
    ``self._update(ignore_stale_grad)``; ``allreduce_grads()`` and
    ``update()`` call the same two after initialising the kvstore. A
    subclass defines :meth:`fused_allreduce` and :meth:`fused_update`,
    which return False to leave the step to Gluon's own code.
    """

    def fused_allreduce(self):
        return False

    def fused_update(self, ignore_stale_grad):
        return False

    def _allreduce_grads(self):
        if not self.fused_allreduce():
            super()._allreduce_grads()

    def _update(self, ignore_stale_grad=False):
        if not self.fused_update(ignore_stale_grad):
            super()._update(ignore_stale_grad)


# ---------------------------------------------------------------- Optimizer --

# The most arrays one multi-tensor operator takes (1.9.1: the kernels'
# parameter structs hold 60 weights, MultiSGDKernelParam::N; 61 crashes
# the process, measured).
MULTI_TENSOR_MAX = 60


def count_updates(optimizer, device_ids, indices):
    """What ``Optimizer._update_count(indices)`` does on each device in
    turn, as each device's ``Updater`` does before its update, without a
    Python call per device. 1.9.1: ``_set_current_context(device_id)``
    makes ``_index_update_count`` that device's dict in
    ``_all_index_update_counts`` (created on first use); a count starts at
    ``begin_num_update``; ``num_update`` is the largest count."""
    counts = optimizer._all_index_update_counts
    begin, top = optimizer.begin_num_update, optimizer.num_update
    for dev in device_ids:
        mine = counts.get(dev)
        if mine is None:
            mine = counts[dev] = {}
        for i in indices:
            c = mine.get(i, begin) + 1
            mine[i] = c
            if c > top:
                top = c
    optimizer.num_update = top
    optimizer._index_update_count = counts[device_ids[-1]]


def lrs_and_wds(optimizer, indices):
    """The learning rates and weight decays of `indices` for this update
    (``Optimizer._get_lrs`` / ``_get_wds``: the scheduler at
    ``num_update``, times each parameter's ``lr_mult`` / ``wd_mult``)."""
    return optimizer._get_lrs(indices), optimizer._get_wds(indices)


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
    handle = ctypes.c_void_p(_op_handle(name).value)
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
    call = mx.base._LIB.MXImperativeInvokeEx
    n, keys, vals = params
    for head, stypes, _ in ops:
        if call(*head, n, keys, vals, stypes) != 0:
            mx.base.check_call(-1)


# ---------------------------------------------------------------- KVStore --

def batched_pushpull(kv, keys, values, priority=0):
    """A callable doing ``kv.pushpull(keys, values)`` (each key's list of
    per-device arrays summed and written back to them) in one C call, or
    None for a kvstore that is not MXNet's own ``KVStore`` (Horovod's
    store sums in Python). 1.9.1: ``KVStore.pushpull`` with int keys calls
    ``MXKVStorePushPull`` with each key repeated once per value; its
    Python (``_ctype_key_value``) recurses once per key, so the arrays are
    built here once."""
    if not isinstance(kv, mx.kv.KVStore):
        return None
    flat_keys = [k for k, vs in zip(keys, values) for _ in vs]
    flat = [v.handle for vs in values for v in vs]
    n = len(flat)
    ckeys = (ctypes.c_int * n)(*flat_keys)
    cvals = (mx.base.NDArrayHandle * n)(*flat)
    args = (kv.handle, mx.base.mx_uint(n), ckeys, mx.base.mx_uint(n), ckeys, cvals, cvals,
            ctypes.c_int(priority))
    keep = (kv, values)

    def pushpull():
        assert keep
        mx.base.check_call(mx.base._LIB.MXKVStorePushPull(*args))
    return pushpull

# ---------------------------------------------------------------- KVStore --

def kvstore_barrier(kv):
    """``KVStore._barrier()``: every worker of a dist kvstore meets."""
    kv._barrier()


def free_kvstore(kv):
    """Free a kvstore's C handle now (``MXKVStoreFree``), leaving the Python
    object with a NULL handle, which ``KVStore.__del__`` frees as a no-op.
    A dist kvstore freed while interpreter shutdown tears modules down
    aborts the process (1.9.1: "terminate called without an active
    exception")."""
    from mxnet.base import _LIB, check_call
    handle, kv.handle = kv.handle, None
    check_call(_LIB.MXKVStoreFree(handle))


def specialise(obj, cls):
    """Give a live MXNet object the methods of `cls`, a subclass of its
    class that adds no state (assigning ``__class__``: the object was made
    by MXNet or the user, not by us)."""
    assert isinstance(obj, cls.__mro__[1])
    obj.__class__ = cls


def needs_grad(arr):
    """Whether autograd would carry a gradient with respect to `arr` on to an
    array that keeps one: `arr` was computed under ``record()`` from an array
    marked with ``attach_grad``/``mark_variables``. MXNet 1.9.1 names the
    leaves of the recorded history ``var<k>`` for marked arrays and
    ``null<k>`` for arrays the recorded operators only read (imperative.cc,
    MarkVariables and RecordOp); ``autograd.get_symbol`` raises for an array
    outside the recorded graph, and walks its whole history."""
    try:
        sym = autograd.get_symbol(arr)
    except mx.base.MXNetError:
        return False
    return any(name.startswith('var') for name in sym.list_arguments())


def is_recorded(arr):
    """Whether autograd recorded the operation that made `arr` (1.9.1:
    ``autograd.get_symbol`` raises for an array outside the recorded graph;
    it walks the array's whole history, so call it rarely)."""
    try:
        autograd.get_symbol(arr)
    except mx.base.MXNetError:
        return False
    return True
