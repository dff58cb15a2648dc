"""gluon_parallel.Trainer's gradient buckets (gluon_parallel/buckets.py):
every device's gradients are views of a few flat arrays, each summed as one
kvstore key, and training gives what gluon.Trainer gives."""
import ctypes
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp

CTX = [mx.cpu(i) for i in range(4)]
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()
SGD = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}


def address(a):
    """The address of an array's first element (``MXNDArrayGetData``)."""
    ptr = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(a.handle, ctypes.byref(ptr)))
    return ptr.value


def mlp(ctx, in_units=8, seed=0):
    """Dense layers (in_units=0: deferred initialisation)."""
    mx.random.seed(seed)
    net = nn.HybridSequential(prefix='mlp_')
    with net.name_scope():
        hidden = 16 if in_units else 0
        net.add(nn.Dense(16, activation='relu', in_units=in_units),
                nn.Dense(16, in_units=hidden), nn.Dense(4, in_units=hidden))
    net.initialize(mx.init.Xavier(), ctx=ctx)
    return net


def batches(count, size=8, seed=1):
    rng = np.random.RandomState(seed)
    return [(nd.array(rng.normal(size=(size, 8))), nd.array(rng.randint(0, 4, size)))
            for _ in range(count)]


def backward(dp, x, y):
    with autograd.record():
        losses = gp.DataParallelLoss(LOSS)(dp(x), y)
    autograd.backward(losses)


def values(net):
    nd.waitall()
    return {k: [d.asnumpy() for d in p.list_data()]
            for k, p in net._collect_params_with_prefix().items()}


def assert_close(got, want, rtol=1e-6):
    assert sorted(got) == sorted(want)
    for k in want:
        for a, b in zip(got[k], want[k]):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max(), err_msg=k)


def assert_as_gluon(loop):
    """loop(gp.Trainer) ends with loop(gluon.Trainer)'s parameters, and
    warns nothing."""
    want = loop(gluon.Trainer)
    with warnings.catch_warnings():
        warnings.simplefilter('error', UserWarning)
        got = loop(gp.Trainer)
    assert_close(got, want)


def gluon_reference(graph='auto'):
    """mlp's parameters after `run` with gluon.Trainer, updates on the devices."""
    net = mlp(CTX)
    net.hybridize()
    return run(net, gluon.Trainer(net.collect_params(), 'sgd', SGD, update_on_kvstore=False),
               graph=graph)


def run(net, trainer, steps=3, graph='auto', size=8):
    with gp.DataParallel(net, CTX, graph=graph) as dp:
        for x, y in batches(steps, size):
            backward(dp, x, y)
            trainer.step(len(x))
    return values(net)


# ---------------------------------------------------------------- layout --

