"""SyncBatchNorm in hybridized networks: the graph runs in stages, and the
replicas meet between stages in their issuing threads.

A barrier must not wait inside MXNet's engine on CPU contexts: all of them
share one round-robin pool of temp-space buffers (imperative operators and
dynamic graphs draw one per call, static graphs one per graph and device at
set-up), one random-number resource and one parallel-random resource, each
an engine variable served in push order. An operator blocked in a barrier
while another device's earlier operator queues on the same variable closes
a cycle; more temp copies make that rarer, never impossible (MXNet 1.9.1,
src/resource.cc, src/executor/attach_op_resource_pass.cc). So the graph a
hybridized block traced is cut at its SyncBatchNorm nodes: stage L holds
every node computable after L barriers, each stage is one CachedOp (with
the block's flags, static_alloc included), and the barrier between stages
is a ParallelState in the thread that issues the replica, as in imperative
mode. All of one replica's operators before a barrier are pushed before any
operator after it, on every device.

The traced graph keeps SyncBatchNorm as a BatchNorm node marked with the
attribute ``traced.MARK``: outside a parallel call (for a layer without a
reducer), in predict mode, or on export, the block's own CachedOp runs it
as BatchNorm.
"""
import threading
import weakref
from typing import NamedTuple

from mxnet import nd

from .. import _gluon
from . import stats
from .layers import kernels_of, layer_of
from .inputs import Carried, Constant, Counts, Pivot, Sums, unit
from .traced import MARK, Entry, Running, Traced
from .writer import GraphWriter, json_entry

__all__ = ['StagedGraph', 'Stage', 'staged_graph']

_lock = threading.RLock()
#: block -> its _Cut. Weakly keyed: nothing in a _Cut references the block
#: (its StagedGraph holds the SyncBatchNorm layers weakly).
_CUTS = weakref.WeakKeyDictionary()
_FLAGS = ('static_alloc', 'static_shape', 'inline_limit', 'forward_bulk_size',
          'backward_bulk_size')


class Outputs(NamedTuple):
    """One stage's outputs by name."""
    carried: dict           # Entry -> array, for later stages and the heads
    pivots: dict            # Pivot -> array
    sums: object            # [S1 | S2 | q] of the layers of the next barrier, or None
    run: object             # new running statistics of `Stage.writes`, or None
    check: object           # [scale | shift] to check for non-finite values, or None


class Stage:
    """One CachedOp of a staged graph (op None: nothing to compute).

    Attributes
    ----------
    inputs : list
        The op's inputs' kinds (syncgraph.inputs), in its order.
    merges : list of int
        Marked nodes merged in this stage.
    sums_of : list of int
        Marked nodes whose sums this stage computes (their barrier follows).
    writes : list of int
        Marked nodes whose running statistics ``Outputs.run`` holds.
    drop : list of Entry
        Carried entries no later stage reads.
    """

    def __init__(self, op, inputs, kinds, merges, sums_of, writes, drop):
        self.op, self.inputs, self._kinds = op, inputs, kinds
        self.merges, self.sums_of, self.writes, self.drop = merges, sums_of, writes, drop

    def outputs(self, outs):
        """The op's outputs (a list) by name."""
        carried, pivots, named = {}, {}, {'sums': None, 'run': None, 'check': None}
        for kind, out in zip(self._kinds, outs):
            if isinstance(kind, Carried):
                carried[kind.entry] = out
            elif isinstance(kind, Pivot):
                pivots[kind] = out
            else:
                named[kind] = out
        return Outputs(carried, pivots, **named)


