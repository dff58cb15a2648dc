"""Graph-mode loss (gluon_parallel/graph/loss_executor.py): DataParallelLoss on the
outputs of a graph-mode call runs as one more executor. Every test compares
against the per-replica path (DataParallel(graph=False), whose loss runs
replica by replica in Gluon) and checks which path ran, so a comparison
cannot pass by both sides falling back."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp
import loops

CTX = loops.CTX
SCE = gluon.loss.SoftmaxCrossEntropyLoss


class TwoHeads(nn.HybridBlock):
    """A network with an auxiliary head: outputs (pred, aux)."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.body = nn.Dense(8, activation='relu', in_units=6)
            self.head = nn.Dense(3, in_units=8)
            self.aux = nn.Dense(3, in_units=8)

    def hybrid_forward(self, F, x):
        h = self.body(x)
        return self.head(h), self.aux(h)


class AuxLoss(gluon.loss.Loss):
    """GluonCV-style: loss(pred, aux, label), the auxiliary head weighted."""

    def __init__(self, aux_weight=0.4):
        super().__init__(None, 0)
        self.sce, self.aux_weight = SCE(), aux_weight

    def hybrid_forward(self, F, pred, aux, label):
        return self.sce(pred, label) + self.aux_weight * self.sce(aux, label)


class MainOnly(gluon.loss.Loss):
    """loss(pred, aux, label) that ignores the auxiliary head."""

    def __init__(self):
        super().__init__(None, 0)
        self.sce = SCE()

    def hybrid_forward(self, F, pred, aux, label):
        return self.sce(pred, label)


class Counted(SCE):
    """SoftmaxCrossEntropyLoss that counts its imperative calls."""

    def __init__(self):
        super().__init__()
        self.imperative = 0

    def hybrid_forward(self, F, pred, label):
        self.imperative += F is nd
        return super().hybrid_forward(F, pred, label)


class ShapeReading(gluon.loss.Loss):
    """A loss that reads a shape (NDArrays only): it cannot be traced."""

    def __init__(self):
        super().__init__(None, 0)

    def hybrid_forward(self, F, pred, label):
        return F.mean(F.square(pred - label.reshape((pred.shape[0], 1))), axis=1)


class Weighted(gluon.loss.Loss):
    """A loss with a trainable parameter (runs per replica)."""

    def __init__(self):
        super().__init__(None, 0)
        with self.name_scope():
            self.w = self.params.get('w', shape=(1,), init=mx.init.One())

    def hybrid_forward(self, F, pred, label, w):
        return F.broadcast_mul(SCE()(pred, label), w)


def weighted():
    loss = Weighted()
    loss.initialize(ctx=CTX)
    return loss


def dense_net(heads=False):
    mx.random.seed(1)
    net = TwoHeads() if heads else nn.HybridSequential()
    if not heads:
        net.add(nn.Dense(8, activation='relu', in_units=6), nn.Dense(3, in_units=8))
    net.initialize(mx.init.Xavier(), ctx=CTX)
    net.hybridize()
    return net


def train(graph, sizes, loss, ctx=CTX, heads=False, extra=None, retain=False):
    """SGD steps of batches of `sizes` rows through DataParallelLoss(loss):
    (every step's losses, every context's parameters, the DataParallelLoss).
    `extra(outputs, losses)`: more heads for the backward pass."""
    net = dense_net(heads)
    for p in net.collect_params().values():
        p.reset_ctx(ctx)
    dp = gp.DataParallel(net, ctx, graph=graph)
    dpl = gp.DataParallelLoss(loss)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    rng = np.random.RandomState(5)
    seen = []
    for b in sizes:
        x, y = nd.array(rng.normal(size=(b, 6))), nd.array(rng.randint(0, 3, b))
        with autograd.record():
            out = dp(x)
            losses = dpl(out, y)
            more = extra(out, losses) if extra else []
        autograd.backward(losses + more, retain_graph=retain)
        if retain:
            autograd.backward(losses + more)
        trainer.step(b)
        seen.append([x.asnumpy() for x in losses])
    params = {name: [p.data(c).asnumpy() for c in ctx]
              for name, p in net._collect_params_with_prefix().items()}
    return seen, params, dpl


def assert_same(ref, got):
    for step, (a, b) in enumerate(zip(ref[0], got[0])):
        assert len(a) == len(b)
        for r, (x, y) in enumerate(zip(a, b)):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6,
                                       err_msg=f'loss of replica {r:d}, step {step:d}')
    for name in ref[1]:
        for r, (x, y) in enumerate(zip(ref[1][name], got[1][name])):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6,
                                       err_msg=f'{name} on context {r:d}')


