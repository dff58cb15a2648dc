"""Hybridized calls of SyncBatchNorm networks routed into the staged path.

Inside a parallel call, in training, a hybridized network holding a
SyncBatchNorm must not run its own CachedOp (which computes BatchNorm per
device): its graph runs in stages (stages.py), the replicas meeting
between them (rendezvous.py). Gluon has no hook for that, so MXNet's
``HybridBlock._call_cached_op`` is patched (``_gluon.route_cached_op_calls``)
to call :func:`route`. The patch is process-wide and installed by what
needs it, on first use (:func:`ensure_routing`): the parallel calls
(DataParallel, ``parallel_apply``, GluonCV's ``Parallel``) when any
SyncBatchNorm is alive, and a layer given a reducer (which synchronises
outside parallel calls too). ``_gluon.unroute_cached_op_calls`` removes it;
the next such call installs it again.
"""
from mxnet import autograd

from .. import _gluon
from ..replica_context import current_replica
from .layers import any_layers, has_reducers
from .rendezvous import run as run_staged
from .stages import staged_graph

__all__ = ['route', 'ensure_routing']


def route(block, args, original):
    """A hybridized block's call (``original(block, *args)``: Gluon's own),
    or, inside a parallel call (or, for a layer with a reducer, anywhere)
    and in training mode, its graph run in stages when it holds a
    SyncBatchNorm."""
    if autograd.is_training():
        replica = current_replica()
        reducers = has_reducers()
        if replica is not None or reducers:
            staged = staged_graph(block, args)
            # Outside a parallel call, a reducer still merges this device's
            # batch with its group's (e.g. the other workers').
            if staged is not None and (replica is not None or staged.reduced_levels()):
                return _gluon.nested_outputs(block, run_staged(staged, args, replica, reducers))
    return original(block, *args)


def ensure_routing():
    """Route Gluon's hybridized calls through :func:`route` if a
    SyncBatchNorm is alive and they are not yet (a look-up when they are:
    the parallel calls ask at every call)."""
    if any_layers() and _gluon.cached_op_route() is not route:
        _gluon.route_cached_op_calls(route)
