"""data_parallel.py: DataParallel.

Every numeric check compares against an independent reference: a separate
plain Gluon network on one context holding the same initial values, applied
to the whole batch.
"""
import gc
import threading
import traceback

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

from gluon_parallel import (DataParallel, DataParallelLoss, current_replica, gather,
                            parallel_apply, split_sizes)
from replicas import (IN_UNITS, ReplicaBoom, assert_close, batch, fresh_deferred_mlp, make_mlp,
                      new_mlp, reference_copy)

pytestmark = pytest.mark.usefixtures('both_thread_modes')

# ---------------------------------------------------------------- outputs

@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybrid'])
@pytest.mark.parametrize('batch_size', [8, 7, 3, 1])
def test_outputs_equal_the_block_on_the_whole_batch(ctx_list, batch_size, hybridize):
    net, ref = new_mlp(ctx_list, hybridize)
    x, _ = batch(batch_size, seed=batch_size)
    expected = ref(x)
    with DataParallel(net, ctx_list) as dp:
        for _ in range(2):          # the first call (graphs built) and a later one
            out = dp(x)
            assert isinstance(out, list)
            assert len(out) == min(batch_size, len(ctx_list))
            assert [o.context for o in out] == ctx_list[:len(out)]
            assert [o.shape[0] for o in out] == split_sizes(batch_size, len(ctx_list))
            assert_close(gather(out), expected)


