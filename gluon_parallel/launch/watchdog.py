"""The watchdog every launcher mode shares: start processes, prefix their
output, stop all of them on the first failure, and leave nothing running.

A :class:`~.process.Spec` says what to start; a local process is stopped
by signals to its session, a remote one (an ssh client) by closing its
stdin, which the wrapper on the other host takes as the order to stop (see
:mod:`gluon_parallel.launch.ssh`).
"""
import os
import re
import selectors
import signal
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from .failfast import SAYS
from .process import Proc, Spec, exit_status

TIMEOUT_STATUS = 124
# A remote process gets the grace period on its host after its ssh client
# closed stdin; this covers the round trip before its ssh client exits.
_REMOTE_MARGIN = 3.0
# A failing process's own word (failfast.SAYS, a non-zero status).
_FAILING = re.compile(re.escape(SAYS).replace('%s', '.*').replace('%d', '[1-9]').encode())
# How long a process that said it fails before the one seen exiting first
# gets to exit, to be named as the job's failure.
_CAUSE_WAIT = 2.0


class _CannotStart(Exception):
    """A command could not be started (status 127, as a shell's)."""


class StopSignal(Exception):
    """A signal asked the launcher to stop (SIGINT, SIGTERM, SIGHUP)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def raise_stop(signum, frame):
    """The launcher's signal handler: raise :class:`StopSignal`."""
    raise StopSignal(signum)


