"""``--discover CMD``: the hosts an elastic job may run on, and which of
them an attempt uses.

CMD runs through ``/bin/sh -c`` and prints the available hosts, one
``host[:slots]`` a line (Horovod's host-discovery format; ``#`` comments
and blank lines are skipped, a host named twice adds its slots up). It runs
before every attempt and, while an attempt runs, every
``--discover-interval`` seconds in the background (:class:`Poll`).

Hosts whose processes became unreachable (:func:`unreachable_hosts`) are
left out while the command still lists them, except when the job could not
reach MIN without them (:func:`choose`): a network blip or a restarted sshd
is more common than a host that stays broken while discovery keeps listing
it, and a retry costs one restart of a bounded ``--max-restarts``, while
refusing would fail a job that can run (Horovod blacklists such hosts for
good; torchrun has no hosts to leave out).
"""
import os
import subprocess
import tempfile
import time
from typing import NamedTuple

from .hosts import LaunchError, is_loopback, parse_hosts

__all__ = ['Discovery', 'DiscoveryError', 'Layout', 'Poll', 'choose', 'unreachable_hosts',
           'format_hosts']

#: A discovery command still running after this many seconds has failed.
DISCOVER_TIMEOUT = 30.0
# ssh's own status when it cannot reach the host or the connection drops.
_SSH_FAILED = 255


class DiscoveryError(LaunchError):
    """The discovery command failed, or printed something other than hosts."""


class Layout(NamedTuple):
    """The hosts of one attempt."""
    workers: int
    hosts: list                 # [(host, slots)] the attempt's workers fill, in order
    discovered: list            # [(host, slots)] the command printed
    left_out: list              # hosts not used because they became unreachable


def format_hosts(hosts):
    return ' '.join(f'{h}:{n:d}' for h, n in hosts) or 'none'


def _merge(hosts):
    total = {}
    for host, slots in hosts:
        total[host] = total.get(host, 0) + slots
    return list(total.items())


def _is_here(host):
    name = host.rsplit('@', 1)[-1]
    return name == 'localhost' or is_loopback(name)


class Discovery:
    """The discovery command of a job.

    Parameters
    ----------
    command : str
        Run by ``/bin/sh -c``.
    local : bool
        ``--launcher local``: every line must name this machine
        (``localhost`` or a 127.x address).
    """

    def __init__(self, command: str, local: bool) -> None:
        self.command, self.local = command, local

    def start(self):
        """Start the command; its output goes to a file (never a pipe that
        could fill up while nobody reads it)."""
        return Poll(self)

    def run(self):
        """Run the command now: [(host, slots)], or DiscoveryError."""
        poll = self.start()
        try:
            while True:
                result = poll.result()
                if result is not None:
                    if isinstance(result, DiscoveryError):
                        raise result
                    return result
                time.sleep(0.02)
        finally:
            poll.cancel()       # (a signal while it runs)

    def parse(self, status, out, err):
        """The command's hosts, or DiscoveryError saying what is wrong."""
        where = f'--discover {self.command!r}'
        if status:
            tail = (err.strip().splitlines() or ['(no output on stderr)'])[-1]
            raise DiscoveryError(f'{where} exited with status {status:d}: {tail}')
        try:
            hosts = _merge(parse_hosts(out.splitlines(), f'{where} output'))
        except LaunchError as e:
            raise DiscoveryError(str(e)) from None
        if self.local:
            others = [h for h, _ in hosts if not _is_here(h)]
            if others:
                raise DiscoveryError(f'{where} names {others[0]}: --launcher local runs on this '
                                     'machine only (lines "localhost:SLOTS"; other hosts: '
                                     '--launcher ssh)')
        return hosts


class Poll:
    """One run of the discovery command in the background."""

    def __init__(self, discovery):
        self.discovery = discovery
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self._deadline = time.monotonic() + DISCOVER_TIMEOUT
        self._result = None
        try:
            self._popen = subprocess.Popen(['/bin/sh', '-c', discovery.command],
                                           stdin=subprocess.DEVNULL, stdout=self._out,
                                           stderr=self._err, start_new_session=True)
        except OSError as e:
            self._popen = None
            self._result = DiscoveryError(f'cannot run --discover {discovery.command!r}: {e}')
            self._close()

    def result(self):
        """None while running; then the hosts, or a DiscoveryError."""
        if self._result is not None:
            return self._result
        status = self._popen.poll()
        if status is None:
            if time.monotonic() < self._deadline:
                return None
            self.cancel()
            self._result = DiscoveryError(f'--discover {self.discovery.command!r} did not '
                                          f'finish in {DISCOVER_TIMEOUT:g}s')
            return self._result
        out, err = (self._read(f) for f in (self._out, self._err))
        self._close()
        try:
            self._result = self.discovery.parse(status, out, err)
        except DiscoveryError as e:
            self._result = e
        return self._result

    @staticmethod
    def _read(f):
        f.seek(0)
        return f.read().decode(errors='replace')

    def cancel(self):
        """Stop the command (its whole session) if it still runs."""
        if self._popen is not None and self._popen.poll() is None:
            try:
                os.killpg(self._popen.pid, 9)
            except OSError:
                pass
            self._popen.wait()
        self._close()

    def _close(self):
        for f in (self._out, self._err):
            f.close()


def choose(discovered, unreachable, min_workers, max_workers):
    """The Layout of the next attempt, or None below `min_workers` slots.

    Hosts in `unreachable` are left out unless the others have fewer than
    `min_workers` slots (see the module's notes); an attempt runs
    ``min(max_workers, slots)`` workers, filling the hosts in order.
    """
    usable = [(h, n) for h, n in discovered if h not in unreachable]
    left_out = [h for h, _ in discovered if h in unreachable]
    if sum(n for _, n in usable) < min_workers:
        usable, left_out = list(discovered), []
    total = sum(n for _, n in usable)
    if total < min_workers:
        return None
    workers = min(max_workers, total)
    hosts, need = [], workers
    for host, slots in usable:
        if need <= 0:
            break
        hosts.append((host, min(slots, need)))
        need -= slots
    return Layout(workers, hosts, list(discovered), left_out)


def usable_slots(discovered, unreachable):
    """The slots an attempt could use without the unreachable hosts."""
    return sum(n for h, n in discovered if h not in unreachable)


def unreachable_hosts(procs):
    """The hosts of remote processes whose ssh client reported a lost
    connection (status 255) rather than the process's own status."""
    return {p.spec.host for p in procs
            if p.spec.remote and p.spec.host and p.returncode == _SSH_FAILED}