class StagedGraph:
    """The stages of one traced graph.

    Parameters
    ----------
    traced : traced.Traced
        The traced graph (its BatchNorm nodes marked by SyncBatchNorm).
    params : dict
        Parameter name -> Parameter (their shapes and dtypes are known).
    flags : list
        The block's CachedOp flags (static_alloc, static_shape...).
    args : list of NDArray
        One call's data inputs (shapes and dtypes of the layers' inputs).

    The layers are the registry's (layers.py: a marked node's SyncBatchNorm,
    held weakly), and so are the optional kernels the sums may use
    (``ops``: the layers' ``kernel_ops``, or None).
    """

    def __init__(self, traced, params, flags, args):
        self.traced = traced
        nodes = traced.nodes
        self.heads = traced.heads
        self.params = params
        self.flags = [f for f in flags if f[0] in _FLAGS]
        self.markers = traced.markers
        level = self.level = [0] * len(nodes)
        for i, node in enumerate(nodes):
            if node['op'] != 'null':
                ready = max([level[_entry(e).node] for e in node['inputs']] or [0])
                level[i] = ready + 1 if i in traced.markers else ready
        self.num_stages = max(level) + 1
        reads = [set() for _ in range(self.num_stages)]
        for i, node in enumerate(nodes):
            if node['op'] != 'null':
                reads[level[i]].update(_entry(e) for e in node['inputs'])
            if i in traced.markers:
                reads[level[i] - 1].add(traced.batchnorms[i].x)
        self.exported = {e for L in range(self.num_stages) for e in reads[L]
                         if not traced.is_variable(e) and level[e.node] < L}
        self.exported.update(h for h in self.heads if not traced.is_variable(h))
        self.last_read = {}
        for L in range(self.num_stages):
            for e in reads[L]:
                self.last_read[e] = L
        # The layers' blocks held weakly (their Layer's block left None): a
        # SyncBatchNorm reaches its network (Gluon leaves a child's scope
        # pointing at its parent's after a forward), which _CUTS keys weakly.
        self.layers = traced.layers(params, args, lambda mark: None).layers
        self._blocks = {m: weakref.ref(b) for m in self.markers
                        if (b := layer_of(self.use(m).mark)) is not None}
        self.ops = kernels_of(self.layer_blocks)
        self._stages = {}
        #: id(layer) -> the reducer whose results were checked (rendezvous.py)
        self.checked_reducers = {}

    def block(self, m):
        """The SyncBatchNorm of marked node `m`, or None (a loaded graph)."""
        ref = self._blocks.get(m)
        return None if ref is None else ref()

    @property
    def layer_blocks(self):
        """The SyncBatchNorm layers of the marked nodes, each once."""
        live = (self.block(m) for m in self.markers)
        return list({id(b): b for b in live if b is not None}.values())

    def use(self, m):
        return self.traced.batchnorms[m]

    def running(self, m):
        """The running mean and variance Parameters of marked node `m`."""
        names = self.use(m).running
        return Running(self.params[names.mean], self.params[names.var])

    # -------------------------------------------------------------- stages

    def reduced_levels(self):
        """The barriers (stage indices) where a layer has a reducer: there
        every replica merges one entry, the totals the reducer returned."""
        return frozenset(self.level[m] for m in self.markers
                         if self.block(m) is not None and self.block(m).reducer is not None)

    def stages(self, n, recording, reduced=frozenset()):
        """The list of Stage of a call of `n` replicas (`reduced`: the
        barriers where every replica merges one entry)."""
        key = (n, recording, reduced)
        st = self._stages.get(key)
        if st is None:
            with _lock:
                st = self._stages.get(key)
                if st is None:
                    st = self._stages[key] = [
                        _StageWriter(self, L, 1 if L in reduced else n, recording).stage()
                        for L in range(self.num_stages)]
        return st

    def chain(self, here):
        """Per marker merged here, the index of an earlier one updating the
        same running statistics (one layer used twice), or None."""
        seen, chain = {}, []
        for k, m in enumerate(here):
            key = self.use(m).running
            chain.append(seen.get(key))
            seen[key] = k
        return chain

    def writes(self, here):
        """The markers merged here whose running statistics a stage's run
        output holds, in order: the last use of each."""
        chain = self.chain(here)
        return [m for k, m in enumerate(here) if k not in chain]


def _entry(e):
    """An Entry of a node's input as MXNet's JSON lists it."""
    return Entry(*e[:2])


