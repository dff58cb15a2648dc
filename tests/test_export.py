"""gluon_parallel.export: a model trained on several devices (SyncBatchNorm,
HostEmbedding) becomes a single-device symbol + params that plain Gluon
loads, with the predictions of the model, and the model is left as it was."""
import os
import shutil
import subprocess
import sys
import sysconfig
import threading

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp
import predict_race

CTX = [mx.cpu(i) for i in range(4)]
# SymbolBlock.imports cannot tell the input's dtype before the first call.
pytestmark = pytest.mark.filterwarnings('ignore:Cannot decide type:UserWarning')
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()


def conv_net(bn):
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, padding=1, in_channels=2), bn(in_channels=4), nn.Activation('relu'),
            nn.Dropout(0.5), nn.Conv2D(4, 3, strides=2, in_channels=4), bn(in_channels=4),
            nn.Activation('relu'), nn.Dense(3, in_units=36))
    return net


def train(net, ctx, steps=2, seed=0):
    rng = np.random.RandomState(seed)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
    with gp.DataParallel(net, ctx) as dp:
        dp_loss = gp.DataParallelLoss(LOSS)
        for _ in range(steps):
            x = rng.normal(size=(10, 2, 8, 8)).astype('float32')
            y = rng.randint(0, 3, 10).astype('float32')
            with autograd.record():
                losses = dp_loss(dp(x), y)
            autograd.backward(losses)
            trainer.step(len(x))
    return trainer


def test_export_syncbn_model(tmp_path):
    net = conv_net(gp.nn.SyncBatchNorm)
    net.initialize(mx.init.Xavier(), ctx=CTX)
    train(net, CTX)
    path = str(tmp_path / 'model')
    sym_file, params_file = gp.export(gp.DataParallel(net, CTX), path, epoch=3)
    assert (sym_file, params_file) == (path + '-symbol.json', path + '-0003.params')

    # Exactly the parameters of the graph, one copy each: no gradients, no
    # optimizer state, running statistics as auxiliary states.
    saved = nd.load(params_file)
    expected = {('aux:' if 'running' in p.name else 'arg:') + p.name
                for p in net.collect_params().values()}
    assert set(saved) == expected
    assert all(v.context == mx.cpu() for v in saved.values())

    # Independent reference: plain Gluon, one device, gluon.nn.BatchNorm,
    # predict mode, with the trained values read from one device's copies.
    ref = conv_net(nn.BatchNorm)
    ref.initialize(ctx=mx.cpu(1))
    ref_params = ref._collect_params_with_prefix()
    for k, p in net._collect_params_with_prefix().items():
        ref_params[k].set_data(p.data(CTX[2]).copyto(mx.cpu(1)))
    x = nd.array(np.random.RandomState(5).normal(size=(6, 2, 8, 8)), ctx=mx.cpu(1))
    imported = gluon.SymbolBlock.imports(sym_file, ['data'], params_file, ctx=mx.cpu(1))
    np.testing.assert_allclose(imported(x).asnumpy(), ref(x).asnumpy(), rtol=1e-5, atol=1e-6)

    # The trained model is untouched: still SyncBatchNorm, still trains.
    assert type(net[1]) is gp.nn.SyncBatchNorm and not net._active
    assert net[0].weight.list_ctx() == CTX
    train(net, CTX, steps=1, seed=1)


class Tagger(gluon.Block):
    """An embedding on one context, a dense body, and a training-only head."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embed = gp.nn.HostEmbedding(30, 4, ctx=mx.cpu(3))
            self.body = nn.HybridSequential()
            self.body.add(nn.Dense(5, activation='relu', in_units=12), nn.Dense(2, in_units=5))
            self.aux_head = nn.Dense(7, in_units=12)        # used only in training

    def forward(self, x):
        return self.body(self.embed(x))


def test_export_host_embedding_model_without_training_only_parts(tmp_path):
    net = Tagger()
    net.initialize(mx.init.Xavier(), ctx=CTX[:2])
    net.body.hybridize()
    x = nd.array(np.random.RandomState(0).randint(0, 30, (5, 3)), ctx=mx.cpu(0))
    expected = net(x).asnumpy()
    sym_file, params_file = gp.export(net, str(tmp_path / 'tagger'))
    saved = nd.load(params_file)
    assert 'arg:' + net.embed.weight.name in saved
    assert not any(net.aux_head.prefix in k for k in saved)
    imported = gluon.SymbolBlock.imports(sym_file, ['data'], params_file, ctx=mx.cpu(2))
    np.testing.assert_allclose(imported(x.as_in_context(mx.cpu(2))).asnumpy(), expected,
                               rtol=1e-6)
    # The lookup is still the cross-device one afterwards.
    with pytest.raises(RuntimeError, match='reads its table across devices'):
        net.embed(mx.sym.var('data'))


def test_export_names_a_block_that_cannot_be_traced(tmp_path):
    class Imperative(gluon.Block):
        def forward(self, x):
            return nd.relu(x)
    with pytest.raises(RuntimeError, match='cannot trace'):
        gp.export(Imperative(), str(tmp_path / 'x'))


class Probe(nn.HybridBlock):
    """Identity; while traced on symbols it calls `during()`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.during = None

    def hybrid_forward(self, F, x):
        if F is mx.sym and self.during is not None:
            self.during()
        return x


