"""Shared machinery of the benchmark scripts (not part of the library).

Every contender runs in its own worker process (so its peak RSS is its own
and a contender that hangs, like MXNet's contrib SyncBatchNorm on CPU
contexts, can be killed), and the parent interleaves timing chunks of the
contenders round-robin, so machine noise hits all of them alike. Workers talk
to the parent with JSON lines on a private copy of stdout; anything else a
worker prints goes to its stderr log.
"""
import argparse
import json
import os
import platform
import queue
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:            # run from a checkout without installing
    sys.path.insert(0, ROOT)


# --------------------------------------------------------------------------
# Machine and load


def load_avg():
    """The 1, 5 and 15 minute load averages."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        return (float('nan'),) * 3


def load_str(load=None):
    return 'load average %.2f, %.2f, %.2f' % (load or load_avg())


def gluoncv_version():
    try:
        from importlib.metadata import version
        return version('gluoncv')
    except Exception:
        return None


def import_gluoncv_parallel():
    """gluoncv.utils.parallel, or Skip('gluoncv not installed').

    BENCH_HIDE_GLUONCV=1 pretends it is missing (to check that path)."""
    if os.environ.get('BENCH_HIDE_GLUONCV'):
        raise Skip('gluoncv not installed')
    try:
        from gluoncv.utils import parallel
    except Exception:
        raise Skip('gluoncv not installed')
    return parallel


def machine_info():
    from importlib.metadata import version
    info = {'python': platform.python_version(), 'platform': platform.platform(),
            'cpu_count': os.cpu_count(), 'processor': platform.processor() or platform.machine()}
    try:
        import psutil
        info['physical_cores'] = psutil.cpu_count(logical=False)
        info['memory_gb'] = round(psutil.virtual_memory().total / 2 ** 30, 1)
    except Exception:
        pass
    for pkg in ('mxnet', 'numpy', 'gluoncv'):
        try:
            info[pkg] = version(pkg)
        except Exception:
            info[pkg] = None
    info['env'] = {k: v for k, v in os.environ.items()
                   if k.startswith(('MXNET_', 'OMP_')) or k == 'GLUON_PARALLEL_TIMEOUT'}
    return info


# --------------------------------------------------------------------------
# Worker processes


def peak_rss():
    """Peak resident set size of this process, in bytes (Linux: KiB units)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == 'darwin' else rss * 1024


def worker_main(make_contender):
    """Serve the parent's requests until 'quit'.

    `make_contender(name, options)` returns an object with
    ``setup(config) -> dict`` and ``run(iters) -> list of seconds``.
    """
    import faulthandler
    import signal
    # The parent sends SIGUSR1 to a worker it is about to kill as hung: the
    # stacks of all its threads go to the worker's log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    proto = os.fdopen(os.dup(1), 'w', buffering=1)
    os.dup2(2, 1)                    # stray prints (C or Python) go to stderr
    sys.stdout = sys.stderr
    contender = None
    for line in sys.stdin:
        req = json.loads(line)
        op = req['op']
        try:
            if op == 'init':
                contender = make_contender(req['name'], req.get('options', {}))
                rep = {}
            elif op == 'setup':
                rep = contender.setup(req['config']) or {}
            elif op == 'run':
                rep = {'times': contender.run(req['iters'])}
            elif op == 'rss':
                rep = {'peak_rss': peak_rss()}
            elif op == 'quit':
                proto.write(json.dumps({'ok': True}) + '\n')
                proto.flush()
                os._exit(0)          # skip atexit: nothing left worth waiting for
            else:
                raise ValueError(f'unknown op {op!r}')
            rep['ok'] = True
        except Skip as e:
            rep = {'ok': False, 'skip': str(e)}
        except BaseException as e:
            import traceback
            traceback.print_exc()
            where = traceback.extract_tb(e.__traceback__)[-1]
            rep = {'ok': False, 'error': '%s: %s (at %s:%d)' % (
                type(e).__name__, e, where.filename, where.lineno)}
        proto.write(json.dumps(rep) + '\n')
        proto.flush()


class Skip(Exception):
    """A contender that cannot run here (e.g. gluoncv not installed)."""


class Hang(Exception):
    """A worker that did not answer within its timeout (it was killed)."""


class WorkerError(Exception):
    pass


