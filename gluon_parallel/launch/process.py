"""One process of a job: what to start (:class:`Spec`), how it is watched
and stopped (:class:`Proc`), and free ports for ps-lite.
"""
import os
import random
from collections.abc import Iterable, Mapping, Sequence
import signal
import socket
import subprocess
import sys

from ..channel import CHANNEL_ENV, KEY_ENV, MEMBER_ENV

#: Environment variable telling a worker the rank the launcher expects it to
#: get from ps-lite (gluon_parallel.dist warns when it does not).
LAUNCH_RANK_ENV = 'GLUON_PARALLEL_LAUNCH_RANK'

#: Environment variable telling every process of a job which attempt it
#: belongs to: 0, then 1, 2... after each restart (``--max-restarts``).
RESTART_ENV = 'GLUON_PARALLEL_RESTART'

#: The launcher's channel and the process's name in it (an elastic job's
#: flag too: the same name as elastic.ELASTIC_ENV).
CHANNEL_VARS = (CHANNEL_ENV, KEY_ENV, MEMBER_ENV, 'GLUON_PARALLEL_ELASTIC')

#: Variables a launcher sets; a value left in its own environment (say, by
#: an outer launcher) must not leak into the processes it starts.
DMLC_VARS = ('DMLC_ROLE', 'DMLC_PS_ROOT_URI', 'DMLC_PS_ROOT_PORT', 'DMLC_NUM_SERVER',
             'DMLC_NUM_WORKER', 'DMLC_NODE_HOST', 'DMLC_RANK', 'PORT', LAUNCH_RANK_ENV,
             RESTART_ENV) + CHANNEL_VARS

# Ports below Linux's ephemeral range (32768-60999) are never handed out to
# bind(0) or outgoing connections, so a port we checked stays free until the
# process we give it to binds it (MXNet's import takes seconds).
PORT_RANGE = (20000, 32000)


def find_free_ports(count: int, port_range: tuple[int, int] = PORT_RANGE,
                    exclude: Iterable[int] = ()) -> list[int]:
    """`count` distinct TCP ports in `port_range` that nothing listens on
    here, in ascending order.

    ps-lite ranks the nodes of one address in the order of their ports, so
    handing sorted ports to workers 0, 1, ... makes each worker's rank its
    launch index.

    Parameters
    ----------
    count : int
    port_range : (int, int)
        Half-open range to draw from.
    exclude : collection of int
        Ports not to return (say, the scheduler's).

    Returns
    -------
    list of int
    """
    lo, hi = port_range
    candidates = [p for p in range(lo, hi) if p not in exclude]
    random.shuffle(candidates)
    ports, socks = set(), []
    try:
        for port in candidates:
            if len(ports) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(('', port))      # every interface, as ps-lite binds
            except OSError:
                s.close()
                continue
            socks.append(s)             # held until all are chosen, so they differ
            ports.add(port)
    finally:
        for s in socks:
            s.close()
    if len(ports) < count:
        raise RuntimeError(f'found only {len(ports):d} free ports in [{lo:d}, {hi:d}), need '
                           f'{count:d}')
    return sorted(ports)


def _die_with_parent():
    """preexec_fn: on Linux, SIGKILL this child when the launcher dies, even
    by SIGKILL (the launcher is single-threaded, so preexec_fn is safe)."""
    if sys.platform.startswith('linux'):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:       # best effort: the watchdog still stops children
            pass


def exit_status(returncode):
    """Shell-style exit status of a child's Popen.returncode."""
    return 128 - returncode if returncode < 0 else returncode


class Spec:
    """One process to start.

    Parameters
    ----------
    name : str
        Its prefix, e.g. ``'worker 1'`` or ``'worker 1@node2'``.
    role : str
        ``'scheduler'``, ``'server'`` or ``'worker'``.
    argv : list of str
        What to run on this machine (for a remote process: its ssh client).
    env : dict
        Its complete environment.
    remote : bool
        Stop it by closing its stdin rather than by signals.
    host : str, optional
        The host a remote process runs on.
    heartbeat : float, optional
        A remote process: write a line to its stdin this often (seconds),
        which its wrapper takes as the launcher being there.
    wrapper_lines : (bytes, bytes), optional
        A remote process: the lines its wrapper writes on stderr when the
        command has started and when it has exited (not shown).
    """

    def __init__(self, name: str, role: str, argv: Sequence[str], env: Mapping[str, str],
                 remote: bool = False, host: str | None = None, heartbeat: float | None = None,
                 wrapper_lines: tuple[bytes, bytes] | None = None) -> None:
        self.name, self.role, self.argv, self.env, self.remote = name, role, argv, env, remote
        self.host, self.heartbeat, self.wrapper_lines = host, heartbeat, wrapper_lines

    @property
    def is_worker(self):
        return self.role == 'worker'


class Proc:
    """A started process and its two output streams (pipes)."""

    def __init__(self, spec):
        self.spec = spec
        self.name = spec.name
        # Its own session, so a stop reaches whatever it starts; a remote
        # one reads its stdin to learn when to stop.
        self.popen = subprocess.Popen(
            spec.argv, env=spec.env,
            stdin=subprocess.PIPE if spec.remote else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=_die_with_parent)
        self.prefix = (f'[{spec.name}] ').encode()
        self.buffers = {}       # fd -> bytes of an unfinished line
        self.returncode = None  # as Popen's: -N when killed by signal N
        self.failed_at = None   # when its fail-fast hook said it fails (watchdog)
        self.heard_at = None    # when it last printed a line (watchdog)
        self.started_at = None  # a remote one: when its wrapper said the command started
        self.exited_seen = False    # ... and that it exited (its status is the command's)
        self._beat_at = 0.0
        if spec.heartbeat:
            os.set_blocking(self.popen.stdin.fileno(), False)

    def wrapper_line(self, line, now):
        """Whether `line` (of its stderr) is its wrapper's own; notes it."""
        lines = self.spec.wrapper_lines
        if not lines or line not in lines:
            return False
        if line == lines[0]:
            self.started_at = now
        else:
            self.exited_seen = True
        return True

    @property
    def lost(self):
        """A remote process whose ssh client exited with 255 after the
        command started and before it exited: its connection dropped."""
        return (self.spec.remote and self.started_at is not None and not self.exited_seen
                and self.returncode == 255)

    def beat(self, now):
        """A remote process: its heartbeat line, when one is due."""
        if not self.spec.heartbeat or now - self._beat_at < self.spec.heartbeat:
            return
        self._beat_at = now
        try:
            os.write(self.popen.stdin.fileno(), b'\n')
        except (OSError, ValueError):   # full (a dark link), closed, or gone
            pass

    def poll(self):
        """The exit code once the process has exited, else None, *without*
        reaping it: until :meth:`reap`, its pid, hence the id of its process
        group, cannot be reused, so signalling that group can only reach
        what it started."""
        if self.returncode is None:
            try:
                info = os.waitid(os.P_PID, self.popen.pid,
                                 os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except (AttributeError, ChildProcessError):   # no waitid: reap now
                self.returncode = self.popen.poll()
                return self.returncode
            if info is not None and info.si_pid:
                self.returncode = (info.si_status if info.si_code == os.CLD_EXITED
                                   else -info.si_status)
        return self.returncode

    def signal(self, sig):
        try:
            os.killpg(self.popen.pid, sig)      # its session: what it started too
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self):
        if self.spec.remote:
            # End of input: the wrapper on the other host stops the process
            # group there, its output still reaches us, then ssh exits.
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        else:
            self.signal(signal.SIGTERM)

    def reap(self):
        self.popen.wait()
