"""Run a dist_sync job on this machine: ``python -m gluon_parallel.launch``.

::

    python -m gluon_parallel.launch -n WORKERS -s SERVERS [--timeout S] [--] COMMAND...

Starts one scheduler, ``SERVERS`` parameter servers and ``WORKERS`` workers,
every one of them running ``COMMAND`` with the standard DMLC environment
(``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``,
``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``) on 127.0.0.1 and a free port, so
a script written for MXNet's ``tools/launch.py``, dmlc-tracker, SLURM or
Kubernetes runs unchanged. Every line a process prints is streamed with a
prefix naming it (``[worker 1] ...``), stdout to stdout and stderr to stderr.

The launcher is a watchdog: ps-lite never notices a dead peer, so a worker
that dies would leave the others blocked forever. The first process that
exits with a non-zero status ends the job: every other process is stopped
(SIGTERM, then SIGKILL after ``--grace`` seconds) and the launcher exits
with that status. The same happens on ``--timeout``, on Ctrl-C (SIGINT)
and on SIGTERM/SIGHUP sent to the launcher. Each process runs in its own
session, so the stop reaches whatever it started, and on Linux it is
killed if the launcher itself is killed.

This module imports nothing from MXNet: in a process whose ``DMLC_ROLE`` is
``scheduler`` or ``server``, ``import mxnet`` runs the server loop instead
of returning.

Exit status: 0 when every worker exited with 0; else the first non-zero
status (``128 + N`` for a process killed by signal N); 124 on timeout;
``128 + N`` when the launcher got signal N (130 for Ctrl-C).
"""
import argparse
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import time

__all__ = ['Launcher', 'main', 'find_free_ports']

#: Environment variable telling a worker the rank the launcher expects it to
#: get from ps-lite (gluon_parallel.dist warns when it does not).
LAUNCH_RANK_ENV = 'GLUON_PARALLEL_LAUNCH_RANK'

_DMLC_VARS = ('DMLC_ROLE', 'DMLC_PS_ROOT_URI', 'DMLC_PS_ROOT_PORT', 'DMLC_NUM_SERVER',
              'DMLC_NUM_WORKER', 'DMLC_NODE_HOST', 'DMLC_INTERFACE', 'DMLC_RANK', 'PORT',
              LAUNCH_RANK_ENV)

# Ports below Linux's ephemeral range (32768-60999) are never handed out to
# bind(0) or outgoing connections, so a port we checked stays free until the
# process we give it to binds it (MXNet's import takes seconds).
_PORT_RANGE = (20000, 32000)
_TIMEOUT_STATUS = 124


class _Stop(Exception):
    """A signal asked the launcher to stop."""

    def __init__(self, signum):
        super(_Stop, self).__init__(signum)
        self.signum = signum