class Worker:
    """A contender in its own process: ``python script --worker``."""

    def __init__(self, script, name, options=None, env=None, scale=1.0):
        self.name = name
        self.scale = scale           # fraction of the iterations per round it runs
        self.log = tempfile.NamedTemporaryFile('w+', prefix=f'bench-{name}-',
                                               suffix='.log', delete=False)
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault('PYTHONPATH', ROOT)
        self.proc = subprocess.Popen([sys.executable, script, '--worker'],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=full_env, text=True, bufsize=1,
                                     cwd=ROOT)
        self._lines = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.dead = None             # why it stopped: 'hangs', an error message...
        self.send({'op': 'init', 'name': name, 'options': options or {}})
        self.pending = 'init'

    def _read(self):
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, req):
        """Send a request without waiting for its answer (see receive)."""
        if self.dead:
            raise WorkerError(self.dead)
        try:
            self.proc.stdin.write(json.dumps(req) + '\n')
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.dead = f'died: {self.tail()}'
            raise WorkerError(self.dead)
        self.pending = req['op']

    def receive(self, timeout):
        """The answer to the last request; kills the worker after `timeout`
        seconds without one (Hang)."""
        if self.dead:
            raise WorkerError(self.dead)
        what, self.pending = self.pending, None
        try:
            line = self._lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            self.dump_stacks()
            self.kill()
            self.dead = 'hangs'
            raise Hang(f'{self.name}: no answer to {what} within {timeout:.0f} s (thread stacks in {self.log.name})')
        if line is None:
            self.dead = f'died: {self.tail()}'
            raise WorkerError(self.dead)
        rep = json.loads(line)
        if not rep.get('ok'):
            if 'skip' in rep:
                self.dead = rep['skip']
                raise Skip(rep['skip'])
            raise WorkerError(rep.get('error', 'failed'))
        return rep

    def request(self, req, timeout):
        if self.pending:             # e.g. the init sent by the constructor
            self.receive(timeout)
        self.send(req)
        return self.receive(timeout)

    def tail(self, lines=3):
        try:
            with open(self.log.name) as f:
                return ' | '.join(f.read().strip().splitlines()[-lines:])
        except OSError:
            return ''

    def dump_stacks(self):
        """Have a hung worker write its threads' stacks to its log, which is
        then kept for inspection."""
        import signal
        self.keep_log = True
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
            except OSError:
                pass

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()         # the process we started, by its handle
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None and not self.dead and not self.pending:
            try:
                self.request({'op': 'quit'}, timeout=10)
            except Exception:
                pass
        self.kill()
        if not getattr(self, 'keep_log', False):
            try:
                os.unlink(self.log.name)
            except OSError:
                pass


# --------------------------------------------------------------------------
# Interleaved timing


def interleave(workers, rounds, iters, timeout, on_round=None):
    """Time `iters` iterations of each live worker per round, rotating the
    order every round. Returns {name: [per-iteration seconds, ...]}."""
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
                times[w.name].extend(w.request({'op': 'run', 'iters': k}, timeout)['times'])
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
            print(f'  {w.name}: no answer to setup (warm-up included) within {timeout:.0f} s: killed '
                  f'(thread stacks in {w.log.name})', file=sys.stderr)
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


# --------------------------------------------------------------------------
# Reporting


def fmt_ratio(x):
    return '-' if x is None or x != x else f'{x:.2f}'


def table(header, rows):
    """A Markdown table (also readable on a terminal)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: '| ' + ' | '.join(c.ljust(w) for c, w in zip(r, widths)) + ' |'
    out = [line(cells[0]), '|' + '|'.join('-' * (w + 2) for w in widths) + '|']
    out += [line(r) for r in cells[1:]]
    return '\n'.join(out)


class Targets:
    """Collects PASS/FAIL/SKIP lines for the targets of an issue."""

    def __init__(self):
        self.items = []

    def check(self, name, value, limit, op='<='):
        """value op limit, or SKIP when value is unknown."""
        if value is None or value != value:
            status, shown = 'SKIP', 'n/a'
        else:
            ok = value <= limit if op == '<=' else value >= limit
            status, shown = ('PASS' if ok else 'FAIL'), f'{value:.2f}'
        self.items.append({'target': name, 'value': shown, 'limit': f'{op} {limit:.2f}',
                           'status': status})

    def note(self, name, status, value='-', limit='-'):
        self.items.append({'target': name, 'value': value, 'limit': limit, 'status': status})

    def render(self):
        return table(['target', 'measured', 'limit', 'result'],
                     [[t['target'], t['value'], t['limit'], t['status']] for t in self.items])


def save_json(path, obj):
    if path:
        with open(path, 'w') as f:
            json.dump(obj, f, indent=1, sort_keys=True)


def mib(nbytes):
    return '-' if nbytes is None else '%.0f' % (nbytes / 2 ** 20)


class TimedContender:
    """Base of the contenders: setup() sets self.step and self.mx; run()
    times `iters` steps, each ending with nd.waitall()."""

    def run(self, iters):
        return time_iters(self.step, iters, self.mx.nd.waitall)


def add_common_args(p, contenders, timeout, quick_help, contenders_help=None):
    """The options every benchmark script takes."""
    p.add_argument('--contenders', default=','.join(contenders), help=contenders_help)
    p.add_argument('--timeout', type=float, default=timeout,
                   help='seconds a worker may take to set up (warm-up included) or to run '
                        'one round before it counts as hung (default %(default)s)')
    p.add_argument('--quick', action='store_true', help=quick_help)
    p.add_argument('--json', help='write the results to this file')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)


def close_workers(workers, status=None):
    """Peak RSS of each worker (None if it died), then close them all; dead
    workers' reasons go into `status` when given."""
    rss = {}
    for w in workers:
        if w.dead and status is not None:
            status.setdefault(w.name, w.dead)
        try:
            rss[w.name] = None if w.dead else w.request({'op': 'rss'}, 30)['peak_rss']
        except Exception:
            rss[w.name] = None
        w.close()
    return rss