def test_export_leaves_the_model_to_other_threads(tmp_path):
    # While export traces the model, another thread runs it in training:
    # its SyncBatchNorm still normalises over the whole batch.
    net = nn.HybridSequential()
    probe = Probe()
    net.add(probe, gp.nn.SyncBatchNorm(in_channels=3))
    net.initialize(ctx=CTX[:2])
    rng = np.random.RandomState(0)
    x = np.concatenate([rng.normal(5, 1, (4, 3, 2, 2)), rng.normal(-5, 2, (4, 3, 2, 2))])
    seen = {}

    def train_meanwhile():
        with gp.DataParallel(net, CTX[:2]) as dp, autograd.train_mode():
            seen['out'] = np.concatenate([o.asnumpy() for o in dp(nd.array(x))])

    def during():
        worker = threading.Thread(target=train_meanwhile)
        worker.start()
        worker.join()

    probe.during = during
    gp.export(net, str(tmp_path / 'model'))
    want = (x - x.mean((0, 2, 3), keepdims=True)) / np.sqrt(x.var((0, 2, 3), keepdims=True)
                                                              + 1e-5)
    np.testing.assert_allclose(seen['out'], want, rtol=1e-4, atol=1e-4)
    assert type(net[1]) is gp.nn.SyncBatchNorm


def test_export_right_after_a_predict_forward(tmp_path):
    """The MKL-DNN in-place weight reorder of a predict-mode forward
    (tests/predict_race.py) never reaches an exported file."""
    path = str(tmp_path / 'model')
    for r in range(predict_race.ROUNDS):
        net = predict_race.fresh_after_predict([mx.cpu(0)], seed=r)
        _, params_file = gp.export(net, path)
        saved = {k.split(':', 1)[1]: v.asnumpy() for k, v in nd.load(params_file).items()}
        want = predict_race.settled_values(net)
        names = {k: p.name for k, p in net._collect_params_with_prefix().items()}
        predict_race.assert_values(saved, {names[k]: v for k, v in want.items()},
                                   f'round {r:d}')


# A plain-MXNet inference script, as docs/checkpoints.md shows it, run where
# gluon_parallel cannot be imported. `install` is 1 when the script first
# calls the copied gluon_parallel_numpy_compat's install().
PLAIN_MXNET = """
import sys
try:
    import gluon_parallel
except ImportError:
    pass
else:
    sys.exit('gluon_parallel is importable: not a machine without it')
if sys.argv[1] == '1':
    import gluon_parallel_numpy_compat
    gluon_parallel_numpy_compat.install()
import numpy as np
import mxnet as mx
from mxnet import gluon
model = gluon.SymbolBlock.imports(sys.argv[2] + '-symbol.json', ['data'],
                                  sys.argv[2] + '-0000.params', ctx=mx.cpu())
np.save(sys.argv[3], model(mx.nd.array(np.load(sys.argv[4]))).asnumpy())
"""


def run_without_gluon_parallel(tmp_path, install, *args):
    """`PLAIN_MXNET` under ``python -S``: site-packages on the path but none
    of its .pth files run, so neither gluon_parallel (an editable or normal
    install) nor its start-up hook is there; only a copy of the hook's one
    file, next to the script."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copy(os.path.join(root, 'gluon_parallel_numpy_compat.py'), tmp_path)
    (tmp_path / 'predict.py').write_text(PLAIN_MXNET)
    env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'PYTHONSTARTUP')}
    env['PYTHONPATH'] = os.pathsep.join([str(tmp_path), sysconfig.get_paths()['purelib'],
                                         sysconfig.get_paths()['platlib']])
    return subprocess.run([sys.executable, '-S', str(tmp_path / 'predict.py'), str(install),
                           *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), timeout=300)


def test_an_exported_model_loads_without_gluon_parallel(tmp_path):
    """docs/checkpoints.md's recipe: plain MXNet loads gp.export's files and
    predicts what the trained model predicts, on a Python where
    gluon_parallel is not importable; with a numpy of 1.24 or later, only
    after the copied hook's install()."""
    net = conv_net(gp.nn.SyncBatchNorm)
    net.initialize(mx.init.Xavier(), ctx=CTX[:2])
    train(net, CTX[:2])
    x = np.random.RandomState(1).normal(size=(3, 2, 8, 8)).astype('float32')
    np.save(tmp_path / 'x.npy', x)
    gp.export(net, str(tmp_path / 'model'))
    want = net(nd.array(x, ctx=CTX[0])).asnumpy()
    args = (tmp_path / 'model', tmp_path / 'out.npy', tmp_path / 'x.npy')

    proc = run_without_gluon_parallel(tmp_path, 1, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / 'out.npy'), want, rtol=1e-5, atol=1e-6)

    bare = run_without_gluon_parallel(tmp_path, 0, *args)
    if tuple(int(v) for v in np.__version__.split('.')[:2]) >= (1, 24):
        assert bare.returncode != 0 and "has no attribute 'bool'" in bare.stderr, bare.stderr
    else:
        assert bare.returncode == 0, bare.stderr
