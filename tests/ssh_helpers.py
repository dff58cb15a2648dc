"""A real sshd for the ssh launcher tests (tests/test_launch_ssh.py,
tests/test_launch_elastic_ssh.py): Debian's /usr/sbin/sshd on a free
loopback port with a throwaway host key and an authorized key made in a
temporary directory (where OpenSSH is not installed the tests skip, or fail
under .ci/run: tests/daemons.py); the launcher arguments of an ssh job; and
the check that a job left no process behind (its token, or any session of
the test sshd)."""
import os
import shlex
import shutil
import subprocess
import time
import types

import psutil
import pytest

from gluon_parallel.launch import find_free_ports

import daemons
from launch_helpers import carrying

OPENSSH = ('sshd', 'ssh', 'ssh-keygen')


def _fail_sshd(why, log=None):
    text = open(log, errors='replace').read() if log and os.path.exists(log) else ''
    pytest.fail(f'cannot start a test sshd ({why}); install Debian openssh-server '
                f'(apt-get install openssh-server). sshd log:\n{text}')


def start_sshd(tmp_path_factory):
    """The body of conftest's module-scoped ``sshd`` fixture: yields its
    port, ssh command, process and directory."""
    missing = daemons.missing(*OPENSSH)
    daemons.require(not missing, 'OpenSSH is not installed (missing {}): apt-get install '
                    'openssh-server'.format(', '.join(missing)))
    sshd_path = daemons.which('sshd')
    d = tmp_path_factory.mktemp('sshd')
    for key in ('host_key', 'user_key'):
        subprocess.run(['ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-f', str(d / key)],
                       check=True, timeout=30)
    shutil.copy(str(d / 'user_key.pub'), str(d / 'authorized_keys'))
    port = find_free_ports(1)[0]
    (d / 'sshd_config').write_text('\n'.join([
        f'Port {port:d}', 'ListenAddress 127.0.0.1', 'HostKey %s' % (d / 'host_key'),
        'AuthorizedKeysFile %s' % (d / 'authorized_keys'), 'PermitRootLogin yes',
        'StrictModes no', 'PasswordAuthentication no', 'KbdInteractiveAuthentication no',
        'UsePAM no', 'PidFile none', 'MaxStartups 100', '']))
    try:
        os.makedirs('/run/sshd', exist_ok=True)     # privilege separation directory
    except OSError:
        pass
    log = str(d / 'sshd.log')
    with open(log, 'wb') as f:
        proc = subprocess.Popen([sshd_path, '-D', '-e', '-f', str(d / 'sshd_config')],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    ssh_command = ('ssh -F /dev/null -o BatchMode=yes -o StrictHostKeyChecking=no -o '
                   'UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o IdentitiesOnly=yes -i '
                   '%s' % (d / 'user_key'))
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                _fail_sshd(f'sshd exited with status {proc.returncode:d}', log)
            trial = subprocess.run(shlex.split(ssh_command) + ['-p', str(port), '127.0.0.1',
                                                               'true'],
                                   capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
            if trial.returncode == 0:
                break
            if time.monotonic() > deadline:
                _fail_sshd(f"ssh to it failed: {trial.stderr.decode(errors='replace')}", log)
            time.sleep(0.2)
        yield types.SimpleNamespace(port=port, ssh_command=ssh_command, proc=proc, dir=d)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def ssh_args(sshd, hostfile, *args):
    """Launcher arguments for an ssh job; the test token and (when set)
    PYTHONPATH are passed to the remote processes with --env. `hostfile`
    None: no -H (an elastic job's --discover names the hosts)."""
    out = ['--launcher', 'ssh'] + (['-H', str(hostfile)] if hostfile else []) + [
        '--ssh-port', str(sshd.port), '--ssh-command', sshd.ssh_command,
        '--env', 'GP_LAUNCH_TEST_TOKEN']
    if 'PYTHONPATH' in os.environ:
        out += ['--env', 'PYTHONPATH']
    return out + list(args)


def _job_left(token, sshd):
    """Processes of the job still there: carrying its token in their
    environment or command line (the remote wrapper shells), or any
    session of the test sshd."""
    left = set(carrying(token))
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and token in ' '.join(p.cmdline()):
                left.add(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    try:
        left.update(c for c in psutil.Process(sshd.proc.pid).children(recursive=True)
                    if c.status() != psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        pass
    return left


def assert_job_gone(token, sshd, within=10):
    deadline = time.monotonic() + within
    while _job_left(token, sshd) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = []
    for p in _job_left(token, sshd):
        try:
            left.append((p.pid, ' '.join(p.cmdline())[:200]))
        except psutil.Error:
            pass
    assert not left, f'processes of the job left running: {left}'
