"""Real dist jobs for the tests: tests/dist_scripts/train_dist.py run by the
launcher (2 workers x 2 CPU contexts), its initial parameters, and the
independent single-process references the jobs are checked against (plain
Gluon: 1 process x 4 contexts, or BatchNorm on the whole batch on one
device). Used by the dist_sync, ssh, SLURM and Horovod tests."""
import json
import os
import subprocess
import sys
import uuid

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

from launch_helpers import assert_nothing_left, launch_env

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, 'dist_scripts'))
import train_dist  # noqa: E402  (make_data, make_net, OPTIMIZER: the job's model and data)

SCRIPT = os.path.join(HERE, 'dist_scripts', 'train_dist.py')
JOB_TIMEOUT = 120
STEPS = 5


def launch(out, *args, workers=2, servers=1, env=None):
    """Run train_dist.py as a dist job (with `env` added to every process's
    environment); return (status, stdout, stderr)."""
    token = uuid.uuid4().hex
    # One OpenMP thread per process: 4 processes share this machine's cores.
    env = launch_env(token, OMP_NUM_THREADS='1', MXNET_CPU_WORKER_NTHREADS='1', **(env or {}))
    cmd = [sys.executable, '-m', 'gluon_parallel.launch', '-n', str(workers), '-s', str(servers),
           '--timeout', str(JOB_TIMEOUT), '--grace', '2', '--',
           sys.executable, SCRIPT, '--out', str(out)] + [str(a) for a in args]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=JOB_TIMEOUT + 30)
    assert_nothing_left(token)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def load(path):
    return {k: v.asnumpy() for k, v in nd.load(str(path)).items()}


def write_init(path, batchnorm):
    """Random initial parameters (BatchNorm's gamma and beta included)."""
    net = train_dist.make_net(batchnorm)
    net.initialize(mx.init.Normal(0.5))
    rng = np.random.RandomState(7)
    for name, p in net.collect_params().items():
        if name.endswith('gamma'):
            p.set_data(nd.array(rng.uniform(0.5, 1.5, p.shape)))
        elif name.endswith('beta'):
            p.set_data(nd.array(rng.randn(*p.shape)))
    net.save_parameters(str(path))


def reference_multi_ctx(init, steps, global_batch, num_ctx=4, freeze=False):
    """1 process x num_ctx contexts, plain Gluon: split_and_load + Trainer
    (`freeze`: the first layer not trained)."""
    ctx = [mx.cpu(i) for i in range(num_ctx)]
    net = train_dist.make_net()
    net.load_parameters(str(init), ctx=ctx)
    if freeze:
        train_dist.freeze(net)
    trainer = gluon.Trainer(net.collect_params(), *train_dist.OPTIMIZER)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x, y = train_dist.make_data(steps, global_batch)
    for k in range(steps):
        sl = slice(k * global_batch, (k + 1) * global_batch)
        xs = gluon.utils.split_and_load(x[sl], ctx)
        ys = gluon.utils.split_and_load(y[sl], ctx)
        with autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(losses)
        trainer.step(global_batch)
    return net


def reference_whole_batch_bn(init, steps, global_batch):
    """BatchNorm on the whole global batch on one device."""
    net = train_dist.make_net(gluon.nn.BatchNorm)
    net.load_parameters(str(init))
    trainer = gluon.Trainer(net.collect_params(), *train_dist.OPTIMIZER)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x, y = train_dist.make_data(steps, global_batch)
    for k in range(steps):
        sl = slice(k * global_batch, (k + 1) * global_batch)
        with autograd.record():
            loss = loss_fn(net(nd.array(x[sl])), nd.array(y[sl]))
        loss.backward()
        trainer.step(global_batch)
    return net


def params_of(net, tmp_path, name):
    path = tmp_path / name
    net.save_parameters(str(path))
    return load(path)


def assert_params_close(got, want, rtol=1e-4, atol=1e-6, what=''):
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol,
                                   err_msg=f'{what} parameter {k}')



def check_equal_to_four_contexts(out, init, tmp_path, freeze=False, rtol=1e-4, atol=1e-6):
    """The 2-worker job in `out` ended with the parameters of 1 process x 4
    contexts (`freeze`: both with the first layer frozen); returns the
    workers' json records."""
    ranks = [load(out / (f'rank{r:d}.params')) for r in range(2)]
    info = [json.load(open(out / (f'rank{r:d}.json'))) for r in range(2)]
    assert [i['rank'] for i in info] == [0, 1]
    assert all(i['steps'] == STEPS and i['num_workers'] == 2 for i in info)
    want = params_of(reference_multi_ctx(init, STEPS, 16, freeze=freeze), tmp_path,
                     'ref.params')
    for r in range(2):
        assert_params_close(ranks[r], want, rtol=rtol, atol=atol, what=f'rank {r:d}')
    # Same summed gradients and same updates: the workers agree exactly
    # (rank 1 started from other values: init_trainer gave it rank 0's).
    for k in want:
        np.testing.assert_array_equal(ranks[0][k], ranks[1][k], err_msg=k)
    return info


def check_launched_job(out, init, tmp_path):
    """check_equal_to_four_contexts, and the launcher's rank of each worker
    (its output prefix) is ps-lite's rank."""
    info = check_equal_to_four_contexts(out, init, tmp_path)
    assert [i['launch_rank'] for i in info] == ['0', '1']


def check_syncbn_job(out, init, tmp_path):
    """The cross-worker SyncBatchNorm job in `out` (7 rows per worker) ended
    with the parameters of BatchNorm on the global batch on one device, and
    the same running statistics on every context of every worker; returns
    the workers' parameters."""
    want = params_of(reference_whole_batch_bn(init, STEPS, 14), tmp_path, 'ref.params')
    ranks = [load(out / (f'rank{r:d}.params')) for r in range(2)]
    for r in range(2):
        assert_params_close(ranks[r], want, what=f'rank {r:d}')
        info = json.load(open(out / (f'rank{r:d}.json')))
        for name, copies in info['running_copies'].items():
            assert len(copies) == 2
            for c in copies[1:]:
                np.testing.assert_array_equal(c, copies[0], err_msg=name)
    for k in want:
        np.testing.assert_array_equal(ranks[0][k], ranks[1][k], err_msg=k)
    return ranks