def find_free_ports(count, host='127.0.0.1'):
    """`count` distinct TCP ports that nothing listens on, in ascending order.

    ps-lite gives ranks in the order of the nodes' ports, so handing sorted
    ports to workers 0, 1, ... makes each worker's rank its launch index.

    Parameters
    ----------
    count : int
    host : str
        Only used to check the ports are free; they are probed on every
        interface, as ps-lite binds them.

    Returns
    -------
    list of int
    """
    ports, socks = set(), []
    try:
        tries = 0
        while len(ports) < count:
            tries += 1
            port = random.randrange(*_PORT_RANGE) if tries < 50 * count else 0
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(('', port))
            except OSError:
                s.close()
                continue
            socks.append(s)          # held until all are chosen, so they differ
            ports.add(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
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


def _status(returncode):
    """Shell-style exit status of a child's Popen.returncode."""
    return 128 - returncode if returncode < 0 else returncode


class _Proc(object):
    """One launched process and its two output streams."""

    def __init__(self, name, popen, is_worker):
        self.name = name
        self.popen = popen
        self.is_worker = is_worker
        self.prefix = ('[%s] ' % name).encode()
        self.buffers = {}       # fd -> bytes of an unfinished line
        self.returncode = None  # as Popen's: -N when killed by signal N

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

    def reap(self):
        self.popen.wait()


class Launcher(object):
    """Start a scheduler, servers and workers on this machine and watch them.

    Parameters
    ----------
    command : list of str
        The command every process runs.
    num_workers : int
    num_servers : int, default 1
    timeout : float, optional
        Seconds after which every process is stopped; None: no limit.
    grace : float, default 5
        Seconds between SIGTERM and SIGKILL when stopping.
    host : str, default '127.0.0.1'
    port : int, optional
        The scheduler's port (``DMLC_PS_ROOT_PORT``); default: a free one.
    env : dict, optional
        Extra environment variables for every process.
    stdout, stderr : binary file, optional
        Where prefixed output goes; default: the launcher's own.
    """

    def __init__(self, command, num_workers, num_servers=1, timeout=None, grace=5.0,
                 host='127.0.0.1', port=None, env=None, stdout=None, stderr=None):
        if not command:
            raise ValueError('no command to launch')
        if num_workers < 1:
            raise ValueError('need at least one worker, got %d' % num_workers)
        if num_servers < 1:
            raise ValueError('dist_sync needs at least one server, got %d' % num_servers)
        self.command = list(command)
        self.num_workers = int(num_workers)
        self.num_servers = int(num_servers)
        self.timeout = timeout
        self.grace = float(grace)
        self.host = host
        self.port = port
        self.env = dict(env or {})
        self.stdout = stdout if stdout is not None else sys.stdout.buffer
        self.stderr = stderr if stderr is not None else sys.stderr.buffer
        self.procs = []
        self._sel = None

    # -- output ---------------------------------------------------------------

    def _note(self, msg):
        self.stderr.write(('[launch] %s\n' % msg).encode())
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
        if lines:
            out.write(b''.join(proc.prefix + line + b'\n' for line in lines))
            out.flush()

    def _pump(self, wait):
        """Copy whatever output is ready, waiting at most `wait` seconds."""
        if not self._sel.get_map():
            time.sleep(wait)
            return
        for key, _ in self._sel.select(wait):
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

    def _spawn(self, name, role, extra, is_worker=False):
        env = {k: v for k, v in os.environ.items() if k not in _DMLC_VARS}
        env.update(self.env)
        env.update(extra)
        env['DMLC_ROLE'] = role
        env.setdefault('PYTHONUNBUFFERED', '1')     # lines as they are printed
        popen = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True, preexec_fn=_die_with_parent)
        proc = _Proc(name, popen, is_worker)
        self.procs.append(proc)
        for f in (popen.stdout, popen.stderr):
            os.set_blocking(f.fileno(), False)
            self._sel.register(f.fileno(), selectors.EVENT_READ, proc)
        return proc

    def start(self):
        """Start the scheduler, the servers and the workers."""
        self._sel = selectors.DefaultSelector()
        ports = find_free_ports(1 + self.num_servers + self.num_workers)
        root = self.port if self.port is not None else ports[0]
        ports = [p for p in ports if p != root][:self.num_servers + self.num_workers]
        common = {'DMLC_PS_ROOT_URI': self.host, 'DMLC_PS_ROOT_PORT': str(root),
                  'DMLC_NUM_SERVER': str(self.num_servers),
                  'DMLC_NUM_WORKER': str(self.num_workers),
                  # ps-lite skips loopback interfaces when it picks its own
                  # address: give it the one every process can reach.
                  'DMLC_NODE_HOST': self.host}
        self._spawn('scheduler', 'scheduler', common)
        for i in range(self.num_servers):
            self._spawn('server %d' % i, 'server', dict(common, PORT=str(ports[i])))
        for i in range(self.num_workers):
            port = ports[self.num_servers + i]
            self._spawn('worker %d' % i, 'worker',
                        dict(common, PORT=str(port), **{LAUNCH_RANK_ENV: str(i)}),
                        is_worker=True)

    def _signal(self, sig, procs):
        for p in procs:
            try:
                os.killpg(p.popen.pid, sig)     # its session: what it started too
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self):
        """SIGTERM every process (and what it started), SIGKILL those still
        there after the grace period, and reap them."""
        live = [p for p in self.procs if p.poll() is None]
        self._signal(signal.SIGTERM, live)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(p.poll() is None for p in live):
            self._pump(0.05)
        # Every group, also those whose leader exited: what it left behind.
        self._signal(signal.SIGKILL, self.procs)
        for p in self.procs:
            p.reap()
        self._drain(1.0)

    def wait(self):
        """Watch the processes until the job ends; return the exit status."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        workers = [p for p in self.procs if p.is_worker]
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._note('timeout after %gs: stopping every process' % self.timeout)
                self.stop()
                return _TIMEOUT_STATUS
            self._pump(0.1 if left is None else min(0.1, left))
            failed = [p for p in self.procs
                      if p.returncode is None and p.poll() is not None and p.returncode]
            if failed:
                # Of failures seen together, a worker's is the likely cause:
                # servers abort when a worker vanishes mid-request.
                p = ([f for f in failed if f.is_worker] or failed)[0]
                self._note('%s exited with status %d: stopping the other processes'
                           % (p.name, _status(p.returncode)))
                self.stop()
                return _status(p.returncode)
            if all(p.returncode == 0 for p in workers):
                # The scheduler and servers leave once every worker has
                # finalized; wait for them briefly, then stop the rest.
                end = time.monotonic() + self.grace
                if deadline is not None:
                    end = min(end, deadline)
                others = [p for p in self.procs if not p.is_worker]
                while time.monotonic() < end and any(p.poll() is None for p in others):
                    self._pump(0.05)
                failed = [p for p in others if p.returncode]
                stuck = [p.name for p in others if p.returncode is None]
                if stuck:
                    self._note('every worker finished; stopping %s' % ', '.join(stuck))
                self.stop()
                if failed:
                    self._note('%s exited with status %d' % (failed[0].name,
                                                              _status(failed[0].returncode)))
                    return _status(failed[0].returncode)
                return 0

    def run(self):
        """Start, watch and clean up; return the exit status.

        SIGINT, SIGTERM and SIGHUP stop every process and return
        ``128 + signal``.
        """
        def handler(signum, frame):
            raise _Stop(signum)

        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, handler)
        try:
            try:
                self.start()
                return self.wait()
            except _Stop as e:
                # Finish the cleanup even if the signal comes again.
                for sig in old:
                    signal.signal(sig, signal.SIG_IGN)
                self._note('got %s: stopping every process' % signal.Signals(e.signum).name)
                self.stop()
                return 128 + e.signum
            except BaseException:
                for sig in old:
                    signal.signal(sig, signal.SIG_IGN)
                self.stop()
                raise
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
            if self._sel is not None:
                for p in self.procs:
                    for f in (p.popen.stdout, p.popen.stderr):
                        f.close()
                self._sel.close()


def _parser():
    p = argparse.ArgumentParser(
        prog='python -m gluon_parallel.launch',
        description='Run COMMAND as a dist_sync job on this machine: one scheduler, '
                    'SERVERS servers and WORKERS workers on 127.0.0.1, output prefixed '
                    'by process; the first failure stops everything.',
        epilog='Example: python -m gluon_parallel.launch -n 2 -s 1 -- '
               'python examples/train_image_classification.py --kvstore dist_sync')
    p.add_argument('-n', '--num-workers', type=int, required=True, metavar='WORKERS',
                   help='number of worker processes')
    p.add_argument('-s', '--num-servers', type=int, default=1, metavar='SERVERS',
                   help='number of parameter servers (default 1)')
    p.add_argument('--timeout', type=float, default=None, metavar='S',
                   help='stop everything after S seconds (exit status 124)')
    p.add_argument('--grace', type=float, default=5.0, metavar='S',
                   help='seconds between SIGTERM and SIGKILL when stopping (default 5)')
    p.add_argument('--host', default='127.0.0.1',
                   help='address every process binds and reaches (default 127.0.0.1)')
    p.add_argument('--port', type=int, default=None,
                   help="the scheduler's port (default: a free one)")
    p.add_argument('command', nargs=argparse.REMAINDER, metavar='COMMAND',
                   help='the command every process runs (after an optional --)')
    return p


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command
    if command and command[0] == '--':
        command = command[1:]
    if not command:
        parser.error('no COMMAND given')
    if args.num_workers < 1:
        parser.error('-n must be at least 1')
    if args.num_servers < 1:
        parser.error('-s must be at least 1: dist_sync keeps its values on the servers')
    if args.timeout is not None and args.timeout <= 0:
        parser.error('--timeout must be positive')
    launcher = Launcher(command, args.num_workers, args.num_servers, timeout=args.timeout,
                        grace=args.grace, host=args.host, port=args.port)
    return launcher.run()


if __name__ == '__main__':
    sys.exit(main())
