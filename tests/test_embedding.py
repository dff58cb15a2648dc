"""HostEmbedding: a sparse embedding table on one CPU context, read by
replicated dense layers on three others, trains exactly like plain Gluon on
one device (gluon.nn.Embedding with sparse_grad=True)."""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp
from loops import values

TABLE_CTX = mx.cpu(3)
CTX = [mx.cpu(i) for i in range(3)]
VOCAB, DIM, WORDS = 50, 5, 4
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()
SGD = ('sgd', {'learning_rate': 0.2, 'momentum': 0.9, 'wd': 1e-3})


class Model(gluon.Block):
    def __init__(self, embed, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embed = embed
            self.body = nn.HybridSequential()
            self.body.add(nn.Dense(8, activation='tanh', in_units=WORDS * DIM),
                          nn.Dense(3, in_units=8))

    def forward(self, x):
        return self.body(self.embed(x))


def host_model():
    return Model(gp.nn.HostEmbedding(VOCAB, DIM, ctx=TABLE_CTX))


def plain_model():
    return Model(nn.Embedding(VOCAB, DIM, sparse_grad=True))


@pytest.fixture(scope='module')
def init(tmp_path_factory):
    rng = np.random.RandomState(0)
    path = str(tmp_path_factory.mktemp('emb') / 'init.params')
    nd.save(path, {k: nd.array(rng.normal(0, 0.5, p.shape))
                   for k, p in plain_model()._collect_params_with_prefix().items()})
    return path


def batches(sizes, seed=1):
    rng = np.random.RandomState(seed)
    # Few distinct rows, so replicas read (and get gradients for) the same rows.
    return [(rng.randint(0, 12, (b, WORDS)).astype('float32'),
             rng.randint(0, 3, b).astype('float32')) for b in sizes]


def split_trainers(net, uok=None):
    table = list(net.embed.collect_params().values())
    rest = [p for p in net.collect_params().values() if p not in table]
    return [gluon.Trainer(rest, *SGD, update_on_kvstore=uok), gluon.Trainer(table, *SGD)]


def dense_grads(net):
    out = {}
    for k, p in net._collect_params_with_prefix().items():
        out[k] = sum(g.tostype('default').asnumpy() for g in p.list_grad())
    return out


def check(got, ref, rtol=1e-5, atol=1e-6, what=''):
    for k, copies in got.items():
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0], err_msg=f'{what}{k}: contexts differ')
        np.testing.assert_allclose(copies[0], ref[k][0], rtol=rtol, atol=atol,
                                   err_msg=f'{what}{k}')


def train(net, trainers, data, dp, grads=None):
    dp_loss = gp.DataParallelLoss(LOSS)
    for x, y in data:
        with autograd.record():
            losses = dp_loss(dp(x), y)
        autograd.backward(losses)
        if grads is not None:
            grads.append(dense_grads(net))
        gp.step(trainers, len(x))


@pytest.mark.parametrize('uok', [None, False], ids=['kvstore-update', 'local-update'])
def test_host_embedding_trains_like_one_device(init, uok):
    data = batches([9, 10, 2, 9])        # uneven, and a batch leaving a device idle
    ref = plain_model()
    ref.load_parameters(init, ctx=mx.cpu(0))
    trainer = gluon.Trainer(ref.collect_params(), *SGD)
    ref_grads = []
    for x, y in data:
        with autograd.record():
            loss = LOSS(ref(nd.array(x)), nd.array(y))
        loss.backward()
        ref_grads.append(dense_grads(ref))
        trainer.step(len(x))

    net = host_model()
    net.initialize(ctx=CTX)
    assert net.embed.weight.list_ctx() == [TABLE_CTX]
    net.load_parameters(init, ctx=CTX)                  # plain Gluon API: the table stays put
    assert net.embed.weight.list_ctx() == [TABLE_CTX]
    assert net.body[0].weight.list_ctx() == CTX
    net.hybridize()             # the dense part; the lookup stays imperative
    grads = []
    with gp.DataParallel(net, CTX) as dp:
        train(net, split_trainers(net, uok), data, dp, grads)
    for step, (g, r) in enumerate(zip(grads, ref_grads)):
        for k in r:
            np.testing.assert_allclose(g[k], r[k], rtol=1e-5, atol=1e-6,
                                       err_msg=f'gradient of {k} at step {step:d}')
    assert net.embed.weight.list_grad()[0].stype == 'row_sparse'
    check(values(net), values(ref))


def test_checkpoint_with_two_trainers(init, tmp_path):
    data = batches([9, 9, 9, 9], seed=2)
    net = host_model()
    net.load_parameters(init, ctx=CTX)
    trainers = split_trainers(net)
    with gp.DataParallel(net, CTX) as dp:
        train(net, trainers, data[:2], dp)
        gp.save_checkpoint(str(tmp_path / 'ck'), dp, trainers, step=2)
        train(net, trainers, data[2:], dp)
    expected = values(net)

    # The checkpoint is a plain Gluon file for the single-device model.
    plain = plain_model()
    plain.load_parameters(str(tmp_path / 'ck.params'), ctx=mx.cpu(0))

    net2 = host_model()
    net2.initialize(mx.init.Xavier(), ctx=CTX)
    trainers2 = split_trainers(net2)
    assert gp.load_checkpoint(str(tmp_path / 'ck'), net2, trainers2, ctx_list=CTX) == {'step': 2}
    assert net2.embed.weight.list_ctx() == [TABLE_CTX]
    check(values(net2), values(plain), rtol=0, atol=0)
    with gp.DataParallel(net2, CTX) as dp:
        train(net2, trainers2, data[2:], dp)
    check(values(net2), expected, rtol=1e-6)

    with pytest.raises(ValueError, match=r'ck\.states holds the states of 2 trainers, but 1'):
        gp.load_checkpoint(str(tmp_path / 'ck'), net2, trainers2[:1])


def test_host_embedding_refuses_a_hybridized_graph():
    seq = nn.HybridSequential()
    seq.add(gp.nn.HostEmbedding(VOCAB, DIM), nn.Dense(2, in_units=DIM * WORDS))
    seq.initialize()
    seq.hybridize()
    with pytest.raises(RuntimeError, match=seq[0].name + ' reads its table across devices'):
        seq(nd.ones((2, WORDS)))


def test_check_params_allows_the_pinned_table_and_nothing_else_on_one_context():
    net = host_model()
    net.initialize(ctx=CTX)
    gp.check_params(net, CTX)                   # the table is on TABLE_CTX only: allowed
    # The same dense layers on one context are a mistake, named with the device.
    net.body.collect_params().reset_ctx(CTX[0])
    with pytest.raises(ValueError, match=rf'parameter {net.body[0].weight.name} is not on context '
                                         r'cpu\(1\)'):
        gp.check_params(net, CTX)
    # A plain Embedding on one context is not pinned either.
    plain = plain_model()
    plain.initialize(ctx=CTX)
    plain.embed.collect_params().reset_ctx(CTX[0])
    with pytest.raises(ValueError, match=rf'{plain.embed.weight.name} is not on context cpu\(1\)'):
        gp.check_params(plain, CTX)
