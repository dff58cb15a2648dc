"""SyncBatchNorm inside DataParallel against gluon.nn.BatchNorm on the whole
batch on one context (the independent reference)."""
import threading
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import gluon_parallel as gp
from gluon_parallel.nn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from syncbn_checks import (assert_close, check_against_batchnorm, check_large_mean_inputs,
                           check_two_layers, cpus, make_pair, step_both)


@pytest.mark.parametrize('n', [1, 2, 3, 4])
@pytest.mark.parametrize('shape', [(8, 3, 4, 4), (16, 5), (6, 4, 7), (4, 2, 3, 3, 3)])
def test_matches_batchnorm_on_the_whole_batch(n, shape):
    check_against_batchnorm(n, shape)


@pytest.mark.parametrize('n,shape', [(4, (10, 3, 2, 2)),      # uneven: 3, 3, 2, 2
                                     (3, (10, 6)),            # uneven: 4, 3, 3
                                     (4, (3, 5, 2)),          # fewer rows than devices
                                     (4, (1, 3, 2, 2))])      # a single row
def test_uneven_and_short_batches(n, shape):
    check_against_batchnorm(n, shape)


def test_constant_cache_stays_bounded_with_changing_batches(monkeypatch):
    # The layer caches per-split and per-shape constants; batches of ever
    # new sizes must not grow that cache without bound, nor break results.
    from gluon_parallel.syncgraph import stats as moments
    monkeypatch.setattr(moments, 'MAX_CONSTS', 6)
    ctxs = cpus(3)
    sync, ref = make_pair(3, ctxs)
    rng = np.random.RandomState(5)
    with gp.DataParallel(sync, ctxs) as dp:
        for rows in (5, 7, 9, 4, 11, 6, 8):
            x = rng.randn(rows, 3, 2, rows % 3 + 1).astype('float32')
            w = rng.randn(*x.shape).astype('float32')
            out, gx, ref_out, ref_gx = step_both(dp, ref, x, w, ctxs)
            assert_close(out, ref_out, what=f'output, {rows:d} rows')
            assert_close(gx, ref_gx, what=f'input gradient, {rows:d} rows')
            assert len(moments.CONSTS) <= 6


@pytest.mark.parametrize('n,shape', [(4, (8, 5, 3)), (3, (10, 2, 2, 4))])
def test_channel_axis_last(n, shape):
    check_against_batchnorm(n, shape, axis=-1)


@pytest.mark.parametrize('kwargs', [dict(scale=False), dict(center=False),
                                    dict(momentum=0.5, epsilon=1e-3)])
def test_options_match_batchnorm(kwargs):
    check_against_batchnorm(4, (10, 3, 3), **kwargs)


@pytest.mark.parametrize('n', [1, 4])
def test_large_mean_inputs(n):
    check_large_mean_inputs(n)


def test_predict_mode_and_global_stats_use_running_statistics():
    ctxs = cpus(4)
    sync, ref = check_against_batchnorm(4, (8, 3, 2, 2))
    x = np.random.RandomState(5).randn(8, 3, 2, 2).astype('float32')
    with gp.DataParallel(sync, ctxs) as dp:
        out = np.concatenate([o.asnumpy() for o in dp(nd.array(x))])
        with autograd.record(train_mode=False):
            out2 = np.concatenate([o.asnumpy() for o in dp(nd.array(x))])
    want = ref(nd.array(x)).asnumpy()
    assert_close(out, want)
    assert_close(out2, want)
    # use_global_stats=True in training mode: a scale/shift by running stats.
    check_against_batchnorm(4, (10, 3, 2), use_global_stats=True)


def test_outside_dataparallel_it_is_batchnorm():
    sync, ref = make_pair(3, [mx.cpu(0)])
    x = nd.random.normal(shape=(6, 3, 2))
    for mode in (True, False):
        with autograd.record(train_mode=mode):
            a, b = sync(x), ref(x)
        assert_close(a.asnumpy(), b.asnumpy())


def test_deferred_initialisation_infers_channels():
    ctxs = cpus(2)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(6, flatten=False), SyncBatchNorm(axis=-1))
    net.initialize(ctx=ctxs)
    with gp.DataParallel(net, ctxs) as dp, autograd.record():
        outs = dp(nd.ones((5, 2, 3)))
    assert net[1].gamma.shape == (6,)
    assert [o.shape for o in outs] == [(3, 2, 6), (2, 2, 6)]


def test_two_layers_and_a_layer_called_twice_do_not_mix_rounds():
    check_two_layers()


class FailOn(gluon.HybridBlock):
    """Raises on one context; passes everything else through."""

    def __init__(self, ctx, **kwargs):
        super().__init__(**kwargs)
        self.ctx = ctx

    def hybrid_forward(self, F, x):
        if x.context == self.ctx:
            raise ValueError('planted failure')
        return x


