"""What a lost worker costs an elastic job: the time from a worker's death
to the first step of the next attempt, and what it is made of.

The job: ``python -m gluon_parallel.launch -n 1:2 --discover 'cat HOSTS'``
(dist_sync with one server, or ``--engine horovod``), each worker training
bench_train.py's ResNet-20 (BatchNorm, 1 CPU context, global batch 64 cut
by dist.GlobalBatchSampler) with a dist.save_checkpoint every 5 steps. Once
the first checkpoint is written, this script rewrites HOSTS to one slot and
SIGKILLs worker 1 (time 0); the launcher stops the attempt and starts the
next at 1 worker, which loads the checkpoint and trains one step; then this
script stops the launcher. Each phase ends at an event whose wall-clock
time is known here: a ``[launch]`` line (stamped when it arrives) or a
time the new worker prints (same clock, same machine):

  detect       the launcher reports the death (its loop polls every 0.1 s)
  stop         the old attempt's other processes stopped (restart line)
  discovery    the discovery command ran (the layout line of attempt 1)
  start        the new worker runs its first line (fork, exec, Python)
  import       gluon_parallel and MXNet imported
  rendezvous   dist.get_kvstore() returned: scheduler and server (dist_sync)
               or Horovod's Gloo ring (horovod) ready
  load         the model built and the checkpoint loaded (dist.load_checkpoint)
  first step   one step done (nd.waitall)

Timings are noisy while other work runs on the machine: the load average
is printed; --rounds repeats and gives medians.
"""
import argparse
import os
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from harness import HERE
from harness.machine import load_str
from harness.tables import table

PHASES = ('detect', 'stop', 'discovery', 'start', 'import', 'rendezvous', 'load', 'first step')
EVENTS = ('start', 'imported', 'kvstore', 'loaded', 'stepped')
STEPS = 200          # attempt 0 trains until it is stopped


def stamp(event):
    print(f'BENCH {event} {time.time():.6f} attempt {os.environ.get("GLUON_PARALLEL_RESTART")}',
          flush=True)


def worker(args):
    """One worker of the job (run by the launcher)."""
    stamp('start')
    from gluon_parallel import dist     # a dist_sync server or scheduler stops here
    import mxnet as mx
    from mxnet import autograd, gluon, nd
    import gluon_parallel as gp
    from bench_train import resnet20
    stamp('imported')
    dist.get_kvstore()
    stamp('kvstore')
    ctx = [mx.cpu(0)]
    mx.random.seed(0)
    net = resnet20(gluon.nn.BatchNorm, {})
    net.initialize(mx.init.Xavier(magnitude=2), ctx=ctx)
    net(nd.zeros((1, 3, 32, 32)))
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                            kvstore=dist.get_kvstore())
    prefix = os.path.join(args.out, 'ckpt')
    position = {'epoch': 0, 'samples': 0}
    if os.path.exists(prefix + '.json'):
        position = dist.load_checkpoint(prefix, net, trainer)['position']
    else:
        dist.init_trainer(trainer)
    stamp('loaded')
    sampler = dist.GlobalBatchSampler(STEPS * 64, 64)
    sampler.set_epoch(0, position['samples'])
    data = nd.random.uniform(shape=(64, 3, 32, 32))
    label = nd.random.randint(0, 10, shape=(64,)).astype('float32')
    dp = gp.DataParallel(net, ctx)
    dp_loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    for k, part in enumerate(sampler):
        rows = nd.array([i % 64 for i in part], dtype='int64')
        with autograd.record():
            losses = dp_loss(dp(data.take(rows)), label.take(rows))
        autograd.backward(losses)
        trainer.step(sampler.global_batch_size(k))
        nd.waitall()
        if k == 0:
            stamp('stepped')
        if (k + 1) % 5 == 0:
            dist.save_checkpoint(prefix, net, trainer, position=sampler.position(k + 1))


