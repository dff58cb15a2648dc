"""loss.py: DataParallelLoss against the loss of a plain Gluon network on
one context applied to the whole batch."""
import mxnet as mx
import pytest
from mxnet import autograd, gluon, nd

from gluon_parallel import DataParallel, DataParallelLoss, gather, split_load_kwargs
from replicas import TwoHeads, assert_close, batch, new_mlp

pytestmark = pytest.mark.usefixtures('both_thread_modes')


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybrid'])
def test_tuple_output_block_with_the_loss_wrapper(ctx_list, hybridize):
    net, ref = new_mlp(ctx_list, hybridize, TwoHeads)
    ce, l2 = gluon.loss.SoftmaxCrossEntropyLoss(), gluon.loss.L2Loss()

    def two_head_loss(scores, value, label, target):
        # a replica's tuple is unpacked before the targets (GluonCV semantics)
        return ce(scores, label) + l2(value, target)

    x, y = batch(7, seed=5)
    target = nd.random.uniform(shape=(7, 1))
    with DataParallel(net, ctx_list) as dp:
        with autograd.record():
            out = dp(x)
            losses = DataParallelLoss(two_head_loss)(out, y, target)
        autograd.backward(losses)
    # a hybridized graph returns its outputs as a list
    assert all(isinstance(o, (tuple, list)) and len(o) == 2 for o in out)
    with autograd.record():
        ref_loss = two_head_loss(*ref(x), y, target)
    ref_loss.backward()
    assert_close(gather(losses), ref_loss)
    for p, p_ref in zip(net.collect_params().values(), ref.collect_params().values()):
        assert_close(sum(g.asnumpy() for g in p.list_grad()), p_ref.grad(), atol=1e-5)


def test_loss_with_presplit_targets(ctx_list):
    net, ref = new_mlp(ctx_list, hybridize=False)
    x, y = batch(7, seed=6)
    weight = nd.random.uniform(shape=(7, 1))
    target = nd.random.uniform(shape=(7, 4))
    l2 = gluon.loss.L2Loss()
    dpl = DataParallelLoss(l2)
    with DataParallel(net, ctx_list) as dp:
        out = dp(x)
    n = len(out)
    presplit = [a[0] for a in split_load_kwargs((target,), {}, ctx_list)[0]]
    expected = l2(ref(x), target, weight)
    full = dpl(out, target, weight)
    pre = dpl(out, presplit, weight)              # one pre-split, one full target
    assert [x.context for x in pre] == ctx_list[:n]
    assert_close(gather(full), expected)
    assert_close(gather(pre), expected)
    # pre-split entries elsewhere are moved to their replica's context
    moved = dpl(out, [t.as_in_context(mx.cpu(0)) for t in presplit], weight)
    assert_close(gather(moved), expected)
    # one entry too few or too many
    with pytest.raises(ValueError):
        dpl(out, presplit[:-1] if n > 1 else presplit * 2, weight)
    with pytest.raises(ValueError):
        dpl(out, presplit + presplit[:1], weight)
    with pytest.raises(ValueError):                # full target of the wrong batch size
        dpl(out, nd.ones((8, 4)))