@pytest.mark.parametrize('where', [0, 1, 2])
def test_failure_in_one_replica_does_not_hang_the_others(where):
    ctxs = cpus(4)
    net = gluon.nn.HybridSequential()
    layers = [SyncBatchNorm(in_channels=3), SyncBatchNorm(in_channels=3)]
    fail = FailOn(ctxs[2])
    for i, layer in enumerate(layers):
        if i == where:
            net.add(fail)
        net.add(layer)
    if where == 2:
        net.add(fail)
    net.initialize(ctx=ctxs)
    x = nd.random.normal(shape=(8, 3, 2))
    threads = threading.active_count()
    with gp.DataParallel(net, ctxs, timeout=30) as dp:
        start = time.monotonic()
        with pytest.raises(ValueError, match='planted failure') as info:
            with autograd.record():
                dp(x)
        assert time.monotonic() - start < 20        # aborted, not timed out
        assert 'cpu(2)' in str(info.value)
        fail.ctx = None                              # the next call is clean
        with autograd.record():
            outs = dp(x)
        assert len(outs) == 4
        assert threading.active_count() == threads + 3


def test_replica_that_skips_the_barrier_times_out_naming_it():
    class SkipOn(gluon.Block):
        def __init__(self, ctx, **kwargs):
            super().__init__(**kwargs)
            self.ctx = ctx
            self.bn = SyncBatchNorm(in_channels=2)

        def forward(self, x):
            return x if x.context == self.ctx else self.bn(x)

    ctxs = cpus(3)
    net = SkipOn(ctxs[1])
    net.initialize(ctx=ctxs)
    with gp.DataParallel(net, ctxs, timeout=0.5) as dp:
        with pytest.raises(TimeoutError, match=r'\[1\]'):
            with autograd.record():
                dp(nd.ones((6, 2)))


def test_num_devices_must_match():
    ctxs = cpus(2)
    bn = SyncBatchNorm(in_channels=2, num_devices=4)
    bn.initialize(ctx=ctxs)
    with gp.DataParallel(bn, ctxs) as dp:
        with pytest.raises(ValueError, match='num_devices=4'):
            with autograd.record():
                dp(nd.ones((4, 2)))


def test_channel_mismatch_is_a_clear_error():
    ctxs = cpus(2)
    bn = SyncBatchNorm(in_channels=3)
    bn.initialize(ctx=ctxs)
    with gp.DataParallel(bn, ctxs) as dp:
        with pytest.raises(ValueError, match='expects 3 channels'):
            with autograd.record():
                dp(nd.ones((4, 5)))


def small_cnn(bn_cls):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, padding=1, in_channels=1), bn_cls(in_channels=4),
            gluon.nn.Activation('relu'),
            gluon.nn.Conv2D(4, 3, padding=1, in_channels=4), bn_cls(in_channels=4),
            gluon.nn.Activation('relu'),
            gluon.nn.Dense(3, in_units=4 * 6 * 6))
    return net


def test_small_cnn_trains_like_batchnorm_on_one_device():
    ctxs = cpus(4)
    mx.random.seed(7)
    ref = small_cnn(gluon.nn.BatchNorm)
    ref.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    net = small_cnn(SyncBatchNorm)
    net.initialize(ctx=ctxs)
    for p, q in zip(net.collect_params().values(), ref.collect_params().values()):
        p.set_data(q.data())
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    opt = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}
    t_ref = gluon.Trainer(ref.collect_params(), 'sgd', opt)
    t_net = gluon.Trainer(net.collect_params(), 'sgd', dict(opt))
    rng = np.random.RandomState(3)
    dp = gp.DataParallel(net, ctxs)
    dl = gp.DataParallelLoss(loss)
    for _ in range(5):
        x = rng.randn(10, 1, 6, 6).astype('float32')
        y = rng.randint(0, 3, 10).astype('float32')
        with autograd.record():
            lr = loss(ref(nd.array(x)), nd.array(y))
        lr.backward()
        t_ref.step(10)
        with autograd.record():
            losses = dl(dp(x), y)
        autograd.backward(losses)
        t_net.step(10)
    dp.close()
    for (name, p), q in zip(net.collect_params().items(), ref.collect_params().values()):
        for c in ctxs:
            np.testing.assert_allclose(p.data(c).asnumpy(), q.data().asnumpy(),
                                       rtol=1e-4, atol=1e-5, err_msg=f'{name} on {c}')


