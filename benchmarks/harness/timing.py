"""Timing: the parent interleaves timing chunks of the contenders
round-robin, so machine noise hits all of them alike; a worker times its
iterations with `time_iters`."""
import statistics
import sys
import time

from .workers import Hang, Skip, WorkerError


def interleave(workers, rounds, iters, timeout, on_round=None):
    """Time `iters` iterations of each live worker per round, rotating the
    order every round. Returns {name: [per-iteration seconds, ...]}; each
    worker's ``cpu`` gets the CPU seconds per iteration of every run,
    (whole process, main thread)."""
    times = {w.name: [] for w in workers}
    if not workers:
        return times
    for r in range(rounds):
        order = workers[r % len(workers):] + workers[:r % len(workers)]
        for w in order:
            if w.dead:
                continue
            try:
                k = max(1, int(round(iters * w.scale)))
                reply = w.request({'op': 'run', 'iters': k}, timeout)
                times[w.name].extend(reply['times'])
                if reply.get('cpu'):
                    w.cpu.append([c / k for c in reply['cpu']])
            except (Hang, WorkerError) as e:
                print(f'  {w.name}: {e}', file=sys.stderr)
        if on_round:
            on_round(r)
    return times


def setup_all(workers, config, timeout):
    """Send `config` to every live worker at once (they set up concurrently)
    and collect the answers; returns {name: status} for those that failed,
    status being 'hangs', 'skipped: ...' or an error message."""
    failed = {}
    for w in workers:
        try:
            if w.pending:
                w.receive(timeout)
            w.send({'op': 'setup', 'config': config})
        except (Skip, Hang, WorkerError) as e:
            failed[w.name] = w.dead or str(e)
    deadline = time.monotonic() + timeout
    for w in workers:
        if w.name in failed or w.dead:
            failed.setdefault(w.name, w.dead)
            continue
        try:
            w.info = w.receive(deadline - time.monotonic())     # setup()'s reply
        except Hang:
            failed[w.name] = 'hangs'
            print(f'  {w.name}: no answer to setup (warm-up included) within {timeout:.0f} s: '
                  f'killed (thread stacks in {w.log.name})', file=sys.stderr)
        except (Skip, WorkerError) as e:
            failed[w.name] = w.dead or str(e)
            print(f'  {w.name}: {e}', file=sys.stderr)
    return failed


def median(xs):
    return statistics.median(xs) if xs else float('nan')


def time_iters(step, iters, sync):
    """Per-iteration wall times of `step()`; `sync()` ends each iteration."""
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        sync()
        out.append(time.perf_counter() - t0)
    return out


class TimedContender:
    """Base of the contenders: setup() sets self.step and self.mx; run()
    times `iters` steps, each ending with nd.waitall()."""

    def run(self, iters):
        return time_iters(self.step, iters, self.mx.nd.waitall)