def both(sizes, loss_fn, **kw):
    """train() per replica and in graph mode; returns graph mode's
    DataParallelLoss."""
    ref = train(False, sizes, loss_fn(), **kw)
    got = train(True, sizes, loss_fn(), **kw)
    assert ref[2].graph_loss.binds == 0
    assert_same(ref, got)
    return got[2]


@pytest.mark.parametrize('n, sizes', [(1, [8, 8]), (2, [8, 7]), (4, [8, 7, 8]),
                                      (4, [3, 2, 9])])
def test_equals_the_per_replica_loss(n, sizes):
    """1, 2 and 4 devices; even, uneven and short batches (fewer devices):
    one loss executor per signature."""
    dpl = both(sizes, SCE, ctx=CTX[:n])
    assert dpl.graph_loss.binds == len(set(sizes))


def test_the_loss_runs_as_one_graph():
    """Traced once per replica; no imperative call of the loss afterwards."""
    loss = Counted()
    _, _, dpl = train(True, [8, 8, 8], loss)
    assert loss.imperative == 0 and dpl.graph_loss.binds == 1


def test_auxiliary_heads_and_an_ignored_output():
    """loss(pred, aux, label) of a two-output network; a loss that ignores
    the auxiliary head leaves its gradient zero, as autograd does."""
    assert both([8, 7], AuxLoss, heads=True).graph_loss.binds == 2
    assert both([8, 7], MainOnly, heads=True).graph_loss.binds == 2


def test_outputs_also_used_outside_the_loss():
    """A regulariser on the raw outputs adds to the loss's gradient."""
    dpl = both([8, 7], SCE, extra=lambda out, losses: [0.1 * (o * o).sum() for o in out])
    assert dpl.graph_loss.binds == 2


def test_a_second_loss_on_the_same_outputs():
    """The second loss runs per replica; the gradients add."""
    second = gp.DataParallelLoss(gluon.loss.L2Loss())
    dpl = both([8], SCE, extra=lambda out, losses: second(out, nd.ones((8, 3))))
    assert dpl.graph_loss.binds == 1 and second.graph_loss.binds == 0


def test_backward_twice_with_retain_graph():
    assert both([8, 8], SCE, retain=True).graph_loss.binds == 1


def test_a_loss_that_cannot_be_traced_or_has_parameters_runs_per_replica():
    assert both([8], ShapeReading).graph_loss.binds == 0
    assert both([8], weighted).graph_loss.binds == 0


def test_outside_record_and_with_sync():
    net = dense_net()
    dp = gp.DataParallel(net, CTX, graph=True)
    x, y = nd.random.uniform(shape=(8, 6)), nd.ones(8)
    ref = [x.asnumpy() for x in gp.DataParallelLoss(SCE())(dp(x), y)]
    dpl = gp.DataParallelLoss(SCE(), sync=True)
    with autograd.record():
        got = [out.asnumpy() for out in dpl(dp(x), y)]
    assert dpl.graph_loss.binds == 1
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, rtol=1e-6)


def test_targets_of_the_wrong_batch_size_raise_as_per_replica():
    dp = gp.DataParallel(dense_net(), CTX, graph=True)
    dpl = gp.DataParallelLoss(SCE())
    with autograd.record():
        out = dp(nd.ones((8, 6)))
        with pytest.raises(ValueError, match='target rows'):
            dpl(out, nd.ones(6))
        with pytest.raises(ValueError, match='split into 3 slices'):
            dpl(out, nd.ones(3))
    assert dpl.graph_loss.binds == 0


