"""Graph mode across input shapes (gluon_parallel/graph/memory.py): the
executors of every input signature share one arena, bound from the
largest inputs seen; results equal the per-replica path's whatever the
schedule of sizes, and a cache smaller than the schedule keeps most
executors bound."""
import gc
import weakref

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, nd

import gluon_parallel as gp
import loops
from graph_helpers import pooled_net, run_steps, steps_both_modes

CTX = loops.CTX

# Sizes that re-base the arena (a larger one after smaller ones), short
# batches and one with an idle device (3 rows on 4 devices).
SCHEDULE = [(8, 8), (8, 12), (7, 8), (8, 16), (3, 12), (8, 10), (8, 16), (5, 16), (8, 8)]


@pytest.mark.parametrize('bn', [mx.gluon.nn.BatchNorm, gp.nn.SyncBatchNorm],
                         ids=['batchnorm', 'syncbatchnorm'])
def test_mixed_sizes_short_batches_and_an_idle_device_equal_the_per_replica_path(bn):
    ref, got = steps_both_modes(lambda: pooled_net(bn), CTX, SCHEDULE)
    for step, (a, b) in enumerate(zip(ref, got)):
        for name in a:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6,
                                       err_msg=f'{name} after step {step}')


def _binds(monkeypatch):
    """Record every bind's inputs' shapes and the executor whose memory it
    shares."""
    from gluon_parallel.graph import executor
    seen = []
    original = executor.Executor.__init__

    def init(self, spec):
        original(self, spec)
        side = next(a.shape[-1] for k, a in spec.args.items() if k.startswith('data'))
        seen.append((side, spec.shared))
    monkeypatch.setattr(executor.Executor, '__init__', init)
    return seen


def test_signatures_share_the_memory_of_the_largest(monkeypatch):
    """Every executor shares the memory of the arena's base, bound with
    memory of its own for the largest inputs; a larger signature drops the
    arena's executors and becomes the new base."""
    seen = _binds(monkeypatch)
    net, dp, _ = run_steps(pooled_net(), CTX, [(8, 12), (8, 8), (8, 16), (8, 8), (8, 12)],
                           graph=True)
    (arena,) = dp.graph_mode.arenas.arenas
    first, small, large, small_again, mid = [s for _, s in seen]
    assert first is None and small is not None          # 8 shares 12's memory
    assert large is None                                # 16 re-bases the arena
    assert small_again is arena.base and mid is arena.base
    assert [side for side, _ in seen] == [12, 8, 16, 8, 12]
    assert len(arena.executors) == 3 and arena.base.size == 8 * 2 * 16 * 16



def test_executors_hold_the_symbol_they_were_bound_from_not_a_copy_each():
    """MXNet's Python Executor keeps a deep copy of the symbol it is bound
    from (every node of the graph once more, for as long as the executor
    lives: about 0.1 MiB per executor of a two-layer BERT on two devices):
    graph mode's executors of every signature hold their one symbol, and
    still read their arguments' and outputs' names from it."""
    net, dp, _ = run_steps(pooled_net(), CTX, [(8, 12), (8, 8), (8, 10)], graph=True)
    executors = dp.graph_mode.arenas.executors()
    assert len(executors) == 3 and len({id(ex.symbol) for ex in executors}) == 1
    for ex in executors:
        assert ex.bound._symbol is ex.symbol
        assert list(ex.bound.arg_dict) == ex.symbol.list_arguments()
        assert list(ex.bound.output_dict) == ex.symbol.list_outputs()


def test_a_rebase_frees_the_executors_it_drops(monkeypatch):
    """A larger signature re-bases the arena: the executors it drops are
    garbage when their memory is given back, before the new base binds (so
    the peak stays the largest signature's): nothing keeps one alive, not
    the last recorded call either."""
    from gluon_parallel.graph import memory
    net, dp, _ = run_steps(pooled_net(), CTX, [(8, 12), (8, 8)], graph=True)
    dropped = [weakref.ref(ex) for ex in dp.graph_mode.arenas.executors()]
    assert len(dropped) == 2
    alive = []
    original = memory.release_memory

    def release():
        gc.collect()
        alive.append([r() for r in dropped if r() is not None])
        original()
    monkeypatch.setattr(memory, 'release_memory', release)
    run_steps(net, CTX, [(8, 16)], dp=dp)
    assert alive == [[]], f'a re-base kept {len(alive[0])} dropped executors alive'
    dp.close()

def test_a_pool_shares_its_whole_inputs_and_calls_pushed_back_to_back_keep_theirs():
    """As BucketingModule's buckets reshape the largest one's input arrays:
    a smaller signature's whole input is a view of the base's. Calls of
    both sizes pushed back to back, none read in between, each compute on
    their own inputs (MXNet's engine orders the views' writes and reads)."""
    rng = np.random.RandomState(5)
    xs = [nd.array(rng.uniform(size=(8, 2, s, s))) for s in (12, 8, 12, 8, 8, 12)]
    outs = {}
    for graph in (False, True):
        dp = gp.DataParallel(pooled_net(), CTX, graph=graph)
        calls = [dp(x) for x in xs]
        outs[graph] = [[o.asnumpy() for o in out] for out in calls]
    for k, (a, b) in enumerate(zip(outs[False], outs[True])):
        for r, (x, y) in enumerate(zip(a, b)):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6, err_msg=f'call {k}, {CTX[r]}')
    (arena,) = dp.graph_mode.arenas.arenas
    (small,) = [ex for ex in arena.executors.values() if ex is not arena.base]
    arena.base.inputs.whole[0][:] = 3
    assert (small.inputs.whole[0].asnumpy() == 3).all()


def test_two_forwards_of_two_sizes_then_one_backward_is_exact(monkeypatch):
    """The second call's executor must not overwrite the activations the
    first call's backward still needs: it gets an arena of its own."""
    x1 = nd.random.uniform(shape=(8, 2, 12, 12))
    x2 = nd.random.uniform(shape=(8, 2, 8, 8))
    grads = []
    for graph in (False, True):
        net = pooled_net()
        dp = gp.DataParallel(net, CTX, graph=graph)
        dp(x1), dp(x2)                                  # (both bound beforehand)
        with autograd.record():
            total = [o.sum() for o in dp(x1)] + [(o * o).sum() for o in dp(x2)]
        autograd.backward(total)
        grads.append({k: [g.asnumpy() for g in p.list_grad()]
                      for k, p in net._collect_params_with_prefix().items()
                      if p.grad_req != 'null'})
        if graph:
            assert len(dp.graph_mode.arenas.arenas) == 2
    for k in grads[0]:
        for r, (a, b) in enumerate(zip(grads[0][k], grads[1][k])):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=f'{k} on {CTX[r]}')


def test_more_signatures_than_the_cache_keep_most_executors(monkeypatch):
    """Six sizes cycling through a cache of four: least-recently-used would
    bind on every call; the arena keeps the ones used most and binds the
    others in its last places."""
    net = pooled_net()
    dp = gp.DataParallel(net, CTX, graph=True, cache_size=4)
    sides = [16, 14, 12, 10, 8, 6]
    for _ in range(5):
        for side in sides:
            dp(nd.ones((8, 2, side, side)))
    assert dp.graph_mode.binds <= len(sides) + 4 * 3       # LRU: 30
    assert len(dp.graph_mode.arenas.executors()) == 4


@pytest.mark.parametrize('bad', [0, -1, 2.5, True, '8'])
def test_cache_size_is_checked(bad):
    with pytest.raises(ValueError, match='cache_size'):
        gp.DataParallel(pooled_net(), CTX, cache_size=bad)
