"""Reliability: planted faults, soak, shutdown, and bad inputs.

The promise: a call either returns the right answer or raises a clear error
promptly, and the next call works.
"""
import re
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import gluon_parallel as gp
from gluon_parallel.nn import SyncBatchNorm

import soaking
from children import interrupt_when, run_script
from faults import MATRIX, Planted, cpus, make_rig, planted_failure

@pytest.fixture(scope='module', params=[2, 4])
def rig(request):
    yield from make_rig(request.param, SyncBatchNorm)


@pytest.fixture(scope='module', params=[2, 4])
def plain_rig(request):
    # No layer synchronises: DataParallel's default mode issues every
    # replica from the calling thread, a different failure path.
    yield from make_rig(request.param, gluon.nn.BatchNorm)


@pytest.mark.parametrize('stage,which,exc', MATRIX)
def test_planted_failure_is_reported_and_the_next_call_is_clean(rig, stage, which, exc,
                                                                monkeypatch, capfd):
    planted_failure(rig, stage, which, exc, monkeypatch, capfd)
    assert rig[3]._replicas.threads is True              # SyncBatchNorm needed the workers


@pytest.mark.parametrize('stage,which,exc', [m for m in MATRIX if m[0] != 'op'])
def test_planted_failure_without_synchronisation(plain_rig, stage, which, exc,
                                                 monkeypatch, capfd):
    planted_failure(plain_rig, stage, which, exc, monkeypatch, capfd)
    assert plain_rig[3]._replicas.threads == 'auto' and plain_rig[3]._replicas.pool.threads == []


def test_failure_in_the_caller_replica_does_not_wait_for_slow_replicas():
    """A Ctrl-C style failure in replica 0 (run by the caller) returns within
    the pool's grace period even though another replica is still busy."""
    ctxs = cpus(3)

    def fn(x):
        if x.context == ctxs[0]:
            raise Planted('interrupt in caller replica')
        time.sleep(4 if x.context == ctxs[2] else 0)
        return x

    pool = gp.WorkerPool(ctxs)
    try:
        start = time.monotonic()
        with pytest.raises(Planted, match='cpu\\(0\\)'):
            pool.run(fn, [(nd.ones(1, ctx=c),) for c in ctxs])
        assert time.monotonic() - start < 3.5
        outs = pool.run(lambda x: x * 2, [(nd.ones(1, ctx=c),) for c in ctxs])
        assert [o.asscalar() for o in outs] == [2, 2, 2]
    finally:
        pool.close()


def test_timeout_default_and_environment(monkeypatch):
    monkeypatch.delenv('GLUON_PARALLEL_TIMEOUT', raising=False)
    assert gp.default_timeout() == 300.0
    monkeypatch.setenv('GLUON_PARALLEL_TIMEOUT', '12.5')
    assert gp.default_timeout() == 12.5
    monkeypatch.setenv('GLUON_PARALLEL_TIMEOUT', '0')
    assert gp.default_timeout() is None


def soak_calls():
    """The soak below: DataParallel over a conv + dense net with two
    SyncBatchNorm layers (both code paths of the layer: 4-D and 2-D inputs;
    a per-call leak of one operator used for 4-D inputs once grew RSS by
    7 % over 2000 calls of this network). Runs in a child (soaking.py)."""
    ctxs = cpus(4)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, padding=1, in_channels=3), SyncBatchNorm(in_channels=4),
            gluon.nn.Dense(4, in_units=4 * 8 * 8), SyncBatchNorm(in_channels=4))
    net.initialize(ctx=ctxs)
    x = nd.random.normal(shape=(8, 3, 8, 8))
    dp = gp.DataParallel(net, ctxs)

    def calls(k):
        for _ in range(k):
            with autograd.record():
                outs = dp(x)
            autograd.backward(outs)
        nd.waitall()
    return calls


@pytest.mark.soak
def test_soak_threads_constant_and_memory_flat(capsys):
    result = soaking.in_child('test_reliability', 'soak_calls', 300, 3000)
    soaking.check(result, 'soak: 3000 calls (4 contexts, conv + dense, SyncBN)', capsys)


def test_script_that_never_closes_exits_promptly():
    proc = run_script('''
        import mxnet as mx
        from mxnet import gluon, nd, autograd
        import gluon_parallel as gp
        ctxs = [mx.cpu(i) for i in range(4)]
        net = gluon.nn.Dense(2, in_units=3)
        net.initialize(ctx=ctxs)
        dp = gp.DataParallel(net, ctxs)
        for _ in range(5):
            with autograd.record():
                outs = dp(nd.ones((8, 3)))
            autograd.backward(outs)
        print('done', flush=True)
    ''')
    start = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert 'done' in out
    assert time.monotonic() - start < 30


