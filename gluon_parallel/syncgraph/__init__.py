"""SyncBatchNorm's graph rewriting: one home for both ways of running it.

A hybridized network traces SyncBatchNorm as a marked BatchNorm node. Two
consumers rewrite that graph, from the same parts:

1. **parse** (traced.py) — the traced graph read once: its nodes, one
   :class:`Use` per BatchNorm node (input, gamma, beta, running
   statistics, the layer's id, attributes), each marked use's
   :class:`Layer` from shape inference;
2. **inputs** (inputs.py) — what each variable of a rewritten graph is
   (data, parameter, pivot, sums, counts, constant...), each kind asking a
   feed for its array;
3. **arithmetic** (stats.py) — the sums, the merge, the affine map,
   written into graphs (writer.py), given the optional kernels.

The staged path (stages.py cuts the graph at the barriers, rendezvous.py
runs the stages in a replica, meets the others between them and writes
the new running statistics back) runs inside a parallel call; graph mode
(``gluon_parallel.graph``) replicates the graph on every device and merges
inside it: everything it needs of SyncBatchNorm and BatchNorm (the node
rewrite, the running statistics as outputs and their updates, their
order against backward) is in_graph.py, which graph/ imports itself.

The layers themselves (nn/sync_batchnorm.py, which imports this package;
this package never imports nn) are found through the registry, layers.py
(a traced node's mark -> its live layer, the layers with a reducer, why a
graph of them cannot run as one); routing.py routes Gluon's hybridized
calls into the staged path, installed by the parallel calls
(:func:`ensure_routing`).
"""
from . import layers
from .inputs import Constant, Counts, Data, Param, Scratch, counts_array, unit, zero
from .rendezvous import Message
from .rendezvous import run as run_staged
from .rendezvous import write_new_running
from .routing import ensure_routing
from .stages import StagedGraph, staged_graph
from .stats import (Layer, centred_affine, centred_sums, const, dtype_name, merge,
                    param_dtype)
from .traced import MARK, BatchNormAttrs, Entry, Traced, Use, batchnorm_attrs, is_marker
from .writer import GraphWriter, json_entry

__all__ = ['MARK', 'BatchNormAttrs', 'Constant', 'Counts', 'Data', 'Entry', 'GraphWriter',
           'Layer', 'Message', 'Param', 'Scratch', 'StagedGraph', 'Traced', 'Use',
           'batchnorm_attrs', 'centred_affine', 'centred_sums', 'const', 'counts_array',
           'dtype_name', 'is_marker', 'merge', 'param_dtype', 'run_staged', 'staged_graph',
           'unit', 'write_new_running', 'zero', 'ensure_routing', 'json_entry', 'layers']