def test_backward_through_a_given_up_call_raises():
    """More recorded calls with a loss than graph mode keeps executors for:
    a backward reaching the oldest loss raises; the newest is exact."""
    from gluon_parallel.graph import calls
    dp = gp.DataParallel(dense_net(), CTX, graph=True)
    dpl = gp.DataParallelLoss(SCE())
    x, y = nd.random.uniform(shape=(8, 6)), nd.ones(8)
    with autograd.record():
        losses = [dpl(dp(x), y) for _ in range(calls.MAX_PENDING + 1)]
    with pytest.raises(RuntimeError, match='has reused'):
        autograd.backward(losses[0])
    autograd.backward(losses[-1])
    got = [p.grad(CTX[1]).asnumpy() for p in dp.block.collect_params().values()]
    net = dense_net()
    dp2 = gp.DataParallel(net, CTX, graph=False)
    with autograd.record():
        autograd.backward(gp.DataParallelLoss(SCE())(dp2(x), y))
    for a, b in zip([p.grad(CTX[1]).asnumpy() for p in net.collect_params().values()], got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_a_backward_over_some_replicas_losses():
    """A step over every replica's loss, then one over replica 0's: replica
    0's gradients equal the per-replica path's, the others' are zeros (the
    loss's unused head gradients reset, not left at the first step's)."""
    x, y = nd.random.uniform(shape=(8, 6)), nd.array(np.arange(8) % 3)
    grads = []
    for graph in (False, True):
        net = dense_net()
        dp = gp.DataParallel(net, CTX, graph=graph)
        dpl = gp.DataParallelLoss(SCE())
        for used in (4, 1):
            with autograd.record():
                losses = dpl(dp(x), y)
            autograd.backward(losses[:used])
        assert dpl.graph_loss.binds == (1 if graph else 0)
        grads.append([p.list_grad() for p in net.collect_params().values()])
    for ref, got in zip(*grads):
        np.testing.assert_allclose(got[0].asnumpy(), ref[0].asnumpy(), rtol=1e-5, atol=1e-6)
        for g in got[1:]:
            assert not g.asnumpy().any()


def test_loss_executors_are_freed_with_the_network_executors():
    """One loss executor per network executor, dropped when graph mode drops
    that executor (its signature evicted, its arena re-based, or close())."""
    dp = gp.DataParallel(dense_net(), CTX, graph=True)
    dpl = gp.DataParallelLoss(SCE())
    sizes = range(5 + dp.graph_mode.cache_size + 2, 4, -1)      # the largest first
    for b in sizes:
        with autograd.record():
            losses = dpl(dp(nd.ones((b, 6))), nd.ones(b))
        autograd.backward(losses)
    assert dpl.graph_loss.binds == len(sizes)
    assert len(dpl.graph_loss.arenas.executors()) == dp.graph_mode.cache_size
    with autograd.record():                 # a larger batch re-bases the network's arena
        losses = dpl(dp(nd.ones((sizes[0] + 1, 6))), nd.ones(sizes[0] + 1))
    autograd.backward(losses)
    assert len(dpl.graph_loss.arenas.executors()) == 1
    dp.close()
    assert len(dpl.graph_loss.arenas.executors()) == 0


def test_a_loss_with_forward_hooks_runs_per_replica():
    """Hooks run once per replica, as without graph mode."""
    loss = SCE()
    ref = train(False, [8], loss)
    seen = []
    loss.register_forward_hook(lambda block, inputs, output: seen.append(output.context))
    got = train(True, [8], loss)
    assert seen == CTX and got[2].graph_loss.binds == 0
    assert_same(ref, got)


def test_two_calls_with_their_losses_then_one_backward():
    """Two recorded calls of one signature, each with its graph-mode loss
    (two network executors, two loss executors), one backward over both."""
    x1, x2 = nd.random.uniform(shape=(8, 6)), nd.random.uniform(shape=(8, 6))
    y1, y2 = nd.array(np.arange(8) % 3), nd.array(np.arange(8) % 2)
    grads = []
    for graph in (False, True):
        net = dense_net()
        dp = gp.DataParallel(net, CTX, graph=graph)
        dpl = gp.DataParallelLoss(SCE())
        with autograd.record():
            losses = dpl(dp(x1), y1) + dpl(dp(x2), y2)
        autograd.backward(losses)
        assert dpl.graph_loss.binds == (2 if graph else 0)
        grads.append([g.asnumpy() for p in net.collect_params().values() for g in p.list_grad()])
    for a, b in zip(*grads):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.fixture
def mxnet_passes():
    """Counts MXNet's own backward passes (``MXAutogradBackwardEx`` under
    graph mode's hook, which the next graph-mode call installs again)."""
    from gluon_parallel import _gluon
    _gluon.remove_after_backward()
    lib, seen = mx.base._LIB, []
    original = lib.MXAutogradBackwardEx

    def counted(*args):
        seen.append(args[0])
        return original(*args)
    lib.MXAutogradBackwardEx = counted
    yield seen
    _gluon.remove_after_backward()
    lib.MXAutogradBackwardEx = original


def test_a_backward_from_the_losses_alone_skips_autograds_pass(mxnet_passes):
    """autograd.backward(losses) on graph-mode losses, whose gradients are
    ones: graph mode writes them itself and MXNet's pass does not run. Head
    gradients given, and a backward over replica 0's loss only, in between:
    every step's gradients equal the per-replica path's, also after the
    caller wrote into the losses' gradient buffers (the ones are written
    every pass), and the losses' gradients are MXNet's; MXNet's pass runs
    once."""
    x, y = nd.random.uniform(shape=(8, 6)), nd.array(np.arange(8) % 3)
    def full(losses):
        autograd.backward(losses)

    def given(losses):                          # MXNet's pass: the heads get 2
        autograd.backward(losses, head_grads=[2 * nd.ones_like(v) for v in losses])

    def first(losses):                          # replica 0's loss (the others' heads: 0)
        losses[0].backward()

    def scribbled(losses):                      # the buffers of ones written over
        autograd.backward(losses)
        for v in losses:
            if v.grad is not None:              # (graph mode's losses are variables)
                v.grad[:] = 5

    steps = [full, first, full, given, full, full, scribbled, full, scribbled, first, full]
    grads, passes = [], []
    for graph in (False, True):
        net = dense_net()
        dp = gp.DataParallel(net, CTX, graph=graph)
        dpl = gp.DataParallelLoss(SCE())
        grads.append([])
        del mxnet_passes[:]
        for backward in steps:
            with autograd.record():
                losses = dpl(dp(x), y)
            backward(losses)
            grads[-1].append([[g.asnumpy() for g in p.list_grad()]
                              for p in net.collect_params().values()])
            if graph and backward is not scribbled:     # the losses' own gradients, as MXNet's
                head = 2 if backward is given else 1
                for v in losses[:1] if backward is first else losses:
                    assert (v.grad.asnumpy() == head).all()
        passes.append(len(mxnet_passes))
        assert dpl.graph_loss.binds == (1 if graph else 0)
    assert passes == [len(steps), 1]            # graph mode: the head gradients' step
    for step, (ref, got) in enumerate(zip(*grads)):
        for a, b in zip(ref, got):
            used = a[:1] if steps[step] is first else a     # (the others' stay stale)
            for r, (u, v) in enumerate(zip(used, b)):
                np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-6,
                                           err_msg=f'step {step:d}, replica {r:d}')


