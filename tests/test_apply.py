"""apply.py: parallel_apply, its first-call warm-up and its failures."""
import os
import re
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import gluon_parallel
from gluon_parallel import current_replica, parallel_apply
from gluon_parallel.contexts import check_ctx_list
import mode_blocks
from replicas import (IN_UNITS, ReplicaBoom, assert_close, fresh_deferred_mlp, make_mlp,
                      reference_copy)

pytestmark = pytest.mark.usefixtures('both_thread_modes')


def test_parallel_apply_with_a_function(ctx_list):
    n = len(ctx_list)
    xs = [nd.ones((2, 3), ctx=c) * i for i, c in enumerate(ctx_list)]

    def fn(x, scale=1, label=None):
        replica = current_replica()
        return (x * scale, replica.rank, replica.size, mx.current_context(),
                autograd.is_recording(), autograd.is_training(), label)

    with autograd.record():
        out = parallel_apply(fn, xs, [{'scale': 3, 'label': f'l{i:d}'} for i in range(n)])
    for i, (y, rank, size, ctx, rec, train, label) in enumerate(out):
        assert (rank, size, ctx, rec, train, label) == (i, n, ctx_list[i], True, True,
                                                        f'l{i:d}')
        assert y.context == ctx_list[i]
        assert_close(y, np.full((2, 3), 3.0 * i))
    # explicit contexts, tuple inputs, sync
    out = parallel_apply(lambda a, b: a + b, [(x, x) for x in xs], ctx_list=ctx_list,
                         sync=True)
    assert [o.context for o in out] == ctx_list
    with pytest.raises(ValueError):
        parallel_apply(fn, xs, [{}] * (n + 1))
    with pytest.raises(ValueError):
        parallel_apply([fn] * (n + 1), xs)


def test_parallel_apply_with_a_list_of_blocks(ctx_list):
    blocks, xs = [], []
    for i, c in enumerate(ctx_list):
        b = gluon.nn.Dense(3, in_units=4)
        b.initialize(mx.init.Uniform(), ctx=c)
        blocks.append(b)
        xs.append(nd.random.uniform(shape=(2 + i, 4), ctx=c))
    expected = [b(x) for b, x in zip(blocks, xs)]
    with autograd.record():
        out = parallel_apply(blocks, xs)
    autograd.backward(out)
    for o, e, b in zip(out, expected, blocks):
        assert_close(o, e)
        assert b.weight.grad().abs().sum().asscalar() > 0


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybrid'])
def test_parallel_apply_first_concurrent_call_of_one_block(ctx_list, hybridize):
    # One deferred-initialised (and maybe hybridized) block on every replica:
    # its first concurrent call races unless done safely, and a lost race can
    # leave the caller thread inside the block's name scope.
    for _ in range(5):
        net = fresh_deferred_mlp(ctx_list, hybridize)
        xs = [nd.random.uniform(shape=(2, IN_UNITS), ctx=c) for c in ctx_list]
        with autograd.record():
            out = parallel_apply(net, xs)
        autograd.backward(out)
        ref = reference_copy(net, make_mlp, ctx_list[0])
        for o, x in zip(out, xs):
            assert_close(o, ref(x.as_in_context(mx.cpu(0))))
    # the caller is not left inside some block's name scope
    assert re.fullmatch(r'dense\d+_', gluon.nn.Dense(2).prefix)


def test_parallel_apply_reports_failures_too(ctx_list):
    n = len(ctx_list)
    bad = ctx_list[-1]

    def fn(x):
        if mx.current_context() == bad:
            raise ReplicaBoom('parallel_apply failed')
        return x

    xs = [nd.ones((1,), ctx=c) for c in ctx_list]
    with pytest.raises(ReplicaBoom, match=fr'cpu\({bad.device_id:d}\)'):
        parallel_apply(fn, xs)
    assert len(parallel_apply(lambda x: x, xs)) == n


NESTED_WARM_UP = '''
import mxnet as mx
from mxnet import gluon, nd
import gluon_parallel as gp

ctx = [mx.cpu(0), mx.cpu(1)]
inner = []
for c in ctx:
    d = gluon.nn.Dense(4, in_units=3)
    d.initialize(ctx=c)
    inner.append(d)


class Outer(gluon.Block):
    """Deferred (so its first call is a warm-up) and making, in forward, a
    threaded parallel call whose replicas make parallel calls of their own."""

    def __init__(self):
        super(Outer, self).__init__()
        self.dense = gluon.nn.Dense(3)

    def forward(self, x):
        h = self.dense(x)
        xs = [nd.ones((2, 3), ctx=c) for c in ctx]
        out = gp.parallel_apply(lambda v: gp.parallel_apply(
            inner[gp.current_replica().rank], [v])[0], xs, threads=True)
        return h + out[0].sum() * 0 if h.context == ctx[0] else h


net = Outer()
net.initialize(ctx=ctx)
print('ok', [o.shape for o in gp.DataParallel(net, ctx)(nd.ones((4, 5)))])
'''


def test_a_warm_up_whose_forward_makes_nested_parallel_calls_does_not_wait_for_itself():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, '-c', NESTED_WARM_UP], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith('ok'), proc.stderr[-2000:]


class Scaled(gluon.Block):
    """x * scale, the scale a keyword argument."""

    def forward(self, x, scale=1.0):
        return x * scale


