"""Multi-process jobs: a benchmark script's workers started by
``python -m gluon_parallel.launch``, each printing one ``BENCH_RESULT``
JSON line."""
import json
import os
import re
import subprocess
import sys

from . import HERE

RESULT = re.compile(r'BENCH_RESULT (\{.*\})')


def result_line(result):
    """Print a worker's result (a dict) for :func:`run_job`."""
    print('BENCH_RESULT ' + json.dumps(result), flush=True)


def run_job(script, worker_args, timeout, engine='dist_sync', workers=2, env=None):
    """Run `script` ``--worker`` `worker_args` as a job of `workers` worker
    processes (dist_sync: one server; 'horovod': horovodrun), each with
    OMP_NUM_THREADS=1 and `env`. Returns (the workers' results sorted by
    rank or by order, None, the job's output) or (None, why, output)."""
    cmd = [sys.executable, '-m', 'gluon_parallel.launch', '-n', str(workers), '--timeout',
           str(timeout), '--grace', '2']
    cmd += ['--engine', 'horovod'] if engine == 'horovod' else ['-s', '1']
    cmd += ['--', sys.executable, os.path.abspath(script), '--worker'] + \
        [str(a) for a in worker_args]
    full_env = dict(os.environ, OMP_NUM_THREADS='1', **(env or {}))
    full_env['PYTHONPATH'] = os.pathsep.join(
        [os.path.dirname(HERE), HERE] +
        ([full_env['PYTHONPATH']] if full_env.get('PYTHONPATH') else []))
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True,
                          timeout=timeout + 60)
    output = proc.stdout + proc.stderr
    results = [json.loads(m.group(1)) for m in RESULT.finditer(proc.stdout)]
    if proc.returncode != 0 or len(results) != workers:
        tail = output.strip().splitlines()[-3:]
        return None, f"status {proc.returncode:d}: {' | '.join(tail)}", output
    return sorted(results, key=lambda r: r.get('rank', 0)), None, output


def resnet20_worker(contexts, hybridize=False, trainer_cls=None, **trainer_kwargs):
    """A job worker's model: bench_train.py's ResNet-20 (BatchNorm) on
    `contexts` CPU contexts, seeded, and `trainer_cls` (default
    gluon.Trainer; SGD with momentum) on the process's dist kvstore,
    initialised by ``dist.init_trainer``. Returns (trainer, DataParallel,
    DataParallelLoss)."""
    from gluon_parallel import dist   # first: a dist_sync server or scheduler stops here
    import mxnet as mx
    from mxnet import gluon
    import gluon_parallel as gp
    from bench_train import resnet20
    ctx = [mx.cpu(i) for i in range(contexts)]
    mx.random.seed(0)
    net = resnet20(gluon.nn.BatchNorm, {})
    net.initialize(mx.init.Xavier(magnitude=2), ctx=ctx)
    if hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    trainer = (trainer_cls or gluon.Trainer)(
        net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4},
        kvstore=dist.get_kvstore(), update_on_kvstore=False, **trainer_kwargs)
    dist.init_trainer(trainer)
    return trainer, gp.DataParallel(net, ctx), \
        gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
