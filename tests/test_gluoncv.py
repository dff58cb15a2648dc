"""GluonCV drop-in: its losses for networks with auxiliary heads work through
DataParallelLoss exactly as through GluonCV's own DataParallelCriterion
(the reference: GluonCV's code, run on the same CPU contexts), and
``autograd.backward`` of the losses gives the whole-batch gradients of one
device wherever the loss itself is additive over the batch.
"""
import inspect

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

from gluoncv.loss import MixSoftmaxCrossEntropyLoss
from gluoncv.utils import parallel as gluoncv_parallel
from gluoncv.utils.parallel import DataParallelCriterion, DataParallelModel

import gluon_parallel as gp
import seg_loop
from gluon_parallel import gluoncv as gp_gluoncv

CLASSES = 3
CTX4 = [mx.cpu(i) for i in range(4)]


class SegHeads(gluon.HybridBlock):
    """A tiny FCN: per-pixel class scores and an auxiliary head's, as
    GluonCV's segmentation models return them (a tuple)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.body = gluon.nn.Conv2D(6, 3, padding=1, in_channels=2, activation='relu')
            self.head = gluon.nn.Conv2D(CLASSES, 1, in_channels=6)
            self.aux = gluon.nn.Conv2D(CLASSES, 1, in_channels=6)

    def hybrid_forward(self, F, x):
        h = self.body(x)
        return self.head(h), self.aux(h)


def data(batch, seed=0):
    rng = np.random.RandomState(seed)
    x = nd.array(rng.uniform(-1, 1, (batch, 2, 5, 5)))
    y = nd.array(rng.randint(-1, CLASSES, (batch, 5, 5)))    # -1: ignored pixels
    return x, y


def grads(net):
    return {k: sum(g.asnumpy().astype(np.float64) for g in p.list_grad())
            for k, p in net._collect_params_with_prefix().items()}


def assert_grads_close(got, ref):
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybrid'])
@pytest.mark.parametrize('size_average', [True, False])
@pytest.mark.parametrize('num_ctx', [2, 3])
def test_aux_loss_matches_gluoncv_data_parallel_criterion(num_ctx, size_average, hybridize):
    ctx = [mx.cpu(i) for i in range(num_ctx)]
    net = SegHeads()
    net.initialize(mx.init.Xavier(), ctx=ctx)
    loss = MixSoftmaxCrossEntropyLoss(aux=True, size_average=size_average)
    if hybridize:
        net.hybridize()     # returns its tuple as a list (the loss itself cannot hybridize)
    # A batch divisible by the device count: GluonCV puts the remainder of
    # an uneven batch on the last device, we put it on the first ones.
    x, y = data(6 * num_ctx)
    with gp.DataParallel(net, ctx) as dp:
        with autograd.record():
            out = dp(x)
            losses = gp.DataParallelLoss(loss)(out, y)
        autograd.backward(losses)
    ours = grads(net)
    assert all(isinstance(o, (tuple, list)) and len(o) == 2 for o in out)

    # GluonCV's criterion on the very same outputs (it wants tuples).
    theirs = DataParallelCriterion(loss, ctx)([tuple(o) for o in out], y)
    assert len(theirs) == len(losses) == num_ctx
    for a, b in zip(losses, theirs):
        assert a.context == b.context
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-6, atol=1e-7)

    # GluonCV's whole data-parallel step gives the same gradients. With
    # size_average=True its SoftmaxOutput normalises each device's gradient
    # by that device's count of labelled pixels, in GluonCV as here.
    model, criterion = DataParallelModel(net, ctx), DataParallelCriterion(loss, ctx)
    with autograd.record():
        ref_losses = criterion(model(x), y)
    autograd.backward(list(ref_losses))
    assert_grads_close(ours, grads(net))

    if not size_average:
        # An additive loss: the gradients are those of the whole batch on one device.
        single = SegHeads()
        single.initialize(ctx=mx.cpu(0))
        for p_s, p in zip(single.collect_params().values(), net.collect_params().values()):
            p_s.set_data(p.data(ctx[0]).as_in_context(mx.cpu(0)))
        with autograd.record():
            whole = loss(*single(x), y)
        whole.backward()
        np.testing.assert_allclose(gp.gather(losses, mx.cpu(0)).asnumpy(), whole.asnumpy(),
                                   rtol=1e-5, atol=1e-6)
        assert_grads_close(ours, grads(single))


def test_uneven_batch_unpacks_every_replica():
    """7 rows on 3 devices (3, 2, 2): each replica's tuple meets its own targets."""
    ctx = [mx.cpu(i) for i in range(3)]
    net = SegHeads()
    net.initialize(mx.init.Xavier(), ctx=ctx)
    loss = MixSoftmaxCrossEntropyLoss(aux=True, size_average=False)
    x, y = data(7, seed=1)
    with gp.DataParallel(net, ctx) as dp:
        with autograd.record():
            losses = gp.DataParallelLoss(loss)(dp(x), y)
        autograd.backward(losses)
    assert [x.shape[0] for x in losses] == [3, 2, 2]
    ours = grads(net)
    with autograd.record():
        whole = loss(*net(x.as_in_context(ctx[0])), y.as_in_context(ctx[0]))
    whole.backward()
    np.testing.assert_allclose(gp.gather(losses, ctx[0]).asnumpy(), whole.asnumpy(),
                               rtol=1e-5, atol=1e-6)
    ref = {k: p.grad(ctx[0]).asnumpy() for k, p in net._collect_params_with_prefix().items()}
    assert_grads_close(ours, ref)


