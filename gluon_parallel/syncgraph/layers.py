"""The process's SyncBatchNorm layers, by the mark their traced node
carries, and what a graph of them may not do as one graph.

A SyncBatchNorm (nn/sync_batchnorm.py) registers itself when constructed
(:func:`register`: its mark, the MARK attribute of the BatchNorm node it
traces as) and tells when it gets or loses a reducer
(:func:`set_reducer`). Everything syncgraph reads of a layer it reads of
the live objects found here: its name, reducer, ``num_devices``,
``check_finite``, ``check_devices`` and the kernels its graphs use
(``kernel_ops``); syncgraph never imports nn/. The registry holds the
layers weakly: a dropped network's layers are collected (a graph loaded
from a file names layers that are gone: :func:`layer_of` gives None).
"""
import itertools
import weakref

__all__ = ['register', 'layer_of', 'set_reducer', 'has_reducers', 'any_layers', 'sync_layers',
           'why_not_one_graph', 'kernels_of']

#: Mark (an int) -> the live layer.
_LAYERS = weakref.WeakValueDictionary()
_IDS = itertools.count()
_REDUCED = weakref.WeakSet()        # layers with a reducer


def register(layer):
    """Register a new SyncBatchNorm `layer`; returns its mark (the MARK
    attribute of its traced node)."""
    mark = next(_IDS)
    _LAYERS[mark] = layer
    return str(mark)


def layer_of(mark):
    """The SyncBatchNorm whose graph node carries `mark`, or None (a graph
    loaded from a file)."""
    try:
        return _LAYERS.get(int(mark))
    except (TypeError, ValueError):
        return None


def set_reducer(layer, reduced):
    """Note whether `layer` has a reducer (`reduced`)."""
    (_REDUCED.add if reduced else _REDUCED.discard)(layer)


def has_reducers():
    """Whether any SyncBatchNorm has a reducer."""
    return bool(_REDUCED)


def any_layers():
    """Whether any SyncBatchNorm is alive."""
    return bool(_LAYERS)


def sync_layers(traced):
    """The live SyncBatchNorm layers the marked nodes of `traced` (a
    syncgraph.Traced) name, each once, in graph order."""
    found = {}
    for m in traced.markers:
        layer = layer_of(traced.batchnorms[m].mark)
        if layer is not None:
            found.setdefault(id(layer), layer)
    return list(found.values())


def why_not_one_graph(layers, num_ctx):
    """Why a network holding these SyncBatchNorm `layers` cannot run as one
    graph on `num_ctx` devices (a layer with a reducer: its statistics
    cross processes, which the staged path does), or None; a ValueError for
    a layer built for another device count."""
    if _REDUCED:
        for layer in layers:
            if layer in _REDUCED:       # (the registry's record: no call into the layer)
                return (f'{layer.name} has a reducer (statistics across processes): its '
                        'network runs per replica, in stages')
    # (Asked per call: the layers' own check raises, only where a layer's
    # num_devices is another count.)
    for layer in layers:
        if layer.num_devices not in (None, num_ctx):
            layer.check_devices(num_ctx)
    return None


def kernels_of(layers):
    """The optional kernels' operators (``nn.kernels.Kernels``) the graphs
    of these SyncBatchNorm `layers` use, or None (no layer, or no kernels):
    the layers' own answer (``kernel_ops``), asked when a graph is built."""
    for layer in layers:
        return layer.kernel_ops()
    return None