class _StageWriter:
    """Writes stage L of a StagedGraph for `n` merged entries."""

    def __init__(self, staged, L, n, recording):
        self.staged, self.L, self.n, self.recording = staged, L, n, recording
        self.g = GraphWriter(f'_gp{L}_')
        self.kinds, self.made = {}, {}

    def var(self, kind):
        self.kinds.setdefault(kind.name, kind)
        return self.g.var(kind.name)

    def resolve(self, e):
        made, traced = self.made, self.staged.traced
        e = _entry(e)
        if e.node in made:      # a copied node's id, or the entry of an affine map
            copied = made[e.node]
            return json_entry(copied, e.index) if isinstance(copied, int) else copied
        if traced.is_variable(e):
            kind = traced.variable(e)
            self.kinds.setdefault(kind.name, kind)
            return self.g.var(kind.name, traced.nodes[e.node].get('attrs'))
        return self.var(Carried(e))

    def stage(self):
        st, g, L = self.staged, self.g, self.L
        here = [m for m in st.markers if st.level[m] == L]
        merged = self._copy_nodes(here)
        heads, outputs = [], []
        for e in sorted(st.exported):
            if st.level[e.node] == L:
                heads.append(self.resolve(e))
                outputs.append(Carried(e))
        if merged is not None and merged.run is not None:
            heads.append(merged.run)
            outputs.append('run')
        if merged is not None and any(st.block(m) is not None and st.block(m).check_finite
                                      for m in here):
            heads.append(g.op('BlockGrad', g.concat(merged.scale, merged.shift)))
            outputs.append('check')
        sums_of = [m for m in st.markers if st.level[m] == L + 1]
        if sums_of:
            heads.extend(self._sums(sums_of, outputs))
            outputs.append('sums')
        drop = [e for e, last in st.last_read.items() if last == L and e not in st.heads]
        if not heads:
            return Stage(None, [], outputs, here, sums_of, st.writes(here), drop)
        symbol = g.symbol(heads)
        names = symbol.list_inputs()
        inputs = [self.kinds[name] for name in names]
        params = [i for i, name in enumerate(names) if name in st.params]
        flags = [('data_indices', [i for i in range(len(names)) if i not in params]),
                 ('param_indices', params)] + st.flags
        return Stage(nd.CachedOp(symbol, flags), inputs, outputs, here, sums_of,
                     st.writes(here), drop)

    def _copy_nodes(self, here):
        """Copy the stage's nodes, the marked ones as the merge and the
        affine map; returns the merge's (scale, shift, run) or None."""
        st, g = self.staged, self.g
        merged, offsets, off = None, {}, 0
        for m in here:
            offsets[m], off = off, off + st.layers[m].channels
        for i, node in enumerate(st.traced.nodes):
            if node['op'] == 'null' or st.level[i] != self.L:
                continue
            if i not in st.layers:
                self.made[i] = g.copy(node, [self.resolve(_entry(e)) for e in node['inputs']])
                continue
            if merged is None:
                merged = self._merge(here)
            lay = st.layers[i]
            c = lay.channels
            scale = g.slice_axis(merged.scale, 0, offsets[i], offsets[i] + c)
            shift = g.slice_axis(merged.shift, 0, offsets[i], offsets[i] + c)
            self.made[i] = stats.affine(g, self.resolve(st.use(i).x), scale, shift,
                                        self.var(Pivot(i)), self.var(unit(lay)), lay)
        return merged

    def _sums(self, sums_of, outputs):
        """Heads: the pivot of every layer of the next barrier, then one
        vector of their sums [S1... | S2... | q...]."""
        st, g = self.staged, self.g
        heads, local = [], []
        for m in sums_of:
            sums = stats.local_sums(g, self.resolve(st.use(m).x), st.layers[m], st.ops)
            local.append(sums)
            heads.append(sums.pivot)
            outputs.append(Pivot(m))
        heads.append(g.concat(*[s.s1 for s in local], *[s.s2 for s in local],
                              *[s.q for s in local]))
        return heads

    def _merge(self, here):
        st, g = self.staged, self.g
        layers = [st.layers[m] for m in here]
        uses = [st.use(m) for m in here]
        sums = [self.var(Sums(r)) for r in range(self.n)]
        counts = self.var(Counts())
        # A fixed gamma is 1, its gradient zeros (as BatchNorm's with
        # fix_gamma: a symbol's gamma may have a gradient to write).
        gamma = [g.op('ones_like', self.resolve(u.gamma)) if lay.fix_gamma
                 else self.resolve(u.gamma) for u, lay in zip(uses, layers)]
        running = [stats.RunningEntries(self.resolve(u.mean), self.resolve(u.var))
                   for u in uses] if self.recording else None
        per = {}
        for field in ('eps', 'momentum'):
            values = [getattr(lay, field) for lay in layers]
            per[field] = values[0] if len(set(values)) == 1 else self.var(Constant(
                field, tuple((lay.channels, v) for lay, v in zip(layers, values)), 'float64'))
        inputs = stats.LayerInputs([self.var(Pivot(m)) for m in here], gamma,
                                   [self.resolve(u.beta) for u in uses], running)
        settings = stats.MergeSettings(per['eps'], per['momentum'], layers[0].param_dtype,
                                       chain=st.chain(here),
                                       channels=[lay.channels for lay in layers])
        return stats.merge(g, sums, counts, inputs, settings)


def staged_graph(block, args, flags=None):
    """The StagedGraph of a hybridized block's current graph, or None when
    it holds no SyncBatchNorm. Built once per graph: after ``hybridize()``
    or a cast, Gluon traces anew. `flags`: the stages' CachedOp flags,
    default the block's."""
    cached = _CUTS.get(block)
    if cached is not None and cached.handle is _gluon.graph_handle(block):
        return cached.staged
    with _lock:
        handle, data_names, out, own_flags = _gluon.traced_graph(block, args)
        cached = _CUTS.get(block)
        if cached is None or cached.handle is not handle:
            staged = None
            if MARK in out.tojson():
                staged = StagedGraph(Traced(out, data_names),
                                     {p.name: p for p in block.collect_params().values()},
                                     own_flags if flags is None else flags,
                                     _gluon.flat_inputs(args))
            # The graph's stages, kept with the handle of the graph they
            # were cut from, outside the user's block.
            _CUTS[block] = cached = _Cut(handle, staged)
    return cached.staged


class _Cut(NamedTuple):
    """A block's StagedGraph (or None) and the CachedOp it was cut from."""
    handle: object
    staged: object
