"""The three process-wide patches of MXNet, each installed by the feature
that needs it on first use and removable: hybridized calls routed through
SyncBatchNorm's staged path (syncgraph/routing.py: a parallel call while a
SyncBatchNorm is alive, or a layer given a reducer), a callback after
every backward pass (graph/recording.py's hook object: the first
graph-mode call), the Python backward calls routed (the first round of a
``gluoncv.Parallel``: its tasks' backward passes run as one) (mxnet
1.9.1; see the package docstring)."""
import ctypes
from typing import NamedTuple

import mxnet as mx
from mxnet import autograd, gluon

__all__ = ['route_cached_op_calls', 'cached_op_route', 'unroute_cached_op_calls', 'after_backward',
           'after_backward_hook', 'remove_after_backward', 'route_backward', 'backward_route',
           'unroute_backward']


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


def after_backward(hook):
    """Call ``hook.after_backward(retain_graph, skipped)`` in the calling
    thread right after every autograd backward pass has been pushed, before
    the caller can push anything else, until :func:`remove_after_backward`;
    :func:`after_backward_hook` gives `hook` back. Replaces an earlier hook.

    ``hook.heads_only(handles)`` sees a plain pass first (heads only: no
    head gradients given, no variables asked for as ``autograd.grad`` does,
    no ``create_graph``) as the heads' handle values; when it returns True
    it has done the pass itself and MXNet's is skipped (``after_backward``
    still runs, with `skipped` True). ``hook.removed()`` is called when it
    stops being called (:func:`remove_after_backward`, or another hook
    installed), so that its owner knows without asking MXNet's function.

    1.9.1: ``autograd.backward``, ``autograd.grad`` and ``NDArray.backward``
    all call ``MXAutogradBackwardEx`` through ``mxnet.base._LIB`` at call
    time (a ctypes library whose function attributes can be replaced); its
    arguments are (number of heads, their handles, their head gradients'
    handles (NULL, or NULL entries, for none), number of variables, their
    handles, retain_graph, create_graph, ...: :class:`BackwardCall`). The C
    call returns once the pass's operations are pushed (not run), so an
    operation pushed by the hook is ordered after them and before whatever
    the caller pushes next.
    """
    lib = mx.base._LIB
    original = getattr(lib.MXAutogradBackwardEx, '_gp_original', lib.MXAutogradBackwardEx)
    _removed(after_backward_hook())

    def backward_ex(*args):
        call = BackwardCall(*args)
        skipped = call.plain() and hook.heads_only(call.head_handles())
        status = 0 if skipped else original(*args)
        if status == 0:
            hook.after_backward(bool(_value(call.retain_graph)), skipped)
        return status
    backward_ex._gp_original = original
    backward_ex._gp_hook = hook
    lib.MXAutogradBackwardEx = backward_ex


def _removed(hook):
    if hook is not None:
        hook.removed()


def _value(arg):
    """A ctypes scalar argument's value (Python passes plain ints too)."""
    return getattr(arg, 'value', arg)


class BackwardCall(NamedTuple):
    """The arguments of a ``MXAutogradBackwardEx`` call, by name (1.9.1's
    C signature; Python's ``autograd`` passes all ten, ctypes scalars or
    ints)."""
    num_heads: object
    heads: object                   # their handles
    head_grads: object              # NULL, or an array with NULL entries: none given
    num_variables: object = 0       # autograd.grad's variables
    variables: object = None
    retain_graph: object = 0
    create_graph: object = 0
    is_train: object = 1
    grad_handles: object = None
    grad_stypes: object = None

    def head_handles(self):
        """The heads' handle values."""
        return [self.heads[i] for i in range(_value(self.num_heads))]

    def plain(self):
        """Whether the call asks for the heads' gradients only: no head
        gradients given, no variables (as ``autograd.grad`` asks), no
        ``create_graph``."""
        if _value(self.num_variables) or _value(self.create_graph) or \
                not _value(self.num_heads):
            return False
        grads = self.head_grads
        if grads is None or isinstance(grads, ctypes.c_void_p):
            return not grads or grads.value is None
        return all(grads[i] is None for i in range(_value(self.num_heads)))


def after_backward_hook():
    """The hook :func:`after_backward` installed, or None."""
    return getattr(mx.base._LIB.MXAutogradBackwardEx, '_gp_hook', None)


def remove_after_backward():
    """Give ``MXAutogradBackwardEx`` back MXNet's own function."""
    lib = mx.base._LIB
    original = getattr(lib.MXAutogradBackwardEx, '_gp_original', None)
    if original is not None:
        hook = after_backward_hook()
        lib.MXAutogradBackwardEx = original
        _removed(hook)


def route_backward(route):
    """Make every ``autograd.backward(heads, head_grads, retain_graph,
    train_mode)`` and ``NDArray.backward(out_grad, retain_graph,
    train_mode)`` go through ``route(heads, head_grads, retain_graph,
    train_mode, original)`` (`heads` a list, `head_grads` a list or None,
    `original` MXNet's ``autograd.backward``) until :func:`unroute_backward`.
    Replaces an earlier route.

    1.9.1: both are Python functions read at call time (``autograd.backward``
    as a module attribute, ``backward`` as a method) making the same C call
    (``MXAutogradBackwardEx`` with no variables), so the route's
    ``original(heads, head_grads, ...)`` is what ``NDArray.backward`` does
    for ``heads=[self]``. A caller that bound ``backward`` by name before
    keeps MXNet's.
    """
    original = getattr(autograd.backward, '_gp_original', autograd.backward)
    method = getattr(mx.nd.NDArray.backward, '_gp_original', mx.nd.NDArray.backward)

    def backward(heads, head_grads=None, retain_graph=False, train_mode=True):
        if isinstance(heads, mx.nd.NDArray):
            heads = [heads]
            head_grads = [head_grads] if isinstance(head_grads, mx.nd.NDArray) else head_grads
        return route(list(heads), head_grads, retain_graph, train_mode, original)

    def ndarray_backward(self, out_grad=None, retain_graph=False, train_mode=True):
        return route([self], None if out_grad is None else [out_grad], retain_graph, train_mode,
                     original)
    for fn, was in ((backward, original), (ndarray_backward, method)):
        fn._gp_original, fn._gp_route = was, route
    autograd.backward = backward
    mx.nd.NDArray.backward = ndarray_backward


def backward_route():
    """The route installed by :func:`route_backward`, or None."""
    return getattr(autograd.backward, '_gp_route', None)


def unroute_backward():
    """Give ``autograd.backward`` and ``NDArray.backward`` back MXNet's own."""
    original = getattr(autograd.backward, '_gp_original', None)
    if original is not None:
        autograd.backward = original
    method = getattr(mx.nd.NDArray.backward, '_gp_original', None)
    if method is not None:
        mx.nd.NDArray.backward = method