def test_ctrl_c_during_a_long_call_exits_within_seconds():
    proc = run_script('''
        import time
        import mxnet as mx
        from mxnet import gluon, nd
        import gluon_parallel as gp
        class Slow(gluon.Block):
            def forward(self, x):
                print('started', flush=True)
                end = time.time() + 120
                while time.time() < end:
                    time.sleep(0.05)
                return x
        ctxs = [mx.cpu(i) for i in range(4)]
        dp = gp.DataParallel(Slow(), ctxs)
        dp(nd.ones((4, 2)))
    ''')
    interrupt_when(proc, 'started')


def dense(ctxs, units=2, in_units=3):
    net = gluon.nn.Dense(units, in_units=in_units)
    net.initialize(ctx=ctxs)
    return net


@pytest.fixture(scope='module')
def dp2():
    ctxs = cpus(2)
    with gp.DataParallel(dense(ctxs), ctxs) as dp:
        yield dp


class KwBlock(gluon.Block):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = gluon.nn.Dense(2, in_units=3)

    def forward(self, x, mask=None):
        return self.dense(x) if mask is None else self.dense(x) * mask


BAD_CALLS = {
    'empty batch': (lambda dp: dp(np.zeros((0, 3), 'float32')), ValueError, 'empty batch'),
    'batch dims disagree between args':
        (lambda dp: dp(nd.ones((4, 3)), nd.ones((5, 3))), ValueError, r'inputs\[1\]'),
    'batch_axis out of range':
        (lambda dp: gp.split_load_kwargs((nd.ones((4, 3)),), {}, cpus(2), batch_axis=2),
         ValueError, 'batch_axis 2'),
    'int where an array must be split': (lambda dp: dp(3), ValueError, 'nothing to split'),
    'None where an array must be split': (lambda dp: dp(None), ValueError, 'nothing to split'),
    'string where an array must be split': (lambda dp: dp('abc'), ValueError, 'nothing to split'),
    'empty ctx_list': (lambda dp: gp.DataParallel(dense(cpus(1)), []), ValueError, 'empty'),
    'duplicated ctx_list':
        (lambda dp: gp.DataParallel(dense(cpus(1)), [mx.cpu(0), mx.cpu(0)]), ValueError,
         'twice'),
    'ctx_list of strings':
        (lambda dp: gp.DataParallel(dense(cpus(1)), ['cpu0']), TypeError, 'Context'),
    'not a block': (lambda dp: gp.DataParallel(lambda x: x, cpus(2)), TypeError, 'Block'),
    'split_sizes of zero': (lambda dp: gp.split_sizes(0, 2), ValueError, 'empty batch'),
    'ParallelState of zero parties':
        (lambda dp: gp.ParallelState(0, sum), ValueError, 'num_parties'),
    'gather of mismatched outputs':
        (lambda dp: gp.gather([(nd.ones(1),), (nd.ones(1), nd.ones(1))]), ValueError,
         'different lengths'),
    'parallel_apply with more inputs than contexts':
        (lambda dp: gp.parallel_apply(lambda x: x, [nd.ones(1), nd.ones(1)], ctx_list=cpus(1)),
         ValueError, '2 replica inputs'),
    'loss outputs not a list':
        (lambda dp: gp.DataParallelLoss(gluon.loss.L2Loss())(nd.ones((2, 2)), nd.ones((2, 2))),
         TypeError, 'list'),
}


@pytest.mark.parametrize('kind', sorted(BAD_CALLS))
def test_bad_input_is_a_clear_error(dp2, kind):
    fn, exc, match = BAD_CALLS[kind]
    with pytest.raises(exc, match=match):
        fn(dp2)
    # and the DataParallel still works afterwards
    assert len(dp2(nd.ones((4, 3)))) == 2


def test_batch_dims_disagree_between_args_and_kwargs():
    ctxs = cpus(2)
    net = KwBlock()
    net.initialize(ctx=ctxs)
    with gp.DataParallel(net, ctxs) as dp:
        with pytest.raises(ValueError, match='mask'):
            dp(nd.ones((4, 3)), mask=nd.ones((5, 1)))


def test_context_with_no_parameters():
    net = dense(cpus(2))
    with gp.DataParallel(net, cpus(3)) as dp:
        with pytest.raises(ValueError, match=r'not on context cpu\(2\)'):
            dp(nd.ones((6, 3)))


