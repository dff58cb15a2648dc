"""Multi-worker training on an emulated cluster link (issue 48).

The whole run happens in a private network namespace (``unshare -n``, as
root) whose loopback is rate-limited: ``ip link set lo mtu 9000 up`` and
``tc qdisc add dev lo root tbf rate RATE burst 256kb latency 400ms``
(changed between jobs with ``tc qdisc change``). Every process of a job
talks on 127.0.0.1, so every byte the job moves (a worker's push, a
server's reply, a Horovod ring's message) goes through that bucket. Before
a rate is trusted, a plain TCP transfer of 8 MB on 127.0.0.1 measures it.
Where ``unshare``, ``ip`` or ``tc`` are missing or not permitted the script
says so and exits with status 3, having run nothing.

The job: the CIFAR ResNet-20 of bench_train.py (BatchNorm) on synthetic
3x32x32 images, 2 worker processes x 2 CPU contexts, 32 images per worker,
SGD with momentum, each job started by ``python -m gluon_parallel.launch -n
2 -s 1`` (dist_sync, one server) or ``--engine horovod -n 2``. Contenders
(a registry, `CONTENDERS`; ``--contenders`` picks them, ``NAME@key=value``
makes a variant of NAME with gp.Trainer keyword arguments, e.g.
``ours@bucket_cap_mb=0``):

  ours       DataParallel in graph mode (hybridized) + gp.Trainer, defaults
  gluon      hybridized Gluon, split_and_load, gluon.Trainer
  module     MXNet Module, one executor per device, its dist_sync defaults
             (the update on the server)
  ours-hvd   ours on Horovod
  hvd-gluon  hybridized Gluon + Horovod's DistributedTrainer (which reduces
             one device per process: the two contexts' gradients are summed
             into the first before its all-reduce and copied back after)
  ours-fp16, ours-cap1 (not run by default): gp.Trainer(compression='fp16'),
             gp.Trainer(bucket_cap_mb=1)

A contender whose gp.Trainer keyword arguments the installed library does
not take is skipped (said so); the Horovod ones are skipped, with the
reason, where ``import horovod.mxnet`` fails.

Every job measures, on every worker (the slowest worker counts):

  step     --warmup steps, then --steps timed steps (nd.waitall at both
           ends, the workers meeting at a barrier first)
  reduce   the cross-worker reduction alone, --probe times after a
           backward pass, nd.waitall and a barrier: trainer.allreduce_grads()
           (gp.Trainer, gluon.Trainer, Horovod's trainer) or Module's
           update() (its push and pull; the server's update included)
  compute  the same step on a second copy of the model whose trainer has a
           local 'device' kvstore (the two contexts summed, no link): the
           step with the cross-worker reduction removed

and the overlap achieved: (compute + reduce - step) / min(compute, reduce)
(0: the step is their sum; 1: the shorter one is hidden). Rounds alternate
the rates and, within a rate, the contenders; medians over the rounds.

Rates (--rates): by default 300,150,75 Mbit/s. The reduction alone moves
~4.2 MB through the loopback per step (each worker pushes its 1.1 MB of
gradients and pulls the sum back: 34 Mbit; measured: 174 ms at 200 Mbit/s,
336 at 100, 665 at 50), and the computation takes ~228 ms per step on a
quiet machine (the issue's figure), so 34 Mbit / 300 Mbit/s = 114 ms ~0.5x,
150 Mbit/s ~1x and 75 Mbit/s ~2x. ``auto`` calibrates them here with one
job at 200 Mbit/s (the reduction's time taken as inversely proportional to
the rate); ``bare`` is the loopback without tc; ``--rates 200,100`` gives
the issue's columns. The ratio each rate gives is printed (the reduction
at that rate over the median computation of all of ours' jobs), with the
GPU cluster it stands for: ResNet-50 has 102 MB of float32 gradients, a
ring all-reduce moves ~2 x that per machine and step, against ~0.2 s of
V100 computation per step, so link = 2 x 102 MB x 8 / (ratio x 0.2 s):
0.5x is 16 Gbit/s (25 GbE), 1x 8 Gbit/s (10 GbE), 2x 4 Gbit/s (10 GbE
shared by two jobs, or 10 GbE with mixed precision's ~2x faster compute).

Targets (issue 48), each at the rate whose measured ratio (ours' reduction
alone / its computation) is nearest the target's, within a factor sqrt(2)
(else SKIP): at the ~0.5x rate ours <= 0.95 x module and <= 0.85 x
gluon; at the ~1x rate ours <= 1.15 x max(compute, reduce), overlap >= 0.7,
ours <= 0.95 x module; at every rate ours-hvd <= 0.95 x hvd-gluon; at the
~2x rate ours-fp16 <= 0.70 x ours (when run).
"""
import argparse
import ast
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

