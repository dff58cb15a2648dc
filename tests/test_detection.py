"""GluonCV's detection training through DataParallel (issue 41): the loops
of scripts/detection/yolo/train_yolo3.py and scripts/detection/ssd/
train_ssd.py (tests/detection_loops.py) on tiny synthetic data, against
one DataParallel call per step.

yolo3_mobilenet0.25_voc (the smallest YOLOv3 of the model zoo; the
issue's yolo3_mobilenet1.0_voc has the same layers, four times the
channels) on 2 CPU contexts, batch 4, input sizes 64 -> 96 -> 64 (a new
executor, then the first one's second step); ssd_300_mobilenet0.25_voc at
128x128, 2 steps. With BatchNorm, the script's loop on the same contexts
is the reference; with SyncBatchNorm, the script's loop on one context
with the whole batch.
"""
import mxnet as mx
import numpy as np
import pytest
from gluoncv.loss import SSDMultiBoxLoss

import gluon_parallel as gp
import detection_loops as dl
import yardstick

CTX = [mx.cpu(0), mx.cpu(1)]
YOLO, YOLO_SIZES, BATCH = 'yolo3_mobilenet0.25_voc', [64, 96, 64], 4
SSD_SIZE = 128


@pytest.fixture(scope='module')
def yolo_data(tmp_path_factory):
    """(initial parameter file, batches), once."""
    target_net = dl.yolo_net(YOLO)
    path = dl.init_file(target_net, str(tmp_path_factory.mktemp('yolo') / 'init.params'),
                        (1, 3, 64, 64))
    return path, dl.yolo_batches(target_net, YOLO_SIZES, BATCH)


@pytest.fixture(scope='module')
def ssd_data(tmp_path_factory):
    target_net = dl.ssd_net()
    path = dl.init_file(target_net, str(tmp_path_factory.mktemp('ssd') / 'init.params'),
                        (1, 3, SSD_SIZE, SSD_SIZE))
    return path, dl.ssd_batches(target_net, SSD_SIZE, 2, BATCH)


def _yolo_loop(path, batches, ctx):
    ref = dl.yolo_net(YOLO, params=path, ctx=ctx)
    ref.hybridize()
    trainer = dl.trainer(ref)
    return ref, [_numbers(dl.yolo_loop_step(ref, ctx, b, trainer)) for b in batches]


def _numbers(per_device):
    return np.array([[float(v.sum().asscalar()) for v in out] for out in per_device])


def _same_running_everywhere(net, skip=()):
    """Every device's running statistics equal replica 0's, bit for bit
    (but those whose name holds a string of `skip`)."""
    for k, copies in dl.values(net).items():
        if dl.is_running(k) and not any(s in k for s in skip):
            for c in copies[1:]:
                np.testing.assert_array_equal(c, copies[0], err_msg=k)


@pytest.mark.parametrize('graph', ['auto', False])
def test_yolo3_with_batchnorm_is_the_script_loop(yolo_data, graph):
    path, batches = yolo_data
    ref, want = _yolo_loop(path, batches, CTX)
    net = dl.yolo_net(YOLO, params=path, ctx=CTX)
    net.hybridize()
    trainer = dl.trainer(net)
    with gp.DataParallel(net, CTX, graph=graph) as dp:
        got = [_numbers(dl.yolo_dp_step(dp, b, trainer)) for b in batches]
        assert dp.last_path == ('graph' if graph else 'replicas')
    np.testing.assert_array_equal(got, want)
    worst = dl.compare(dl.values(net), dl.values(ref))
    assert worst['params'] == 0, worst
    # Graph mode's momentum update of the running statistics rounds once
    # more than MKL-DNN's BatchNorm kernel.
    assert worst['running'] < 1e-6, worst


@pytest.mark.parametrize('graph', ['auto', False])
def test_yolo3_with_syncbatchnorm_trains_as_one_device(yolo_data, graph):
    """norm_layer=SyncBatchNorm (loading BatchNorm's file): the first step's
    losses are those of the script's loop on one device with the whole
    batch, within float32 BatchNorm's own error (measured 1.6e-3 here; that
    one-device run is the less exact of the two:
    test_yolo3_syncbatchnorm_within_batchnorm_error); every step runs;
    every device holds the same running statistics, after the first step
    those of the one device. (Later steps' are not compared: YOLOv3's
    targets depend on its predictions, which these errors move.)"""
    path, batches = yolo_data
    ref, want = _yolo_loop(path, batches[:1], [mx.cpu(0)])
    net = dl.yolo_net(YOLO, norm_layer=gp.nn.SyncBatchNorm, params=path, ctx=CTX)
    net.hybridize()
    trainer = dl.trainer(net)
    with gp.DataParallel(net, CTX, graph=graph) as dp:
        got = [_numbers(dl.yolo_dp_step(dp, b, trainer)) for b in batches[:1]]
        np.testing.assert_allclose(got[0].sum(axis=0), want[0].sum(axis=0), rtol=5e-3)
        worst = dl.compare({k: v for k, v in dl.values(net).items() if dl.is_running(k)},
                           {k: v for k, v in dl.values(ref).items() if dl.is_running(k)})
        assert worst['running'] < 1e-3, worst
        got += [_numbers(dl.yolo_dp_step(dp, b, trainer)) for b in batches[1:]]
        assert dp.last_path == ('graph' if graph else 'replicas')
    assert np.isfinite(got).all()
    _same_running_everywhere(net)