def test_every_devices_gradients_are_views_of_one_flat_array():
    net = mlp(CTX)
    params = net.collect_params()
    trainer = gp.Trainer(params, 'sgd', SGD)
    order = list(params.values())[::-1]         # from the last parameter used back
    for ctx in CTX:
        grads = [p.grad(ctx) for p in order]
        start, offset = address(grads[0]), 0
        for p, g in zip(order, grads):
            assert address(g) == start + offset * 4, p.name
            assert g.shape == p.shape and g.context == ctx
            offset += -(-g.size // 16) * 16     # 64-byte aligned
    # each device's bucket is its own memory
    assert len({address(params[order[0].name].grad(c)) for c in CTX}) == len(CTX)
    del trainer


def test_buckets_group_by_dtype_and_grad_req_and_are_capped():
    """One bucket per (dtype, grad_req) from the last parameter back, cut
    where the next gradient would pass the cap; a gradient larger than the
    cap has its own; row-sparse gradients and frozen parameters stay out."""
    ps = [gluon.Parameter(f'p{i}', shape=shape, dtype=dtype, grad_req=req)
          for i, (shape, dtype, req) in enumerate([
              ((100,), 'float32', 'write'), ((300, 1000), 'float32', 'write'),
              ((200,), 'float16', 'write'), ((100, 50), 'float32', 'add'),
              ((60000,), 'float32', 'write'), ((50,), 'float32', 'null'),
              ((70000,), 'float32', 'write')])]
    ps.append(gluon.Parameter('sparse', shape=(10, 4), grad_stype='row_sparse'))
    for p in ps:
        p.initialize(ctx=CTX[:2])
    trainer = gp.Trainer(ps, 'sgd', SGD, bucket_cap_mb=0.5)
    got = [(str(b.dtype), b.grad_req, [ps[s.index].name for s in b.slots])
           for b in trainer._buckets.layouts]
    assert got == [('float32', 'write', ['p6', 'p4']),
                   ('float32', 'add', ['p3']), ('float16', 'write', ['p2']),
                   ('float32', 'write', ['p1']), ('float32', 'write', ['p0'])]
    assert ps[7].list_grad()[0].stype == 'row_sparse'
    for layout in trainer._buckets.layouts:
        assert layout.size * layout.dtype.itemsize <= 0.5 * 2 ** 20 or len(layout.slots) == 1


def test_mixed_dtypes_and_grad_reqs_sum_and_update_as_gluon():
    """float16 (multi-precision SGD), float32 and float64 gradients, 'write'
    and 'add', written by hand on 4 devices, a tiny cap (several buckets
    per group): every step's parameters are Gluon's."""
    specs = [((30, 7), 'float16', 'write'), ((5,), 'float32', 'write'), ((64, 3), 'float64',
             'write'), ((9,), 'float32', 'add'), ((40, 40), 'float32', 'write'),
             ((11,), 'float16', 'write')]
    rng = np.random.RandomState(3)
    grads = [[rng.normal(size=(4,) + shape) for shape, _, _ in specs] for _ in range(3)]

    def loop(cls):
        ps = [gluon.Parameter(f'p{i}', shape=shape, dtype=dtype, grad_req=req)
              for i, (shape, dtype, req) in enumerate(specs)]
        for p in ps:
            p.initialize(mx.init.Constant(0.5), ctx=CTX)
        kwargs = {'bucket_cap_mb': 0.004} if cls is gp.Trainer else {}
        trainer = cls(ps, 'sgd', dict(SGD, multi_precision=True), update_on_kvstore=False,
                      **kwargs)
        for step in grads:
            for p, g in zip(ps, step):
                for k, ctx in enumerate(CTX):
                    p.grad(ctx)[:] = nd.array(g[k], dtype=p.dtype)
                    p.list_data()[k]._fresh_grad = True
            trainer.step(4)
        nd.waitall()
        return {p.name: [d.asnumpy() for d in p.list_data()] for p in ps}, trainer
    want, _ = loop(gluon.Trainer)
    got, trainer = loop(gp.Trainer)
    assert len(trainer._buckets.layouts) >= 5
    half = {f'p{i}' for i, spec in enumerate(specs) if spec[1] == 'float16'}
    assert_close({k: got[k] for k in half}, {k: want[k] for k in half}, rtol=1e-3)
    assert_close({k: got[k] for k in got if k not in half},
                 {k: want[k] for k in want if k not in half})


@pytest.mark.parametrize('cap', [-1, 'big', float('nan'), float('inf')])
def test_a_bad_cap_is_refused(cap):
    with pytest.raises(ValueError, match='bucket_cap_mb must be'):
        gp.Trainer(mlp(CTX[:2]).collect_params(), 'sgd', SGD, bucket_cap_mb=cap)


def test_buckets_follow_the_order_of_use_not_the_names():
    """The Trainer lists a dict's parameters sorted by name; the buckets are
    filled from the last parameter *used* back (the dict's order, as
    ``collect_params`` lists a network's layers): 'dense10' sorts before
    'dense2' by name but comes last in use, so its gradient, which backward
    writes first, opens the first bucket."""
    net = nn.HybridSequential(prefix='')
    for k in (2, 10):
        net.add(nn.Dense(8, in_units=8, prefix=f'dense{k}_'))
    net.initialize(ctx=CTX[:2])
    params = net.collect_params()
    trainer = gp.Trainer(params, 'sgd', SGD, bucket_cap_mb=320 / 2 ** 20)    # one layer each
    names = [[trainer._params[s.index].name for s in b.slots] for b in trainer._buckets.layouts]
    assert names == [['dense10_bias', 'dense10_weight'], ['dense2_bias', 'dense2_weight']]


@pytest.mark.parametrize('kvstore, count', [('device', 1), ('dist_sync', 3)])
def test_more_and_smaller_buckets_where_the_reduction_crosses_a_link(kvstore, count):
    """Four 0.96 MB layers: on one machine one bucket (25 MB cap); with a
    dist store the first bucket (the last layer's gradients) holds at most
    1 MB, so that its reduction starts early in backward, and the others at
    most max(the gradients / LINK_MIN_BUCKETS, twice the largest gradient):
    two layers here."""
    net = nn.HybridSequential(prefix='big_')
    with net.name_scope():
        for _ in range(4):
            net.add(nn.Dense(500, in_units=500, use_bias=False))    # 0.95 MB each
    net.initialize(ctx=CTX[:2])
    trainer = gp.Trainer(net.collect_params(), 'sgd', SGD, kvstore=kvstore)
    layouts = trainer._buckets.layouts
    names = [[trainer._params[s.index].name for s in layout.slots] for layout in layouts]
    if count == 1:
        assert len(names) == 1 and names[0][0] == 'big_dense3_weight'
    else:
        assert names == [['big_dense3_weight'], ['big_dense2_weight', 'big_dense1_weight'],
                         ['big_dense0_weight']]
        assert layouts[0].size * 4 <= gp.buckets.FIRST_CAP_MB * 2 ** 20


def test_a_small_model_gets_several_buckets_over_a_link():
    """ResNet-20-like sizes (a 1 MB model, 25 MB cap): over a link the caps
    shrink to the gradients / LINK_MIN_BUCKETS, but never below twice the
    largest gradient, so no bucket is a fragment between two large ones."""
    net = nn.HybridSequential(prefix='small_')
    with net.name_scope():
        for _ in range(8):
            net.add(nn.Dense(96, in_units=384, use_bias=False))     # 147 KB each
            net.add(nn.BatchNorm(in_channels=96))
    net.initialize(ctx=CTX[:2])
    trainer = gp.Trainer(net.collect_params(), 'sgd', SGD, kvstore='dist_sync')
    sizes = [layout.size * 4 for layout in trainer._buckets.layouts]
    largest = 96 * 384 * 4
    assert len(sizes) >= 4 and all(size <= 2 * largest + 64 * 8 for size in sizes), sizes
    assert min(sizes) >= largest, sizes


def test_fp16_compression_sums_float16_copies_of_the_buckets():
    """compression='fp16': each device's float32 bucket is summed as a
    float16 copy and cast back (half the bytes on a link). One SGD step
    (lr 1, no momentum or decay) on hand-written gradients gives the weights
    minus the sum of the float16-rounded gradients, within float16's
    rounding of the sum, and not the float32 sum's exact result."""
    rng = np.random.RandomState(0)
    grads = {}
    net = mlp(CTX)
    params = net.collect_params()
    trainer = gp.Trainer(params, 'sgd', {'learning_rate': 1.0}, compression='fp16')
    before = {k: p.data(CTX[0]).asnumpy() for k, p in params.items()}
    for k, p in params.items():
        grads[k] = rng.normal(size=(len(CTX),) + p.shape).astype(np.float32)
        for c, ctx in enumerate(CTX):
            p.grad(ctx)[:] = grads[k][c]
            p.list_data()[c]._fresh_grad = True
    trainer.step(1)
    assert all(b.wire.arrays[0].dtype == np.float16 for b in trainer._buckets.buckets)
    exact_anywhere = False
    for k, p in params.items():
        got = p.data(CTX[0]).asnumpy()
        half = grads[k].astype(np.float16).astype(np.float32).sum(axis=0)
        np.testing.assert_allclose(before[k] - got, half, rtol=0, atol=4e-3 * np.abs(half).max(),
                                   err_msg=k)
        exact_anywhere |= not np.array_equal(before[k] - got, grads[k].sum(axis=0))
        for ctx in CTX[1:]:
            np.testing.assert_array_equal(p.data(ctx).asnumpy(), got)
    assert exact_anywhere


@pytest.mark.parametrize('kwargs, match', [({'compression': 'int8'}, 'compression must be'),
                                           ({'compression': 'fp16', 'bucket_cap_mb': 0},
                                            'needs bucket_cap_mb')])
def test_a_bad_compression_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gp.Trainer(mlp(CTX[:2]).collect_params(), 'sgd', SGD, **kwargs)


def test_no_buckets_with_cap_zero():
    net = mlp(CTX[:2])
    before = [p.list_grad() for p in net.collect_params().values()]
    gp.Trainer(net.collect_params(), 'sgd', SGD, bucket_cap_mb=0)
    assert [p.list_grad() for p in net.collect_params().values()] == before


# -------------------------------------------------------------- the step --

def count_pushpull_keys(monkeypatch):
    """The number of keys of every batched kvstore push/pull from now on."""
    calls, lib = [], mx.base._LIB
    real = lib.MXKVStorePushPull

    def counting(handle, n, *args):
        calls.append(n.value)
        return real(handle, n, *args)
    monkeypatch.setattr(lib, 'MXKVStorePushPull', counting)
    return calls


@pytest.mark.parametrize('graph', [True, False], ids=['graph', 'replicas'])
def test_one_key_per_bucket_and_the_same_training_as_gluon(graph, monkeypatch):
    want = gluon_reference(graph)
    net = mlp(CTX)
    net.hybridize()
    trainer = gp.Trainer(net.collect_params(), 'sgd', SGD)
    calls = count_pushpull_keys(monkeypatch)
    got = run(net, trainer, graph=graph)
    assert len(trainer._buckets.layouts) == 1
    assert calls == [len(CTX)] * 3         # one key, its 4 device arrays, per step
    assert_close(got, want)


def test_row_sparse_gradients_stay_out_and_the_dense_ones_share_a_bucket(monkeypatch):
    """Embedding(sparse_grad=True) and Dense on 2 devices: the embedding's
    row-sparse gradient stays Gluon's (pushed and pulled by Gluon's code),
    the dense layer's two gradients are one bucket summed as one key; the
    parameters are Gluon's Trainer's."""
    def loop(cls):
        mx.random.seed(0)
        net = nn.HybridSequential(prefix='sparse_')
        with net.name_scope():
            net.add(nn.Embedding(20, 8, sparse_grad=True), nn.Dense(4, in_units=8))
        net.initialize(mx.init.Xavier(), ctx=CTX[:2])
        trainer = cls(net.collect_params(), 'sgd', SGD, update_on_kvstore=False)
        rng = np.random.RandomState(0)
        for _ in range(3):
            x, y = nd.array(rng.randint(0, 20, (8, 1))), nd.array(rng.randint(0, 4, 8))
            with autograd.record():
                losses = [LOSS(net(a), b) for a, b in zip(gluon.utils.split_and_load(x, CTX[:2]),
                                                          gluon.utils.split_and_load(y, CTX[:2]))]
            autograd.backward(losses)
            trainer.step(len(x))
        assert net[0].weight.list_grad()[0].stype == 'row_sparse'
        return values(net)
    want = loop(gluon.Trainer)
    calls = count_pushpull_keys(monkeypatch)
    got = loop(gp.Trainer)
    assert calls == [2] * 3             # one key (the bucket), its 2 devices' arrays
    assert_close(got, want)


def test_deferred_parameters_get_buckets_before_graph_mode_binds():
    """in_units left to the first call: DataParallel's first call makes the
    buckets after the deferred initialisation and before the executor binds
    the gradients, so graph mode binds once (a rebind would mean it first
    bound the arrays the buckets replaced)."""
    net = mlp(CTX, in_units=0)
    net.hybridize()
    trainer = gp.Trainer(net.collect_params(), 'sgd', SGD)
    assert trainer._buckets.buckets == []
    with gp.DataParallel(net, CTX, graph=True) as dp:
        with warnings.catch_warnings():
            warnings.simplefilter('error', UserWarning)
            for x, y in batches(3):
                backward(dp, x, y)
                trainer.step(len(x))
        assert dp.graph_mode.binds == 1
    assert len(trainer._buckets.buckets) == 1


def test_graph_mode_rebinds_gradients_the_buckets_replaced():
    """An executor bound before the Trainer existed wrote Gluon's arrays:
    after the buckets replace them, graph mode binds the views (its cache
    key has the ids of the gradient lists) and training is exact."""
    want = gluon_reference(graph=True)
    net = mlp(CTX)
    net.hybridize()
    with gp.DataParallel(net, CTX, graph=True) as dp:
        x, y = batches(1)[0]
        backward(dp, x, y)          # bound to Gluon's gradient arrays
        net.collect_params().zero_grad()
        trainer = gp.Trainer(net.collect_params(), 'sgd', SGD)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')     # (the first executor holds the old arrays)
            for x, y in batches(3):
                backward(dp, x, y)
                trainer.step(len(x))
        assert dp.graph_mode.binds == 2
    assert_close(values(net), want)


def test_buckets_made_at_the_first_step_keep_the_gradients():
    """A plain Gluon loop with deferred parameters: the first step puts the
    gradients (already computed) in buckets, values kept; no warning for
    arrays taken after backward and dropped by the next step."""
    def loop(cls):
        net = mlp(CTX[:2], in_units=0)
        trainer = cls(net.collect_params(), 'sgd', SGD, update_on_kvstore=False)
        for x, y in batches(3):
            xs = gluon.utils.split_and_load(x, CTX[:2])
            ys = gluon.utils.split_and_load(y, CTX[:2])
            with autograd.record():
                losses = [LOSS(net(a), b) for a, b in zip(xs, ys)]
            autograd.backward(losses)
            grads = [p.grad(c) for p in net.collect_params().values() for c in CTX[:2]]
            gluon.utils.clip_global_norm(grads, 0.5)
            trainer.step(len(x))
        return values(net)
    assert_as_gluon(loop)


@pytest.mark.parametrize('taken', ['array', 'list'])
def test_a_gradient_taken_before_the_buckets_is_reported(taken):
    net = mlp(CTX[:2])
    p = net[0].weight
    old = p.grad(CTX[1]) if taken == 'array' else p.list_grad()
    trainer = gp.Trainer(net.collect_params(), 'sgd', SGD)
    with gp.DataParallel(net, CTX[:2]) as dp:
        x, y = batches(1)[0]
        backward(dp, x, y)
        with pytest.warns(UserWarning, match=f'{p.name} taken before gluon_parallel.Trainer put '
                                             'the gradients in buckets'):
            trainer.step(len(x))
        backward(dp, x, y)
        with warnings.catch_warnings():
            warnings.simplefilter('error', UserWarning)      # once
            trainer.step(len(x))
    assert old is not None


def test_new_gradient_arrays_go_in_new_buckets(monkeypatch):
    """reset_ctx and grad_req changes give parameters new arrays: summed on
    their own until the next step makes new buckets; training stays exact;
    the other parameters keep their views."""
    def changes(net, trainer, step):
        if kept is not None and step in (1, 2, 3):
            kept.append(net[2].weight.list_grad())
        if step == 1:
            net[1].weight.grad_req = 'null'
            net[1].bias.grad_req = 'null'
        if step == 2:
            net[0].collect_params().setattr('grad_req', 'add')
        if step == 3:
            net.collect_params().reset_ctx(CTX)

    def loop(cls):
        net = mlp(CTX)
        trainer = cls(net.collect_params(), 'sgd', SGD, update_on_kvstore=False)
        with gp.DataParallel(net, CTX) as dp:
            for s, (x, y) in enumerate(batches(5)):
                changes(net, trainer, s)
                backward(dp, x, y)
                trainer.step(len(x))
                net.collect_params().zero_grad()
        return values(net), trainer
    kept = None
    want, _ = loop(gluon.Trainer)
    kept = []
    got, trainer = loop(gp.Trainer)
    assert_close(got, want)
    assert kept[0] is kept[1] is kept[2]        # (steps 1 and 2 changed other parameters)
    layouts = trainer._buckets.layouts
    assert [(b.grad_req, len(b.slots)) for b in layouts] == [('write', 2), ('add', 2)]


def test_graph_mode_after_a_grad_req_change_keeps_training_silently():
    """Freezing a layer gives its parameters Gluon's new arrays, which graph
    mode binds at the next call and the next step puts in new buckets: no
    warning (those arrays are not ones the user took before the buckets),
    and the result of Gluon's Trainer."""
    def loop(cls):
        net = mlp(CTX)
        net.hybridize()
        trainer = cls(net.collect_params(), 'sgd', SGD, update_on_kvstore=False)
        with gp.DataParallel(net, CTX, graph=True) as dp:
            for s, (x, y) in enumerate(batches(5)):
                if s == 2:
                    net[1].collect_params().setattr('grad_req', 'null')
                if s == 3:
                    net[1].collect_params().setattr('grad_req', 'write')
                backward(dp, x, y)
                trainer.step(len(x))
        return values(net)
    assert_as_gluon(loop)


def test_accumulation_with_add_and_write_in_separate_buckets():
    """grad_req 'add' on some parameters, zero_grad between steps."""
    def loop(cls):
        net = mlp(CTX)
        net[0].collect_params().setattr('grad_req', 'add')
        trainer = cls(net.collect_params(), 'sgd', SGD, update_on_kvstore=False)
        with gp.DataParallel(net, CTX) as dp:
            for s, (x, y) in enumerate(batches(6)):
                backward(dp, x, y)
                if s % 2:
                    trainer.step(2 * len(x))
                    net.collect_params().zero_grad()
        return values(net), trainer
    want, _ = loop(gluon.Trainer)
    got, trainer = loop(gp.Trainer)
    assert sorted(b.grad_req for b in trainer._buckets.layouts) == ['add', 'write']
    assert_close(got, want)


def test_clip_global_norm_between_allreduce_and_update():
    def loop(cls):
        net = mlp(CTX)
        trainer = cls(net.collect_params(), 'sgd', SGD, update_on_kvstore=False)
        with gp.DataParallel(net, CTX) as dp:
            for x, y in batches(3):
                backward(dp, x, y)
                trainer.allreduce_grads()
                for c in CTX:
                    gluon.utils.clip_global_norm(
                        [p.grad(c) for p in net.collect_params().values()], 0.1)
                trainer.update(len(x))
        return values(net)
    assert_as_gluon(loop)


class Branch(gluon.HybridBlock):
    """`extra` is used while `use` is True (a branch a step may skip)."""

    def __init__(self):
        super().__init__(prefix='branch_')
        with self.name_scope():
            self.body = nn.Dense(4, in_units=8)
            self.extra = nn.Dense(4, in_units=4)
            self.use = True

    def hybrid_forward(self, F, x):
        h = self.body(x)
        return self.extra(h) if self.use else h


def test_idle_devices_and_unused_parameters_with_gp_step():
    """A short batch (idle devices' gradients count zero) and a parameter
    no replica used (gp.step hides it: not updated; it stays in its bucket)."""
    def loop(cls):
        mx.random.seed(0)
        net = Branch()
        net.initialize(mx.init.Xavier(), ctx=CTX)
        trainer = cls(net.collect_params(), 'sgd', SGD, update_on_kvstore=False)
        with gp.DataParallel(net, CTX) as dp:
            for (x, y), use, rows in zip(batches(4), (True, False, True, False), (8, 3, 2, 8)):
                net.use = use
                backward(dp, x[:rows], y[:rows])
                gp.step(trainer, rows, ignore_stale_grad=True)
        return values(net)
    assert_as_gluon(loop)


@pytest.mark.parametrize('grad_req', ['write', 'add'])
def test_a_hidden_parameter_keeps_its_gradients(grad_req):
    """gp.step hides a parameter no replica used from the Trainer: as with
    gluon.Trainer, its gradient arrays keep what the last backward that
    reached it wrote (they are not summed over the devices with the rest
    of their bucket, which would multiply them by the device count at
    every step), its weights are not updated, and when it is used again
    the step is Gluon's."""
    def loop(cls):
        mx.random.seed(0)
        net = Branch()
        net.initialize(mx.init.Xavier(), ctx=CTX)
        net.collect_params().setattr('grad_req', grad_req)
        trainer = cls(net.collect_params(), 'sgd', SGD, update_on_kvstore=False)
        seen = []
        with gp.DataParallel(net, CTX) as dp:
            for (x, y), use in zip(batches(5), (True, False, False, False, True)):
                net.use = use
                backward(dp, x, y)
                gp.step(trainer, len(x), ignore_stale_grad=True)
                nd.waitall()
                seen.append({k: [g.asnumpy() for g in p.list_grad()]
                             for k, p in net._collect_params_with_prefix().items()})
        return seen, values(net)
    (want, want_values), (got, got_values) = loop(gluon.Trainer), loop(gp.Trainer)
    for step, (a, b) in enumerate(zip(want, got)):
        for k in a:
            for u, v in zip(a[k], b[k]):
                np.testing.assert_allclose(v, u, rtol=1e-6, err_msg=f'step {step:d}, {k}')
    assert_close(got_values, want_values)


def test_idle_devices_gradients_are_zeroed_a_bucket_at_a_time(monkeypatch):
    """A batch of 2 rows on 4 devices: the idle devices' gradients are
    zeroed whole buckets at a time (not parameter by parameter) and marked
    fresh, so the step sums zeros for them."""
    from gluon_parallel import grads
    per_parameter = []
    real = grads.count_as_zero
    monkeypatch.setattr(grads, 'count_as_zero',
                        lambda p, copies: per_parameter.append(p.name) or real(p, copies))
    net = mlp(CTX)
    net[0].weight.grad_req = 'add'              # (accumulating: kept, not zeroed)
    gp.Trainer(net.collect_params(), 'sgd', SGD)
    for p in net.collect_params().values():
        for g in p.list_grad():
            g[:] = 7
    x, y = batches(1)[0]
    with gp.DataParallel(net, CTX) as dp:
        backward(dp, x[:2], y[:2])
    assert per_parameter == [net[0].weight.name]
    for p in net.collect_params().values():
        for ctx, d in zip(CTX[2:], p.list_data()[2:]):
            want = 7 if p is net[0].weight else 0
            assert (p.grad(ctx).asnumpy() == want).all(), (p.name, ctx)
            assert d._fresh_grad


# ----------------------------------------------------------------- MKL-DNN --

class ConvNet(nn.HybridBlock):
    """Convolution, BatchNorm and Dense: the MKL-DNN kernels that write
    weight gradients (MXNet's CPU build uses MKL-DNN for all three)."""

    def __init__(self):
        super().__init__(prefix='convnet_')
        with self.name_scope():
            self.conv = nn.Conv2D(8, 3, padding=1, in_channels=3)
            self.bn = nn.BatchNorm(in_channels=8)
            self.conv2 = nn.Conv2D(4, 3, in_channels=8)
            self.dense = nn.Dense(5, in_units=4 * 6 * 6)

    def hybrid_forward(self, F, x):
        return self.dense(F.relu(self.conv2(F.relu(self.bn(self.conv(x))))))


@pytest.mark.parametrize('graph', [True, False], ids=['graph', 'replicas'])
def test_mkldnn_kernels_write_weight_gradients_into_views(graph):
    """One backward's gradients through bucket views equal those through
    Gluon's own arrays (bucket_cap_mb=0), bit for bit, on every device."""
    assert mx.runtime.Features().is_enabled('MKLDNN')
    rng = np.random.RandomState(0)
    x = nd.array(rng.normal(size=(8, 3, 8, 8)))
    y = nd.array(rng.randint(0, 5, 8))

    def grads(cap):
        mx.random.seed(0)
        net = ConvNet()
        net.initialize(mx.init.Xavier(), ctx=CTX)
        net.hybridize(static_alloc=True, static_shape=True)
        trainer = gp.Trainer(net.collect_params(), 'sgd', SGD, bucket_cap_mb=cap)
        with gp.DataParallel(net, CTX, graph=graph) as dp:
            for _ in range(2):
                backward(dp, x, y)
            ran_graph = dp.graph_mode is not None and dp.graph_mode.binds > 0
        nd.waitall()
        return ({p.name: [g.asnumpy() for g in p.list_grad()]
                 for p in net.collect_params().values() if p.grad_req != 'null'},
                trainer, ran_graph)
    want, _, _ = grads(0)
    got, trainer, ran_graph = grads(25)
    assert ran_graph == graph
    assert len(trainer._buckets.layouts) == 1
    names = {p.name for p in trainer._params if p.grad_req != 'null'}
    assert sorted(got) == sorted(want) and names == set(want) and len(names) == 8
    for k in want:
        for a, b in zip(got[k], want[k]):
            np.testing.assert_array_equal(a, b, err_msg=k)
