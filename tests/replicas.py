"""What the DataParallel, DataParallelLoss and parallel_apply tests share:
small networks and their independent references (a separate plain Gluon
network on one context holding the same values, applied to the whole
batch)."""
import mxnet as mx
import numpy as np
from mxnet import gluon, nd

IN_UNITS = 5


def assert_close(actual, expected, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(_np(actual), _np(expected), rtol=rtol, atol=atol)


def _np(x):
    return x.asnumpy() if isinstance(x, nd.NDArray) else np.asarray(x)


def make_mlp(in_units=IN_UNITS):
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Dense(16, activation='tanh', in_units=in_units),
                gluon.nn.Dense(4, in_units=16 if in_units else 0))
    return net


class TwoHeads(gluon.HybridBlock):
    """A block with a tuple output: class scores and a regression value."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.body = gluon.nn.Dense(8, activation='relu', in_units=IN_UNITS)
            self.cls = gluon.nn.Dense(4, in_units=8)
            self.reg = gluon.nn.Dense(1, in_units=8)

    def hybrid_forward(self, F, x):
        h = self.body(x)
        return self.cls(h), self.reg(h)


def reference_copy(net, factory, ctx):
    """A separate network from `factory` on mx.cpu(0) holding the values that
    `net` has on `ctx`, matched by parameter order and checked by name."""
    ref = factory()
    ref.initialize(ctx=mx.cpu(0))
    pairs = list(zip(ref.collect_params().values(), net.collect_params().values()))
    assert len(pairs) == len(list(net.collect_params().values()))
    for p_ref, p in pairs:
        # names differ only by the network prefix (hybridsequential0_ vs 1_)
        assert p_ref.name.split('_', 1)[1] == p.name.split('_', 1)[1]
        p_ref.set_data(p.data(ctx).as_in_context(mx.cpu(0)))
    return ref


def batch(batch_size, seed):
    rng = np.random.RandomState(seed)
    x = nd.array(rng.uniform(-1, 1, size=(batch_size, IN_UNITS)))
    y = nd.array(rng.randint(0, 4, size=(batch_size,)))
    return x, y


def new_mlp(ctx_list, hybridize, factory=make_mlp):
    """A network from `factory` on ctx_list and its one-context reference."""
    net = factory()
    net.initialize(mx.init.Xavier(), ctx=ctx_list)
    ref = reference_copy(net, factory, ctx_list[0])
    if hybridize:
        net.hybridize()
    return net, ref


def fresh_deferred_mlp(ctx_list, hybridize):
    """A new MLP whose shapes are inferred on its first call (optionally
    hybridized): the setup under which concurrent first calls race."""
    net = make_mlp(in_units=0)
    net.initialize(mx.init.Xavier(), ctx=ctx_list)
    if hybridize:
        net.hybridize()
    return net


class ReplicaBoom(Exception):
    """A user exception type that must reach the caller unchanged."""
