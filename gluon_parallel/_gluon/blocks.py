"""Blocks and their traced graphs: children, hooks, parameters, the
CachedOp and its graph, autograd's record of an array (mxnet 1.9.1; see the
package docstring)."""
import ctypes
import itertools
import threading

import mxnet as mx
from mxnet import autograd, gluon

__all__ = ['structural_params', 'children', 'is_active_hybrid', 'has_forward_hooks',
           'own_call', 'call_with_kwargs', 'cached_graph_inputs', 'graph_input_format',
           'fits_graph_format', 'owns_param', 'replace_param', 'batchnorm_config', 'build_graph',
           'traced_graph', 'graph_handle', 'flat_inputs', 'flat_inputs_all', 'nested_outputs',
           'nested_outputs_all', 'is_symbol_block', 'symbol_graph', 'set_symbol_graph',
           'needs_grad', 'is_recorded', 'VariableMarker']


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


def own_call(block):
    """Whether `block`'s class defines a ``__call__`` of its own. 1.9.1's
    ``Block.__call__(self, *args)`` takes positional arguments only, so
    blocks that take keywords override it (GluonNLP's ``BERTModel.__call__
    (inputs, token_types, valid_length=None, masked_positions=None)``) and
    hand them on positionally."""
    return type(block).__call__ is not gluon.Block.__call__


def call_with_kwargs(block, args, kwargs):
    """``block(*args, **kwargs)`` as one device runs it: a block's own
    ``__call__`` (:func:`own_call`) takes the keywords. Gluon's
    ``Block.__call__`` takes none, so for a block that keeps it they go to
    ``forward``, with the forward hooks (``_forward_pre_hooks``,
    ``_forward_hooks``) run around it as ``Block.__call__`` runs them."""
    if not kwargs or own_call(block):
        return block(*args, **kwargs)
    for hook in block._forward_pre_hooks.values():
        hook(block, args)
    out = block.forward(*args, **kwargs)
    for hook in block._forward_hooks.values():
        hook(block, args, out)
    return out


