"""``--stall-timeout S``: a job that stops moving is found, named and ended.

Every worker reports its progress over the launcher's channel
(:mod:`gluon_parallel.progress`): completed reductions and steps,
whether it waits in a reduction now, DataParallel calls, ``dist.busy``
phases, and whether its program has ended. :class:`Monitor` keeps the
last report of each; when no worker has moved for S seconds and none is
inside ``busy``, the job has stalled. Until every worker has moved once
(the first step compiles, loads data, allocates), it gets
:data:`STARTUP_FACTOR` times S from the attempt's start.

Who stalled (:meth:`Monitor.suspects`), from where the workers are:

* a worker that is stopped (``/proc`` state ``T``) cannot move;
* of the workers not at the end of their program, those behind the
  others (fewer completed reductions, or not yet waiting in the one the
  others wait in) are what the others wait for: a worker blocked in
  Python, a SIGSTOPped one;
* when every worker still running waits in a reduction and the others
  have ended their program, the waiting ones have a step more than the
  others (their sampler gave them a batch more);
* when every worker waits in the same reduction, or at the end of the
  same step count, no worker is behind: the servers and the scheduler
  are the suspects.

Who a worker's failure came from (:meth:`Monitor.blame`, rule in
:mod:`.blame`): the workers it waited for, when they had stopped moving.

A worker that still moves but slowly is not a stall: :meth:`Monitor.slow`
warns (once a minute at most per worker) when a worker's steps take, of
its own time (outside reductions), at least twice the median of the
others'.
"""
import argparse
import math
import os
import signal
import statistics
import time
from typing import NamedTuple

from ..channel import STACK_SIGNAL
from . import blame as _blame
from .process import exit_status

__all__ = ['STALL_STATUS', 'DEFAULT_TIMEOUT', 'STACK_SIGNAL', 'Monitor', 'Stall', 'StallWatch',
           'process_state', 'timeout_option', 'watch']

#: The exit status of an attempt ended because it stalled.
STALL_STATUS = 121
#: Seconds without progress before a job is called stalled: NCCL's own
#: watchdog's default (PyTorch aborts a collective after 10 minutes).
DEFAULT_TIMEOUT = 600.0
#: Before every worker has moved once, the job gets this many times S.
STARTUP_FACTOR = 4
_SLOW_RATIO, _SLOW_MIN_STEPS, _SLOW_EVERY, _SLOW_FLOOR = 2.0, 5, 60.0, 0.005