def test_convert_and_revert_keep_parameters_and_names():
    net = gluon.model_zoo.vision.resnet18_v1(classes=4)
    net.initialize(mx.init.Xavier(), ctx=cpus(2))
    x = nd.random.normal(shape=(2, 3, 32, 32))
    before = net(x).asnumpy()
    names = list(net.collect_params().keys())
    n_bn = sum(1 for b in _blocks(net) if isinstance(b, gluon.nn.BatchNorm))
    assert convert_sync_batchnorm(net) is net
    sync_layers = [b for b in _blocks(net) if isinstance(b, SyncBatchNorm)]
    assert len(sync_layers) == n_bn > 0
    assert list(net.collect_params().keys()) == names
    assert_close(net(x).asnumpy(), before)
    with gp.DataParallel(net, cpus(2)) as dp, autograd.record():
        outs = dp(nd.random.normal(shape=(4, 3, 32, 32)))
    assert [o.shape for o in outs] == [(2, 4), (2, 4)]
    revert_sync_batchnorm(net)
    assert not any(isinstance(b, SyncBatchNorm) for b in _blocks(net))
    net.hybridize()
    assert net(x).shape == (2, 4)
    assert list(net.collect_params().keys()) == names


def test_convert_a_hybridized_net_is_refused():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(3), gluon.nn.BatchNorm())
    net.hybridize()
    with pytest.raises(RuntimeError, match='hybridize'):
        convert_sync_batchnorm(net)


def _blocks(block):
    yield block
    for child in block._children.values():
        yield from _blocks(child)


@pytest.mark.parametrize('hybridize', [None, {'static_alloc': True}], ids=['imperative',
                                                                         'hybridized'])
def test_models_training_concurrently_on_the_same_devices(hybridize):
    # Four threads, each training its own SyncBatchNorm on the same two
    # devices: each matches BatchNorm on its whole batch at every step.
    errors = []

    def train(k):
        try:
            check_against_batchnorm(2, (6, 3, 4), steps=8, mean=k, hybridize=hybridize)
        except BaseException as e:        # reported below, with the thread's number
            errors.append((k, e))

    threads = [threading.Thread(target=train, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), 'a training thread hangs'
    assert not errors, errors


# ------------------------------------------- symbol-built blocks (GluonCV's SSD base)

def test_syncbatchnorm_has_batchnorm_parameter_names(tmp_path):
    """norm_layer=SyncBatchNorm names the parameters as BatchNorm does, also
    where names come from the prefix (a base traced to a symbol): a
    BatchNorm file loads into it and its file into BatchNorm."""
    import symbol_blocks
    with gluon.nn.HybridSequential(prefix='').name_scope():
        bn, sync = symbol_blocks.conv_bn(), symbol_blocks.conv_bn(SyncBatchNorm)
    assert sorted(bn.collect_params()) == sorted(sync.collect_params())
    assert SyncBatchNorm(prefix=None).name.startswith('batchnorm')
    path = symbol_blocks.save_initial(str(tmp_path / 'bn.params'))
    block = symbol_blocks.symbol_block(SyncBatchNorm, params=path, ctx=mx.cpu(0))
    block.collect_params().save(str(tmp_path / 'sync.params'))   # (what save_initial writes)
    back = symbol_blocks.symbol_block(params=str(tmp_path / 'sync.params'), ctx=mx.cpu(0))
    for k, p in back.collect_params().items():
        np.testing.assert_array_equal(p.data().asnumpy(),
                                      block.collect_params()[k].data().asnumpy())


@pytest.mark.parametrize('graph', ['auto', False])
def test_convert_rewrites_the_batchnorms_of_a_symbol_block(graph, tmp_path):
    """convert_sync_batchnorm marks a symbol block's BatchNorm operators
    (it did nothing before): one step on two devices gives the losses,
    parameters and, on every device, running statistics of BatchNorm on
    one device with the whole batch; revert makes them BatchNorm again."""
    import symbol_blocks
    ctx = [mx.cpu(0), mx.cpu(1)]
    path = symbol_blocks.save_initial(str(tmp_path / 'bn.params'))
    ref = symbol_blocks.symbol_block(params=path, ctx=[mx.cpu(0)])
    net = convert_sync_batchnorm(symbol_blocks.symbol_block(params=path, ctx=ctx))
    trainers = [gluon.Trainer(b.collect_params(), 'sgd', {'learning_rate': 0.1})
                for b in (ref, net)]
    x = symbol_blocks.batch(6)
    want = symbol_blocks.loop_step(ref, [mx.cpu(0)], x, trainers[0])
    with gp.DataParallel(net, ctx, graph=graph) as dp:
        got = symbol_blocks.dp_step(dp, x, trainers[1])
    np.testing.assert_allclose(sum(got), sum(want), rtol=1e-5)
    want, got = symbol_blocks.values(ref), symbol_blocks.values(net)
    for k in want:
        for copy in got[k]:
            np.testing.assert_allclose(copy, want[k][0], rtol=1e-4, atol=1e-6, err_msg=k)
    from gluon_parallel import _gluon
    from gluon_parallel.syncgraph import MARK
    assert _gluon.symbol_graph(net).tojson().count(MARK) == 2
    revert_sync_batchnorm(net)
    assert MARK not in _gluon.symbol_graph(net).tojson()


def test_convert_warns_when_it_finds_no_batchnorm():
    net = gluon.nn.Dense(3)
    with pytest.warns(UserWarning, match='no BatchNorm'):
        assert convert_sync_batchnorm(net) is net
