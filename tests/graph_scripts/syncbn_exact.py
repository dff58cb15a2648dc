"""SyncBatchNorm merged inside graph mode's graph, checked as the staged path
is checked (with MKL-DNN on or off: MXNET_MKLDNN_ENABLED).

GP_TEST_KERNEL=<library>: with the kernels loaded from there (and
checked to be in the graphs); GP_TEST_QUICK=1: one ResNet case only."""
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import mxnet as mx                                          # noqa: E402
import numpy as np                                         # noqa: E402
from mxnet import autograd, nd                             # noqa: E402

import yardstick                                           # noqa: E402
from gluon_parallel.graph import recording, mkldnn_cpu        # noqa: E402
from syncbn_checks import (check_against_batchnorm, dtype_pair,  # noqa: E402
                           random_inputs, truth_and_yardstick)

import gluon_parallel as gp                               # noqa: E402

print('MKL-DNN:', mkldnn_cpu([mx.cpu()]), flush=True)
KERNEL = os.environ.get('GP_TEST_KERNEL')
if KERNEL:
    from gluon_parallel.nn import kernels                  # noqa: E402
    assert kernels.load(KERNEL) and kernels.loaded()
# Every DataParallel of the checks below in graph mode where it applies.
_init = gp.DataParallel.__init__
gp.DataParallel.__init__ = lambda self, *a, **k: _init(self, *a, **dict(k, graph='auto'))
ran = []
original = recording.run
# (the networks' executors: a loss executor covers a network's outputs)
recording.run = lambda *a, **k: (not a[0].covered and ran.append(all(
    op in a[0].symbol.tojson() for op in ('gp_channel_sums', 'gp_centred_affine')))) \
    or original(*a, **k)

# The layer against BatchNorm on the whole batch: even, uneven and short
# batches, another channel axis. (Not data far from zero: without MKL-DNN
# the reference, MXNet's own BatchNorm kernel, sums in float32 about zero.)
for n, shape, kw in [(4, (8, 3, 4, 4), {}), (4, (10, 3, 5), {}), (4, (3, 4, 2), {}),
                     (2, (7, 3), {}), (3, (9, 2, 3, 3), dict(axis=3))]:
    axis = kw.pop('axis', 1)
    before = len(ran)
    # (No input gradient: it would keep the calls per replica; the ResNet
    # steps below check what flows back through the layer.)
    check_against_batchnorm(n, shape, axis=axis, hybridize={}, input_grad=False, **kw)
    assert len(ran) == before + 3, 'the layer did not run in graph mode'
    print('layer', n, shape, 'ok', flush=True)

# float16 data with float32 parameters, and float64 data far from zero: the
# layer hybridized, in graph mode against the staged path (which the
# accuracy tests check against BatchNorm); float16 outputs may differ by one
# rounding (the graph rounds once from float64).


def graph_or_staged(dtype, mean, graph):
    ctx_list = [mx.cpu(i) for i in range(4)]
    x, w = random_inputs((10, 6, 5, 5), mean=mean)
    sync, _ = dtype_pair(6, ctx_list, dtype)
    sync.hybridize()
    dp = _init_dp(sync, ctx_list, graph=graph)
    with autograd.record():
        outs = dp(nd.array(x, dtype=dtype))
        ends = np.cumsum([o.shape[0] for o in outs])
        losses = [(o.astype('float64') * nd.array(w[e - o.shape[0]:e], ctx=o.context,
                                                  dtype='float64')).sum()
                  for o, e in zip(outs, ends)]
    autograd.backward(losses)
    return ([np.concatenate([o.asnumpy().astype('float64') for o in outs])]
            + [sum(g.asnumpy().astype('float64') for g in p.list_grad())
               for p in (sync.gamma, sync.beta)]
            + [getattr(sync, k).data(c).asnumpy() for k in ('running_mean', 'running_var')
               for c in ctx_list])


def _init_dp(block, ctx_list, graph):
    dp = gp.DataParallel.__new__(gp.DataParallel)
    _init(dp, block, ctx_list, graph=graph)
    return dp


for dtype, mean, rtol in (('float16', 2.0, 2e-3), ('float64', 100.0, 1e-12)):
    before = len(ran)
    got = graph_or_staged(dtype, mean, 'auto')
    assert len(ran) == before + 1, f'the {dtype} check did not run in graph mode'
    want = graph_or_staged(dtype, mean, False)
    for what, g, v in zip(['output', 'gamma grad', 'beta grad'] + ['running'] * 8, got, want):
        np.testing.assert_allclose(g, v, rtol=rtol, atol=rtol * np.abs(v).max(),
                                   err_msg=f'{dtype} {what}')
    print(dtype, 'graph mode == staged', flush=True)

# One SGD step of model-zoo ResNets against the float64 truth.
CASES = [('cifar_resnet20_v1', 4, 7), ('cifar_resnet20_v1', 4, 3), ('resnet18_v1', 4, 4),
         ('resnet18_v1', 2, 7)]
for name, n, batch in CASES[:1] if os.environ.get('GP_TEST_QUICK') else CASES:
    values, x, y, truth, bn_errors = truth_and_yardstick(name, batch)
    run = yardstick.one_step(name, values, x, y, [mx.cpu(i) for i in range(n)], sync=True,
                             hybridize={})
    ours, where = yardstick.worst(yardstick.relative_errors(run, truth))
    bound, _ = yardstick.worst(bn_errors)
    print(name, n, batch, f'graph SyncBN {ours:.3g} ({where}), float32 BatchNorm {bound:.3g}',
          flush=True)
    assert ours <= 10 * bound, (name, n, batch, ours, bound)
    for k, v in run.items():
        if k.endswith(('running_mean', 'running_var')):
            assert all((c == v[0]).all() for c in v), f'{k} differs between devices'
assert ran, 'graph mode did not run'
print(f'graph mode ran {len(ran):d} calls, {sum(ran):d} with the kernels')
