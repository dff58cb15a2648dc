"""Keyword arguments and a block's own __call__, on every path
(_gluon/blocks.py: call_with_kwargs, cached_graph_inputs): the call
reaches the block as ``block(*args, **kwargs)`` on one device would, and
graph mode runs it as one graph where the call hands its graph the
arguments it was given. GluonNLP's own models: tests/test_nlp.py."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp
from gluon_parallel import gluoncv as gp_gluoncv

CTX = [mx.cpu(i) for i in range(3)]
B = 7                   # uneven over 3 devices: 3, 2, 2


class KeywordNet(nn.HybridBlock):
    """GluonNLP's shape: ``__call__`` takes keywords and hands them to
    Block.__call__ positionally, None where not given."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = nn.Dense(4, in_units=5)
            self.scale = nn.Dense(4, in_units=2)

    def __call__(self, x, mask=None, weight=None):
        return super().__call__(x, mask, weight)

    def hybrid_forward(self, F, x, mask=None, weight=None):
        out = self.dense(x)
        if mask is not None:
            out = F.broadcast_mul(out, F.expand_dims(mask, axis=1))
        if weight is not None:
            out = out + self.scale(weight)
        return out


class SwappingNet(nn.HybridBlock):
    """A ``__call__`` that reorders its positional arguments: the graph's
    inputs are not the call's."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = nn.Dense(3, in_units=2)

    def __call__(self, a, b):
        return super().__call__(b, a)

    def hybrid_forward(self, F, x, y):
        return F.broadcast_add(self.dense(x) * 2, F.sum(y, axis=1, keepdims=True))


class ComputingNet(KeywordNet):
    """A ``__call__`` that computes an input of its graph."""

    def __call__(self, x, mask=None, weight=None):
        return super().__call__(x, mask * 2, weight)


def _inputs(seed=0):
    rng = np.random.RandomState(seed)
    return (nd.array(rng.randn(B, 5)), nd.array(rng.rand(B) > 0.3),
            nd.array(rng.randn(B, 2)))


def _pair(cls, hybridize):
    """The network on every context, and its copy on one context."""
    mx.random.seed(0)
    net = cls()
    net.initialize(mx.init.Xavier(), ctx=CTX)
    ref = cls()
    ref.initialize(ctx=mx.cpu(0))
    for p, q in zip(net.collect_params().values(), ref.collect_params().values()):
        q.set_data(p.data(CTX[0]))
    if hybridize:
        net.hybridize()
        ref.hybridize()
    return net, ref


def _grads(block, ctx):
    return [p.grad(ctx).asnumpy() for p in block.collect_params().values()]


def _step(block, call, ctx_list):
    """The outputs (gathered) and the summed gradients of one recorded call."""
    with autograd.record():
        outs = call()
        outs = outs if isinstance(outs, list) else [outs]
        losses = [o.sum() for o in outs]
    autograd.backward(losses)
    grads = [sum(g) for g in zip(*(_grads(block, c) for c in ctx_list))]
    return gp.gather(outs, ctx=mx.cpu(0)).asnumpy(), grads


@pytest.mark.parametrize('hybridize', [True, False], ids=['hybridized', 'imperative'])
@pytest.mark.parametrize('given', ['mask', 'mask+weight', 'weight', 'none'])
def test_keywords_reach_the_blocks_own_call(hybridize, given):
    x, mask, weight = _inputs()
    kwargs = {'mask': mask, 'weight': weight}
    kwargs = {k: v for k, v in kwargs.items() if k in given}
    net, ref = _pair(KeywordNet, hybridize)
    dp = gp.DataParallel(net, CTX)
    out, grads = _step(net, lambda: dp(x, **kwargs), CTX)
    assert dp.last_path == ('graph' if hybridize else 'replicas')
    ref_out, ref_grads = _step(ref, lambda: ref(x, **kwargs), [mx.cpu(0)])
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_keyword_calls_in_graph_mode_with_none_patterns_and_sizes():
    """Calls of one graph with its keywords in any order, batches of any
    size; a call whose None inputs differ from the graph's is Gluon's
    ValueError on one device and here."""
    x, mask, weight = _inputs()
    net, ref = _pair(KeywordNet, True)
    dp = gp.DataParallel(net, CTX, graph=True)
    for rows in (7, 4, 2, 7):
        got = gp.gather(dp(x[:rows], weight=weight[:rows], mask=mask[:rows]), ctx=mx.cpu(0))
        want = ref(x[:rows], mask=mask[:rows], weight=weight[:rows])
        np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match='argument structure') as one_device:
        ref(x, mask=mask)
    dp_auto = gp.DataParallel(net, CTX)
    with pytest.raises(type(one_device.value), match=r'argument structure.*replica \d'):
        dp_auto(x, mask=mask)
    np.testing.assert_allclose(gp.gather(dp(x, mask=mask, weight=weight), ctx=mx.cpu(0))
                               .asnumpy(), ref(x, mask, weight).asnumpy(), rtol=1e-5, atol=1e-6)


def test_a_call_that_reorders_its_arguments_runs_as_the_block_runs():
    rng = np.random.RandomState(1)
    a, b = nd.array(rng.randn(B, 4)), nd.array(rng.randn(B, 2))
    net, ref = _pair(SwappingNet, True)
    dp = gp.DataParallel(net, CTX)
    out, grads = _step(net, lambda: dp(a, b), CTX)
    assert dp.last_path == 'graph'
    ref_out, ref_grads = _step(ref, lambda: ref(a, b), [mx.cpu(0)])
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_a_call_that_computes_its_graphs_inputs_runs_per_replica():
    x, mask, weight = _inputs()
    net, ref = _pair(ComputingNet, True)
    dp = gp.DataParallel(net, CTX)
    out, _ = _step(net, lambda: dp(x, mask=mask), CTX)
    assert dp.last_path == 'replicas'
    np.testing.assert_allclose(out, ref(x, mask=mask).asnumpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match='computes inputs of its graph'):
        gp.DataParallel(net, CTX, graph=True)(x, mask=mask)


def test_forward_hooks_run_as_gluon_runs_them():
    x, mask, _ = _inputs()
    net, ref = _pair(KeywordNet, True)
    seen = []
    net.register_forward_pre_hook(lambda b, args: seen.append(len(args)))
    net.register_forward_hook(lambda b, args, out: seen.append(out.shape[0]))
    dp = gp.DataParallel(net, CTX)
    dp(x, mask=mask)                    # (its first call's warm-up runs them too)
    seen.clear()
    dp(x, mask=mask)
    # Block.__call__ runs them with the positional arguments __call__ hands it
    assert sorted(seen) == sorted([3, 3, 3, 3, 2, 2])
    assert dp.last_path == 'replicas'


@pytest.mark.parametrize('hybridize', [True, False], ids=['hybridized', 'imperative'])
def test_bad_keyword_calls_raise_as_one_device_does_and_the_next_call_works(hybridize):
    x, mask, weight = _inputs()
    net, ref = _pair(KeywordNet, hybridize)
    dp = gp.DataParallel(net, CTX)
    with pytest.raises(ValueError, match='batch dimension') as info:
        dp(x, mask=mask[:5])
    assert 'mask' in str(info.value)
    with pytest.raises(TypeError) as one_device:
        ref(x, colour=mask)
    with pytest.raises(TypeError, match=r'colour.*replica 0') as info:
        dp(x, colour=mask)
    assert str(one_device.value) in str(info.value)
    with pytest.raises(TypeError, match=r'multiple values.*replica 0'):
        dp(x, mask, mask=mask)
    got = gp.gather(dp(x, mask=mask, weight=weight), ctx=mx.cpu(0))
    np.testing.assert_allclose(got.asnumpy(), ref(x, mask=mask, weight=weight).asnumpy(),
                               rtol=1e-5, atol=1e-6)
    assert dp.last_path == ('graph' if hybridize else 'replicas')


def test_parallel_apply_and_gluoncv_drop_in_call_the_blocks_own_call():
    x, mask, weight = _inputs()
    net, ref = _pair(KeywordNet, True)
    want = ref(x, mask=mask, weight=weight).asnumpy()
    args, kwargs = gp.split_load_kwargs((x,), {'mask': mask, 'weight': weight}, CTX)
    outs = gp.parallel_apply(net, args, kwargs, ctx_list=CTX)
    np.testing.assert_allclose(gp.gather(outs, ctx=mx.cpu(0)).asnumpy(), want, rtol=1e-5,
                               atol=1e-6)
    model = gp_gluoncv.DataParallelModel(net, CTX)
    outs = model(x, mask=mask, weight=weight)          # GluonCV's: a tuple per device
    np.testing.assert_allclose(gp.gather([o[0] for o in outs], ctx=mx.cpu(0)).asnumpy(), want,
                               rtol=1e-5, atol=1e-6)
    outs = gp_gluoncv.parallel_apply(net, args, kwargs)
    np.testing.assert_allclose(gp.gather([o[0] for o in outs], ctx=mx.cpu(0)).asnumpy(), want,
                               rtol=1e-5, atol=1e-6)


class KeywordLoss(gluon.Block):
    """A loss whose forward takes a keyword (Block.__call__ takes none)."""

    def forward(self, pred, label, weight=None):
        loss = (pred.sum(axis=1) - label) ** 2
        return loss if weight is None else loss * weight


def test_data_parallel_loss_gives_a_block_loss_its_keywords():
    x, mask, weight = _inputs()
    label, w = nd.arange(B), nd.array(np.linspace(0.5, 1.5, B))
    net, ref = _pair(KeywordNet, True)
    dp, dpl = gp.DataParallel(net, CTX), gp.DataParallelLoss(KeywordLoss())
    losses = dpl(dp(x, mask=mask), label, weight=w)
    want = KeywordLoss().forward(ref(x, mask=mask), label, weight=w)
    np.testing.assert_allclose(gp.gather(losses, ctx=mx.cpu(0)).asnumpy(), want.asnumpy(),
                               rtol=1e-5, atol=1e-5)


def test_the_probe_leaves_the_block_as_it_was():
    """cached_graph_inputs' stand-in is gone after the call, whatever
    happened, and another thread's call of the block runs meanwhile."""
    from gluon_parallel import _gluon
    x, mask, weight = _inputs()
    net, ref = _pair(KeywordNet, True)
    ref(x, mask=mask, weight=weight)                     # its graph built
    inputs = _gluon.cached_graph_inputs(ref, (x,), {'weight': weight})
    assert inputs[0] is x and inputs[1] is None and inputs[2] is weight
    assert '_call_cached_op' not in vars(ref)
    with pytest.raises(TypeError):
        _gluon.cached_graph_inputs(ref, (x,), {'colour': weight})
    assert '_call_cached_op' not in vars(ref)
    with autograd.record():
        out = ref(x, mask=mask, weight=weight)
    assert _gluon.is_recorded(out)
