"""_gluon/environment.py: the environment variables a bind reads are set
around it without adding or removing a variable once MXNet runs operators
(glibc's setenv of a new variable, or unsetenv, under another thread's
getenv: a segmentation fault)."""
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

import gluon_parallel as gp
from gluon_parallel._gluon import environment

FWD, BWD = 'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_FWD', 'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD'


def read(name):
    """`name` as MXNet parses it (dmlc::GetEnv reads past the trailing
    space of the values environment.py writes)."""
    return int(os.environ[name])


def test_setting_restores_the_users_values_and_mxnets_defaults(monkeypatch):
    for k in (FWD, BWD, 'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN', 'NNVM_EXEC_MATCH_RANGE'):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(BWD, '7')                        # the user's
    with environment.setting({FWD: '3', BWD: '4', 'NNVM_EXEC_MATCH_RANGE': '1'}):
        assert [read(k) for k in (FWD, BWD, 'NNVM_EXEC_MATCH_RANGE')] == [3, 4, 1]
        assert not environment.user_set(FWD)
    assert [read(k) for k in (FWD, BWD, 'NNVM_EXEC_MATCH_RANGE')] == [15, 7, 16]
    assert os.environ[BWD] == '7'
    assert environment.user_set(BWD) and not environment.user_set(FWD)
    # An unset segment length reads MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN's.
    monkeypatch.setenv('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN', '20')
    with environment.setting({FWD: '3'}):
        pass
    assert read(FWD) == 20
    monkeypatch.setenv(FWD, '5')                        # the user's now
    assert environment.user_set(FWD)


def test_a_child_process_tells_the_written_values_from_the_users(monkeypatch):
    """A process started after a bind inherits the values written here:
    it does not take them for the user's (graph mode would leave its
    segment lengths alone, and MXNet's bind log line on)."""
    monkeypatch.delenv(FWD, raising=False)
    monkeypatch.setenv(BWD, '9')
    with environment.setting({FWD: '3'}):
        pass
    code = ('from gluon_parallel._gluon import environment as e; '
            f'print(e.user_set({FWD!r}), e.user_set({BWD!r}))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ['False', 'True']


def test_binds_add_and_remove_no_variable(monkeypatch):
    """Graph mode binds executors for every new batch size while the
    devices still run the last step (MXNet's operators read the environment
    as they run): after the first step's binds, no bind adds a variable to
    the environment or removes one, during the bind or after it."""
    seen, bind = [], mx.sym.Symbol.bind

    def recorded(self, *args, **kwargs):
        seen.append(frozenset(os.environ))
        out = bind(self, *args, **kwargs)
        seen.append(frozenset(os.environ))
        return out
    monkeypatch.setattr(mx.sym.Symbol, 'bind', recorded)
    ctx = [mx.cpu(i) for i in range(4)]
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, activation='relu', in_units=6), gluon.nn.Dense(3, in_units=8))
    net.initialize(ctx=ctx)
    net.hybridize()
    dp = gp.DataParallel(net, ctx, graph=True)
    dpl = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    keys = None
    for batch in (8, 12, 16, 12, 20):
        x, y = nd.random.uniform(shape=(batch, 6)), nd.array(np.arange(batch) % 3)
        with autograd.record():
            losses = dpl(dp(x), y)
        autograd.backward(losses)
        trainer.step(batch)
        if keys is None:                 # (the first binds may add them, once)
            keys, seen[:] = frozenset(os.environ), []
    nd.waitall()
    assert dp.graph_mode.binds >= 4 and seen
    assert all(s == keys for s in seen), [sorted(s ^ keys) for s in seen if s != keys]
    assert frozenset(os.environ) == keys


def test_add_variable_waits_for_the_engine_before_adding(monkeypatch):
    """A variable another library reads (ps-lite's DMLC_NODE_HOST) is added
    only once MXNet's engine is idle; changing the value of one already set
    moves nothing, and does not wait."""
    name = 'GLUON_PARALLEL_TEST_ADDED'
    monkeypatch.delenv(name, raising=False)
    waits = []
    monkeypatch.setattr(environment.nd, 'waitall', lambda: waits.append(name in os.environ))
    environment.add_variable(name, '127.0.0.1')
    assert waits == [False] and os.environ[name] == '127.0.0.1'
    environment.add_variable(name, '')                  # set already: no wait
    assert waits == [False] and os.environ[name] == ''