# ------------------------------------------------- the one-line switch

@pytest.fixture(scope='module')
def seg_values():
    return seg_loop.initial_values()


@pytest.fixture(scope='module')
def gluoncv_seg_run(seg_values):
    return seg_loop.train_and_validate(gluoncv_parallel, seg_values, CTX4)


def test_segmentation_script_switches_by_its_import_line(seg_values, gluoncv_seg_run):
    """GluonCV's segmentation Trainer (FCN with an auxiliary head,
    MixSoftmaxCrossEntropyLoss, SegEvalModel, SegmentationMetric) with only
    the import switched: the same losses, mIoU and weights after two steps
    as with GluonCV's own classes."""
    ours = seg_loop.train_and_validate(gp_gluoncv, seg_values, CTX4)
    ref = gluoncv_seg_run
    assert len(ours['losses']) == len(ref['losses']) == 2
    for a, b in zip(ours['losses'], ref['losses']):
        assert len(a) == len(b) == len(CTX4)
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    assert ours['miou'] == pytest.approx(ref['miou'], rel=1e-6)
    assert ours['pixacc'] == pytest.approx(ref['pixacc'], rel=1e-6)
    for k, copies in ref['weights'].items():
        for x, y in zip(ours['weights'][k], copies):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=k)


def test_segmentation_script_with_our_syncbatchnorm(seg_values, gluoncv_seg_run):
    """The same loop with gluon_parallel's SyncBatchNorm (sync=True, as the
    script passes args.syncbn): it runs, and every device ends with the
    same running statistics."""
    run = seg_loop.train_and_validate(gp_gluoncv, seg_values, CTX4,
                                      norm_layer=gp.nn.SyncBatchNorm,
                                      norm_kwargs={'num_devices': len(CTX4)}, syncbn=True)
    assert all(np.isfinite(x).all() for step in run['losses'] for x in step)
    assert 0 <= run['miou'] <= 1
    stats = [k for k in run['weights'] if k.endswith(('running_mean', 'running_var'))]
    assert stats
    moved = False
    for k in stats:
        first = run['weights'][k][0]
        for other in run['weights'][k][1:]:
            np.testing.assert_array_equal(other, first, err_msg=k)
        moved = moved or not np.array_equal(first, gluoncv_seg_run['weights'][k][0])
    assert moved


def test_dropin_return_structures():
    """A tuple of per-device tuples (even for one output), `.module`, a
    plain callable as the module, GluonCV's handling of one context."""
    net = SegHeads()
    net.initialize(ctx=CTX4)
    model = gp_gluoncv.DataParallelModel(net, CTX4)
    assert model.module is net
    x = nd.ones((8, 2, 5, 5))
    outs = model(x)
    assert isinstance(outs, tuple) and len(outs) == 4
    assert all(isinstance(o, tuple) and len(o) == 2 for o in outs)
    single = gp_gluoncv.DataParallelModel(lambda a: a * 2, CTX4)(x)
    assert all(isinstance(o, tuple) and len(o) == 1 for o in single)
    np.testing.assert_array_equal(single[3][0].asnumpy(), 2 * np.ones((2, 2, 5, 5)))
    assert single[3][0].context == CTX4[3]
    ref = gluoncv_parallel.DataParallelCriterion(lambda a, b: a.sum() + b.sum(), CTX4[:1])
    ours = gp_gluoncv.DataParallelCriterion(lambda a, b: a.sum() + b.sum(), CTX4[:1])
    args = ([(nd.ones(2),)], nd.ones(2))
    assert type(ours(*args)) is type(ref(*args)) is tuple
    assert ours(*args)[0].asscalar() == ref(*args)[0].asscalar()


@pytest.mark.parametrize('make', [
    lambda: gp.DataParallel(gluon.nn.Dense(2), CTX4, True),
    lambda: gp.DataParallelLoss(gluon.loss.L2Loss(), CTX4, True)])
def test_bool_batch_axis_names_sync(make):
    with pytest.raises(TypeError, match='sync'):
        make()


# ------------------------------------------- the rest of gluoncv.utils.parallel

