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


def run_job(script, worker_args, timeout, engine='dist_sync', workers=2, env=None,
            launch_args=()):
    """Run `script` ``--worker`` `worker_args` as a job of `workers` worker
    processes (dist_sync: one server; 'horovod': horovodrun), each with
    OMP_NUM_THREADS=1 and `env`, the launcher given `launch_args` too.
    Returns (the workers' results sorted by rank or by order, None, the
    job's output) or (None, why, output)."""
    cmd = [sys.executable, '-m', 'gluon_parallel.launch', '-n', str(workers), '--timeout',
           str(timeout), '--grace', '2', *launch_args]
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


def alternate(kinds, rounds, run, show):
    """Run one job of each of `kinds` per round, their order reversed every
    other round; print each job. `run(kind)` -> (value, None) or (None,
    why); `show(value)` -> text. Returns ({kind: [values]}, {kind: why of
    a failure}, {kind: median or None}), medians via statistics."""
    import statistics
    values, failed = {k: [] for k in kinds}, {}
    for r in range(rounds):
        for kind in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
            value, why = run(kind)
            if value is None:
                failed[kind] = why
                print(f'  round {r:d} {kind!s:<9} failed: {why}', flush=True)
            else:
                values[kind].append(value)
                print(f'  round {r:d} {kind!s:<9} {show(value)}', flush=True)
    medians = {k: statistics.median(v) if v else None for k, v in values.items()}
    return values, failed, medians


SGD = ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4})


def resnet20_model(contexts, hybridize=False):
    """bench_train.py's ResNet-20 (BatchNorm), seeded and initialised on
    `contexts` CPU contexts (hybridized with static_alloc if asked).
    Returns (net, contexts)."""
    import mxnet as mx
    from mxnet import gluon
    from bench_train import resnet20
    ctx = [mx.cpu(i) for i in range(contexts)]
    mx.random.seed(0)
    net = resnet20(gluon.nn.BatchNorm, {})
    net.initialize(mx.init.Xavier(magnitude=2), ctx=ctx)
    if hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    return net, ctx


def dist_trainer(net, trainer_cls=None, kvstore=None, **trainer_kwargs):
    """`trainer_cls` (default gluon.Trainer; SGD with momentum) for `net`'s
    parameters on `kvstore` (default the process's dist kvstore), updates
    on the workers, initialised by ``dist.init_trainer``."""
    from gluon_parallel import dist
    from mxnet import gluon
    trainer = (trainer_cls or gluon.Trainer)(
        net.collect_params(), *SGD, kvstore=dist.get_kvstore() if kvstore is None else kvstore,
        update_on_kvstore=False, **trainer_kwargs)
    dist.init_trainer(trainer)
    return trainer


def resnet20_worker(contexts, hybridize=False, trainer_cls=None, **trainer_kwargs):
    """A job worker's model: `resnet20_model` and `dist_trainer`. Returns
    (trainer, DataParallel, DataParallelLoss)."""
    from gluon_parallel import dist  # noqa: F401  first: a dist_sync server or scheduler stops here
    from mxnet import gluon
    import gluon_parallel as gp
    net, ctx = resnet20_model(contexts, hybridize)
    trainer = dist_trainer(net, trainer_cls, **trainer_kwargs)
    return trainer, gp.DataParallel(net, ctx), \
        gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
