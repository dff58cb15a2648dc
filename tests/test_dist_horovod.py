"""gluon_parallel.dist on Horovod: real Horovod jobs (Gloo) on this machine,
started by ``python -m gluon_parallel.launch --engine horovod``.

The same script as tests/dist_jobs.py's dist_sync jobs
(tests/dist_scripts/train_dist.py, 2 workers x 2 CPU contexts), unchanged:
the engine comes from the environment horovodrun gives the workers. Each
job is compared with the same independent single-process references, is
bounded by the launcher's --timeout and leaves no process behind.
Horovod is an optional, compiled dependency: without it these tests skip
(fail under .ci/run, which builds it).
"""
import json
import subprocess
import sys
import time
import uuid

import pytest
import mxnet as mx
from mxnet import gluon

import daemons
import dist_jobs
from dist_jobs import STEPS, assert_params_close, load, write_init
from launch_helpers import launch_env, assert_nothing_left


@pytest.fixture(autouse=True)
def horovod_installed():
    daemons.require(daemons.horovod_available(), daemons.HOROVOD_MISSING)


def launch_horovod(out, *args, timeout=dist_jobs.JOB_TIMEOUT):
    """Run train_dist.py as a 2-worker Horovod job; (status, stdout, stderr)."""
    token = uuid.uuid4().hex
    env = launch_env(token, OMP_NUM_THREADS='1', MXNET_CPU_WORKER_NTHREADS='1')
    cmd = [sys.executable, '-m', 'gluon_parallel.launch', '--engine', 'horovod', '-n', '2',
           '--timeout', str(timeout), '--grace', '2', '--',
           sys.executable, dist_jobs.SCRIPT, '--out', str(out)] + [str(a) for a in args]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=timeout + 30)
    assert_nothing_left(token)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


@pytest.fixture(scope='module')
def continuous(tmp_path_factory, plain_init):
    """2 workers x 2 contexts on Horovod, 5 steps; rank 0 checkpoints after 3."""
    if not daemons.horovod_available():
        return None
    out = tmp_path_factory.mktemp('horovod')
    rc, stdout, stderr = launch_horovod(out, '--init', plain_init, '--steps', STEPS,
                                        '--save-at', 3)
    assert rc == 0, stdout + stderr
    return out


def test_two_workers_equal_one_process_with_four_contexts(continuous, plain_init, tmp_path):
    dist_jobs.check_equal_to_four_contexts(continuous, plain_init, tmp_path)


def test_two_workers_with_gp_trainer_equal_one_process_with_four_contexts(plain_init, tmp_path):
    """gp.Trainer on Horovod: the gradients' one bucket summed by one
    all-reduce per step, the update fused; 1 process x 4 contexts'
    parameters."""
    out = tmp_path / 'gp-trainer'
    rc, stdout, stderr = launch_horovod(out, '--init', plain_init, '--steps', STEPS,
                                        '--gp-trainer')
    assert rc == 0, stdout + stderr
    info = dist_jobs.check_equal_to_four_contexts(out, plain_init, tmp_path)
    assert [i['trainer'] for i in info] == ['gluon_parallel.trainer.Trainer'] * 2
    assert [i['reductions'] for i in info] == [[1] * STEPS] * 2


def test_one_context_per_worker_with_gp_trainer(plain_init, tmp_path):
    """2 workers x 1 context (Horovod's usual one device per process) with
    gp.Trainer: each worker's bucket all-reduced in place, once per step;
    1 process x 4 contexts' parameters."""
    out = tmp_path / 'one-context'
    rc, stdout, stderr = launch_horovod(out, '--init', plain_init, '--steps', STEPS,
                                        '--gp-trainer', '--num-ctx', 1)
    assert rc == 0, stdout + stderr
    info = dist_jobs.check_equal_to_four_contexts(out, plain_init, tmp_path)
    assert [i['reductions'] for i in info] == [[1] * STEPS] * 2


@pytest.mark.parametrize('engine', ['horovod', 'dist_sync'])
def test_checkpoint_written_under_horovod_resumes_exactly(continuous, plain_init, tmp_path,
                                                          engine):
    """Rank 0 wrote it under Horovod; both engines resume from it and end
    where the job that never stopped ended."""
    out = tmp_path / 'resumed'
    args = ('--init', plain_init, '--steps', STEPS, '--resume', continuous / 'ckpt')
    rc, stdout, stderr = launch_horovod(out, *args) if engine == 'horovod' \
        else dist_jobs.launch(out, *args)
    assert rc == 0, stdout + stderr
    for r in range(2):
        assert json.load(open(out / (f'rank{r:d}.json')))['steps'] == STEPS - 3
        assert_params_close(load(out / (f'rank{r:d}.params')),
                            load(continuous / (f'rank{r:d}.params')), rtol=1e-6, atol=1e-7,
                            what=f'resumed under {engine} vs continuous, rank {r:d}')


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_cross_worker_syncbn_equals_batchnorm_on_the_global_batch(tmp_path, hybridize):
    init = tmp_path / 'bn.params'
    write_init(init, gluon.nn.BatchNorm)
    out = tmp_path / 'job'
    # 7 rows per worker: slices of 4 and 3, so the merge must weight by count.
    rc, stdout, stderr = launch_horovod(out, '--init', init, '--steps', STEPS, '--batch', 7,
                                        '--syncbn', *(['--hybridize'] if hybridize else []))
    assert rc == 0, stdout + stderr
    dist_jobs.check_syncbn_job(out, init, tmp_path)


def test_a_failing_worker_ends_the_job_promptly(tmp_path, plain_init):
    start = time.monotonic()
    rc, stdout, stderr = launch_horovod(tmp_path, '--init', plain_init, '--steps', STEPS,
                                        '--fail-at', 2)
    assert time.monotonic() - start < 60
    assert rc == 1, stdout + stderr      # horovodrun's status: not the launcher's timeout
    assert 'RuntimeError: injected failure at step 2 on rank 1' in stderr
    assert '[launch] horovodrun exited with status 1' in stderr
    assert not (tmp_path / 'rank0.params').exists()


def test_horovod_store_outside_a_job_is_refused(monkeypatch):
    from gluon_parallel.dist import kvstore
    for k in ('HOROVOD_RANK', 'HOROVOD_SIZE', 'DMLC_ROLE'):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match='horovodrun'):
        kvstore.get_kvstore('horovod')
    assert kvstore.get_kvstore() == 'device'
    assert mx.kv.create('device').type == 'device'