from harness import HERE, ROOT
from harness import link
from harness.jobs import dist_trainer, resnet20_model, result_line, run_job
from harness.machine import load_avg, load_str
from harness.tables import Targets, finish, fmt_ratio, table


class Contender(NamedTuple):
    """A registry entry: the launcher's engine, the training loop (a key of
    `LOOPS`), gp.Trainer's keyword arguments (loop 'ours'), a description."""
    engine: str
    loop: str
    trainer_kwargs: dict
    about: str


CONTENDERS = {
    'ours': Contender('dist_sync', 'ours', {}, 'DataParallel graph mode + gp.Trainer'),
    'gluon': Contender('dist_sync', 'gluon', {}, 'hybridized Gluon + gluon.Trainer'),
    'module': Contender('dist_sync', 'module', {}, 'MXNet Module, dist_sync defaults'),
    'ours-hvd': Contender('horovod', 'ours', {}, 'ours on Horovod'),
    'hvd-gluon': Contender('horovod', 'hvd-gluon', {},
                           "hybridized Gluon + Horovod's DistributedTrainer"),
    'ours-fp16': Contender('dist_sync', 'ours', {'compression': 'fp16'},
                           "gp.Trainer(compression='fp16')"),
    'ours-cap1': Contender('dist_sync', 'ours', {'bucket_cap_mb': 1},
                           'gp.Trainer(bucket_cap_mb=1)'),
}
DEFAULT = ('ours', 'gluon', 'module', 'ours-hvd', 'hvd-gluon')
DEFAULT_RATES = '300,150,75'
CALIBRATION_MBIT = 200.0
RATIOS = (0.5, 1.0, 2.0)         # reduction alone / computation, the three rates


def parse_contender(text, registry=CONTENDERS):
    """(name, Contender) of a registry name, or of ``NAME@key=value[@...]``:
    a variant of NAME with those gp.Trainer keyword arguments (values are
    Python literals)."""
    base, *pairs = text.strip().split('@')
    if base not in registry:
        raise ValueError(f'unknown contender {base!r}: known are {", ".join(registry)}')
    entry = registry[base]
    if not pairs:
        return base, entry
    if entry.loop != 'ours':
        raise ValueError(f'{text!r}: keyword arguments are gp.Trainer\'s, and {base} does not '
                         'use gp.Trainer')
    kwargs = dict(entry.trainer_kwargs)
    for pair in pairs:
        key, sep, value = pair.partition('=')
        if not sep or not key.isidentifier():
            raise ValueError(f'{text!r}: give keyword arguments as @key=value')
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value             # a bare word: a string
    return text.strip(), entry._replace(trainer_kwargs=kwargs,
                                        about=f'{entry.about} with {kwargs}')


def calibrated_rates(ref_mbit, reduce_s, compute_s, ratios=RATIOS):
    """Rates (Mbit/s, two significant digits) at which the reduction alone
    would take each of `ratios` x `compute_s`, from its time `reduce_s` at
    `ref_mbit`, the reduction's time taken as inversely proportional to the
    rate."""
    if not (reduce_s > 0 and compute_s > 0):
        raise ValueError('calibration needs positive reduce and compute times')
    return [link.nice_rate(ref_mbit * reduce_s / (r * compute_s)) for r in ratios]


