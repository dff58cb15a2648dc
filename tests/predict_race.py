"""Parameters read right after a predict-mode forward (MKL-DNN builds).

MXNet 1.9.1's MKL-DNN convolution, in a predict-mode forward, reorders its
weight to its own layout in place, in an engine operation that the running
convolution pushes itself. A host read of the weight racing that reorder
raised "We can't generate TBlob for MKLDNN data" or returned a scrambled
value (measured: resnet18_v1 on 1x3x32x32 after deferred initialisation,
about one read in thirty). The race is intermittent, so a test repeats it.
"""
import mxnet as mx
import numpy as np
from mxnet import nd
from gluoncv.model_zoo import get_model

__all__ = ['ROUNDS', 'fresh_after_predict', 'settled_values', 'assert_values']

ROUNDS = 30


def fresh_after_predict(ctxs, seed):
    """A model-zoo ResNet-18 just initialised (deferred) on `ctxs` by one
    predict-mode forward on each context, with that forward maybe still
    running."""
    mx.random.seed(seed)
    net = get_model('resnet18_v1', classes=10)
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    for c in ctxs:
        net(nd.zeros((1, 3, 32, 32), ctx=c))
    return net


def settled_values(net):
    """Structural name -> first context's value, read once every operation
    has finished (the reference)."""
    nd.waitall()
    return {k: p.list_data()[0].asnumpy()
            for k, p in net._collect_params_with_prefix().items()}


def assert_values(got, want, what):
    assert sorted(got) == sorted(want), what
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f'{what}: {k}')
