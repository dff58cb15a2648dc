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