def _lines(popen, seen, until, limit):
    """Read the launcher's stdout and stderr, stamping each line on arrival
    into `seen` [(time, line)], until until(seen) holds."""
    sel = selectors.DefaultSelector()
    bufs = {}
    for f in (popen.stdout, popen.stderr):
        sel.register(f, selectors.EVENT_READ)
        bufs[f.fileno()] = b''
    deadline = time.monotonic() + limit
    try:
        while not until(seen):
            if time.monotonic() > deadline:
                raise RuntimeError('the job never got there:\n' + '\n'.join(x for _, x in seen))
            for key, _ in sel.select(0.1):
                data = os.read(key.fd, 65536)
                now = time.time()
                bufs[key.fd] += data
                *done, bufs[key.fd] = bufs[key.fd].split(b'\n')
                seen += [(now, x.decode(errors='replace')) for x in done]
    finally:
        sel.close()


def _victim(popen):
    """The pid of worker 1 of attempt 0 (the launcher's child, or
    horovodrun's grandchild): the process whose environment says so."""
    import psutil
    for p in psutil.Process(popen.pid).children(recursive=True):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get('GLUON_PARALLEL_RESTART') == '0' and p.name().startswith('python') and \
                (env.get('GLUON_PARALLEL_LAUNCH_RANK') == '1' or env.get('HOROVOD_RANK') == '1'):
            return p.pid
    raise RuntimeError('worker 1 not found')


def one_round(args, engine):
    """{phase: seconds} of one death and restart."""
    out = tempfile.mkdtemp(prefix='bench_restart')
    hosts = os.path.join(out, 'hosts')
    with open(hosts, 'w') as f:
        f.write('localhost:2\n')
    env = dict(os.environ, OMP_NUM_THREADS='1', MXNET_CPU_WORKER_NTHREADS='1',
               PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE),
                                           os.environ.get('PYTHONPATH', '')]))
    cmd = [sys.executable, '-m', 'gluon_parallel.launch', '-n', '1:2', '--discover',
           f'cat {hosts}', '--max-restarts', '1', '--engine', engine, '--grace', '2', '--',
           sys.executable, os.path.abspath(__file__), '--worker', '--out', out]
    popen = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
    seen = []
    try:
        _lines(popen, seen, lambda s: os.path.exists(os.path.join(out, 'ckpt.json')),
               args.limit)
        with open(hosts, 'w') as f:
            f.write('localhost:1\n')
        victim = _victim(popen)
        died = time.time()
        os.kill(victim, signal.SIGKILL)
        _lines(popen, seen, lambda s: any('BENCH stepped' in x and 'attempt 1' in x
                                          for _, x in s), args.limit)
    finally:
        popen.send_signal(signal.SIGTERM)
        popen.communicate(timeout=60)
    return _phases(seen, died)


def _phases(seen, died):
    def arrival(text):
        return next(t for t, x in seen if text in x)

    def printed(event):
        return next(float(x.split()[-3]) for _, x in seen
                    if f'BENCH {event} ' in x and x.endswith('attempt 1'))
    ends = [arrival(' exited with status '), arrival('[launch] restart 1 of 1'),
            arrival('[launch] attempt 1:')] + [printed(e) for e in EVENTS]
    times = [died] + ends
    return {phase: times[i + 1] - times[i] for i, phase in enumerate(PHASES)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--out', help=argparse.SUPPRESS)
    p.add_argument('--engines', default='dist_sync,horovod')
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--limit', type=float, default=300, help='seconds per round at most')
    args = p.parse_args()
    if args.worker:
        return worker(args)
    engines = args.engines.split(',')
    results = {e: [] for e in engines}
    for _ in range(args.rounds):
        for engine in engines:          # interleaved
            results[engine].append(one_round(args, engine))
    print(f'Restart cost: a worker SIGKILLed -> first step at 1 worker, medians of '
          f'{args.rounds:d} rounds ({load_str()})\n')
    rows = []
    for phase in PHASES + ('total',):
        row = [phase]
        for engine in engines:
            values = [sum(r.values()) if phase == 'total' else r[phase] for r in results[engine]]
            row.append(f'{statistics.median(values):.2f} s')
        rows.append(row)
    print(table(['phase'] + engines, rows))


if __name__ == '__main__':
    main()