WITHIN = math.sqrt(2)             # a target's rate: its ratio within this factor of the wanted


def closest_ratio(ratios, want, within=WITHIN):
    """The key of `ratios` ({key: ratio or None}) whose ratio is nearest
    `want` on a log scale and within a factor `within` of it, or None.
    (With sqrt(2), the windows of 0.5, 1 and 2 tile the axis: a rate
    serves one target at most.)"""
    known = {k: v for k, v in ratios.items() if v and v > 0
             and abs(math.log(v / want)) <= math.log(within) + 1e-12}
    if not known:
        return None
    return min(known, key=lambda k: abs(math.log(known[k] / want)))


# ---------------------------------------------------------------- the workers

class Loop(NamedTuple):
    """A worker's training loop, in the pieces the job times."""
    step: Callable          # one whole step
    backward: Callable      # forward and backward only
    reduce: Callable        # the cross-worker reduction (after backward)
    update: Callable        # the rest of the step (after reduce)
    close: Callable


def _inputs(args):
    from mxnet import nd
    from gluon_parallel import dist
    x = nd.random.uniform(shape=(args.batch, 3, 32, 32))
    y = nd.random.randint(0, 10, shape=(args.batch,)).astype('float32')
    return x, y, dist.global_batch_size(args.batch)


def _trainer_loop(backward, trainer, batch, close=lambda: None):
    def step():
        backward()
        trainer.step(batch)
    return Loop(step, backward, trainer.allreduce_grads, lambda: trainer.update(batch), close)


def ours_loop(args, kwargs, kvstore):
    """DataParallel (graph mode: hybridized) + gp.Trainer(**kwargs)."""
    from mxnet import autograd, gluon
    import gluon_parallel as gp
    net, ctx = resnet20_model(args.contexts, hybridize=True)
    trainer = dist_trainer(net, gp.Trainer, kvstore, **kwargs)
    dp, dpl = gp.DataParallel(net, ctx), gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    x, y, batch = _inputs(args)

    def backward():
        with autograd.record():
            losses = dpl(dp(x), y)
        autograd.backward(losses)
    return _trainer_loop(backward, trainer, batch, dp.close)


