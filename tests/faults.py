"""Planted faults: a network whose forward, barrier operation, loss or
backward raises on a chosen device, and the rig that checks a failing step
is reported promptly and the next step is clean (bit for bit).
"""
import threading
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import gluon_parallel as gp
from gluon_parallel.nn import SyncBatchNorm
from gluon_parallel.syncgraph import rendezvous as sbn_rendezvous

BOUND = 15.0          # seconds a failing call may take to report


def cpus(n):
    return [mx.cpu(i) for i in range(n)]


class Planted(BaseException):
    """A KeyboardInterrupt-like failure: not an Exception subclass."""


class Plan:
    """Where the next failure goes: stage, context, exception type."""
    stage = ctx = exc = None

    @classmethod
    def arm(cls, stage, ctx, exc):
        cls.stage, cls.ctx, cls.exc = stage, ctx, exc

    @classmethod
    def disarm(cls):
        cls.stage = cls.ctx = cls.exc = None

    @classmethod
    def fire(cls, stage, ctx):
        if cls.stage == stage and (cls.ctx is None or cls.ctx == ctx):
            raise cls.exc(f'planted at {stage}')


class FailPoint(gluon.HybridBlock):
    def __init__(self, stage, **kwargs):
        super().__init__(**kwargs)
        self.stage = stage

    def hybrid_forward(self, F, x):
        Plan.fire(self.stage, x.context)
        return x


class BackwardFail(autograd.Function):
    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def forward(self, x):
        return x * 1

    def backward(self, dy):
        Plan.fire('backward', self.ctx)
        return dy


class BackwardPoint(gluon.Block):
    def forward(self, x):
        return BackwardFail(x.context)(x)


def probe_net(ctxs, bn=SyncBatchNorm):
    net = gluon.nn.Sequential()
    net.add(FailPoint('before'), gluon.nn.Dense(6, in_units=4, flatten=False),
            bn(in_channels=6, axis=-1), FailPoint('between'),
            bn(in_channels=6, axis=-1), FailPoint('after'), BackwardPoint())
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    return net


def planted_loss(out, label):
    Plan.fire('loss', out.context)
    return ((out.sum(axis=-1) - label) ** 2)


def run_step(dp, dl, net, ctxs, x, y):
    with autograd.record():
        losses = dl(dp(x), y)
    autograd.backward(losses)
    nd.waitall()
    out = [x.asnumpy() for x in losses]
    grads = {k: [p.grad(c).asnumpy() for c in ctxs]
             for k, p in net.collect_params().items() if p.grad_req != 'null'}
    return out, grads


def assert_next_step_clean(rig):
    """The rig's next step equals its clean one, bit for bit."""
    n, ctxs, net, dp, dl, x, y, clean = rig
    out, grads = run_step(dp, dl, net, ctxs, x, y)
    for a, b in zip(out, clean[0]):
        np.testing.assert_array_equal(a, b)
    for k in grads:
        for a, b in zip(grads[k], clean[1][k]):
            np.testing.assert_array_equal(a, b)


def make_rig(n, bn, build=probe_net):
    """The network build(ctxs, bn) in a DataParallel, and one clean step."""
    ctxs = cpus(n)
    mx.random.seed(0)
    net = build(ctxs, bn)
    dp = gp.DataParallel(net, ctxs, timeout=60)
    dl = gp.DataParallelLoss(planted_loss)
    rng = np.random.RandomState(0)
    x = rng.randn(2 * n + 1, 3, 4).astype('float32')    # uneven slices
    y = rng.randn(2 * n + 1, 3).astype('float32')
    clean = run_step(dp, dl, net, ctxs, x, y)
    yield n, ctxs, net, dp, dl, x, y, clean
    dp.close()


STAGES = ['before', 'op', 'between', 'after', 'loss', 'backward']
# A BaseException in an autograd.Function's backward is swallowed by MXNet's
# ctypes callback (measured: no error at all), so backward gets Exception only.
MATRIX = [(stage, which, exc) for stage in STAGES for which in ('first', 'middle', 'last')
          for exc in (ValueError, Planted) if not (stage == 'backward' and exc is Planted)]


def planted_failure(rig, stage, which, exc, monkeypatch, capfd):
    n, ctxs, net, dp, dl, x, y, clean = rig
    k = {'first': 0, 'middle': n // 2, 'last': n - 1}[which]
    threads = threading.active_count()
    if stage == 'op':
        # The operation of SyncBatchNorm's barrier (run once per round).
        real = sbn_rendezvous._gather

        def failing_gather(*pushed):
            Plan.fire('op', None)
            return real(*pushed)
        monkeypatch.setattr(sbn_rendezvous, '_gather', failing_gather)
        Plan.arm('op', None, exc)
    else:
        Plan.arm(stage, ctxs[k], exc)
    start = time.monotonic()
    try:
        if stage == 'backward':
            # MXNet runs a Function's backward itself: it prints the original
            # exception and raises MXNetError when the gradient is read.
            with pytest.raises(mx.base.MXNetError):
                run_step(dp, dl, net, ctxs, x, y)
            assert 'planted at backward' in ''.join(capfd.readouterr())
        else:
            with pytest.raises(exc, match=f'planted at {stage}') as info:
                run_step(dp, dl, net, ctxs, x, y)
            text = str(info.value)
            if stage == 'op':
                assert 'cpu(' in text
            else:
                assert f'on {ctxs[k]}' in text, text
    finally:
        Plan.disarm()
        monkeypatch.undo()
    assert time.monotonic() - start < BOUND
    assert_next_step_clean(rig)
    # Workers that overran the grace period are replaced; allow them to exit.
    # (Fewer threads than before is no leak: workers of DataParallels that
    # earlier tests dropped without close() stop whenever the garbage
    # collector reaches them, which may be during this test.)
    deadline = time.monotonic() + 5
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads
    assert all(t.is_alive() for t in dp._replicas.pool.threads)