class _Reached(BaseException):
    """Unwinds a call stopped at its cached graph, carrying its inputs (a
    BaseException, so that a block's own ``except Exception`` lets it by)."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = inputs


def cached_graph_inputs(block, args, kwargs):
    """The positional inputs that ``block(*args, **kwargs)``
    (:func:`call_with_kwargs`) hands an active HybridBlock's cached graph,
    or None when the call returned without reaching it.

    1.9.1: ``Block.__call__(*args)`` calls ``forward(*args)``, and
    ``HybridBlock.forward(x, *args)``, once it has checked its NDArrays are
    on one context, calls ``self._call_cached_op(x, *args)``: the graph's
    one entry, whatever the block's own ``__call__`` did with its keywords
    on the way. An instance attribute stands in for that method, for this
    thread only, and stops the call there: the block's own code runs down
    to its graph, the graph is neither built nor run. The call runs
    unrecorded and in predict mode, so a block whose code computes before
    its graph (or instead of it) moves no running statistics and records
    nothing. Errors on the way are raised as they are.
    """
    caller = threading.get_ident()
    before = block.__dict__.get('_call_cached_op')
    method = before if before is not None else type(block)._call_cached_op.__get__(block)

    def stand_in(*inputs):
        if threading.get_ident() != caller:
            return method(*inputs)
        raise _Reached(inputs)

    block.__dict__['_call_cached_op'] = stand_in
    try:
        with autograd.pause(train_mode=False):
            call_with_kwargs(block, args, kwargs)
    except _Reached as reached:
        return reached.inputs
    finally:
        if before is None:
            del block.__dict__['_call_cached_op']
        else:
            block.__dict__['_call_cached_op'] = before
    return None


def graph_input_format(block):
    """The nesting of the inputs an active HybridBlock's cached graph was
    built for (``_in_format``: ``gluon.block._flatten``'s format, 0 an
    NDArray, -1 a None, a list a nested list)."""
    return block._in_format


def fits_graph_format(stored, args):
    """Whether ``_call_cached_op(*args)`` accepts `args` for a graph built
    for the format `stored` (1.9.1's rule: equal formats, or one a prefix of
    the other followed by None entries only), so that the flat inputs, None
    left out, are the graph's in order. A value ``_flatten`` refuses (not
    an NDArray, None or a list of them) does not fit."""
    try:
        fmt = gluon.block._flatten(args, 'input')[1]
    except ValueError:
        return False
    if fmt == stored:
        return True
    short, long_ = (fmt, stored) if len(fmt) < len(stored) else (stored, fmt)
    return len(short) != len(long_) and long_[:len(short)] == short and \
        all(f == -1 for f in long_[len(short):])


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


def build_graph(block, args):
    """Build an active HybridBlock's graph for a call on `args` without
    running it, as its first hybridized call would before running it:
    ``HybridBlock._call_cached_op`` calls ``_build_cache(*args)`` while
    ``_cached_op`` is None (until the first call, and again after
    ``hybridize()`` or a cast), which traces ``hybrid_forward`` on symbols
    in the current autograd mode (``_get_graph``: the graph is cached once,
    whatever mode later calls run in), infers the deferred parameters'
    shapes from the inputs' and initialises them, and creates the CachedOp.
    Nothing is computed."""
    if block._cached_op is None:
        block._build_cache(*args)


def traced_graph(block, args):
    """(handle, data input names, output Symbol, CachedOp flags) of an active
    HybridBlock's graph (built by :func:`build_graph` if it is not):
    ``_cached_graph = (data symbols, output symbol)``; ``_flags`` holds the
    hybridize() flags. The handle (the CachedOp) tells a rebuilt graph from
    the one seen before."""
    build_graph(block, args)
    data, out = block._cached_graph
    return block._cached_op, [d.name for d in data], out, list(block._flags)


def is_symbol_block(block):
    """A ``gluon.SymbolBlock``: its graph is a symbol given at construction
    (``_cached_graph``), not traced from child blocks."""
    return isinstance(block, gluon.SymbolBlock)


def symbol_graph(block):
    """The output Symbol of a SymbolBlock: ``_cached_graph = (input symbols,
    output)``, set by its constructor (1.9.1), composed with the inputs by
    its ``hybrid_forward`` when a parent traces it, and the CachedOp's
    graph when it runs alone."""
    return block._cached_graph[1]


def set_symbol_graph(block, out):
    """Make `out` (the same inputs and parameters) a SymbolBlock's graph:
    ``_cached_graph`` replaced and the CachedOp built from the old one
    dropped (``_clear_cached_op``, which SymbolBlock overrides to keep
    ``_cached_graph``)."""
    block._cached_graph = (block._cached_graph[0], out)
    block._clear_cached_op()


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


def needs_grad(arr):
    """Whether autograd would carry a gradient with respect to `arr` on to an
    array that keeps one: `arr` was computed under ``record()`` from an array
    marked with ``attach_grad``/``mark_variables``. MXNet 1.9.1 names the
    leaves of the recorded history ``var<k>`` for marked arrays and
    ``null<k>`` for arrays the recorded operators only read (imperative.cc,
    MarkVariables and RecordOp); see :func:`_recorded_symbol`."""
    sym = _recorded_symbol(arr)
    return sym is not None and any(name.startswith('var') for name in sym.list_arguments())


def is_recorded(arr):
    """Whether autograd recorded the operation that made `arr` (see
    :func:`_recorded_symbol`)."""
    return _recorded_symbol(arr) is not None


class VariableMarker:
    """``autograd.mark_variables(arrays, gradients)`` (grad_req 'write') for
    new arrays each time and the same gradient buffers, in one C call
    (1.9.1: ``MXAutogradMarkVariables(count, handles, requests,
    gradient handles)``, what ``mark_variables`` calls): the gradients'
    handles and the requests are prepared once.

    Parameters
    ----------
    gradients : list of NDArray
        The gradient buffers, one per array marked.
    """

    def __init__(self, gradients):
        n = self._count = len(gradients)
        self._grads = (mx.base.NDArrayHandle * n)(*[g.handle for g in gradients])
        self._reqs = (mx.base.mx_uint * n)(*[1] * n)        # 1: 'write' (_GRAD_REQ_MAP)
        self._gradients = list(gradients)                    # (their handles stay valid)

    def __call__(self, arrays):
        """Mark `arrays` (as many as the gradients) as autograd variables."""
        handles = (mx.base.NDArrayHandle * self._count)(*[a.handle for a in arrays])
        if mx.base._LIB.MXAutogradMarkVariables(self._count, handles, self._reqs,
                                                self._grads) != 0:
            mx.base.check_call(-1)


def _recorded_symbol(arr):
    """``autograd.get_symbol(arr)``, or None for an array outside the
    recorded graph. 1.9.1: ``MXAutogradGetSymbol`` fails for such an array
    (an input batch, every step): called directly, without the Python
    exception ``check_call`` would build from the error. It walks the
    array's whole history."""
    handle = mx.base.SymbolHandle()
    if mx.base._LIB.MXAutogradGetSymbol(arr.handle, ctypes.byref(handle)) != 0:
        return None
    return mx.sym.Symbol(handle)
