"""A real one-node SLURM for tests: munged, slurmctld and slurmd on this
machine, with a throwaway munge key and socket and a throwaway
``slurm.conf`` (127.0.0.1, free ports), all in one temporary directory.

Debian's ``slurm-wlm`` and ``munge`` provide the daemons (.ci/run installs
them). :func:`available` says whether they are here; :func:`cluster`
starts them, waits for the node to be idle, yields the environment that
points ``srun``/``salloc`` at them (``SLURM_CONF``), and stops them,
waiting for each to exit. slurmd runs as root (it starts the tasks as
their user); tasks are tracked by ``proctrack/linuxproc``, so no cgroup
set-up is needed.
"""
import contextlib
import os
import random
import signal
import socket
import subprocess
import time

from gluon_parallel.launch import find_free_ports

import daemons

DAEMONS = ('munged', 'slurmctld', 'slurmd')
CLIENTS = ('srun', 'salloc', 'sinfo', 'scancel')
START_LIMIT = 60        # seconds for the node to come up


_which = daemons.which


def available():
    """(bool, reason): whether a SLURM can be started here."""
    missing = daemons.missing(*(DAEMONS + CLIENTS))
    if missing:
        return False, (f"SLURM is not installed (missing {', '.join(missing)}): apt-get install "
                       'slurm-wlm munge')
    if os.geteuid() != 0:
        return False, 'slurmd must run as root to start tasks'
    return True, ''


def _conf(d, node, ports, munge_socket):
    return '\n'.join([
        'ClusterName=gptest',
        # Job ids start anew with every cluster: random ones keep the
        # scheduler ports the launcher derives from them apart from the last
        # run's (still in TIME_WAIT).
        f'FirstJobId={random.randrange(1000, 1000000):d}',
        f'SlurmctldHost={node}(127.0.0.1)',
        f'SlurmctldPort={ports[0]:d}',
        f'SlurmdPort={ports[1]:d}',
        f'SrunPortRange={ports[2]:d}-{ports[2] + 50:d}',
        'SlurmUser=root',
        'SlurmdUser=root',
        'AuthType=auth/munge',
        'CredType=cred/munge',
        f'AuthInfo=socket={munge_socket}',
        'StateSaveLocation=%s' % (d / 'state'),
        'SlurmdSpoolDir=%s' % (d / 'spool'),
        'SlurmctldPidFile=%s' % (d / 'slurmctld.pid'),
        'SlurmdPidFile=%s' % (d / 'slurmd.pid'),
        'SlurmctldLogFile=%s' % (d / 'slurmctld.log'),
        'SlurmdLogFile=%s' % (d / 'slurmd.log'),
        'ProctrackType=proctrack/linuxproc',
        'TaskPlugin=task/none',
        'PlugStackConfig=%s' % (d / 'plugstack.conf'),
        'MpiDefault=none',
        'SchedulerType=sched/builtin',
        'SelectType=select/cons_tres',
        'SelectTypeParameters=CR_CPU',
        'ReturnToService=2',
        'JobCompType=jobcomp/none',
        'AccountingStorageType=accounting_storage/none',
        'JobAcctGatherType=jobacct_gather/none',
        'KillWait=5',
        'MessageTimeout=20',
        f'NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN',
        f'PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP '
        'OverSubscribe=FORCE:8',
        ''])


def _logs(d):
    out = []
    for name in ('munged.log', 'slurmctld.log', 'slurmd.log'):
        path = d / name
        if path.exists():
            out.append('--- {} (end)\n{}'.format(name, path.read_text(errors='replace')[-3000:]))
    return '\n'.join(out)


def _stop(procs):
    """SIGTERM each daemon, newest first, and wait for it (then SIGKILL)."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def cluster(d):
    """Start a one-node SLURM in directory `d` (a pathlib.Path); yield
    ``{'env': the environment for SLURM's clients, 'node': the node name,
    'dir': d}``; stop every daemon on exit."""
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(str(d), 0o700)
    for sub in ('state', 'spool', 'munge'):
        (d / sub).mkdir(exist_ok=True)
        os.chmod(str(d / sub), 0o700)
    key = d / 'munge' / 'munge.key'
    key.write_bytes(os.urandom(1024))
    os.chmod(str(key), 0o400)
    munge_socket = d / 'munge' / 'munge.socket'
    (d / 'plugstack.conf').write_text('')
    node = socket.gethostname().split('.')[0]
    ports = find_free_ports(3)
    conf = d / 'slurm.conf'
    conf.write_text(_conf(d, node, ports, munge_socket))
    env = dict(os.environ, SLURM_CONF=str(conf))
    for k in [k for k in env if k.startswith('SLURM_') and k != 'SLURM_CONF']:
        del env[k]
    procs = []

    def start(argv):
        procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                      start_new_session=True))

    try:
        start([_which('munged'), '-F', '-f', f'--socket={munge_socket}',
               f'--key-file={key}', '--pid-file=%s' % (d / 'munge' / 'munged.pid'),
               '--log-file=%s' % (d / 'munged.log'), '--seed-file=%s' % (d / 'munge' / 'seed')])
        _wait(lambda: munge_socket.exists(), procs, d, 'munged never opened its socket')
        start([_which('slurmctld'), '-D', '-c', '-f', str(conf)])
        start([_which('slurmd'), '-D', '-N', node, '-f', str(conf)])
        _wait(lambda: _idle(env, node), procs, d, 'the node never became idle')
        yield {'env': env, 'node': node, 'dir': d}
    finally:
        _stop(procs)


def _idle(env, node):
    out = subprocess.run([_which('sinfo'), '-h', '-n', node, '-o', '%t'], env=env,
                         capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and out.stdout.strip() == 'idle'


def _wait(ready, procs, d, what):
    deadline = time.monotonic() + START_LIMIT
    while not ready():
        dead = [p.args[0] for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            _stop(procs)
            exited = f" ({', '.join(dead)} exited)" if dead else ''
            raise RuntimeError(f'cannot start a test SLURM: {what}{exited}\n{_logs(d)}')
        time.sleep(0.2)