class Columns(gluon.loss.Loss):
    """A loss of (classes, rows) predictions and (1, rows) targets: its
    batch on axis 1, so graph mode splits the targets (no whole copy)."""

    def __init__(self):
        super().__init__(None, 1)

    def hybrid_forward(self, F, pred, label):
        return F.mean(F.square(F.broadcast_sub(pred, label)), axis=0)


def _columns_losses(graph):
    """One recorded step of a network whose outputs have their batch on
    axis 1 through DataParallelLoss(Columns, batch_axis=1): every replica's
    losses and the DataParallelLoss."""
    mx.random.seed(1)
    net = nn.HybridSequential()
    net.add(nn.Dense(3, in_units=6), nn.HybridLambda(lambda F, x: F.transpose(x)))
    net.initialize(mx.init.Xavier(), ctx=CTX)
    net.hybridize()
    dp = gp.DataParallel(net, CTX, graph=graph)
    dpl = gp.DataParallelLoss(Columns(), batch_axis=1)
    rng = np.random.RandomState(3)
    x, y = nd.array(rng.normal(size=(8, 6))), nd.array(rng.normal(size=(1, 8)))
    with autograd.record():
        losses = dpl(dp(x), y)
    autograd.backward(losses)
    return [loss.asnumpy() for loss in losses], dpl


def _count_splits(monkeypatch, shape):
    """Count every call of the package's split functions on arrays of
    `shape` (the targets', not the network's inputs'), wherever a module
    imported them."""
    import sys
    calls = []
    for name in ('split_ndarrays', 'split_load_kwargs'):
        real = getattr(gp.split, name)

        def counted(inputs, *args, real=real, name=name, **kwargs):
            if any(getattr(a, 'shape', None) == shape for a in inputs):
                calls.append(name)
            return real(inputs, *args, **kwargs)
        for module in list(sys.modules.values()):
            if getattr(module, '__name__', '').startswith('gluon_parallel') \
                    and getattr(module, name, None) is real:
                monkeypatch.setattr(module, name, counted)
    return calls


def test_targets_are_split_once_when_the_graph_loss_declines_after_splitting(monkeypatch):
    """The graph-mode loss splits the targets, then declines (its executor
    does not bind): the per-replica path takes the same slices."""
    ref, _ = _columns_losses(False)
    calls = _count_splits(monkeypatch, (1, 8))
    _, dpl = _columns_losses(True)
    assert dpl.graph_loss.binds == 1 and calls == ['split_ndarrays']       # graph mode's

    import gluon_parallel.graph.loss_executor as graph_loss

    def refuse(*args, **kwargs):
        raise mx.MXNetError('does not bind')
    monkeypatch.setattr(graph_loss, 'bind_loss', refuse)
    del calls[:]
    got, dpl = _columns_losses(True)
    assert dpl.graph_loss.binds == 0 and calls == ['split_ndarrays'], calls
    for r, (a, b) in enumerate(zip(ref, got)):
        np.testing.assert_allclose(b, a, rtol=1e-6, err_msg=f'replica {r:d}')
