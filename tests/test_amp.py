"""Mixed precision: MXNet's AMP (bfloat16 on CPU contexts; float16 on GPUs
is the same code path) through DataParallel + DataParallelLoss +
SyncBatchNorm.

``amp.init()`` patches MXNet for the whole process, so the AMP runs happen
in one subprocess (tests/amp_loop.py); the float32 reference, plain Gluon
on one device, runs here.
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import amp_loop
from gluon_parallel import split_sizes
from gluon_parallel.loss_scaling import bfloat16_problem

HERE = Path(__file__).resolve().parent
NUM_CTX = 4
# One 2^16 loss scale, then the spike step overflows: skipped, the scale
# halves and the count of good steps restarts (MXNet's LossScaler rules).
EXPECTED_SCALER = [(2.0 ** 16, 2.0 ** 16, 1), (2.0 ** 16, 2.0 ** 15, 0), (2.0 ** 15, 2.0 ** 15, 1)]
TRAINED = ('weight', 'bias', 'gamma', 'beta')


def _amp_subprocess(folder, what):
    init, out = folder / 'init.npz', folder / f'{what}.npz'
    amp_loop.make_init(str(init))
    proc = subprocess.run([sys.executable, str(HERE / 'amp_loop.py'), str(init), str(out),
                           str(NUM_CTX), what], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(np.load(str(init))), dict(np.load(str(out)))


@pytest.fixture(scope='module')
def amp_run(tmp_path_factory):
    """Every AMP run (bfloat16 arithmetic: CPUs with AVX-512)."""
    if bfloat16_problem():
        # Not ours to fix: MXNet itself cannot run AMP here (the examples'
        # test checks that the example says so).
        pytest.skip(bfloat16_problem())
    return _amp_subprocess(tmp_path_factory.mktemp('amp'), 'all')


@pytest.fixture(scope='module')
def amp_contracts(tmp_path_factory):
    """What happens under AMP before any bfloat16 arithmetic: on any CPU."""
    return _amp_subprocess(tmp_path_factory.mktemp('amp'), 'contracts')[1]


def states(run, prefix):
    steps = {}
    for key, value in run.items():
        if key.startswith(prefix) and key.count('/') == 2:
            _, step, name = key.split('/')
            steps.setdefault(int(step), {})[name] = value
    return [steps[i] for i in sorted(steps)]


def test_loss_scaler_behaves_as_in_the_single_device_loop(amp_run):
    _, run = amp_run
    assert [tuple(r) for r in run['single/scaler']] == EXPECTED_SCALER
    assert [tuple(r) for r in run['dp/scaler']] == EXPECTED_SCALER
    assert 'bfloat16' in str(run['dp/output_dtype'])          # AMP really ran in low precision


def test_gather_of_bfloat16_outputs(amp_run):
    # AMP makes MXNet's own copy across contexts float32; gather keeps bfloat16.
    _, run = amp_run
    assert 'bfloat16' in str(run['dp/gathered_dtype']), run['dp/gathered_dtype']
    np.testing.assert_array_equal(run['dp/gathered'], run['dp/outputs'])


def test_overflowing_step_is_skipped(amp_run):
    _, run = amp_run
    for prefix in ('single/', 'dp/'):
        before, after = states(run, prefix)[amp_loop.SPIKE_STEP - 1:amp_loop.SPIKE_STEP + 1]
        for name in before:
            if name.endswith(TRAINED):
                np.testing.assert_array_equal(after[name], before[name],
                                              err_msg=prefix + name)
        # ...and the steps around it do update
        assert any(not np.array_equal(after[n], states(run, prefix)[-1][n]) for n in after)


def test_trainer_left_to_update_on_the_kvstore_is_switched_with_a_warning(amp_contracts):
    """Gluon's default Trainer on several devices updates on its kvstore,
    where an overflowing step would reach the weights: DataParallel sets
    update_on_kvstore=False before the first step and says so."""
    warned = amp_contracts['default/warnings']
    assert any('update_on_kvstore=False' in w for w in warned), warned


def test_switched_trainer_steps_as_one_created_so(amp_run):
    """...and the steps are those of the Trainer created that way."""
    _, run = amp_run
    assert [tuple(r) for r in run['default/scaler']] == EXPECTED_SCALER
    for got, want in zip(states(run, 'default/'), states(run, 'dp/')):
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_trainer_asking_to_update_on_the_kvstore_is_refused(amp_contracts):
    error = str(amp_contracts['explicit/error'])
    assert 'update_on_kvstore=True' in error and 'update_on_kvstore=False' in error, error


def test_gp_trainer_under_amp_equals_gluon_trainer(amp_run):
    # The same loss scaler states (the overflowing step skipped) and the
    # same parameters after every step, within the batched reduction's
    # float32 rounding (see tests/test_trainer.py).
    _, run = amp_run
    assert [tuple(r) for r in run['gp-trainer/scaler']] == EXPECTED_SCALER
    ours, gluons = states(run, 'gp-trainer/'), states(run, 'dp/')
    assert len(ours) == len(gluons) == amp_loop.STEPS
    for step in range(amp_loop.STEPS):
        for name, ref in gluons[step].items():
            np.testing.assert_allclose(ours[step][name], ref, rtol=1e-5, atol=1e-6,
                                       err_msg=f'step {step} {name}')


# 'dp/': imperative; 'sync-h/': hybridized (SyncBatchNorm, DataParallel's
# choice of path).
@pytest.mark.parametrize('prefix', ['dp/', 'sync-h/'])
def test_three_steps_close_to_float32(amp_run, prefix):
    init, run = amp_run
    _, float32 = amp_loop.single_device(init, use_amp=False, skip=(amp_loop.SPIKE_STEP,))
    dp, single = states(run, prefix), states(run, 'single/')
    assert len(dp) == len(float32) == amp_loop.STEPS
    for step in range(amp_loop.STEPS):
        for name, ref in float32[step].items():
            # Measured on 4 CPU contexts: DataParallel + SyncBatchNorm + AMP is
            # within 1.6e-3 of float32 (single-device AMP: 1.3e-3), and within
            # 1e-3 of single-device AMP, over parameters of magnitude <= 1.7.
            np.testing.assert_allclose(dp[step][name], ref, rtol=0, atol=5e-3,
                                       err_msg=f'step {step:d} {name}: AMP vs float32')
            np.testing.assert_allclose(dp[step][name], single[step][name], rtol=0, atol=3e-3,
                                       err_msg=f'step {step:d} {name}: vs one-device AMP')


# Under AMP the statistics of both layers stay float32-accurate (measured:
# BatchNorm's mean exact, variance 1.4e-5 relative): SyncBatchNorm widens
# its bfloat16 slice once and sums it with dot, which AMP leaves in float32.
# '-h': hybridized (BatchNorm in graph mode, SyncBatchNorm in its stages).
FLOAT32_STATISTICS = ['BatchNorm', 'SyncBatchNorm', 'BatchNorm-h', 'SyncBatchNorm-h']


@pytest.mark.parametrize('layer', FLOAT32_STATISTICS)
def test_batchnorm_statistics_stay_float32_under_amp(amp_run, layer):
    _, run = amp_run
    seen = run[f'stats/{layer}/input'].astype(np.float64)
    # SyncBatchNorm: the whole batch; BatchNorm: the first device's slice.
    rows = len(seen) if layer.startswith('SyncBatchNorm') else split_sizes(len(seen), NUM_CTX)[0]
    seen = seen[:rows]
    mean, var = seen.mean(axis=(0, 2, 3)), seen.var(axis=(0, 2, 3))
    np.testing.assert_allclose(run[f'stats/{layer}/mean'], mean, rtol=1e-6)
    np.testing.assert_allclose(run[f'stats/{layer}/var'], var, rtol=1e-4)


# Hybridized networks under AMP: graph mode and SyncBatchNorm build their
# graphs from the traced one, which must keep AMP's casts (Symbol.tojson
# drops them by default: both ran in float32), and graph mode copies
# bfloat16 arrays past AMP's float32 wrapper of _copyto. Which path each
# configuration takes is DataParallel's rule, which knows nothing of AMP:
# the float32 run of the same configuration shows it on any CPU.
@pytest.fixture(scope='module')
def float32_paths(tmp_path_factory):
    """prefix -> (last_path, executors bound) of the float32 run."""
    path = tmp_path_factory.mktemp('amp') / 'init.npz'
    amp_loop.make_init(str(path))
    init = dict(np.load(str(path)))
    return {prefix: amp_loop.path_of(init, NUM_CTX, amp_loop.norm_layer(layer), graph)
            for prefix, (layer, graph) in amp_loop.HYBRID.items()}


@pytest.mark.parametrize('prefix', list(amp_loop.HYBRID))
def test_which_path_a_hybridized_network_takes(float32_paths, prefix):
    """DataParallel's rule: graph='auto' runs a hybridized block as one graph
    unless GraphMode.run names a reason (none here: no reducer, forward
    hook, sparse or pinned parameter; SyncBatchNorm runs in graph mode with
    MKL-DNN or without); graph=False, per replica. Graph mode binds one
    executor for the network and one for the loss (it takes the labels and
    the sample weights)."""
    path, binds = float32_paths[prefix]
    assert path == ('replicas' if amp_loop.HYBRID[prefix][1] is False else 'graph')
    assert list(binds) == ([1, 1] if path == 'graph' else [0, 0])


@pytest.mark.parametrize('prefix', list(amp_loop.HYBRID))
def test_hybridized_network_runs_in_bfloat16(amp_run, float32_paths, prefix):
    _, run = amp_run
    assert 'bfloat16' in str(run[prefix + 'output_dtype']), run[prefix + 'output_dtype']
    assert [tuple(r) for r in run[prefix + 'scaler']] == EXPECTED_SCALER
    # the path of the float32 run, and its executors
    path, binds = float32_paths[prefix]
    assert str(run[prefix + 'path']) == path, run[prefix + 'path']
    assert list(run[prefix + 'binds']) == list(binds), run[prefix + 'binds']


def test_graph_mode_under_amp_equals_the_per_replica_path(amp_run):
    _, run = amp_run
    graph, replicas = states(run, 'graph/'), states(run, 'replicas/')
    assert len(graph) == len(replicas) == amp_loop.STEPS
    for step in range(amp_loop.STEPS):
        for name, want in replicas[step].items():
            # Measured: weights bit-identical; running statistics within
            # 2.4e-7 (graph mode updates them from the kernel's 1/sqrt(var + eps)).
            np.testing.assert_allclose(graph[step][name], want, rtol=0, atol=2e-6,
                                       err_msg=f'step {step:d} {name}')

