"""The two process-wide patches of MXNet, each installed by the feature
that needs it on first use and removable: hybridized calls routed through
SyncBatchNorm's staged path (the first SyncBatchNorm constructed), a
callback after every backward pass (the first graph-mode call) (mxnet
1.9.1; see the package docstring)."""
import mxnet as mx
from mxnet import gluon

__all__ = ['route_cached_op_calls', 'cached_op_route', 'unroute_cached_op_calls', 'after_backward',
           'after_backward_callback', 'remove_after_backward']


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
