"""Elastic jobs: ``-n MIN:MAX --discover CMD``.

Every attempt is a whole job (as ``--max-restarts`` runs them) at the size
the discovery command reports before it starts: ``W = min(MAX, slots)``
workers, after waiting up to ``--elastic-timeout`` seconds while there are
fewer than MIN slots (:mod:`.discovery`). A failure ends the attempt as
always and counts against ``--max-restarts``; the next attempt runs at the
size discovered then.

Growing: while an attempt runs, the launcher polls the command; once it
reports more usable slots than W (and W < MAX), the launcher tells the
workers, at their next ``gluon_parallel.dist.save_checkpoint``, to leave:
every worker returns from the save (the checkpoint complete) and exits with
:data:`GROW_STATUS`, and the next attempt starts at the larger size without
counting against ``--max-restarts``. The workers of an elastic job
(:data:`ELASTIC_ENV` set) ask over the launcher's channel
(:mod:`gluon_parallel.channel`: signed datagrams, answered in the
watchdog's loop by :class:`Endpoint`; the launcher stays
single-threaded): a ``leave?`` message with the attempt and N for the
N-th checkpoint of the process, the answer ``stop`` or ``go``, the same
to every worker for a given N.

This module imports only the standard library: workers import it too.
"""
import itertools
import os
import signal
import sys
import time
import warnings
from typing import NamedTuple

from .. import channel
from .discovery import DiscoveryError, choose, format_hosts, usable_slots
from .listener import Listener
from .process import RESTART_ENV
from .watchdog import StopSignal, raise_stop

__all__ = ['GROW_STATUS', 'ELASTIC_ENV', 'Endpoint', 'Watcher', 'AttemptEnd', 'run_elastic',
           'should_leave', 'parse_size']

#: The exit status of a worker leaving for a larger attempt (EX_TEMPFAIL:
#: "try again"); reserved: the launcher does not count it as a failure when
#: it told the workers to leave.
GROW_STATUS = 75
#: Set (``1``) in the processes of an elastic job: after a checkpoint a
#: worker asks the launcher's channel whether to leave.
ELASTIC_ENV = 'GLUON_PARALLEL_ELASTIC'
#: Exit status when MIN slots never showed up and nothing had failed.
NEVER_STARTED_STATUS = 124
_ASK_TIMEOUT = 10.0
_asked = itertools.count()      # this process's checkpoints, in order


def parse_size(text):
    """``-n`` value: ``N`` -> (N, N, False); ``MIN:MAX`` -> (MIN, MAX, True).
    Raises ValueError saying what is wrong."""
    low, sep, high = text.partition(':')
    try:
        low, high = int(low), int(high) if sep else int(low)
    except ValueError:
        raise ValueError(f'-n {text}: expected WORKERS or MIN:MAX (integers)') from None
    if low < 1:
        raise ValueError(f'-n {text}: at least 1 worker' if not sep else
                         f'-n {text}: MIN must be at least 1')
    if high < low:
        raise ValueError(f'-n {text}: MIN is larger than MAX')
    return low, high, bool(sep)


def should_leave():
    """In a worker, after a checkpoint is complete on every worker: whether
    the launcher asks the job to end here (to go on at a larger size).
    False outside an elastic job, or when the launcher cannot be reached
    (with a warning: the others may leave, then the launcher stops this
    worker)."""
    if not os.environ.get(ELASTIC_ENV):
        return False
    number = next(_asked)
    client = channel.client()
    try:
        reply = None if client is None else client.ask(
            'leave?', _ASK_TIMEOUT, attempt=os.environ.get(RESTART_ENV, '0'), n=number)
    except OSError as e:
        reply, why = None, str(e)
    else:
        why = 'no channel in the environment' if client is None else \
            f'no answer in {_ASK_TIMEOUT:g}s'
    if reply is None:
        where = os.environ.get(channel.CHANNEL_ENV)
        warnings.warn(f'gluon_parallel: cannot ask the launcher at {where} whether to leave '
                      f'after this checkpoint ({why}); going on', stacklevel=3)
        return False
    return reply.get('answer') == 'stop'


class Endpoint:
    """The answers to the workers' question at each checkpoint (see the
    module's notes): the handler of the channel's ``leave?`` messages."""

    def __init__(self, listener):
        self.listener = listener
        listener.handlers['leave?'] = self.answer
        self.reset(0)

    def reset(self, attempt):
        """A new attempt: nothing asked, nothing decided."""
        self.attempt, self.grow, self.told, self._answers = attempt, False, False, {}

    def answer(self, fields):
        answer = 'go'
        if str(fields['attempt']) == str(self.attempt):
            answer = self._answers.setdefault(str(fields['n']), 'stop' if self.grow else 'go')
            self.told |= answer == 'stop'
        return {'answer': answer}

    def close(self):
        self.listener.handlers.pop('leave?', None)