class Launcher:
    """Start the processes of a job and watch them until it ends.

    Parameters
    ----------
    specs : list of Spec
        Started in this order (the scheduler first).
    timeout : float, optional
        Seconds after which every process is stopped; None: no limit.
    grace : float, default 5
        Seconds between SIGTERM and SIGKILL when stopping.
    stdout, stderr : binary file, optional
        Where prefixed output goes; default: the launcher's own.
    watcher : optional
        Run beside the job (an elastic job's :class:`~.elastic.Watcher`):
        ``register(selector)`` at the start (a socket whose data is a
        callable, called when it is readable), ``tick()`` every turn of
        the loop, ``unregister(selector)`` when stopping.
    stall : StallWatch, optional
        ``--stall-timeout`` (:mod:`.stall`): registered as the watcher is,
        ``tick(launcher)`` every turn, which ends a stalled attempt and
        returns its status; ``blame(launcher, proc)`` when `proc` fails,
        which names the workers it likely waited for (the words added to
        the cause, or None).
    """

    def __init__(self, specs: Sequence[Spec], timeout: float | None = None, grace: float = 5.0,
                 stdout: TextIO | None = None, stderr: TextIO | None = None,
                 watcher=None, stall=None) -> None:
        if not any(s.is_worker for s in specs):
            raise ValueError('a job needs at least one worker')
        self.specs = list(specs)
        self.timeout = timeout
        self.grace = float(grace)
        self.stdout = stdout if stdout is not None else sys.stdout.buffer
        self.stderr = stderr if stderr is not None else sys.stderr.buffer
        self.procs = []
        self.signalled = None   # the signal that stopped the launcher, if any
        self.cause = None       # why the job ended with a non-zero status
        self.restartable = False    # a process failed (not a timeout, a signal, a start)
        self.watcher = watcher
        self.stall = stall
        self.stalled_hosts = set()  # remote hosts of the workers a stall blamed
        self._sel = None

    # -- output ---------------------------------------------------------------

    def note(self, msg):
        """Print a ``[launch]`` line on stderr."""
        self.stderr.write((f'[launch] {msg}\n').encode())
        self.stderr.flush()

    def _emit(self, proc, fd, data, final=False):
        out = self.stdout if fd == proc.popen.stdout.fileno() else self.stderr
        data = proc.buffers.pop(fd, b'') + data
        lines = data.split(b'\n')
        rest = lines.pop()
        if final and rest:
            lines.append(rest)          # a last line without newline
            rest = b''
        if rest:
            proc.buffers[fd] = rest
        if out is self.stderr and proc.spec.wrapper_lines:
            now = time.monotonic()
            lines = [line for line in lines if not proc.wrapper_line(line, now)]
        if lines:
            proc.heard_at = time.monotonic()
            if proc.failed_at is None and out is self.stderr \
                    and any(_FAILING.match(line) for line in lines):
                proc.failed_at = time.monotonic()
            out.write(b''.join(proc.prefix + line + b'\n' for line in lines))
            out.flush()

    def _pump(self, wait):
        """Copy whatever output is ready, waiting at most `wait` seconds."""
        if not self._sel.get_map():
            time.sleep(wait)
            return
        for key, _ in self._sel.select(wait):
            if callable(key.data):      # the watcher's socket
                key.data()
                continue
            proc, fd = key.data, key.fd
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b''
            if data:
                self._emit(proc, fd, data)
            else:
                self._sel.unregister(fd)
                self._emit(proc, fd, b'', final=True)

    def _drain(self, seconds):
        """Copy the remaining output of exited processes (bounded)."""
        deadline = time.monotonic() + seconds
        while self._sel.get_map() and time.monotonic() < deadline:
            self._pump(0.05)

    # -- processes ------------------------------------------------------------

    def start(self):
        """Start every process."""
        self._sel = selectors.DefaultSelector()
        for w in (self.watcher, self.stall):
            if w is not None:
                w.register(self._sel)
        for spec in self.specs:
            try:
                proc = Proc(spec)
            except OSError as e:
                raise _CannotStart(f'cannot start {spec.name}: {e}') from e
            self.procs.append(proc)
            for f in (proc.popen.stdout, proc.popen.stderr):
                os.set_blocking(f.fileno(), False)
                self._sel.register(f.fileno(), selectors.EVENT_READ, proc)

    def _wait_for(self, procs, seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            self._pump(0.05)

    def stop(self) -> None:
        """Ask every process to stop (and what it started), SIGKILL those
        still there after the grace period, and reap them."""
        for w in (self.watcher, self.stall):
            if w is not None:
                w.unregister(self._sel)
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            p.terminate()
            if not p.spec.remote:
                p.signal(signal.SIGCONT)    # a stopped process takes SIGTERM once resumed
        margin = _REMOTE_MARGIN if any(p.spec.remote for p in live) else 0.0
        self._wait_for(live, self.grace + margin)
        # Every group, also those whose leader exited: what it left behind.
        for p in self.procs:
            p.signal(signal.SIGKILL)
        for p in self.procs:
            p.reap()
        self._drain(1.0)

    def _failure(self, p):
        status = exit_status(p.returncode)
        why = ''
        if p.lost:
            return (f'lost {p.name}: connection dropped after '
                    f'{time.monotonic() - p.started_at:.0f} s of running')
        if p.spec.remote and status == 255 and not p.exited_seen:
            why = ' (ssh could not run it: see its output)'
        elif p.spec.remote and p.returncode < 0:
            why = ' (its ssh client was killed)'
        return f'{p.name} exited with status {status:d}{why}'

    def wait(self):
        """Watch the processes until the job ends; return the exit status."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        workers = [p for p in self.procs if p.spec.is_worker]
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.cause = f'timeout after {round(self.timeout, 1):g}s'
                self.note(f'{self.cause}: stopping every process')
                self.stop()
                return TIMEOUT_STATUS
            self._pump(0.1 if left is None else min(0.1, left))
            now = time.monotonic()
            for p in self.procs:
                if p.returncode is None:
                    p.beat(now)
            if self.watcher is not None:
                self.watcher.tick()
            p = self._new_failure()
            if p is None and self.stall is not None:
                status = self.stall.tick(self)
                if status is not None:
                    return status
            if p is not None:
                p = self._first_failed(p)
                self.cause, self.restartable = self._failure(p), True
                blame = self.stall.blame(self, p) if self.stall is not None else None
                if blame:
                    self.cause += f' ({blame})'
                why = self.watcher.why(exit_status(p.returncode)) if self.watcher else ''
                self.note(f'{self.cause}{why}: stopping the other processes')
                self.stop()
                return exit_status(p.returncode)
            if all(p.returncode == 0 for p in workers):
                return self._finish(deadline)

    def _new_failure(self):
        """A process that has just exited with an error, or None. Of
        failures seen together, a worker's is the likely cause: servers
        abort when a worker vanishes mid-request."""
        failed = [p for p in self.procs
                  if p.returncode is None and p.poll() is not None and p.returncode]
        return ([f for f in failed if f.spec.is_worker] or failed or [None])[0]

    def _first_failed(self, p):
        """The job's failure, `p` having been seen exiting with an error: a
        process whose fail-fast hook said it fails before `p` did is the
        cause if it exits within a moment (over ssh the exits arrive in any
        order, and a failing rank makes its peers fail: Horovod raises on
        every other rank)."""
        earlier = [q for q in self.procs if q is not p and q.failed_at is not None
                   and (p.failed_at is None or q.failed_at < p.failed_at)]
        if not earlier:
            return p
        self._wait_for(earlier, _CAUSE_WAIT)
        return next((q for q in sorted(earlier, key=lambda q: q.failed_at) if q.returncode), p)

    def _finish(self, deadline):
        """Every worker exited with 0. The scheduler and servers leave once
        every worker has finalized: wait for them briefly, then stop the rest."""
        others = [p for p in self.procs if not p.spec.is_worker]
        end = self.grace if deadline is None else min(self.grace, deadline - time.monotonic())
        self._wait_for(others, end)
        stuck = [p.name for p in others if p.returncode is None]
        if stuck:
            self.note('every worker finished; stopping {}'.format(', '.join(stuck)))
        self.stop()
        failed = [p for p in others if p.returncode]
        if failed:
            self.cause, self.restartable = self._failure(failed[0]), True
            self.note(self.cause)
            return exit_status(failed[0].returncode)
        return 0

    def run(self) -> int:
        """Start, watch and clean up; return the exit status.

        SIGINT, SIGTERM and SIGHUP stop every process and return
        ``128 + signal``.
        """
        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, raise_stop)
        try:
            try:
                self.start()
                return self.wait()
            except _CannotStart as e:
                self.cause = str(e)
                self.note(self.cause)
                self.stop()
                return 127
            except StopSignal as e:
                self.signalled = e.signum
                # Finish the cleanup even if the signal comes again.
                for sig in old:
                    signal.signal(sig, signal.SIG_IGN)
                # A process that failed before the signal arrived is the
                # first failure (another task may have stopped this one
                # because of it): its status, not the signal's, is reported.
                p = self._new_failure()
                self.cause = f'got {signal.Signals(e.signum).name}'
                self.note(f'{self.cause}: stopping every process')
                self.stop()
                if p is not None:
                    self.cause = self._failure(p)
                    self.note(self.cause)
                    return exit_status(p.returncode)
                return 128 + e.signum
            except BaseException:
                for sig in old:
                    signal.signal(sig, signal.SIG_IGN)
                if self._sel is not None:
                    self.stop()
                raise
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
            if self._sel is not None:
                for p in self.procs:
                    for f in (p.popen.stdin, p.popen.stdout, p.popen.stderr):
                        if f is not None:
                            f.close()
                self._sel.close()
