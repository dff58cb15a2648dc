"""The optional C++ kernels of SyncBatchNorm's sums and affine map
(nn/kernels): built here from source, checked against numpy, and SyncBatchNorm checked against
BatchNorm both with and without it (the rest of the suite uses whichever
the environment has)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from mxnet import autograd, nd

import yardstick
from gluon_parallel.nn import kernels
from gluon_parallel.syncgraph import GraphWriter
from syncbn_checks import (FLAGS, check_against_batchnorm, check_float64_throughout,
                           check_large_mean_inputs, cpus, truth_and_yardstick)

STATIC = FLAGS['static']


@pytest.fixture(scope='module')
def library(tmp_path_factory):
    if shutil.which(os.environ.get('CXX', 'g++')) is None:
        # The kernel is optional for users, not for the suite: its half of
        # these tests needs a compiler, and a skip would hide that.
        pytest.fail('no C++ compiler (g++, or $CXX): these tests build the optional kernel')
    return kernels.build(str(tmp_path_factory.mktemp('kernel')))


@pytest.fixture(params=['mxnet-ops', 'kernel'])
def sums(request, library, monkeypatch):
    """SyncBatchNorm computing its sums with MXNet's operators, then with
    the kernel (for graphs built inside the test)."""
    if request.param == 'kernel':
        monkeypatch.delenv(kernels.ENV, raising=False)
        assert kernels.load(library) and kernels.loaded()
    else:
        monkeypatch.setenv(kernels.ENV, '0')
    return request.param


@pytest.mark.parametrize('dtype,rtol', [('float16', 1e-6), ('float32', 1e-12),
                                        ('float64', 1e-12)])
def test_kernel_sums_and_gradient_match_numpy(library, dtype, rtol):
    kernels.load(library)
    g = GraphWriter('t')
    op = nd.CachedOp(g.symbol([g.op(kernels.OP, g.var('x'))]))
    rng = np.random.RandomState(0)
    x = nd.array(rng.randn(3, 5, 7) * 2 + 1000, dtype=dtype)
    x.attach_grad()
    with autograd.record():
        out = op(x)
    head = rng.randn(15)
    out.backward(nd.array(head, dtype='float64'))
    xv = x.asnumpy().astype('float64')
    q = xv[0, :, 0].reshape(1, 5, 1)
    want = np.concatenate([(xv - q).sum(axis=(0, 2)), ((xv - q) ** 2).sum(axis=(0, 2)),
                           q.ravel()])
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-13, atol=1e-9)
    grad = head[:5].reshape(1, 5, 1) + 2 * head[5:10].reshape(1, 5, 1) * (xv - q)
    np.testing.assert_allclose(x.grad.asnumpy().astype('float64'), grad.astype(dtype),
                               rtol=rtol, atol=rtol * np.abs(grad).max())


@pytest.mark.parametrize('dtype,param_dtype', [('float16', 'float32'), ('float32', 'float32'),
                                                ('float64', 'float64')])
def test_affine_kernel_and_gradients_match_numpy(library, dtype, param_dtype):
    """(x - q) * scale + shift, far from zero: the output rounded once from
    float64, dx = dy scale, dscale and dshift summed in float64."""
    kernels.load(library)
    g = GraphWriter('t')
    op = nd.CachedOp(g.symbol([g.op(kernels.AFFINE, *[g.var(k) for k in 'xqab'])]))
    rng = np.random.RandomState(0)
    x = nd.array(rng.randn(3, 5, 7) * 2 + 1000, dtype=dtype)
    q = nd.array(x.asnumpy()[0, :, 0], dtype=param_dtype)
    a, b = [nd.array(rng.randn(5) * 3, dtype=param_dtype) for _ in 'ab']
    for v in (x, q, a, b):
        v.attach_grad()
    with autograd.record():
        y = op(x, q, a, b)
    head = rng.randn(3, 5, 7)
    y.backward(nd.array(head, dtype=dtype))

    def f64(v):
        return v.asnumpy().astype('float64')
    xv, qv, av, bv, hv = f64(x), f64(q)[:, None], f64(a)[:, None], f64(b)[:, None], \
        f64(nd.array(head, dtype=dtype))
    want = ((xv - qv) * av + bv).astype(dtype)
    np.testing.assert_array_equal(y.asnumpy(), want)
    np.testing.assert_array_equal(x.grad.asnumpy(), (hv * av).astype(dtype))
    np.testing.assert_allclose(f64(a.grad), (hv * (xv - qv)).sum(axis=(0, 2)), rtol=1e-6)
    np.testing.assert_allclose(f64(b.grad), hv.sum(axis=(0, 2)), rtol=1e-6)
    assert (q.grad.asnumpy() == 0).all()


@pytest.mark.parametrize('hybridize', [None, STATIC])
@pytest.mark.parametrize('n,shape,axis', [(4, (10, 3, 2, 2), 1), (3, (10, 6), 1),
                                          (4, (8, 5, 3), -1), (4, (3, 5, 2), 1)])
def test_layer_matches_batchnorm(sums, n, shape, axis, hybridize):
    check_against_batchnorm(n, shape, axis=axis, hybridize=hybridize)


def test_large_mean_against_the_float64_truth(sums):
    check_large_mean_inputs(4)


def test_float64_within_1e_13_of_batchnorm(sums):
    check_float64_throughout(4, 10)


@pytest.mark.parametrize('hybridize', [None, STATIC])
def test_model_zoo_step_as_accurate_as_batchnorm(sums, hybridize):
    name, n, batch = 'cifar_resnet20_v1', 4, 7
    values, x, y, truth, bn_errors = truth_and_yardstick(name, batch)
    run = yardstick.one_step(name, values, x, y, cpus(n), sync=True, hybridize=hybridize)
    bound, _ = yardstick.worst(bn_errors)
    ours, where = yardstick.worst(yardstick.relative_errors(run, truth))
    assert ours <= 10 * bound, (ours, where, bound)


def test_graph_mode_syncbatchnorm_with_the_kernels_is_exact(library):
    """Graph mode with the kernels (CPU contexts, MKL-DNN off), in every
    graph: the layer against BatchNorm on the whole batch (even, uneven,
    short, channels last), float16 and float64 data against the staged
    path, and a model-zoo ResNet step within float32 BatchNorm's distance of
    the float64 truth (tests/graph_scripts/syncbn_exact.py, one ResNet
    case)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'graph_scripts',
                          'syncbn_exact.py')
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, MXNET_MKLDNN_ENABLED='0', GP_TEST_KERNEL=library,
                                  GP_TEST_QUICK='1'))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ran = [line for line in out.stdout.splitlines() if line.startswith('graph mode ran')]
    assert ran and ran[0].split()[3] == ran[0].split()[5], ran     # every call: the kernel