def test_hybridize_through_the_wrapper_keeps_outputs(ctx_list):
    net, ref = new_mlp(ctx_list, hybridize=False)
    x, _ = batch(7, seed=1)
    with DataParallel(net, ctx_list) as dp:
        imperative = gather(dp(x))
        dp.hybridize()
        hybrid = gather(dp(x))
    assert_close(imperative, ref(x))
    assert_close(hybrid, imperative)
    # hybridizing the block itself after the wrapper's first call: the next
    # (first hybrid) call must still be done safely
    for _ in range(3):
        net, ref = new_mlp(ctx_list, hybridize=False)
        with DataParallel(net, ctx_list) as dp:
            dp(x)
            net.hybridize()
            assert_close(gather(dp(x)), ref(x))


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybrid'])
def test_deferred_initialisation_on_the_first_concurrent_call(ctx_list, hybridize):
    # Fresh networks each time: the race of several threads finishing
    # deferred initialisation / building graphs is intermittent.
    for trial in range(5):
        net = fresh_deferred_mlp(ctx_list, hybridize)
        x, y = batch(7, seed=trial)
        with DataParallel(net, ctx_list) as dp:
            with autograd.record():
                out = dp(x)
            autograd.backward(out)
        for p in net.collect_params().values():
            values = [d.asnumpy() for d in p.list_data()]
            assert len(values) == len(ctx_list) and p.shape[-1] > 0
            for v in values[1:]:
                np.testing.assert_array_equal(v, values[0])
        ref = reference_copy(net, make_mlp, ctx_list[0])
        assert_close(gather(out), ref(x))


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybrid'])
def test_first_calls_from_two_caller_threads(hybridize):
    # Two threads making the first call of one DataParallel at once: one
    # finishes deferred initialisation / builds the graph, the other waits.
    ctx_list = [mx.cpu(i) for i in range(2)]
    for trial in range(8):
        net = fresh_deferred_mlp(ctx_list, hybridize)
        x, _ = batch(6, seed=trial)
        with DataParallel(net, ctx_list) as dp:
            outs, errors, start = {}, [], threading.Barrier(2, timeout=30)

            def caller(k, start, dp, x, outs, errors):
                try:
                    start.wait()
                    outs[k] = gather(dp(x)).asnumpy()
                except BaseException as e:      # reported below
                    errors.append(e)
            threads = [threading.Thread(target=caller, args=(k, start, dp, x, outs, errors))
                       for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors
            ref = reference_copy(net, make_mlp, ctx_list[0])
            for k in range(2):
                assert_close(outs[k], ref(x))


def test_batch_axis_other_than_zero(ctx_list):
    # time-major input (T, B, C) split along B; Dense acts on the last axis
    def factory():
        return gluon.nn.Dense(3, flatten=False, in_units=IN_UNITS)
    net = factory()
    net.initialize(mx.init.Xavier(), ctx=ctx_list)
    ref = reference_copy(net, factory, ctx_list[0])
    x = nd.random.uniform(shape=(4, 7, IN_UNITS))
    with DataParallel(net, ctx_list, batch_axis=1) as dp:
        out = dp(x)
    assert [o.shape for o in out] == [(4, s, 3) for s in split_sizes(7, len(ctx_list))]
    assert_close(gather(out, batch_axis=1), ref(x))


class MaskedDense(gluon.Block):
    """A plain Block whose forward takes array and non-array kwargs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(3, in_units=IN_UNITS)
        self.seen = []

    def forward(self, x, mask=None, scale=1.0, tag=None, extra=None):
        self.seen.append((x.context, tag))     # list.append is atomic
        y = self.dense(x) * scale
        if mask is not None:
            y = nd.broadcast_mul(y, mask.reshape((-1, 1)))
        if extra is not None:
            y = y + extra['bias'] * extra['weight']
        return y


def test_plain_block_with_forward_kwargs(ctx_list):
    net = MaskedDense()
    net.initialize(mx.init.Xavier(), ctx=ctx_list)
    ref = reference_copy(net, MaskedDense, ctx_list[0])
    x, _ = batch(7, seed=3)
    mask = nd.arange(7)                      # distinct rows: misalignment shows
    bias = nd.random.uniform(shape=(7, 1))
    tag = object()
    # Gluon 1.x Block.__call__ takes no kwargs: call forward on the reference
    expected = ref.forward(x, mask=mask, scale=2.0, tag=tag,
                           extra={'bias': bias, 'weight': 3})
    n = min(7, len(ctx_list))
    with DataParallel(net, ctx_list) as dp:
        out = dp(x, mask=mask, scale=2.0, tag=tag, extra={'bias': bias, 'weight': 3})
        assert_close(gather(out), expected)
        assert sorted(net.seen, key=lambda s: s[0].device_id) == [(c, tag) for c in
                                                                  ctx_list[:n]]
        # every argument by keyword, numpy included
        out = dp(x=x.asnumpy(), mask=mask.asnumpy(), scale=2.0, tag=tag,
                 extra={'bias': bias, 'weight': 3})
        assert_close(gather(out), expected)


class DictOut(gluon.HybridBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(3, in_units=IN_UNITS)

    def forward(self, x):
        return {'logits': self.dense(x), 'double': x * 2, 'name': 'fixed'}


def test_dict_outputs(ctx_list):
    net = DictOut()
    net.initialize(mx.init.Xavier(), ctx=ctx_list)
    ref = reference_copy(net, DictOut, ctx_list[0])
    x, _ = batch(6, seed=4)
    with DataParallel(net, ctx_list) as dp:
        out = dp(x)
    assert all(isinstance(o, dict) for o in out)
    whole = gather(out)
    expected = ref(x)
    assert list(whole) == ['logits', 'double', 'name'] and whole['name'] == 'fixed'
    assert_close(whole['logits'], expected['logits'])
    assert_close(whole['double'], x * 2)


def test_default_context_and_invalid_calls():
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    with pytest.warns(UserWarning, match='no ctx_list given'):
        dp = DataParallel(net)              # no GPU here: [mx.cpu()]
    with dp:
        assert dp.ctx_list == [mx.cpu()]
        assert_close(gather(dp(nd.ones((2, 3)))), net(nd.ones((2, 3))))
        with pytest.raises(ValueError):     # empty batch
            dp(nd.array(np.zeros((0, 3))))
        with pytest.raises(ValueError):     # disagreeing batch dimensions
            dp(nd.ones((2, 3)), nd.ones((3, 3)))
    with pytest.raises(ValueError):
        DataParallel(net, [mx.cpu(0), mx.cpu(0)])
    with pytest.raises(TypeError):
        DataParallel(lambda x: x, [mx.cpu(0)])


# -------------------------------------------------------------- gradients

@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybrid'])
@pytest.mark.parametrize('batch_size', [8, 7, 3])
def test_gradients_equal_single_device_gradients(ctx_list, batch_size, hybridize):
    net, ref = new_mlp(ctx_list, hybridize)
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    dpl = DataParallelLoss(loss)
    with DataParallel(net, ctx_list) as dp:
        # A full batch first leaves a gradient on every device; a smaller
        # batch afterwards must not let those stale gradients into the sum.
        x0, y0 = batch(8, seed=10)
        with autograd.record():
            autograd.backward(dpl(dp(x0), y0))
        x, y = batch(batch_size, seed=batch_size)
        with autograd.record():
            losses = dpl(dp(x), y)
        assert len(losses) == min(batch_size, len(ctx_list))
        assert [x.context for x in losses] == ctx_list[:len(losses)]
        autograd.backward(losses)

    with autograd.record():
        ref_loss = loss(ref(x), y)
        total = ref_loss.sum()
    total.backward()
    assert_close(gather(losses), ref_loss)
    for p, p_ref in zip(net.collect_params().values(), ref.collect_params().values()):
        summed = sum(g.asnumpy() for g in p.list_grad())
        assert_close(summed, p_ref.grad(), atol=1e-5)


def test_sync_true(ctx_list):
    net, ref = new_mlp(ctx_list, hybridize=True)
    x, y = batch(7, seed=7)
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    with DataParallel(net, ctx_list, sync=True) as dp:
        with autograd.record():
            out = dp(x)
            losses = DataParallelLoss(loss, ctx_list=ctx_list, sync=True)(out, y)
        autograd.backward(losses)
    assert_close(gather(out), ref(x))
    assert_close(gather(losses), loss(ref(x), y))


# ----------------------------------------------------- autograd in replicas

class StateProbe(gluon.Block):
    """Returns, per row, (is_recording, is_training) as seen in the replica."""

    def forward(self, x):
        state = [float(autograd.is_recording()), float(autograd.is_training())]
        return nd.array([state] * x.shape[0], ctx=x.context)


AUTOGRAD_CASES = [
    ('plain', lambda: _Nested(), (0, 0)),
    ('record', lambda: _Nested(autograd.record()), (1, 1)),
    ('record_predict', lambda: _Nested(autograd.record(train_mode=False)), (1, 0)),
    ('train_mode', lambda: _Nested(autograd.train_mode()), (0, 1)),
    ('record_then_predict_mode', lambda: _Nested(autograd.record(), autograd.predict_mode()),
     (1, 0)),
    ('pause', lambda: _Nested(autograd.record(), autograd.pause()), (0, 0)),
    ('pause_train', lambda: _Nested(autograd.record(), autograd.pause(train_mode=True)),
     (0, 1)),
]


class _Nested:
    """Enter several context managers, outermost first."""

    def __init__(self, *managers):
        self.managers = managers

    def __enter__(self):
        for m in self.managers:
            m.__enter__()

    def __exit__(self, *exc):
        for m in reversed(self.managers):
            m.__exit__(*exc)


def test_caller_autograd_state_holds_in_every_replica(ctx_list):
    with DataParallel(StateProbe(), ctx_list) as dp:
        # twice through, so a worker cannot pass by keeping an earlier state
        for name, make, expected in AUTOGRAD_CASES * 2:
            with make():
                out = dp(nd.ones((len(ctx_list) * 2, 1)))
            assert len(out) == len(ctx_list)
            for i, o in enumerate(out):
                assert tuple(o.asnumpy()[0]) == expected, (name, ctx_list[i])


def test_dropout_follows_the_caller_mode(ctx_list):
    n = len(ctx_list)
    x = nd.ones((2 * n, 500))
    with DataParallel(gluon.nn.Dropout(0.5), ctx_list) as dp:
        for make, active in [(lambda: autograd.train_mode(), True),
                             (lambda: autograd.record(), True),
                             (lambda: autograd.predict_mode(), False),
                             (lambda: _Nested(autograd.record(), autograd.pause()), False),
                             (lambda: _Nested(), False)]:
            with make():
                out = dp(x)
            for i, o in enumerate(out):
                dropped = int((o == 0).sum().asscalar())
                assert (dropped > 0) == active, (ctx_list[i], active)


def test_batchnorm_uses_batch_statistics_in_train_mode(ctx_list):
    # train_mode() outside record(): BatchNorm normalises each slice with
    # its own statistics, so every slice has mean 0 per channel.
    bn = gluon.nn.BatchNorm(in_channels=3)
    bn.initialize(ctx=ctx_list)
    x = nd.random.uniform(5, 10, shape=(4 * len(ctx_list), 3))
    with DataParallel(bn, ctx_list) as dp:
        with autograd.train_mode():
            train = dp(x)
        predict = dp(x)
    for o in train:
        assert_close(o.mean(axis=0), np.zeros(3), atol=1e-4)
    for o in predict:                       # running stats: mean 0, var 1
        assert o.mean().asscalar() > 4


# --------------------------------------------------------------- failures

class Interrupt(BaseException):
    """Like KeyboardInterrupt: not an Exception subclass."""


class FailOn(gluon.Block):
    """Raises on one context only, after the other replicas are waiting for
    it at a rendezvous: they must be released, not left blocked."""

    def __init__(self, exc_type, **kwargs):
        super().__init__(**kwargs)
        self.exc_type = exc_type
        self.fail_ctx = None

    def forward(self, x):
        replica = current_replica()
        state = replica.next_state('failon', lambda *v: list(v))
        if x.context == self.fail_ctx:
            self.explode_here(x)
        state.pull(state.push(x.shape[0], replica.rank))
        return x * 2

    def explode_here(self, x):
        raise self.exc_type(f'bad input on {x.context}')


@pytest.mark.parametrize('exc_type', [ValueError, ReplicaBoom, KeyError, Interrupt,
                                      KeyboardInterrupt])
def test_exception_in_one_replica_reaches_the_caller(ctx_list, exc_type):
    n = len(ctx_list)
    bad = ctx_list[min(2, n - 1)]          # the 3rd context when there is one
    block = FailOn(exc_type)
    x = nd.arange(2 * n).reshape((2 * n, 1))
    with DataParallel(block, ctx_list) as dp:
        assert_close(gather(dp(x)), x * 2)
        threads = set(threading.enumerate())
        block.fail_ctx = bad
        for _ in range(2):                  # and again: the pool recovered
            with pytest.raises(exc_type) as info:
                dp(x)
            assert type(info.value) is exc_type
            text = ''.join(traceback.format_exception(info.value))
            assert str(bad) in text
            if exc_type is not KeyError:    # KeyError's str() is the repr of its arg
                assert str(bad) in str(info.value)
            assert 'explode_here' in text   # the replica's own raising frame
            assert "raise self.exc_type(f'bad input on {x.context}')" in text
            assert set(threading.enumerate()) == threads
            assert all(t.is_alive() for t in threads)
            block.fail_ctx = None
            # every replica must reach the rendezvous again for this to work
            assert_close(gather(dp(x)), x * 2)
            block.fail_ctx = bad


@pytest.mark.parametrize('exc_type', [ValueError, Interrupt])
def test_exception_in_the_first_replica_releases_the_others(exc_type):
    # replica 0 runs in the calling thread; the workers wait for it
    ctx_list = [mx.cpu(i) for i in range(4)]
    block = FailOn(exc_type)
    x = nd.ones((8, 1))
    with DataParallel(block, ctx_list) as dp:
        block.fail_ctx = ctx_list[0]
        with pytest.raises(exc_type, match=r'cpu\(0\)'):
            dp(x)
        block.fail_ctx = None
        assert_close(gather(dp(x)), x * 2)


# ------------------------------------------------------ threads, lifecycle

def test_thread_count_is_constant_over_100_calls(ctx_list):
    net, _ = new_mlp(ctx_list, hybridize=True)
    x, y = batch(7, seed=8)
    dpl = DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    gc.collect()        # pools other tests dropped must not die mid-loop
    gc.disable()
    try:
        before = set(threading.enumerate())
        dp = DataParallel(net, ctx_list)
        created = set(threading.enumerate()) - before
        assert len(created) <= len(ctx_list)
        threads = set(threading.enumerate())
        count = threading.active_count()
        for i in range(100):
            with autograd.record():
                losses = dpl(dp(x[:1 + i % 7]), y[:1 + i % 7])
            autograd.backward(losses)
            assert threading.active_count() == count, i
        assert set(threading.enumerate()) == threads
        dp.close()
    finally:
        gc.enable()
    assert not any(t.is_alive() for t in created)


def test_auto_mode_creates_threads_only_for_a_block_that_synchronises():
    from gluon_parallel.nn import SyncBatchNorm
    ctx_list = [mx.cpu(i) for i in range(4)]
    x = nd.array(np.random.RandomState(3).uniform(size=(8, 3)))
    gc.collect()
    before = set(threading.enumerate())
    plain = gluon.nn.Dense(2, in_units=3)
    plain.initialize(ctx=ctx_list)
    with DataParallel(plain, ctx_list, threads='auto') as dp:
        for _ in range(3):
            dp(x)
        assert set(threading.enumerate()) == before      # issued by the caller
    sync = gluon.nn.Sequential()
    sync.add(gluon.nn.Dense(3, in_units=3), SyncBatchNorm(in_channels=3))
    sync.initialize(ctx=ctx_list)
    ref = gluon.nn.Sequential()
    ref.add(gluon.nn.Dense(3, in_units=3), gluon.nn.BatchNorm(in_channels=3))
    ref.initialize(ctx=mx.cpu(0))
    for p_ref, p in zip(ref.collect_params().values(), sync.collect_params().values()):
        p_ref.set_data(p.data(ctx_list[0]))
    with DataParallel(sync, ctx_list, threads='auto') as dp:
        with autograd.record():                          # batch statistics
            out = dp(x)
        created = set(threading.enumerate()) - before
        assert len(created) == 3                         # made when replica 0 waited
        with autograd.record():
            expected = ref(x)
        assert_close(gather(out), expected)
        with autograd.record():
            dp(x)
        assert set(threading.enumerate()) - before == created    # reused
    assert not any(t.is_alive() for t in created)


@pytest.mark.parametrize('bad', ['yes', False, 1, None])
def test_bad_threads_argument(bad):
    net = gluon.nn.Dense(2, in_units=3)
    with pytest.raises(ValueError, match='threads'):
        DataParallel(net, [mx.cpu(0)], threads=bad)
    with pytest.raises(ValueError, match='threads'):
        parallel_apply(lambda x: x, [nd.ones(1)], threads=bad)


def test_close_and_context_manager(ctx_list):
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize(ctx=ctx_list)
    x = nd.ones((4, 3))
    before = set(threading.enumerate())
    dp = DataParallel(net, ctx_list)
    created = set(threading.enumerate()) - before
    dp(x)
    dp.close()
    assert not any(t.is_alive() for t in created)
    with pytest.raises(RuntimeError):
        dp(x)
    dp.close()                                      # idempotent

    before = set(threading.enumerate())
    with DataParallel(net, ctx_list) as dp2:
        created = set(threading.enumerate()) - before
        dp2(x)
    assert not any(t.is_alive() for t in created)
    with pytest.raises(RuntimeError):
        dp2(x)


def test_block_and_ctx_list_are_read_only(ctx_list):
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize(ctx=ctx_list)
    other = gluon.nn.Dense(2, in_units=3)
    with DataParallel(net, ctx_list) as dp:
        assert dp.block is net
        assert dp.ctx_list == ctx_list
        for name, value in [('block', other), ('block', None), ('ctx_list', [mx.cpu(5)])]:
            with pytest.raises(AttributeError):
                setattr(dp, name, value)
        dp.ctx_list.append(mx.cpu(7))               # a copy: no effect on dp
        assert dp.block is net and dp.ctx_list == ctx_list
        # the refused assignment left nothing behind
        assert set(dp.collect_params()) == set(net.collect_params())
        assert len(dp(nd.ones((4, 3)))) == min(4, len(ctx_list))


# ---------------------------------------------------------------------------
# First-call sanity checks

CTX = [mx.cpu(i) for i in range(4)]


class _MovesInput(gluon.Block):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(2, in_units=3)

    def forward(self, x):
        return self.dense(x.as_in_context(mx.cpu(0)))


def test_first_call_names_misplaced_outputs_and_parameters():
    net = _MovesInput()
    net.initialize(ctx=CTX[:2])
    with DataParallel(net, CTX[:2]) as dp:
        with pytest.raises(ValueError, match=r'replica 1 .*cpu\(0\).*cpu\(1\)'):
            dp(nd.ones((4, 3)))
    plain = gluon.nn.Dense(2, in_units=3)
    plain.initialize(ctx=CTX[:2])
    with DataParallel(plain, CTX[:3]) as dp:
        with pytest.raises(ValueError, match=r'weight is not on context cpu\(2\)'):
            dp(nd.ones((4, 3)))