def _gluon_backward(net, ctx, x, y):
    from mxnet import autograd, gluon
    loss = gluon.loss.SoftmaxCrossEntropyLoss()

    def backward():
        xs = gluon.utils.split_and_load(x, ctx)
        ys = gluon.utils.split_and_load(y, ctx)
        with autograd.record():
            losses = [loss(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(losses)
    return backward


def gluon_loop(args, kwargs, kvstore):
    """Hybridized Gluon, split_and_load, gluon.Trainer."""
    net, ctx = resnet20_model(args.contexts, hybridize=True)
    trainer = dist_trainer(net, None, kvstore)
    x, y, batch = _inputs(args)
    return _trainer_loop(_gluon_backward(net, ctx, x, y), trainer, batch)


def _local_sum_trainer(hvd):
    """Horovod's DistributedTrainer for several contexts per process: it
    all-reduces each parameter's first gradient only (one device per
    process), so the others are summed into it before and copied back
    after."""
    class LocalSumTrainer(hvd.DistributedTrainer):
        def __init__(self, params, *rest, **kw):
            super().__init__(params, *rest, **kw)
            self.grads = [p.list_grad() for p in params.values() if p.grad_req != 'null']

        def _allreduce_grads(self):
            for g in self.grads:
                for other in g[1:]:
                    g[0] += other.as_in_context(g[0].context)
            super()._allreduce_grads()
            for g in self.grads:
                for other in g[1:]:
                    g[0].copyto(other)
    return LocalSumTrainer


def hvd_gluon_loop(args, kwargs, kvstore):
    """Hybridized Gluon + Horovod's DistributedTrainer (its compute: the
    gluon loop on a local kvstore). The workers' initial values agree by
    seeding (Horovod's broadcast_parameters would send the first context's
    only)."""
    if kvstore is not None:
        return gluon_loop(args, kwargs, kvstore)
    import horovod.mxnet as hvd
    from harness.jobs import SGD
    hvd.init()
    net, ctx = resnet20_model(args.contexts, hybridize=True)
    trainer = _local_sum_trainer(hvd)(net.collect_params(), *SGD)
    x, y, _ = _inputs(args)
    # (the trainer averages over the workers itself: the per-worker batch)
    return _trainer_loop(_gluon_backward(net, ctx, x, y), trainer, args.batch)


def module_loop(args, kwargs, kvstore):
    """MXNet Module, one executor per context, on the job's kvstore."""
    import mxnet as mx
    from gluon_parallel import dist
    from bench_train import _module_step
    net, ctx = resnet20_model(args.contexts)
    x, y, batch = _inputs(args)
    step = _module_step(mx, net, ctx, x, y, batch,
                        kvstore=dist.get_kvstore() if kvstore is None else kvstore)
    mod, data = step.module, step.data
    return Loop(step, lambda: mod.forward_backward(data), mod.update, lambda: None,
                lambda: None)


LOOPS = {'ours': ours_loop, 'gluon': gluon_loop, 'hvd-gluon': hvd_gluon_loop,
         'module': module_loop}


def _time_steps(loop, steps, warmup, meet):
    from mxnet import nd
    for _ in range(warmup):
        loop.step()
    meet()
    start = time.perf_counter()
    for _ in range(steps):
        loop.step()
    nd.waitall()
    return (time.perf_counter() - start) / steps


def _time_reduce(loop, probes, meet):
    from mxnet import nd
    times = []
    for _ in range(probes):
        loop.backward()
        meet()
        start = time.perf_counter()
        loop.reduce()
        nd.waitall()
        times.append(time.perf_counter() - start)
        loop.update()
    return statistics.median(times)


def worker(args):
    """One worker of a job: step, reduction alone, computation alone."""
    from gluon_parallel import dist      # first: a dist_sync server or scheduler stops here
    kwargs = json.loads(args.kwargs)
    make = LOOPS[args.loop]

    def meet():
        dist.barrier()                   # (nd.waitall first)
    job = make(args, kwargs, None)
    step = _time_steps(job, args.steps, args.warmup, meet)
    reduce = _time_reduce(job, args.probe, meet)
    local = make(args, kwargs, 'device')
    compute = _time_steps(local, args.steps, args.warmup, meet)
    result_line({'rank': dist.rank(), 'step': step, 'reduce': reduce, 'compute': compute})
    meet()
    job.close()
    local.close()


# ---------------------------------------------------------------- the parent

class Measure(NamedTuple):
    """One job's figures, seconds, the slowest worker's each."""
    step: float
    compute: float
    reduce: float


def run_one(name, entry, args):
    """One job of contender `name`: (Measure, None) or (None, why)."""
    worker_args = ['--loop', entry.loop, '--kwargs', json.dumps(entry.trainer_kwargs),
                   '--steps', args.steps, '--warmup', args.warmup, '--probe', args.probe,
                   '--batch', args.batch, '--contexts', args.contexts]
    results, why, _ = run_job(__file__, worker_args, args.timeout, engine=entry.engine)
    if results is None:
        return None, why
    return Measure(*(max(r[k] for r in results) for k in Measure._fields)), None


def _python_check(code):
    """Run `code` in a fresh interpreter with this checkout first on the
    path: (stdout, None) or (None, its last error line)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, HERE] + ([os.environ['PYTHONPATH']] if os.environ.get('PYTHONPATH') else [])))
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return None, lines[-1] if lines else f'status {proc.returncode:d}'
    return proc.stdout, None


def runnable(chosen):
    """The contenders of `chosen` ({name: Contender}) that can run here, and
    {name: why} for the others (Horovod missing, gp.Trainer keyword
    arguments the installed library does not take)."""
    skipped = {}
    if any(c.engine == 'horovod' for c in chosen.values()):
        _, why = _python_check('import horovod.mxnet')
        if why is None and not shutil.which('horovodrun'):
            why = 'horovodrun not on PATH'
        if why is not None:
            for name, c in chosen.items():
                if c.engine == 'horovod':
                    skipped[name] = f'Horovod unavailable: {why}'
    if any(c.trainer_kwargs for c in chosen.values()):
        out, why = _python_check('import inspect, json, gluon_parallel as gp; '
                                 'print(json.dumps(list(inspect.signature(gp.Trainer).parameters)))')
        known = set(json.loads(out)) if out else set()
        for name, c in chosen.items():
            unknown = sorted(set(c.trainer_kwargs) - known)
            if unknown and name not in skipped:
                skipped[name] = (f'gp.Trainer does not take {", ".join(unknown)} in this '
                                 'checkout' if out else f'cannot inspect gp.Trainer: {why}')
    return {n: c for n, c in chosen.items() if n not in skipped}, skipped


class Link:
    """The namespace's loopback: its rate and the socket checks."""

    def __init__(self):
        self.qdisc = False
        self.checks = {}                  # rate label: [measured Mbit/s, ...]

    def set(self, rate):
        self.qdisc = link.set_rate(rate, self.qdisc)
        mbit = link.socket_mbit(link.check_bytes(rate.mbit))
        self.checks.setdefault(rate.label, []).append(mbit)
        configured = 'no tc' if rate.mbit is None else f'{rate.mbit:g} Mbit/s configured'
        progress(f'link {rate.label}: socket check {mbit:.0f} Mbit/s ({configured}; '
                 f'{link.qdisc()})')
        if rate.mbit is not None and not 0.5 * rate.mbit < mbit < 1.5 * rate.mbit:
            raise link.LinkError(f'the socket check measured {mbit:.0f} Mbit/s on a link '
                                 f'configured at {rate.mbit:g} Mbit/s: the rate does not hold')


START = time.monotonic()


def progress(text):
    minutes, seconds = divmod(int(time.monotonic() - START), 60)
    print(f'[bench_link {minutes:d}:{seconds:02d}] {text}', file=sys.stderr, flush=True)


def calibrate(the_link, args, entry):
    """Rates for `RATIOS` from one job of `entry` at CALIBRATION_MBIT."""
    the_link.set(link.Rate(f'{CALIBRATION_MBIT:g} Mbit/s', CALIBRATION_MBIT))
    m, why = run_one('ours', entry, args)
    if m is None:
        raise link.LinkError(f'the calibration job failed: {why}')
    mbits = calibrated_rates(CALIBRATION_MBIT, m.reduce, m.compute)
    progress(f'calibration at {CALIBRATION_MBIT:g} Mbit/s: compute {m.compute * 1e3:.0f} ms, '
             f'reduce {m.reduce * 1e3:.0f} ms -> rates ' +
             ', '.join(f'{r:g}x: {b:g} Mbit/s' for r, b in zip(RATIOS, mbits)))
    return [link.Rate(f'{b:g} Mbit/s', b) for b in mbits]


def rotated(items, k):
    items = list(items)
    k %= max(1, len(items))
    return items[k:] + items[:k]


def measure(the_link, rates, chosen, args):
    """Every job of the run: {rate label: {name: [Measure, ...]}}, and
    {(rate label, name): why} for the jobs that failed."""
    got = {r.label: {n: [] for n in chosen} for r in rates}
    failed = {}
    total, done = args.rounds * len(rates) * len(chosen), 0
    for rnd in range(args.rounds):
        for i, rate in enumerate(rotated(rates, rnd)):
            the_link.set(rate)
            for name in rotated(chosen, rnd + i):
                m, why = run_one(name, chosen[name], args)
                done += 1
                head = f'job {done:d}/{total:d} round {rnd + 1:d} {rate.label} {name}:'
                if m is None:
                    failed[(rate.label, name)] = why
                    progress(f'{head} failed: {why}')
                    continue
                got[rate.label][name].append(m)
                progress(f'{head} {m.step * 1e3:.0f} ms/step (compute {m.compute * 1e3:.0f}, '
                         f'reduce {m.reduce * 1e3:.0f})')
    return got, failed


def medians(got):
    """{rate: {name: Measure of medians}} for the contenders with a job."""
    return {rate: {name: Measure(*(statistics.median(getattr(m, f) for m in ms)
                                   for f in Measure._fields))
                   for name, ms in by_name.items() if ms}
            for rate, by_name in got.items()}


def _ratio(med, a, b):
    return med[a].step / med[b].step if a in med and b in med and a != b else None


def report_rows(rates, med, chosen, got, skipped):
    """The table: per rate and contender, the medians, their ratios, and
    the step against the baselines on the same engine. No overlap on the
    bare loopback: a reduction of a few ms makes it noise over a tiny
    denominator."""
    def against(at, name, other):
        same = other in chosen and chosen[other].engine == chosen[name].engine
        return fmt_ratio(_ratio(at, name, other) if same else None)
    names, rows = list(chosen), []
    for rate in rates:
        at = med[rate.label]
        for name in names:
            if name not in at:
                rows.append([rate.label, name] + ['-'] * 9 +
                            ['skipped' if name in skipped else 'failed'])
                continue
            m = at[name]
            rows.append([rate.label, name, f'{m.step * 1e3:.0f}', f'{m.compute * 1e3:.0f}',
                         f'{m.reduce * 1e3:.0f}', fmt_ratio(m.reduce / m.compute),
                         fmt_ratio(m.step / max(m.compute, m.reduce)),
                         fmt_ratio(link.overlap(m.compute, m.reduce, m.step)
                                   if rate.mbit is not None else None),
                         against(at, name, 'module'), against(at, name, 'gluon'),
                         against(at, name, 'hvd-gluon'),
                         str(len(got[rate.label][name]))])
    return table(['rate', 'contender', 'ms/step', 'compute ms', 'reduce ms', 'reduce / compute',
                  'step / max(compute, reduce)', 'overlap', 'x module', 'x gluon',
                  'x hvd-gluon', 'jobs'], rows)


def ours_ratios(rates, med, got, name='ours'):
    """{rate label: `name`'s reduction alone at that rate / its computation},
    links only. The computation does not depend on the rate: the median
    over all of `name`'s jobs (steadier on a busy machine)."""
    computes = [m.compute for by in got.values() for m in by.get(name, [])]
    if not computes:
        return {}
    compute = statistics.median(computes)
    return {r.label: (med[r.label][name].reduce / compute if name in med[r.label] else None)
            for r in rates if r.mbit is not None}


def print_rates(rates, med, got, checks):
    """Per rate: the socket check, the ratio it gives, the cluster it stands for."""
    print()
    print('What each rate stands for: the ratio of ours\' reduction alone there to its '
          'computation (the median over all its jobs), and the GPU cluster with that ratio '
          '(ResNet-50, 102 MB of float32 gradients, a ring all-reduce moving ~2 x that per '
          'machine and step, ~0.2 s of V100 computation per step: link = 2 x 102 MB x 8 / '
          '(ratio x 0.2 s)):')
    ratios, hvd_ratios = ours_ratios(rates, med, got), ours_ratios(rates, med, got, 'ours-hvd')
    for rate in rates:
        check = ', '.join(f'{c:.0f}' for c in checks.get(rate.label, [])) or '-'
        r = ratios.get(rate.label)
        if rate.mbit is None:
            print(f'  {rate.label}: no tc (socket check {check} Mbit/s)')
        elif r is None:
            print(f'  {rate.label}: socket check {check} Mbit/s; no figure of ours')
        else:
            gbit = link.cluster_link_gbit(r)
            hvd = hvd_ratios.get(rate.label)
            print(f'  {rate.label} (socket check {check} Mbit/s): ours\' reduction alone = '
                  f'{r:.2f} x its computation; on V100s, a {gbit:.1f} Gbit/s link per machine '
                  f'(~{link.ethernet_class(gbit):d} GbE)' +
                  ('' if hvd is None else f'; ours-hvd\'s: {hvd:.2f} x'))


def check_targets(rates, med, got, chosen, skipped):
    """Issue 48's targets, each at the rate whose ratio of ours' reduction
    to its computation is nearest the target's."""
    t = Targets()
    ratios = ours_ratios(rates, med, got)
    half, one, two = (closest_ratio(ratios, r) for r in RATIOS)
    measured = ', '.join(f'{k} {fmt_ratio(v)}' for k, v in ratios.items()) or 'none'

    def ratio(rate, a, b, limit, what, want=None):
        if rate is None:
            t.note(f'{what} at ~{want:g}x', 'SKIP', f'no rate with ours\' reduce/compute '
                   f'within {want / WITHIN:.2f}-{want * WITHIN:.2f} (measured: {measured})')
            return
        missing = [n for n in (a, b) if n not in med[rate]]
        if missing:
            t.note(f'{what} at {rate}', 'SKIP', '; '.join(
                f'{n}: {skipped.get(n) or ("no result" if n in chosen else "not run")}'
                for n in missing))
        else:
            known = f' (ours\' reduce/compute {fmt_ratio(ratios.get(rate))})'
            t.check(f'{what} at {rate}{known}', _ratio(med[rate], a, b), limit)
    ratio(half, 'ours', 'module', 0.95, 'ours / module ms per step', 0.5)
    ratio(half, 'ours', 'gluon', 0.85, 'ours / gluon ms per step', 0.5)
    if one is None:
        ratio(one, 'ours', 'ours', 1.15, 'ours step / max(compute, reduce), overlap', 1.0)
    elif 'ours' in med[one]:
        m = med[one]['ours']
        t.check(f'ours step / max(compute, reduce) at {one}', m.step / max(m.compute, m.reduce),
                1.15)
        t.check(f'ours overlap at {one}', link.overlap(m.compute, m.reduce, m.step), 0.7, '>=')
    ratio(one, 'ours', 'module', 0.95, 'ours / module ms per step', 1.0)
    hvd = ('ours-hvd', 'hvd-gluon')
    if any(n in chosen or n in skipped for n in hvd):
        for rate in rates:
            if rate.mbit is not None:
                ratio(rate.label, *hvd, 0.95, 'ours-hvd / hvd-gluon ms per step')
    else:
        t.note('ours-hvd / hvd-gluon ms per step', 'SKIP', 'not run')
    if 'ours-fp16' in chosen or 'ours-fp16' in skipped:
        ratio(two, 'ours-fp16', 'ours', 0.70, 'ours-fp16 / ours ms per step', 2.0)
    return t


def inside(args):
    """The run, inside the namespace (as root): the link, the jobs, the report."""
    rates = None if args.rates == 'auto' else link.parse_rates(args.rates)
    chosen = dict(parse_contender(t) for t in args.contenders.split(',') if t.strip())
    live, skipped = runnable(chosen)
    for name, why in skipped.items():
        print(f'  {name}: skipped: {why}', flush=True)
    the_link = Link()
    try:
        link.setup_loopback()
        if rates is None:
            rates = calibrate(the_link, args, live.get('ours') or CONTENDERS['ours'])
        load_before = load_avg()
        print(f'bench_link: ResNet-20, 2 workers x {args.contexts:d} CPU contexts, '
              f'{args.batch:d} images per worker; {args.steps:d} timed steps per job, '
              f'{args.rounds:d} rounds; rates {", ".join(r.label for r in rates)}; '
              f'{len(live):d} contenders, {args.rounds * len(rates) * len(live):d} jobs; '
              f'{load_str(load_before)}', flush=True)
        got, failed = measure(the_link, rates, live, args)
    except link.LinkError as e:
        print(f'bench_link: {e}: nothing more run', file=sys.stderr)
        return 3
    med = medians(got)
    print_rates(rates, med, got, the_link.checks)
    tbl = report_rows(rates, med, chosen, got, skipped)
    targets = check_targets(rates, med, got, chosen, skipped)
    status = dict(skipped, **{f'{r} {n}': why for (r, n), why in failed.items()})
    finish('link', args.json, tbl, targets, load_before, status=status,
           rates=[r._asdict() for r in rates], socket_mbit=the_link.checks,
           jobs={r: {n: [m._asdict() for m in ms] for n, ms in by.items()}
                 for r, by in got.items()},
           contenders={n: c._asdict() for n, c in chosen.items()})
    return 0


def preflight(args):
    """Usage errors first, then the tools: None if the link can be made,
    else why not."""
    if args.rates != 'auto':
        link.parse_rates(args.rates)
    for t in args.contenders.split(','):
        if t.strip():
            parse_contender(t)
    missing = link.missing_tools()
    if missing:
        return f'{", ".join(missing)} not found'
    proc = subprocess.run(link.namespace_command(['-c', 'pass']), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return f'"unshare -n" is not permitted here: {proc.stderr.strip()}'
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--contenders', default=','.join(DEFAULT),
                   help='comma-separated: ' + ', '.join(CONTENDERS) +
                        ', or NAME@key=value for gp.Trainer keyword arguments '
                        '(default %(default)s)')
    p.add_argument('--rates', default=DEFAULT_RATES,
                   help='comma-separated Mbit/s (200, 1gbit...) or bare, or auto: calibrated '
                        'for reduce/compute 0.5, 1, 2 (default %(default)s)')
    p.add_argument('--rounds', type=int, default=2,
                   help='rounds of every job (default %(default)s)')
    p.add_argument('--steps', type=int, default=10, help='timed steps (default %(default)s)')
    p.add_argument('--warmup', type=int, default=2, help='untimed steps (default %(default)s)')
    p.add_argument('--probe', type=int, default=5,
                   help='timings of the reduction alone (default %(default)s)')
    p.add_argument('--batch', type=int, default=32, help='per-worker batch (default %(default)s)')
    p.add_argument('--contexts', type=int, default=2,
                   help='CPU contexts per worker (default %(default)s)')
    p.add_argument('--timeout', type=int, default=600, help='seconds per job (default %(default)s)')
    p.add_argument('--quick', action='store_true', help='smoke run: 1 round, 3 steps')
    p.add_argument('--json', help='results file (default benchmarks/results/link.json; none '
                                  'with --quick)')
    p.add_argument('--inside', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--loop', choices=sorted(LOOPS), help=argparse.SUPPRESS)
    p.add_argument('--kwargs', default='{}', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.probe = 1, 3, 1, 2
        args.timeout = min(args.timeout, 300)
    elif args.json is None:
        args.json = os.path.join(HERE, 'results', 'link.json')
    if args.inside:
        return inside(args)
    try:
        why = preflight(args)
    except ValueError as e:
        p.error(str(e))
    if why is not None:
        print(f'bench_link: cannot emulate the link: {why}. Nothing run (it needs root, '
              'unshare, ip and tc).', file=sys.stderr)
        return 3
    argv = sys.argv[1:] if argv is None else list(argv)
    return subprocess.run(link.namespace_command([os.path.abspath(__file__), '--inside']
                                                 + argv)).returncode


if __name__ == '__main__':
    sys.exit(main())
