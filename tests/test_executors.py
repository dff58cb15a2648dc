"""Engine operations of a whole training step (_gluon/executors.py's bulk
segments per replica, gp.Trainer's buckets): counted by MXNet's profiler in
benchmarks/bench_engine_ops.py, run in a child process (the profiler's
aggregate mode stops executors bound later from bulking)."""
import json
import os
import pathlib
import subprocess
import sys

from gluon_parallel._gluon.executors import replica_period

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_replica_period_needs_one_sequence_repeated_per_replica():
    assert replica_period(['fc', 'relu', 'fc'] * 4, 4) == 3
    assert replica_period(['fc', 'fc'] * 2, 2) == 2          # (not the shorter period 1)
    assert replica_period(['fc', 'relu', 'relu', 'fc'], 2) is None
    assert replica_period(['fc'] * 5, 2) == 2                 # (one left after the replicas')
    # the replicas' operators, then statistics outputs of every replica
    assert replica_period(['conv', 'bn', 'relu'] * 4 + ['concat', 'square'] * 2, 4) == 3
    assert replica_period(['conv', 'bn'] * 2 + ['concat'] * 5, 2) is None   # (mostly tail)
    assert replica_period([], 2) is None


def test_tiny_mlp_step_runs_no_more_engine_operations_than_module(tmp_path):
    """Tiny MLP, 4 CPU contexts, graph mode + gp.Trainer: every executor
    operator in a per-replica bulk segment, one kvstore sum for the one
    bucket, and no more engine operations per step than MXNet's Module
    (the previous code: 130 against Module's 60)."""
    out = tmp_path / 'ops.json'
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + ([os.environ['PYTHONPATH']] if os.environ.get('PYTHONPATH') else [])))
    env.pop('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN', None)
    proc = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'bench_engine_ops.py'),
                           '--steps', '5', '--contenders', 'module,ours,ours-per-key',
                           '--json', str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    kinds, counts = result['per_kind'], result['counts']
    assert kinds['ours'].get('executor: single node', 0) == 0, counts['ours']
    # network and loss executors x 4 replicas x forward and backward
    assert kinds['ours']['executor: bulked segment'] == 16, counts['ours']
    assert counts['ours']['ElementwiseSum'] == 1 and counts['ours-per-key']['ElementwiseSum'] == 4
    # (a wait_to_read pushes a WaitForVar only when the previous step is
    # still running: timing, not work; Module's step never waits)
    work = {name: sum(v for op, v in c.items() if op != 'WaitForVar')
            for name, c in counts.items()}
    assert work['ours'] <= work['module'], kinds


def backward_operations(kvstore):
    """(path, engine operations of the network's backward) of
    graph_scripts/backward_pieces.py with a gp.Trainer on `kvstore`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + ([os.environ['PYTHONPATH']] if os.environ.get('PYTHONPATH') else [])))
    for k in ('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN', 'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD'):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(ROOT / 'tests' / 'graph_scripts' /
                                               'backward_pieces.py'), kvstore],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result['path'], result['backward_operations']


def test_backward_is_cut_into_pieces_only_where_the_reduction_crosses_a_link():
    """A 12-layer MLP (25 backward operators per replica) on 2 contexts:
    with a local store each replica's backward is one engine operation;
    with a dist store it runs in pieces of at most LINK_PIECE operators, so
    that a bucket's push can start before the whole backward has run."""
    assert backward_operations('device') == ('graph', 2)
    path, pieces = backward_operations('dist_sync')
    assert path == 'graph' and pieces >= 4, pieces      # (2: one per replica)
    from gluon_parallel.graph.executor import LINK_PIECE
    assert pieces >= 2 * -(-25 // LINK_PIECE)
