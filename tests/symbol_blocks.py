"""Symbol-built blocks, as GluonCV's SSD builds its base (FeatureExpander):
a network traced to a symbol and wrapped in a SymbolBlock whose parameters
are named by the symbol's variables."""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

__all__ = ['conv_bn', 'symbol_block', 'save_initial', 'batch', 'loop_step', 'dp_step', 'values']


def conv_bn(norm_layer=gluon.nn.BatchNorm, prefix='base_'):
    """conv-norm-relu twice: the body a symbol block is traced from."""
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        for channels in (6, 4):
            net.add(gluon.nn.Conv2D(channels, 3, padding=1, use_bias=False), norm_layer(),
                    gluon.nn.Activation('relu'))
    return net


def symbol_block(norm_layer=gluon.nn.BatchNorm, params=None, ctx=None):
    """conv_bn(norm_layer) as a SymbolBlock; `params`: a file saved from one
    (``save_parameters``), loaded on `ctx`."""
    data = mx.sym.var('data')
    block = gluon.SymbolBlock(conv_bn(norm_layer)(data), data)
    if params is not None:
        block.load_parameters(params, ctx=ctx)
    block.hybridize()
    return block


def save_initial(path, norm_layer=gluon.nn.BatchNorm):
    """A symbol block's parameter file of random values (the traced body
    initialised, its gamma and beta moved off 1 and 0)."""
    body = conv_bn(norm_layer)
    mx.random.seed(0)
    body.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    body(batch(1))
    rng = np.random.RandomState(1)
    for p in body.collect_params('.*gamma|.*beta').values():
        p.set_data(p.data() + nd.array(rng.uniform(-0.3, 0.3, p.shape)))
    body.collect_params().save(path)        # the names a symbol block's load_parameters reads
    return path


def batch(n, seed=0):
    return nd.array(np.random.RandomState(seed).uniform(-1, 1, (n, 3, 5, 5)))


def loop_step(net, ctx, x, trainer):
    """The per-device loop: one call per device on its rows, the sum of
    squares as loss."""
    from gluon_parallel.split import split_sizes
    outs, start = [], 0
    with autograd.record():
        for c, k in zip(ctx, split_sizes(x.shape[0], len(ctx))):
            outs.append((net(x[start:start + k].as_in_context(c)) ** 2).sum())
            start += k
    autograd.backward(outs)
    trainer.step(x.shape[0])
    return [o.asscalar() for o in outs]


def dp_step(dp, x, trainer):
    with autograd.record():
        outs = [(o ** 2).sum() for o in dp(x)]
    autograd.backward(outs)
    trainer.step(x.shape[0])
    return [o.asscalar() for o in outs]


def values(net):
    return {k: [d.asnumpy() for d in p.list_data()] for k, p in net.collect_params().items()}
