"""Engine operations per training step: what each contender asks MXNet's
engine to run, counted by MXNet's own profiler.

The step is bench_step.py's (tiny MLP, hybridized, 4 CPU contexts, global
batch 32: forward, loss, backward, update). Each contender runs in its own
process: set up and warm up as bench_step.py does (every executor bound
first: MXNet's executors do not bulk their operators when bound while the
profiler aggregates), then --steps steps under ``mx.profiler`` with
``profile_all`` and ``aggregate_stats``; the profiler's count of each
operator it ran (one count per engine operation: a bulked executor segment
counts once, ``[op1,op2,...]``; ``CopyCPU2CPU`` is a copy between arrays,
``DeleteVariable`` an array's free), divided by the steps. Counts, not
times: the same on any machine.

Contenders (bench_step.py's, plus one):

  module        MXNet's Module API: forward_backward + update
  module-gl     the same with Gluon's loss traced under MakeLoss (the
                operators ours runs)
  ours          graph mode + gluon_parallel.Trainer (gradient buckets)
  ours-per-key  the same with bucket_cap_mb=0 (one kvstore key per parameter)
  ours-gluon    graph mode + gluon.Trainer

With ``--model resnet20``: bench_train.py's ResNet-20 (BatchNorm, batch
--batch) and its contenders module+BN (module), ours-fused+BN-h (ours) and
ours-graph+BN-h (ours-gluon).

Target (issue 40): ours' engine operations per step <= module's (the tiny
MLP).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from harness import HERE
from harness.tables import Targets, save_json, table

CONTENDERS = ('module', 'module-gl', 'ours', 'ours-per-key', 'ours-gluon')
RESNET20 = {'module': 'module+BN', 'ours': 'ours-fused+BN-h', 'ours-gluon': 'ours-graph+BN-h'}

#: Operator name -> what it is on the step's path (anything else: an
#: executor node run on its own).
KINDS = {'CopyCPU2CPU': 'copy between arrays', 'DeleteVariable': 'free of an array',
         'ElementwiseSum': 'kvstore sum', 'ones_like': 'losses\' head gradients (ones)',
         'multi_sgd_mom_update': 'update (multi-tensor SGD)',
         'multi_sgd_update': 'update (multi-tensor SGD)', 'sgd_mom_update': 'update (SGD)',
         'WaitForVar': 'wait (wait_to_read)'}
SKIP = {'ResourceParallelRandomSetSeed'}


def kind(name):
    if name.startswith('['):
        return 'executor: bulked segment'
    return KINDS.get(name, 'executor: single node')


def worker(name, model, n, batch, steps):
    """Print the JSON {operator: count per step} of contender `name`."""
    import mxnet as mx
    from mxnet import nd
    if model == 'resnet20':
        import bench_train
        contender = bench_train.Contender(RESNET20[name], {})
        contender.setup({'n': n, 'batch': batch, 'warmup': 2})
    else:
        import bench_step
        contender = bench_step.Contender(name, {'warmup': 10})
        contender.setup({'n': n, 'batch': batch})
    nd.waitall()
    # The profiler's own trace file, in a directory of ours: it may be
    # rewritten when the process exits, which must never touch a device file.
    trace = os.path.join(tempfile.mkdtemp(prefix='bench_engine_ops-'), 'profile.json')
    mx.profiler.set_config(profile_all=True, aggregate_stats=True, filename=trace)
    mx.profiler.set_state('run')
    for _ in range(steps):
        contender.step()
    nd.waitall()
    mx.profiler.set_state('stop')
    counts = {op: n / steps for op, n in operator_counts(mx.profiler.dumps(reset=True)).items()
              if op not in SKIP}
    print('BENCH_OPS ' + json.dumps(counts), flush=True)


def operator_counts(dump):
    """{operator: engine operations} of the 'operator' section of MXNet's
    aggregated profiler dump (``mx.profiler.dumps()``)."""
    counts, section = {}, None
    for line in dump.splitlines():
        words = line.split()
        if line.strip() in ('operator', 'MXNET_C_API', 'Device Storage'):
            section = line.strip()
        elif section == 'operator' and len(words) >= 6 and words[-5].isdigit():
            counts[' '.join(words[:-5])] = int(words[-5])
    return counts


def count(name, args):
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([os.path.dirname(HERE), HERE] +
                                        ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), '--worker', name,
                           '--model', args.model, '--n', str(args.n), '--batch', str(args.batch),
                           '--steps', str(args.steps)],
                          env=env, capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith('BENCH_OPS '):
            return json.loads(line[len('BENCH_OPS '):])
    raise RuntimeError(f'{name} failed: {proc.stderr.strip().splitlines()[-3:]}')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--n', type=int, default=4, help='CPU contexts (default %(default)s)')
    p.add_argument('--batch', type=int, default=32, help='global batch (default %(default)s)')
    p.add_argument('--model', choices=('mlp', 'resnet20'), default='mlp')
    p.add_argument('--steps', type=int, default=50, help='counted steps (default %(default)s)')
    p.add_argument('--contenders', default=','.join(CONTENDERS))
    p.add_argument('--json', help='write the counts per contender to this file')
    p.add_argument('--worker', help=argparse.SUPPRESS)
    p.add_argument('--quick', action='store_true', help='smoke run: 5 steps')
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.model, args.n, args.batch, args.steps)
    if args.quick:
        args.steps = 5
    names = args.contenders.split(',')
    if args.model == 'resnet20':
        names = [n for n in names if n in RESNET20]
    print(f'bench_engine_ops: {"tiny MLP" if args.model == "mlp" else "ResNet-20"}, '
          f'{args.n:d} CPU contexts, global batch {args.batch:d}, '
          f'engine operations per step over {args.steps:d} steps (MXNet profiler)')
    counts = {name: count(name, args) for name in names}
    kinds = sorted({kind(op) for c in counts.values() for op in c})
    per_kind = {name: {k: sum(v for op, v in c.items() if kind(op) == k) for k in kinds}
                for name, c in counts.items()}
    rows = [[k] + [f'{per_kind[name][k]:g}' for name in names] for k in kinds]
    rows.append(['**total**'] + [f'**{sum(c.values()):g}**' for c in counts.values()])
    print()
    print(table(['operation kind'] + names, rows))
    ops = sorted({op for c in counts.values() for op in c})
    print()
    print(table(['operator'] + names,
                [[op.replace('|', '/')] + [f'{counts[name].get(op, 0):g}' for name in names]
                 for op in ops]))
    targets = Targets()
    if 'ours' in counts and 'module' in counts:
        targets.check('ours engine operations per step / module\'s (waits included)',
                      sum(counts['ours'].values()) / sum(counts['module'].values()), 1.0)
    print()
    print(targets.render())
    save_json(args.json, {'bench': 'engine_ops', 'counts': counts, 'per_kind': per_kind,
                          'targets': targets.items})
    return 0


if __name__ == '__main__':
    sys.exit(main())