def test_yolo3_syncbatchnorm_within_batchnorm_error(yolo_data):
    """The decisive comparison (benchmarks/yolo_exactness.py at test size):
    YOLOv3's layers under a fixed loss of their raw predictions, one SGD
    step; against the float64 truth (BatchNorm, one device, whole batch),
    SyncBatchNorm's parameter changes on 2 devices in graph mode are
    within float32 BatchNorm's own error on each parameter."""
    path, batches = yolo_data
    x = batches[0][0]
    rng = np.random.RandomState(3)
    weights = {}

    def fixed(out, rank):
        if 'w' not in weights:
            weights['w'] = rng.uniform(-1, 1, (x.shape[0],) + out.shape[1:])
        rows = out.shape[0]
        return (out * mx.nd.array(weights['w'][rank * rows:(rank + 1) * rows],
                                  ctx=out.context, dtype=out.dtype)).sum()

    runs = {}
    for run, ctx, sync, dtype in (('truth', CTX[:1], False, 'float64'),
                                  ('bn32', CTX[:1], False, 'float32'),
                                  ('sync32', CTX, True, 'float32')):
        net = dl.YoloRaw(dl.yolo_net(YOLO, norm_layer=gp.nn.SyncBatchNorm if sync else None,
                                     params=path, ctx=ctx))
        net.cast(dtype)
        net.hybridize()
        with yardstick.smooth_relu():
            runs[run], taken = dl.one_step_change(net, ctx, (x,), fixed, dtype)
        assert taken == 'graph'
    truth = runs['truth']
    bn = yardstick.relative_errors(runs['bn32'], truth)
    sync = yardstick.relative_errors(runs['sync32'], truth)
    moved = [k for k in truth if not dl.is_running(k) and np.linalg.norm(truth[k]) > 0]
    ratios = {k: sync[k] / bn[k] for k in moved}
    # Measured: here the median ratio 0.18, the largest 0.98; at 4 devices,
    # batch 8, 96 px (benchmarks/yolo_exactness.py) 0.02 and 0.58 (1.13
    # with MKL-DNN off): float32 BatchNorm's sums over the batch and the
    # map lose more of a step's change the larger they are (15 % there),
    # SyncBatchNorm's are float64.
    assert np.median(list(ratios.values())) < 0.5, sorted(ratios.values())
    assert max(ratios.values()) < 2.0, max(ratios.items(), key=lambda kv: kv[1])
    running = [k for k in truth if dl.is_running(k)]
    assert max(sync[k] for k in running) <= max(bn[k] for k in running)


def _ssd_steps(net, batches, graph):
    """train_ssd.py's steps through DataParallel: each step's losses."""
    net.hybridize()
    trainer = dl.trainer(net)
    with gp.DataParallel(net, CTX, graph=graph) as dp:
        got = [_numbers(dl.ssd_dp_step(dp, CTX, b, trainer, SSDMultiBoxLoss()))
               for b in batches]
        assert dp.last_path == ('graph' if graph else 'replicas')
    return got


@pytest.mark.parametrize('graph', ['auto', False])
def test_ssd_with_batchnorm_is_the_script_loop(ssd_data, graph):
    """SSD's base is a symbol block (FeatureExpander) whose parameters keep
    no shape after load_parameters; one SSDMultiBoxLoss over every device's
    lists."""
    path, batches = ssd_data
    ref = dl.ssd_net(params=path, ctx=CTX)
    ref.hybridize()
    trainer = dl.trainer(ref)
    want = [_numbers(dl.ssd_loop_step(ref, CTX, b, trainer, SSDMultiBoxLoss()))
            for b in batches]
    net = dl.ssd_net(params=path, ctx=CTX)
    got = _ssd_steps(net, batches, graph)
    np.testing.assert_array_equal(got, want)
    worst = dl.compare(dl.values(net), dl.values(ref))
    assert worst['params'] == 0 and worst['running'] < 1e-6, worst


@pytest.mark.parametrize('graph', ['auto', False])
@pytest.mark.parametrize('how', ['convert', 'norm_layer'])
def test_ssd_with_syncbatchnorm_trains_as_one_device(ssd_data, how, graph):
    """convert_sync_batchnorm (every BatchNorm, those of the symbol-built
    base and extra layers included) or norm_layer=SyncBatchNorm (the
    base's, a BatchNorm file loading into it): the first step's losses are
    the script's on one device with the whole batch (within float32
    BatchNorm's error, measured 1.2e-5; with norm_layer 3.5e-4: the extra
    layers GluonCV adds to the base with mx.sym.BatchNorm stay BatchNorm),
    and every device's running statistics the same (with norm_layer, but
    the extra layers')."""
    path, batches = ssd_data
    one = [mx.cpu(0)]
    ref = dl.ssd_net(params=path, ctx=one)
    ref.hybridize()
    want = _numbers(dl.ssd_loop_step(ref, one, batches[0], dl.trainer(ref), SSDMultiBoxLoss()))
    if how == 'convert':
        net = gp.nn.convert_sync_batchnorm(dl.ssd_net(params=path, ctx=CTX))
    else:
        net = dl.ssd_net(norm_layer=gp.nn.SyncBatchNorm, params=path, ctx=CTX)
    got = _ssd_steps(net, batches, graph)
    np.testing.assert_allclose(got[0].sum(axis=0), want.sum(axis=0),
                               rtol=1e-4 if how == 'convert' else 2e-3)
    assert np.isfinite(got).all()
    _same_running_everywhere(net, skip=() if how == 'convert' else ('expand_',))