class Counted(gluon.HybridBlock):
    """A small network that counts its forward calls (on any device)."""

    def __init__(self, in_units=0, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0
        with self.name_scope():
            self.dense = gluon.nn.Dense(2, in_units=in_units)
        self.register_forward_pre_hook(lambda block, args: setattr(block, 'calls',
                                                                   block.calls + 1))

    def hybrid_forward(self, F, x):
        return self.dense(x)


def _on_cpu0_known_shapes(tmp_path):
    net = Counted(in_units=3)
    net.initialize()                                  # the current context: cpu(0)
    return net


def _on_cpu0_deferred(tmp_path):
    net = Counted()
    net.initialize(ctx=mx.cpu(0))                     # shapes inferred on the first call
    return net


def _loaded_on_cpu0(tmp_path):
    path = str(tmp_path / 'w.params')
    _on_cpu0_known_shapes(tmp_path).save_parameters(path)
    net = Counted(in_units=3)
    net.load_parameters(path, ctx=mx.cpu(0))
    return net


def _reset_to_cpu0(tmp_path):
    net = Counted(in_units=3)
    net.initialize(ctx=cpus(2))
    net.collect_params().reset_ctx(mx.cpu(0))
    return net


@pytest.mark.filterwarnings('ignore:.*hybridized while still having forward hook')
@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybrid'])
@pytest.mark.parametrize('make', [_on_cpu0_known_shapes, _on_cpu0_deferred, _loaded_on_cpu0,
                                  _reset_to_cpu0], ids=lambda f: f.__name__.strip('_'))
def test_parameter_on_one_context_is_named_before_any_replica_runs(tmp_path, make, hybridize):
    net = make(tmp_path)
    if hybridize:
        net.hybridize()
    with gp.DataParallel(net, cpus(2)) as dp:
        with pytest.raises(ValueError) as info:
            with autograd.record():
                dp(nd.ones((4, 3)))
        # named: the first parameter and the device it lacks
        assert re.search(r'parameter \S*dense\d+_weight is not on context cpu\(1\)',
                         str(info.value)), str(info.value)
        assert net.calls == 0           # no replica (nor the shape-inference call) ran
    # initialised on both devices, the same wrapper's model works
    net.collect_params().reset_ctx(cpus(2))
    with gp.DataParallel(net, cpus(2)) as dp:
        assert [o.context for o in dp(nd.ones((4, 3)))] == cpus(2)
    assert net.calls >= 2               # the counter does count replicas


def test_uninitialised_parameters():
    net = gluon.nn.Dense(2, in_units=3)
    with gp.DataParallel(net, cpus(2)) as dp:
        with pytest.raises(Exception, match='initiali'):
            dp(nd.ones((4, 3)))


def test_targets_whose_length_disagrees_with_the_outputs(dp2):
    dl = gp.DataParallelLoss(gluon.loss.L2Loss())
    outs = dp2(nd.ones((8, 3)))
    with pytest.raises(ValueError, match='rows'):
        dl(outs, nd.ones((6, 2)))


def test_wrong_number_of_presplit_targets(dp2):
    dl = gp.DataParallelLoss(gluon.loss.L2Loss())
    outs = dp2(nd.ones((8, 3)))
    with pytest.raises(ValueError, match='3 pre-split entries, but there are 2 outputs'):
        dl(outs, [nd.ones((4, 2))] * 3)


# SyncBatchNorm channel-count and num_devices mismatches: test_sync_batchnorm.py


def test_use_after_close():
    ctxs = cpus(2)
    dp = gp.DataParallel(dense(ctxs), ctxs)
    dp.close()
    with pytest.raises(RuntimeError, match='closed'):
        dp(nd.ones((4, 3)))


def test_non_finite_statistics_are_reported_when_asked(monkeypatch):
    ctxs = cpus(2)
    bn = SyncBatchNorm(in_channels=2, check_finite=True)
    bn.initialize(ctx=ctxs)
    x = nd.array([[1, 2], [float('nan'), 1], [0, 0], [1, 1]])
    with gp.DataParallel(bn, ctxs) as dp:
        with pytest.raises(FloatingPointError, match='NaN or Inf'):
            with autograd.record():
                dp(x)
        with autograd.record():          # finite input still works
            dp(nd.ones((4, 2)))
    monkeypatch.setenv('GLUON_PARALLEL_CHECK_FINITE', '1')
    assert SyncBatchNorm().check_finite
    monkeypatch.setenv('GLUON_PARALLEL_CHECK_FINITE', '0')
    assert not SyncBatchNorm().check_finite
