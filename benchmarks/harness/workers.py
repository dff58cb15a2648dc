"""The worker protocol: every contender runs in its own process (so its
peak RSS is its own and a contender that hangs, like MXNet's contrib
SyncBatchNorm on CPU contexts, can be killed). Workers talk to the parent
with JSON lines on a private copy of stdout; anything else a worker prints
goes to its stderr log.

The parent's side is `Worker`; the worker's side is `worker_main`.
"""
import json
import os
import queue
import resource
import subprocess
import sys
import tempfile
import threading
import time

from . import ROOT


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
                # CPU seconds of the whole process (the engine's threads
                # too) and of this, the caller's, thread over the run.
                cpu0, main0 = time.process_time(), time.thread_time()
                rep = {'times': contender.run(req['iters'])}
                rep['cpu'] = [time.process_time() - cpu0, time.thread_time() - main0]
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
            rep = {'ok': False, 'error': f'{type(e).__name__}: {e} (at '
                                         f'{where.filename}:{where.lineno:d})'}
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
        self.cpu = []                # per run: (process, main thread) CPU s per iteration
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
            raise WorkerError(self.dead) from None
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
            raise Hang(f'{self.name}: no answer to {what} within {timeout:.0f} s (thread stacks in '
                       f'{self.log.name})') from None
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