def timeout_option(text):
    """``--stall-timeout`` value: seconds >= 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected seconds (a number; 0 turns it off), got '
                                         f'{text!r}') from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f'expected seconds >= 0 (0 turns it off), got {text}')
    return value


def watch(timeout, listener, attempt, specs, num_workers):
    """The StallWatch of an attempt of `specs` (`num_workers` reporting),
    or None when `timeout` is 0 or there is no channel."""
    if not timeout or listener is None:
        return None
    servers = [s.name for s in specs if not s.is_worker]
    return StallWatch(listener, Monitor(timeout, num_workers, attempt, servers))


def process_state(pid):
    """The state letter of local process `pid` in ``/proc`` (``R``, ``S``,
    ``T`` stopped, ``Z``...), or None."""
    try:
        with open(f'/proc/{pid:d}/stat', 'rb') as f:
            return f.read().rsplit(b')', 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


class _Worker:
    """The last report of one worker process."""

    def __init__(self, who, now):
        self.who, self.pid = who, None
        self.steps = self.reductions = self.calls = self.busy_ends = 0
        self.reducing, self.busy, self.exiting, self.own, self.own_n = False, None, False, None, 0
        self.heard_at = self.moved_at = now
        self.moved = False
        self.wait = None            # its last blame.Wait

    def position(self):
        return (self.reductions, self.reducing)

    def where(self, now):
        """Where it is, in words."""
        done = f'step {self.steps:d} ({self.reductions:d} reductions done'
        if self.calls:
            done += f', {self.calls:d} DataParallel calls'
        done += f'); last moved {now - self.moved_at:.0f}s ago'
        if self.busy is not None:
            return f'inside dist.busy({self.busy!r}); {done}'
        if self.exiting:
            return f'at the end of its program (waits for the others at exit); {done}'
        if self.reducing:
            return f'waiting in reduction {self.reductions + 1:d}; {done}'
        return f'running its own code, not in a reduction; {done}'


class Stall(NamedTuple):
    """A stalled job: whom to blame and why."""
    suspects: list          # names
    why: str
    idle: float             # seconds without progress


class Monitor:
    """The workers' progress during one attempt.

    Parameters
    ----------
    timeout : float
        S, seconds.
    num_workers : int
        The workers that will report.
    attempt : int
        The attempt number (reports of another attempt are ignored).
    servers : list of str
        The names of the job's scheduler and servers (the suspects when no
        worker is behind).
    clock : callable
    """

    def __init__(self, timeout, num_workers, attempt=0, servers=(), clock=time.monotonic):
        self.timeout, self.num_workers, self.attempt = float(timeout), num_workers, attempt
        self.servers, self.clock = list(servers), clock
        self.started = self.moved_at = clock()
        self.workers = {}           # who -> _Worker
        self.pids = {}              # who -> set of pids (start-up hook's hello)
        self._warned = {}

    # -- messages -----------------------------------------------------------------

    def hello(self, fields):
        """A Python process of the job has started (its pid, for stacks)."""
        self.pids.setdefault(str(fields['who']), set()).add(int(fields['pid']))

    def receive(self, fields):
        """A ``progress`` message."""
        if str(fields.get('restart', '0')) != str(self.attempt):
            return
        now, who = self.clock(), str(fields['who'])
        w = self.workers.get(who) or self.workers.setdefault(who, _Worker(who, now))
        counts = tuple(int(fields[k]) for k in ('reductions', 'calls', 'busy_ends'))
        busy = fields['busy']
        if counts != (w.reductions, w.calls, w.busy_ends) or busy != w.busy:
            w.moved_at = self.moved_at = now
            w.moved = w.moved or counts[0] > 0 or counts[1] > 0
        w.reductions, w.calls, w.busy_ends = counts
        w.steps, w.busy = int(fields['steps']), None if busy is None else str(busy)
        w.wait = _blame.waited(w.wait, counts[0], bool(fields['reducing']), now)
        w.reducing, w.exiting = bool(fields['reducing']), bool(fields['exiting'])
        own = fields.get('own')
        w.own = None if own is None else float(own)
        w.pid, w.heard_at = int(fields['pid']), now
        self.pids.setdefault(who, set()).add(w.pid)

    # -- decisions ----------------------------------------------------------------

    def check(self, stopped=()):
        """A :class:`Stall` when the job has made no progress for S seconds
        (S times STARTUP_FACTOR from the start until every worker has moved
        once), else None. `stopped`: names of stopped processes."""
        now = self.clock()
        if any(w.busy is not None for w in self.workers.values()):
            return None
        idle = now - self.moved_at
        everyone = (len(self.workers) >= self.num_workers
                    and all(w.moved for w in self.workers.values()))
        if idle < self.timeout or (not everyone
                                   and now - self.started < STARTUP_FACTOR * self.timeout):
            return None
        suspects, why = self.suspects(stopped)
        return Stall(suspects, why, idle)

    def suspects(self, stopped=()):
        """(names, why): who stalled (see the module's notes)."""
        frozen = sorted(set(stopped))
        if frozen:
            return frozen, 'stopped (a SIGSTOP or a debugger): it cannot move'
        ws = list(self.workers.values())
        running = [w for w in ws if not w.exiting]
        silent = self.num_workers - len(ws)
        if silent > 0 and ws:
            return ([f'{silent:d} worker{"s" if silent > 1 else ""} that never reported'],
                    'the others wait for workers that never reached their first reduction')
        if not ws:
            return (['every worker'], 'no worker has reported any progress')
        if running and len(running) < len(ws) and all(w.reducing for w in running):
            top = max(w.reductions for w in ws if w.exiting)
            return (sorted(w.who for w in running),
                    f'waits alone in a reduction the others never enter: they ended their '
                    f'program after {top:d} reductions (its data has a step more?)')
        if not running:
            most = max(w.reductions for w in ws)
            ahead = sorted(w.who for w in ws if w.reductions < most)
            if ahead:
                return (sorted(w.who for w in ws if w.reductions == most),
                        'ended its program with more reductions than the others')
            return self.servers or ['the servers'], 'every worker waits at exit for the others'
        top = max(w.position() for w in running)
        behind = sorted(w.who for w in running if w.position() < top)
        if behind:
            return behind, ('behind the others: they wait in a reduction it has not entered'
                            if top[1] else 'behind the others')
        if all(w.reducing for w in running):
            return (self.servers or ['the servers'],
                    f'every worker waits in reduction {top[0] + 1:d}: no worker is behind, '
                    'the servers or the scheduler do not answer')
        return sorted(w.who for w in running), 'no worker moves, none waits in a reduction'

    def blame(self, failed, stopped=()):
        """A :class:`~.blame.Blame` naming what the failure of worker
        process `failed` likely came from, or None (:func:`.blame.blame`).
        `stopped`: names of stopped processes."""
        return _blame.blame(self.workers, failed, stopped, min(_blame.LAG, self.timeout),
                            self.clock())

    def slow(self):
        """Warnings (lines) about workers whose own step time is at least
        twice the others' median; each worker at most once a minute."""
        now, lines = self.clock(), []
        timed = {w.who: w.own for w in self.workers.values() if w.own is not None
                 and w.steps >= _SLOW_MIN_STEPS and not w.exiting and w.busy is None}
        if len(timed) < 2:
            return lines
        for who, own in sorted(timed.items()):
            others = statistics.median(v for k, v in timed.items() if k != who)
            if own >= _SLOW_RATIO * others and own >= _SLOW_FLOOR \
                    and now - self._warned.get(who, -1e9) >= _SLOW_EVERY:
                self._warned[who] = now
                lines.append(f'{who} is slow: its steps take {own:.3g}s of its own (outside '
                             f'reductions), {own / max(others, 1e-9):.1f}x the median of the '
                             f"others' ({others:.3g}s); the others wait for it")
        return lines

    def report(self, stall, states):
        """The lines of the stall report. `states`: name -> process state
        letter or a note (for the workers whose process is local)."""
        return [f'{", ".join(stall.suspects)} stalled: {stall.why}; no progress in the job for '
                f'{stall.idle:.0f}s (--stall-timeout {self.timeout:g})'] + self.places(states)

    def blame_report(self, failed, blame, states):
        """The lines of the report of `blame` (:meth:`blame`), `failed`
        having failed; `states` as :meth:`report`'s."""
        return [_blame.first_line(failed, blame)] + self.places(states)

    def places(self, states):
        """A line for each worker: where it is (`states` as :meth:`report`'s)."""
        now, lines = self.clock(), []
        for who in sorted(self.workers):
            w = self.workers[who]
            state = states.get(who)
            extra = f'; process {state}' if state else ''
            lines.append(f'  {who}: {w.where(now)}; last report {now - w.heard_at:.0f}s '
                         f'ago{extra}')
        return lines


_ANSWER_WAIT = 2.0      # seconds a process gets to print its stacks
_EVERY = 1.0            # seconds between two checks


class StallWatch:
    """What the watchdog runs for ``--stall-timeout``: the channel's
    progress reports into a :class:`Monitor`, its check every second, and
    on a stall the report, the stacks and the end of the attempt.

    Parameters
    ----------
    listener : Listener
    monitor : Monitor
    """

    def __init__(self, listener, monitor):
        self.listener, self.monitor = listener, monitor
        self._next = 0.0

    def register(self, selector):
        self.listener.handlers.update(progress=self.monitor.receive, hello=self.monitor.hello)
        self.listener.register(selector)

    def unregister(self, selector):
        self.listener.unregister(selector)
        for kind in ('progress', 'hello'):
            self.listener.handlers.pop(kind, None)

    def tick(self, launcher):
        """Check the job (every second); on a stall, end the attempt and
        return :data:`STALL_STATUS`, else None."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + _EVERY
        for line in self.monitor.slow():
            launcher.note(line)
        local = self._local_pids(launcher)
        stall = self.monitor.check(_stopped(local))
        if stall is None:
            return None
        return self._end(launcher, stall, local)

    def blame(self, launcher, failed):
        """Process `failed` has just failed: when :meth:`Monitor.blame`
        names what it likely waited for, print that report and the stacks
        of the local processes still there, and return the words the
        launcher's cause adds; else None (nothing printed)."""
        if not failed.spec.is_worker:   # servers wait for the workers, never time out
            return None
        local = self._local_pids(launcher)
        local.pop(failed.name, None)
        blame = self.monitor.blame(failed.name, _stopped(local))
        if blame is None:
            return None
        states = {name: _state_words(pids) for name, pids in local.items()}
        states[failed.name] = f'exited with status {exit_status(failed.returncode):d}'
        for line in self.monitor.blame_report(failed.name, blame,
                                              {k: v for k, v in states.items() if v}):
            launcher.note(line)
        self._stacks(launcher, local)
        launcher.stalled_hosts = _hosts_of(launcher, blame.suspects)
        _kill_stopped(local)
        return f'likely because {", ".join(blame.suspects)} had not moved for {blame.idle:.0f}s'

    def _local_pids(self, launcher):
        """Name -> pids of the job's processes on this machine (the
        processes the launcher started, and those that said hello)."""
        remote = {p.name for p in launcher.procs if p.spec.remote}
        local = {p.name: {p.popen.pid} for p in launcher.procs
                 if not p.spec.remote and p.poll() is None}
        for name, pids in self.monitor.pids.items():
            if name not in remote:
                local.setdefault(name, set()).update(pids)
        return local

    def _end(self, launcher, stall, local):
        states = {name: _state_words(pids) for name, pids in local.items()}
        for line in self.monitor.report(stall, {k: v for k, v in states.items() if v}):
            launcher.note(line)
        self._stacks(launcher, local)
        launcher.cause = f'{", ".join(stall.suspects)} stalled (no progress for ' \
                         f'{stall.idle:.0f}s)'
        launcher.restartable = True
        launcher.stalled_hosts = _hosts_of(launcher, stall.suspects)
        launcher.note(f'{launcher.cause}: stopping every process (exit status {STALL_STATUS:d})')
        _kill_stopped(local)
        launcher.stop()
        return STALL_STATUS

    def _stacks(self, launcher, local):
        """Ask every local Python process that has the start-up hook for
        its stacks; say which cannot answer."""
        hooked = {name: {pid for pid in self.monitor.pids.get(name, ()) if pid in pids}
                  for name, pids in local.items()}
        asked, asked_at = [], time.monotonic()
        launcher.note('the stack of every thread of each Python process follows, on its '
                      f'stderr ({signal.Signals(STACK_SIGNAL).name}, faulthandler)')
        for name in sorted(hooked):
            state = {process_state(pid) for pid in hooked[name]}
            if not hooked[name]:
                launcher.note(f'{name}: no stack (not a Python process with the start-up hook)')
            elif 'T' in state:
                launcher.note(f'{name}: stopped (state T): it cannot print its stack')
            else:
                for pid in hooked[name]:
                    _kill(pid, STACK_SIGNAL)
                asked.append(name)
        for p in launcher.procs:
            if p.spec.remote:
                launcher.note(f'{p.name}: on another host: its stack is not asked for')
        by_name = {p.name: p for p in launcher.procs}
        end = asked_at + _ANSWER_WAIT
        while time.monotonic() < end:
            launcher._pump(0.05)
        for name in asked:
            p = by_name.get(name)
            if p is not None and (p.heard_at or 0) < asked_at:
                launcher.note(f'{name}: no stack within {_ANSWER_WAIT:g}s (blocked in the '
                              'kernel?)')


def _stopped(local):
    """The names of `local` (name -> pids) with a stopped process."""
    return [name for name, pids in local.items() if any(process_state(pid) == 'T' for pid in pids)]


def _kill_stopped(local):
    """A stopped process takes no SIGTERM: kill it."""
    for pids in local.values():
        for pid in pids:
            if process_state(pid) == 'T':
                _kill(pid, signal.SIGKILL)
                _kill(pid, signal.SIGCONT)


def _hosts_of(launcher, names):
    """The remote hosts of the processes `names` (an elastic job leaves them)."""
    return {p.spec.host for p in launcher.procs
            if p.spec.remote and p.spec.host and p.name in names}


def _state_words(pids):
    states = {process_state(pid) for pid in pids} - {None}
    if 'T' in states:
        return 'stopped (state T)'
    if 'D' in states:
        return 'in uninterruptible sleep (state D)'
    return ''


def _kill(pid, sig):
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