def test_environment_switches_the_kernel_off(library, monkeypatch):
    monkeypatch.setenv(kernels.ENV, '0')
    assert not kernels.load(library) and not kernels.loaded()
    assert kernels.available() is None
    monkeypatch.delenv(kernels.ENV)
    assert kernels.load(library) and kernels.loaded()
    assert kernels.available() == (kernels.OP, kernels.AFFINE)


def test_a_missing_library_leaves_the_layer_on_mxnet_operators(monkeypatch):
    monkeypatch.setattr(kernels, 'library_path', lambda: None)
    assert not kernels.load()
    # (in this process another test may have registered the operators:
    # the layer is kept off them as a process without the library is)
    monkeypatch.setenv(kernels.ENV, '0')
    check_against_batchnorm(2, (6, 3, 2, 2))


def test_loading_the_kernel_keeps_patched_mxnet_functions(library):
    """mx.library.load regenerates every mx.nd/mx.sym function, which would
    undo AMP's patches (AMP then silently runs in float32): the kernel is
    registered without that."""
    code = ('from mxnet.contrib import amp; amp.init(target_dtype="bfloat16")\n'
            'import mxnet as mx\n'
            'conv, bn = mx.nd.Convolution, mx.sym.BatchNorm\n'
            'from gluon_parallel.nn import kernels\n'
            f'assert kernels.load({library!r})\n'
            'assert mx.nd.Convolution is conv and mx.sym.BatchNorm is bn\n'
            'print("ok")\n')
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, **{kernels.ENV: '1'}))
    assert proc.returncode == 0 and proc.stdout.strip() == 'ok', proc.stderr[-2000:]


def test_after_horovod_the_kernel_is_skipped_not_a_crash(library):
    """MXNet 1.9.1 dies of SIGFPE loading an operator library once
    horovod.mxnet is imported: load() then declines, with a warning, and the
    process goes on (MXNet's operators compute the sums)."""
    import daemons
    daemons.require(daemons.horovod_available(), daemons.HOROVOD_MISSING)
    code = ('import warnings, horovod.mxnet\n'
            'from gluon_parallel.nn import kernels\n'
            'with warnings.catch_warnings(record=True) as w:\n'
            '    warnings.simplefilter("always")\n'
            f'    print(kernels.load({library!r}), kernels.loaded(),\n'
            '          [str(x.message)[:60] for x in w])\n')
    env = dict(os.environ, GLUON_PARALLEL_KERNELS='1')
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith('False False'), proc.stdout
    assert 'kernel is not loaded' in proc.stdout
