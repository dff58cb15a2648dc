"""--max-restarts (gluon_parallel/launch/restarts.py) on the local launcher
(ssh and SLURM: tests/test_launch_ssh.py, tests/test_launch_slurm.py).

The flaky jobs run tests/dist_scripts/fake_role.py (no MXNet): worker 1
fails in the first attempts. The training job is the example script, a
2-worker dist_sync run whose worker 1 is SIGKILLed in epoch 2: restarted,
it must end with the parameters of an uninterrupted run, bit for bit.
"""
import csv
import os
import re
import subprocess
import sys
import time
import uuid

import psutil

from launch_helpers import (FAKE, assert_nothing_left, check_restarts, finish, launch_cmd,
                            launch_env, run_launch, wait_for_checkpoint)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, 'examples', 'train_image_classification.py')
TRAIN_LIMIT = 180


def test_a_job_failing_once_succeeds_on_its_restart():
    rc, out, err, token = run_launch(['-n', '2', '-s', '1', '--max-restarts', '2', '--',
                                sys.executable, FAKE, 'flaky', '1'])
    assert rc == 0, (out, err)
    check_restarts(out, err, 1, 2)
    assert_nothing_left(token)


def test_a_job_that_keeps_failing_stops_after_n_restarts_with_its_status():
    rc, out, err, token = run_launch(['-n', '2', '-s', '1', '--max-restarts', '2', '--',
                                sys.executable, FAKE, 'flaky', '99'])
    assert rc == 5, (out, err)
    check_restarts(out, err, 99, 2)
    assert '[launch] no restart left (--max-restarts 2): exiting with status 5' in err
    assert_nothing_left(token)


def test_no_restart_after_a_timeout():
    rc, out, err, token = run_launch(['-n', '1', '--timeout', '2', '--max-restarts', '3', '--',
                                sys.executable, FAKE, 'hang'])
    assert rc == 124, (out, err)
    assert 'restart' not in err
    assert_nothing_left(token)


def test_bad_max_restarts():
    rc, _, err, _ = run_launch(['-n', '1', '--max-restarts', '-1', 'true'])
    assert rc == 2 and '--max-restarts must be at least 0' in err


# ------------------------------------------------ training resumes exactly --

def train_args(save_dir):
    # digits: 1437 training images, 8 per worker and step: 3 epochs of 70
    # steps. One context per worker keeps it quick.
    return [sys.executable, EXAMPLE, '--dataset', 'digits', '--kvstore', 'dist_sync',
            '--epochs', '3', '--max-steps-per-epoch', '70', '--batch-size', '16',
            '--num-devices', '1', '--seed', '3', '--no-progress', '--save-dir', str(save_dir)]


def _worker(token, rank, attempt):
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if (env.get('GP_LAUNCH_TEST_TOKEN') == token and env.get('DMLC_ROLE') == 'worker'
                and env.get('GLUON_PARALLEL_LAUNCH_RANK') == str(rank)
                and env.get('GLUON_PARALLEL_RESTART') == str(attempt)):
            return p
    return None


def final_params(save_dir):
    import mxnet as mx
    return mx.nd.load(str(save_dir / 'checkpoint.params'))


def test_a_killed_worker_is_restarted_and_training_ends_exactly_as_without(tmp_path):
    launch = ['-n', '2', '-s', '1', '--timeout', str(TRAIN_LIMIT)]
    # Bit-reproducible training, without which "equal to an uninterrupted
    # run" cannot be tested: MXNet's float results on CPU change with the
    # processes' memory layout (the length of their command line) and, with
    # the threaded engine, now and then between runs (measured: 1 run in
    # 27 of the same command, and any two runs whose --save-dir lengths
    # straddle a boundary, differ by 2e-6 in epoch 1's loss, which training
    # amplifies to 0.04 in the weights by epoch 3). The synchronous engine
    # and save directories of equal length: 27 runs in 27 alike.
    extra = dict(OMP_NUM_THREADS='1', MXNET_CPU_WORKER_NTHREADS='1',
                 MXNET_ENGINE_TYPE='NaiveEngine')
    rc, out, err, token = run_launch(launch + ['--'] + train_args(tmp_path / 'full'),
                               timeout=TRAIN_LIMIT + 30, **extra)
    assert rc == 0, err[-3000:]
    assert_nothing_left(token)

    save = tmp_path / 'rest'       # as long as 'full' (see above)
    token = uuid.uuid4().hex
    popen = subprocess.Popen(launch_cmd(*launch, '--max-restarts', '1', '--',
                                         *train_args(save)),
                             env=launch_env(token, **extra), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        # Epoch 1's checkpoint is complete once its .json is there: worker 1
        # is then in epoch 2 (70 steps of some 20 ms); kill it a moment in.
        wait_for_checkpoint(popen, save, TRAIN_LIMIT)
        time.sleep(0.5)
        victim = _worker(token, 1, 0)
        assert victim is not None, 'worker 1 of attempt 0 is gone'
        victim.kill()
    finally:
        (rc, out, err), = finish([popen], TRAIN_LIMIT + 30)
    assert rc == 0, err[-3000:]
    assert '[launch] restart 1 of 1 after: worker 1 exited with status 137' in err, err[-3000:]
    # Restarted from epoch 1's checkpoint: the kill came in epoch 2.
    for rank in (0, 1):
        assert (f'[worker {rank:d}] restart 1 of the job: resuming from its last checkpoint'
                in out.splitlines()), out
        assert (f"[worker {rank:d}] resumed from {save / 'checkpoint'} at epoch 1"
                in out.splitlines()), out
    assert_nothing_left(token)
    # Epoch lines and the final line come from rank 0 only.
    assert re.findall(r'^\[worker (\d)\] (epoch \d|final) ', out, re.M) == [
        ('0', 'epoch 1'), ('0', 'epoch 2'), ('0', 'epoch 3'), ('0', 'final')], out
    # The epochs' losses and accuracies (epoch 1 from attempt 0, the others
    # from attempt 1), then the final parameters, bit for bit.
    assert metrics(save) == metrics(tmp_path / 'full')
    want, got = final_params(tmp_path / 'full'), final_params(save)
    assert sorted(want) == sorted(got)
    for name in want:
        w, g = want[name].asnumpy(), got[name].asnumpy()
        assert (w == g).all(), (name, abs(w - g).max())


def metrics(save_dir):
    """[(epoch, train_loss, train_acc, val_acc)] of metrics.csv."""
    with open(save_dir / 'metrics.csv') as f:
        rows = list(csv.DictReader(f))
    return [(r['epoch'], r['train_loss'], r['train_acc'], r['val_acc']) for r in rows]
