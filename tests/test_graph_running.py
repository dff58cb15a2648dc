"""Graph mode computes what Gluon computes in every usage pattern: weights
and running statistics against the per-device Gluon loop (BatchNorm) and
against BatchNorm on the whole batch (SyncBatchNorm, MKL-DNN on and off, in
children); running statistics identical across runs."""
import os
import subprocess
import sys

import numpy as np
import pytest
from mxnet.gluon import nn

import loops
import usage_patterns as up

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize('pattern', up.PATTERNS)
def test_batchnorm_matches_the_per_device_gluon_loop(pattern):
    """The reference hybridized without static_alloc (with it, MXNet 1.9.1
    does not order BatchNorm's backward write of the running statistics),
    read after nd.waitall()."""
    net = up.build(nn.BatchNorm, loops.CTX, {})
    ref = up.run(pattern, net, up.per_device(net, loops.CTX))
    net = up.build(nn.BatchNorm, loops.CTX, {})
    forward = up.data_parallel(net, loops.CTX)
    got = up.run(pattern, net, forward)
    assert forward.dp.graph_mode.binds > 0
    up.assert_close(got, ref, what=pattern + ': ')


@pytest.mark.parametrize('hybridize', [{}, {'static_alloc': True, 'static_shape': True}],
                         ids=['plain', 'static_alloc'])
@pytest.mark.parametrize('pattern', ['steps_16_10_16', 'two_forwards_one_backward'])
def test_two_identical_runs_give_identical_running_statistics(pattern, hybridize):
    runs = []
    for _ in range(2):
        net = up.build(nn.BatchNorm, loops.CTX, hybridize)
        forward = up.data_parallel(net, loops.CTX)
        runs.append(up.run(pattern, net, forward))
        assert forward.dp.graph_mode.binds > 0
    for k in runs[0]:
        if 'running' in k:
            for a, b in zip(runs[0][k], runs[1][k]):
                np.testing.assert_array_equal(a, b, err_msg=k)


@pytest.mark.parametrize('mkldnn', ['0', '1'], ids=['no-mkldnn', 'mkldnn'])
def test_syncbatchnorm_matches_whole_batch_batchnorm(mkldnn):
    """Every pattern, in graph mode (graph='auto'), in a child: MXNet reads
    MXNET_MKLDNN_ENABLED once per process."""
    out = subprocess.run([sys.executable, os.path.join(HERE, 'graph_scripts',
                                                       'syncbn_patterns.py')],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, MXNET_MKLDNN_ENABLED=mkldnn))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if ' ok, graph mode:' in line]
    assert len(lines) == len(up.PATTERNS), out.stdout
    assert all(line.endswith('True') for line in lines), out.stdout


QUIET_SCRIPT = '''
import os
import mxnet as mx
from mxnet import autograd, gluon
import gluon_parallel as gp
ctx = [mx.cpu(0), mx.cpu(1)]
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Conv2D(4, 3), gluon.nn.BatchNorm(), gluon.nn.Dense(3))
net.initialize(ctx=ctx)
net.hybridize()
dp = gp.DataParallel(net, ctx)
loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
x, y = mx.nd.ones((4, 1, 8, 8)), mx.nd.array([0, 1, 2, 0])
dp(x)
with autograd.record():
    losses = loss(dp(x), y)
autograd.backward(losses)
mx.nd.waitall()
print(dp.graph_mode.binds, os.environ.get('MXNET_SUBGRAPH_VERBOSE'))
'''


@pytest.mark.parametrize('verbose', [None, '1'])
def test_binding_prints_no_subgraph_backend_line(verbose):
    """MXNet logs "Subgraph backend MKLDNN is activated." at every executor
    bind (graph mode binds one per signature): not on our path, and the
    environment then reads as MXNet's default (1: the variable stays,
    _gluon/environment.py); a user's MXNET_SUBGRAPH_VERBOSE=1 keeps it."""
    env = {k: v for k, v in os.environ.items() if k != 'MXNET_SUBGRAPH_VERBOSE'}
    if verbose:
        env['MXNET_SUBGRAPH_VERBOSE'] = verbose
    out = subprocess.run([sys.executable, '-c', QUIET_SCRIPT], capture_output=True, text=True,
                         timeout=240, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ['2', '1']
    assert ('Subgraph backend MKLDNN is activated' in out.stderr) == bool(verbose), out.stderr