def test_parallel_apply_gives_a_block_its_keyword_arguments(ctx_list):
    # Gluon 1.x Block.__call__ takes none: they must reach forward anyway.
    xs = [nd.ones((2, 3), ctx=c) for c in ctx_list]
    out = parallel_apply(Scaled(), xs, [{'scale': 2.0 + i} for i in range(len(ctx_list))])
    for i, y in enumerate(out):
        assert_close(y, np.full((2, 3), 2.0 + i))


def test_calls_nested_through_dataparallel_get_pools_of_their_own():
    # DataParallel -> parallel_apply -> DataParallel -> parallel_apply on the
    # same devices: each level needs its own pool, or the innermost call
    # waits for a pool its own caller holds.
    import threading
    import gluon_parallel as gp
    ctx = [mx.cpu(0), mx.cpu(1)]

    class Inner(gluon.Block):
        def forward(self, x):
            out = parallel_apply(lambda a: a * 2, [x.as_in_context(c) for c in ctx])
            return out[ctx.index(x.context)]

    class Middle(gluon.Block):
        def __init__(self):
            super().__init__()
            self.dp = gp.DataParallel(Inner(), ctx)

        def forward(self, x):
            out = parallel_apply(lambda a: gp.gather(self.dp(a), a.context),
                                 [x.as_in_context(c) for c in ctx])
            return out[ctx.index(x.context)]

    outer = gp.DataParallel(Middle(), ctx)
    result = {}

    def run():
        try:
            result['out'] = outer(nd.ones((4, 3)))
        except BaseException as e:      # reported below
            result['out'] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), 'nested calls wait for each other'
    assert not isinstance(result['out'], BaseException), result['out']
    assert_close(result['out'][0], np.full((2, 3), 2.0))


def test_default_contexts_are_named_once_at_construction():
    """DataParallel without contexts says which it chose (here no GPU: one
    CPU context), once, when it is built: not at every call."""
    from gluon_parallel import DataParallel
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    with pytest.warns(UserWarning, match=r'no ctx_list given.*\[cpu\(0\)\] only: MXNet sees '
                                         r'no GPU.*mx\.cpu\(i\) for i in range\(N\)') as caught:
        dp = DataParallel(net)
    assert len(caught) == 1 and dp.ctx_list == [mx.cpu()]
    package = os.path.dirname(os.path.abspath(gluon_parallel.__file__))
    assert not os.path.abspath(caught[0].filename).startswith(package + os.sep)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter('always')
        dp(nd.ones((2, 3)))
        dp(nd.ones((2, 3)))
    assert not [w for w in later if 'ctx_list' in str(w.message)]
    with warnings.catch_warnings(record=True) as given:
        warnings.simplefilter('always')
        DataParallel(net, [mx.cpu(0)])
    assert not given


def test_default_contexts_warning_points_at_the_caller(monkeypatch):
    """With GPUs the default is every one of them, named; the warning
    points at the line that left the contexts out."""
    monkeypatch.setattr(mx.context, 'num_gpus', lambda: 2)
    with pytest.warns(UserWarning, match=r'every GPU MXNet sees, \[gpu\(0\), gpu\(1\)\]') as c:
        assert check_ctx_list(None) == [mx.gpu(0), mx.gpu(1)]
    assert c[0].filename == __file__
# ------------------------------------------------ the warm-up in the call's mode

CTX3 = [mx.cpu(i) for i in range(3)]


def _same(got, want, what):
    for k in want:
        for r, (a, b) in enumerate(zip(got[k], want[k])):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f'{what} {k} [{r}]')


@pytest.mark.parametrize('graph', ['auto', False])
@pytest.mark.parametrize('cls', [mode_blocks.ModeScaled, mode_blocks.TargetsInTraining,
                                 mode_blocks.Glue], ids=lambda c: c.__name__)
def test_first_recorded_call_traces_the_training_graph(cls, graph, both_thread_modes):
    """The first call under record() traces the block in training mode, as
    the per-device loop's first call does: outputs, gradients and running
    statistics as that loop's, on every path (the block's predict graph
    returns y, not 2 * y; TargetsInTraining's refuses the targets); Glue's
    Dropout draws what the loop draws (none in the warm-up)."""
    import gluon_parallel as gp
    x, t = mode_blocks.batch(7)
    targets = (t,) if cls is mode_blocks.TargetsInTraining else ()
    # Worker threads draw from random streams of their own, which
    # mx.random.seed in this thread does not seed (MXNet 1.9.1): the
    # per-device loop's masks are not theirs.
    kwargs = {'rate': 0.5 if both_thread_modes == 'auto' else 0.0} \
        if cls is mode_blocks.Glue else {}
    ref = mode_blocks.make(cls, CTX3, **kwargs)
    mx.random.seed(5)
    want = mode_blocks.per_device_loop(ref, CTX3, x, *targets)
    net = mode_blocks.make(cls, CTX3, **kwargs)
    mx.random.seed(5)
    with gp.DataParallel(net, CTX3, graph=graph) as dp:
        with autograd.record():
            got = dp(x, *targets)
        autograd.backward([o[0] if isinstance(o, (list, tuple)) else o for o in got])
        path = dp.last_path
    assert path == ('graph' if graph == 'auto' and cls is not mode_blocks.Glue else 'replicas')
    flat = [np.concatenate([(o[0] if isinstance(o, (list, tuple)) else o).asnumpy()
                            for o in outs]) for outs in (got, want)]
    np.testing.assert_allclose(flat[0], flat[1], rtol=1e-6, atol=1e-7)
    _same(mode_blocks.grads(net), mode_blocks.grads(ref), 'gradient')
    _same(mode_blocks.running(net), mode_blocks.running(ref), 'running statistic')
