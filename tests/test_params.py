"""gluon_parallel.params: broadcast_params and check_params against values
and contexts set up by hand."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon
from mxnet.gluon import nn

import gluon_parallel as gp
from loops import assert_same, make_batches, parallel, values

CTX = [mx.cpu(i) for i in range(3)]


def _net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4, in_units=3), gluon.nn.BatchNorm(in_channels=4))
    net.initialize(ctx=CTX)
    return net


def _scramble(net):
    """A different value on every context of every parameter; returns
    {name: [value per context]}."""
    rng = np.random.RandomState(0)
    out = {}
    for name, p in net.collect_params().items():
        out[name] = []
        for d in p.list_data():
            v = rng.normal(size=d.shape).astype('float32')
            d[:] = v
            out[name].append(v)
    return out


@pytest.mark.parametrize('root', [None, 2])
def test_broadcast_params_copies_the_root_value_everywhere(root):
    net = _net()
    before = _scramble(net)
    gp.broadcast_params(gp.DataParallel(net, CTX), None if root is None else CTX[root])
    for name, p in net.collect_params().items():
        expected = before[name][0 if root is None else root]
        for d in p.list_data():           # running statistics included
            np.testing.assert_array_equal(d.asnumpy(), expected, err_msg=name)


def test_broadcast_params_names_a_parameter_off_the_root():
    net = _net()
    with pytest.raises(ValueError, match='not on root context cpu\\(5\\)'):
        gp.broadcast_params(net, mx.cpu(5))


def test_broadcast_params_leaves_a_pinned_table_alone():
    net = gluon.nn.HybridSequential()
    table = gp.nn.HostEmbedding(5, 2, ctx=mx.cpu(0))
    net.add(table)
    net.initialize(ctx=CTX)
    value = table.weight.data().asnumpy().copy()
    gp.broadcast_params(net, CTX[2])
    np.testing.assert_array_equal(table.weight.data().asnumpy(), value)


def test_check_params_names_parameter_and_device():
    net = _net()
    with pytest.raises(ValueError, match=r'dense\d+_weight is not on context cpu\(3\)'):
        gp.check_params(net, CTX + [mx.cpu(3)])
    with pytest.raises(ValueError, match='lists a context twice'):
        gp.check_params(net, [mx.cpu(0), mx.cpu(0)])


def test_plain_batchnorm_running_stats_are_averaged(init, tmp_path):
    batches = make_batches([12, 12])
    _, net, trainer = parallel(init, batches, 4, bn=nn.BatchNorm)
    before = values(net)
    assert not np.array_equal(before['1.running_mean'][0], before['1.running_mean'][1])
    changed = gp.sync_running_stats(net)
    assert sorted(changed) == [n for n in sorted(before) if 'running' in n]
    after = values(net)
    for k in before:
        expected = np.mean(before[k], axis=0) if k in changed else before[k][0]
        assert_same({k: after[k]}, {k: expected}, rtol=1e-6)
    assert gp.sync_running_stats(net) == []


@pytest.mark.parametrize('graph', [True, False])
def test_symbol_block_loaded_from_a_file_trains(graph, tmp_path):
    """A SymbolBlock's parameters keep shape None after load_parameters
    (MXNet 1.9.1), which graph mode read (issue 41: SSD's FeatureExpander):
    it trains on both paths as the per-device loop does."""
    import symbol_blocks
    ctx = [mx.cpu(0), mx.cpu(1)]
    path = symbol_blocks.save_initial(str(tmp_path / 'sym.params'))
    ref, net = (symbol_blocks.symbol_block(params=path, ctx=ctx) for _ in range(2))
    assert all(p.shape is None for p in net.collect_params().values())
    trainers = [gluon.Trainer(b.collect_params(), 'sgd', {'learning_rate': 0.1})
                for b in (ref, net)]
    x = symbol_blocks.batch(6)
    with gp.DataParallel(net, ctx, graph=graph) as dp:
        for _ in range(2):
            want = symbol_blocks.loop_step(ref, ctx, x, trainers[0])
            got = symbol_blocks.dp_step(dp, x, trainers[1])
            np.testing.assert_allclose(got, want, rtol=1e-5)
        assert dp.last_path == ('graph' if graph else 'replicas')
    want, got = symbol_blocks.values(ref), symbol_blocks.values(net)
    for k in want:
        for a, b in zip(got[k], want[k]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=k)
