"""joint_backward: in a Parallel round that synchronised, the tasks'
backward calls run as one pass; the route over Python's backward calls is
installed by the first round, removable, and leaves every other backward
call as MXNet's."""
import subprocess
import sys

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

import gluon_parallel as gp
from gluon_parallel import gluoncv as gp_gluoncv

FIRST_ROUND = '''
import mxnet as mx
from mxnet import autograd, nd
import gluon_parallel as gp
from gluon_parallel import _gluon, gluoncv, joint_backward
backward, method = autograd.backward, mx.nd.NDArray.backward


class Task:
    def forward_backward(self, x):
        x.attach_grad()
        with autograd.record():
            y = (x * x).sum()
        y.backward()
        return x.grad


bn = gp.nn.SyncBatchNorm()          # every other feature's patch, but not this one
assert (autograd.backward, mx.nd.NDArray.backward) == (backward, method), 'patched early'
with gluoncv.Parallel(2, Task(), serial_init=False) as parallel:
    for c in (mx.cpu(0), mx.cpu(1)):
        parallel.put(nd.ones(2, ctx=c))
    assert all((g.asnumpy() == 2).all() for g in (parallel.get(), parallel.get()))
assert _gluon.backward_route() is joint_backward.route, 'the first round routes backward'
x = nd.ones(3)
x.attach_grad()
with autograd.record():
    y = x * 3
y.backward()                        # outside a round: MXNet's, through the route
assert (x.grad.asnumpy() == 3).all()
_gluon.unroute_backward()
assert (autograd.backward, mx.nd.NDArray.backward) == (backward, method), 'not removed'
print('ok')
'''


def test_the_route_is_installed_by_the_first_round_and_removable():
    """In a child process: this process's patches would hide the import's."""
    proc = subprocess.run([sys.executable, '-c', FIRST_ROUND], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == 'ok'


class HalfTheTasksBackward(gp_gluoncv.Parallelizable):
    """The task on cpu(0) calls backward; the one on cpu(1) records its
    forward and returns without one."""

    def __init__(self, net):
        self.net = net

    def forward_backward(self, x):
        data, label = x
        data.attach_grad()
        with autograd.record():
            loss = gluon.loss.L2Loss()(self.net(data), label)
        if data.context == mx.cpu(0):
            loss.backward()
        return data


def bn_net(layer, ctx):
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4, in_units=3), layer(in_channels=4), gluon.nn.Dense(2, in_units=4))
    net.initialize(mx.init.Xavier(), ctx=ctx)
    return net


def test_a_task_finishing_without_backward_leaves_the_pass_to_the_others(tmp_path):
    """The pass runs once the task without backward has returned (no wait
    for good); the input gradient is the whole batch's for the one loss."""
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = bn_net(gp.nn.SyncBatchNorm, ctxs)
    ref = bn_net(gluon.nn.BatchNorm, mx.cpu(0))
    net.save_parameters(str(tmp_path / 'p'))
    ref.load_parameters(str(tmp_path / 'p'), ctx=mx.cpu(0))
    rng = np.random.RandomState(0)
    inputs = [(nd.array(rng.randn(r, 3), ctx=c), nd.array(rng.randn(r, 2), ctx=c))
              for c, r in zip(ctxs, (3, 2))]
    with gp_gluoncv.Parallel(2, HalfTheTasksBackward(net), serial_init=False) as parallel:
        for x in inputs:
            parallel.put(x)
        got = {d.context: d for d in (parallel.get(timeout=60) for _ in ctxs)}
    data = nd.concat(*[x.as_in_context(mx.cpu(0)) for x, _ in inputs], dim=0)
    data.attach_grad()
    with autograd.record():
        loss = gluon.loss.L2Loss()(ref(data)[:3], inputs[0][1].as_in_context(mx.cpu(0)))
    loss.backward()
    np.testing.assert_allclose(got[mx.cpu(0)].grad.asnumpy(), data.grad.asnumpy()[:3],
                               rtol=1e-4, atol=1e-6)
    # Through the statistics, cpu(0)'s loss reaches cpu(1)'s rows too.
    np.testing.assert_allclose(got[mx.cpu(1)].grad.asnumpy(), data.grad.asnumpy()[3:],
                               rtol=1e-4, atol=1e-6)