def test_every_public_name_of_gluoncv_utils_parallel():
    public = [n for n in dir(gluoncv_parallel) if not n.startswith('_')
              and callable(getattr(gluoncv_parallel, n))
              and getattr(gluoncv_parallel, n).__module__ == gluoncv_parallel.__name__]
    assert len(public) == 9

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for name in public:
        ours, theirs = getattr(gp_gluoncv, name), getattr(gluoncv_parallel, name)
        if isinstance(theirs, type):
            ours, theirs = ours.__init__, theirs.__init__
        # (ours may add keyword-only arguments after GluonCV's)
        assert [p for p in params(ours) if p[1] != p[1].KEYWORD_ONLY] == params(theirs), name


def structure(obj):
    """The nesting of `obj` with each NDArray as (values, context)."""
    if isinstance(obj, nd.NDArray):
        return ('nd', obj.asnumpy().tolist(), obj.context)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [structure(o) for o in obj])
    if isinstance(obj, dict):
        return ('dict', {k: structure(v) for k, v in obj.items()})
    return obj


@pytest.mark.parametrize('obj', [nd.ones(2), [nd.ones(2), nd.zeros(1)], [], (nd.ones(1),), 3])
def test_tuple_map_as_gluoncv(obj):
    assert structure(gp_gluoncv.tuple_map(obj)) == structure(gluoncv_parallel.tuple_map(obj))


@pytest.mark.parametrize('args,kwargs', [
    ((nd.arange(8).reshape(4, 2), [nd.arange(4), nd.ones((4, 1))], {'a': nd.arange(4)}, 'k'),
     {'w': nd.arange(12).reshape(4, 3), 'n': 3}),
    ((nd.arange(4),), {}),
    ((), {'w': nd.arange(4)}),
    ((5, 'a'), {'n': 1}),
    ((), {}),
], ids=['nested', 'one', 'kwargs-only', 'no-array', 'empty'])
def test_split_load_kwargs_as_gluoncv(args, kwargs):
    ctx = CTX4[:2]
    ours = gp_gluoncv.split_load_kwargs(args, kwargs, ctx)
    theirs = gluoncv_parallel.split_load_kwargs(args, kwargs, ctx)
    assert structure(ours) == structure(theirs)


def _per_device(fn_name, *args, **kwargs):
    return [structure(getattr(m, fn_name)(*args, **kwargs)) for m in (gp_gluoncv, gluoncv_parallel)]


@pytest.mark.parametrize('sync', [False, True])
def test_parallel_apply_and_criterion_as_gluoncv(sync):
    ctx = CTX4[:3]
    net = gluon.nn.Dense(2)
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net(nd.ones((1, 3), ctx=ctx[0]))        # GluonCV's threads cannot finish deferred shapes
    x = nd.array(np.random.RandomState(0).randn(6, 3))
    y = nd.array(np.random.RandomState(1).randn(6, 2))
    per_device, _ = gluoncv_parallel.split_load_kwargs((x, y), {}, ctx)
    inputs, targets = [(a,) for a, _ in per_device], [(b,) for _, b in per_device]
    with autograd.record():
        ours, theirs = _per_device('parallel_apply', net, inputs, sync=sync)
    assert ours == theirs and len(ours[1]) == 3
    outs = gluoncv_parallel.parallel_apply(net, inputs)
    loss = gluon.loss.L2Loss()
    ours, theirs = _per_device('criterion_parallel_apply', loss, outs, targets, sync=sync)
    assert ours == theirs and ours[0] == 'tuple' and len(ours[1]) == 3
    # kwargs per device; a callable that is not a Block; inputs all on one device
    scale = [{'k': 2.0}, {'k': 3.0}]
    ours, theirs = _per_device('parallel_apply', lambda a, k: [a * k, a + k],
                               [(nd.ones(2),), (nd.ones(2),)], scale, sync)
    assert ours == theirs
    with pytest.raises(ValueError, match='2 kwargs dicts for 3'):
        gp_gluoncv.parallel_apply(net, inputs, scale)


def test_parallel_backward_as_gluoncv():
    ctx = CTX4[:2]
    grads_of = {}
    for m in (gp_gluoncv, gluoncv_parallel):
        net = SegHeads(prefix='seg_')
        net.initialize(mx.init.Constant(0.1), ctx=ctx)
        x, y = data(4)
        per_device, _ = gluoncv_parallel.split_load_kwargs((x, y), {}, ctx)
        loss = MixSoftmaxCrossEntropyLoss(aux=True, size_average=False)
        with autograd.record():
            losses = [loss(*net(a), b) for a, b in per_device]
        m.parallel_backward(losses)
        grads_of[m] = grads(net)
    assert_grads_close(grads_of[gp_gluoncv], grads_of[gluoncv_parallel])