class Watcher:
    """What the watchdog runs beside one attempt: the endpoint, and the
    discovery command every `interval` seconds.

    Parameters
    ----------
    discovery : Discovery
    endpoint : Endpoint
    workers, max_workers : int
        The attempt's size, MAX.
    unreachable : set of str
        Hosts not to count.
    interval : float
    note : callable
        Prints a ``[launch]`` line.
    """

    def __init__(self, discovery, endpoint, workers, max_workers, unreachable, interval, note):
        self.discovery, self.endpoint = discovery, endpoint
        self.workers, self.max_workers, self.unreachable = workers, max_workers, unreachable
        self.interval, self.note = interval, note
        self._poll, self._next, self._said = None, time.monotonic() + interval, None

    def register(self, selector):
        self.endpoint.listener.register(selector)

    def unregister(self, selector):
        self.endpoint.listener.unregister(selector)
        self.close()

    def why(self, status):
        """What a worker's exit `status` means beyond a failure."""
        if status == GROW_STATUS and self.endpoint.told:
            return ' (told to leave after its checkpoint, for the larger size)'
        return ''

    def tick(self):
        """Start a discovery run when one is due; read one that finished."""
        if self.endpoint.grow or self.workers >= self.max_workers:
            return
        if self._poll is None:
            if time.monotonic() >= self._next:
                self._poll = self.discovery.start()
            return
        result = self._poll.result()
        if result is None:
            return
        self._poll, self._next = None, time.monotonic() + self.interval
        if isinstance(result, DiscoveryError):
            if str(result) != self._said:
                self._said = str(result)
                self.note(f'{result}; the job goes on at {self.workers:d} workers')
            return
        target = min(self.max_workers, usable_slots(result, self.unreachable))
        if target > self.workers:
            self.endpoint.grow = True
            self.note(f'discovery reports {format_hosts(result)}: the job ends after its next '
                      f'checkpoint and goes on at {target:d} workers')

    def close(self):
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None


class AttemptEnd(NamedTuple):
    """How an attempt ended."""
    status: int
    cause: str | None
    restartable: bool
    unreachable: set            # hosts whose processes became unreachable


def _note(msg):
    sys.stderr.write(f'[launch] {msg}\n')
    sys.stderr.flush()


def _wait_for_layout(discovery, size, unreachable, timeout, interval, note, first=None):
    """The next attempt's Layout, polling the command for up to `timeout`
    seconds while there are fewer than MIN slots; None when they never came.
    Hosts no longer listed leave `unreachable`."""
    min_workers, max_workers = size
    deadline, said = time.monotonic() + timeout, None
    while True:
        try:
            hosts, first = (first, None) if first is not None else (discovery.run(), None)
            unreachable &= {h for h, _ in hosts}
            layout = choose(hosts, unreachable, min_workers, max_workers)
            if layout is not None:
                return layout
            why = (f'discovery reports {format_hosts(hosts)}, fewer than the {min_workers:d} '
                   'slots of MIN')
        except DiscoveryError as e:
            why = str(e)
        left = deadline - time.monotonic()
        if left <= 0:
            note(f'no attempt after waiting {timeout:g}s (--elastic-timeout): {why}')
            return None
        if why != said:
            said = why
            note(f'waiting up to {left:.0f}s: {why}')
        time.sleep(min(interval, left))


def _layout_line(number, layout, size):
    line = (f'attempt {number:d}: {layout.workers:d} worker{"s" if layout.workers > 1 else ""} '
            f'on {format_hosts(layout.hosts)} (-n {size[0]:d}:{size[1]:d}; discovered '
            f'{format_hosts(layout.discovered)}')
    if layout.left_out:
        line += '; left out, unreachable: ' + ' '.join(layout.left_out)
    return line + ')'


def run_elastic(discovery, size, run_attempt, max_restarts=0, timeout=600.0, interval=5.0,
                listener=None, first=None, grow_on_any_status=False, note=_note):
    """Run the attempts of an elastic job; return the exit status.

    Parameters
    ----------
    discovery : Discovery
    size : (int, int)
        MIN, MAX.
    run_attempt : callable
        ``run_attempt(number, layout, watcher) -> AttemptEnd``: the whole job
        once, at ``layout``, the watcher beside it.
    max_restarts : int
    timeout : float
        ``--elastic-timeout``.
    interval : float
        Seconds between discovery runs.
    listener : Listener, optional
        The launcher's channel (default: one on 127.0.0.1).
    first : list, optional
        The hosts discovery already reported (for attempt 0).
    grow_on_any_status : bool
        An attempt that ends after the workers were told to leave is a
        scale-up whatever its status (horovodrun reports its own status,
        not the workers').
    """
    own = listener is None
    listener = Listener() if own else listener
    endpoint = Endpoint(listener)
    old = {s: signal.signal(s, raise_stop) for s in (signal.SIGINT, signal.SIGTERM,
                                                       signal.SIGHUP)}
    number, restarts, unreachable, failure = 0, 0, set(), None
    try:
        while True:
            try:
                layout = _wait_for_layout(discovery, size, unreachable, timeout, interval, note,
                                          first)
            except StopSignal as e:
                note(f'got {signal.Signals(e.signum).name} while waiting for slots')
                return 128 + e.signum
            first = None
            if layout is None:
                return failure if failure is not None else NEVER_STARTED_STATUS
            note(_layout_line(number, layout, size))
            endpoint.reset(number)
            watcher = Watcher(discovery, endpoint, layout.workers, size[1], unreachable,
                              interval, note)
            for s in old:       # the attempt's Launcher handles them
                signal.signal(s, old[s])
            try:
                end = run_attempt(number, layout, watcher)
            finally:
                watcher.close()
                for s in old:
                    signal.signal(s, raise_stop)
            unreachable |= end.unreachable
            if end.status == 0:
                return 0
            if endpoint.told and end.restartable and (
                    grow_on_any_status or end.status == GROW_STATUS):
                number += 1
                note(f'the workers left after their checkpoint to grow; attempt {number:d} '
                     'starts at the size discovery reports (not counted against '
                     '--max-restarts)')
                continue
            if not end.restartable or max_restarts == 0:
                return end.status
            if restarts == max_restarts:
                note(f'no restart left (--max-restarts {max_restarts:d}): exiting with status '
                     f'{end.status:d}')
                return end.status
            restarts, number, failure = restarts + 1, number + 1, end.status
            note(f'restart {restarts:d} of {max_restarts:d} after: {end.cause}; starting the '
                 'whole job again')
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        endpoint.close()
        if own:
            listener.close()
