"""Two hosts on one machine, for the ssh launcher tests that need real
hosts (tests/test_launch_two_hosts.py): two network namespaces joined by a
veth pair, 10.231.0.1/24 and 10.231.0.2/24 (only these namespaces have
them), each running its own Debian sshd (root, key auth, host keys made in
a temporary directory) on port 22 of its address. Each namespace has its
own /etc/hosts (``ip netns exec`` bind-mounts /etc/netns/<ns>/hosts): the
two host names, and this machine's name at 127.0.1.1 as Debian writes it.

A launcher runs inside the first namespace (:meth:`TwoHosts.launch_cmd`)
with ``--launcher ssh`` and a hostfile naming both hosts; the link of the
second can be taken down for good (:meth:`TwoHosts.cut`). Everything is
removed at the end, whatever happens. Where the machine cannot do this (not
root, no ``ip``, no OpenSSH, no network namespaces) the tests skip with the
reason, or fail under .ci/run (tests/daemons.py).
"""
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import uuid

import psutil

import daemons
from launch_helpers import carrying

NET = '10.231.0'
HOSTNAMES = ('gp-host1', 'gp-host2')
_SSHD_CONFIG = ['Port 22', 'ListenAddress {address}', 'HostKey {dir}/host_key{i:d}',
                'AuthorizedKeysFile {dir}/authorized_keys', 'PermitRootLogin yes',
                'StrictModes no', 'PasswordAuthentication no', 'KbdInteractiveAuthentication no',
                'UsePAM no', 'PidFile none', 'MaxStartups 100']


def _run(*argv):
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def _netns_inode(ns):
    return os.stat(f'/run/netns/{ns}').st_ino


class TwoHosts:
    """The two hosts: ``namespaces``, ``addresses``, ``hostnames``,
    ``ssh_command`` (the test key, the hosts' keys in a known_hosts file:
    strict checking), ``dir`` (the temporary directory)."""

    def __init__(self, directory):
        tag = uuid.uuid4().hex[:6]
        self.dir = directory
        self.namespaces = (f'gp{tag}a', f'gp{tag}b')
        self.links = (f'gpv{tag}a', f'gpv{tag}b')
        self.addresses = (f'{NET}.1', f'{NET}.2')
        self.hostnames = HOSTNAMES
        self.sshds = []
        self.ssh_command = (
            f'ssh -F /dev/null -o BatchMode=yes -o StrictHostKeyChecking=yes '
            f'-o UserKnownHostsFile={directory}/known_hosts -o LogLevel=ERROR '
            f'-o IdentitiesOnly=yes -i {directory}/user_key')

    # -- setting up and tearing down -------------------------------------

    def start(self):
        for ns in self.namespaces:
            _run('ip', 'netns', 'add', ns)
        a, b = self.links
        _run('ip', 'link', 'add', a, 'type', 'veth', 'peer', 'name', b)
        for ns, link, address, in zip(self.namespaces, self.links, self.addresses):
            _run('ip', 'link', 'set', link, 'netns', ns)
            _run('ip', '-n', ns, 'addr', 'add', f'{address}/24', 'dev', link)
            _run('ip', '-n', ns, 'link', 'set', link, 'up')
            _run('ip', '-n', ns, 'link', 'set', 'lo', 'up')
            os.makedirs(f'/etc/netns/{ns}', exist_ok=True)
            with open(f'/etc/netns/{ns}/hosts', 'w') as f:
                f.write(self.hosts_file())
        self._keys()
        for i in range(2):
            self._start_sshd(i)

    def hosts_file(self):
        lines = ['127.0.0.1 localhost', f'127.0.1.1 {socket.gethostname()}']
        lines += [f'{a} {h}' for a, h in zip(self.addresses, self.hostnames)]
        return '\n'.join(lines) + '\n'

    def _keys(self):
        d = self.dir
        for key in ('host_key0', 'host_key1', 'user_key'):
            _run('ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-f', f'{d}/{key}')
        shutil.copy(f'{d}/user_key.pub', f'{d}/authorized_keys')
        with open(f'{d}/known_hosts', 'w') as f:
            for i, (host, address) in enumerate(zip(self.hostnames, self.addresses)):
                pub = open(f'{d}/host_key{i:d}.pub').read().split()[:2]
                f.write(f'{host},{address} {" ".join(pub)}\n')

    def _start_sshd(self, i):
        config = f'{self.dir}/sshd_config{i:d}'
        with open(config, 'w') as f:
            f.write('\n'.join(_SSHD_CONFIG).format(address=self.addresses[i], dir=self.dir, i=i)
                    + '\n')
        os.makedirs('/run/sshd', exist_ok=True)
        log = open(f'{self.dir}/sshd{i:d}.log', 'wb')
        self.sshds.append(subprocess.Popen(
            ['ip', 'netns', 'exec', self.namespaces[i], daemons.which('sshd'), '-D', '-e',
             '-f', config], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        self._wait_for_ssh(i)

    def _wait_for_ssh(self, i):
        """Until host `i`'s sshd answers the first host."""
        deadline = time.monotonic() + 20
        while True:
            trial = subprocess.run(self.in_host(0, shlex.split(self.ssh_command)
                                                + [self.hostnames[i], 'true']),
                                   capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
            if trial.returncode == 0:
                return
            if self.sshds[i].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f'sshd on {self.hostnames[i]} does not answer: '
                                   f'{trial.stderr.decode(errors="replace")}'
                                   + open(f'{self.dir}/sshd{i:d}.log').read())
            time.sleep(0.2)

    def close(self):
        """Stop everything in the namespaces, then remove them."""
        for ns in self.namespaces:
            for pid in self.pids(ns):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        for p in self.sshds:
            p.kill()
            p.wait(timeout=10)
        for ns in self.namespaces:
            subprocess.run(['ip', 'netns', 'del', ns], capture_output=True, timeout=30)
            shutil.rmtree(f'/etc/netns/{ns}', ignore_errors=True)

    @staticmethod
    def pids(ns):
        out = subprocess.run(['ip', 'netns', 'pids', ns], capture_output=True, text=True,
                             timeout=30).stdout
        return [int(x) for x in out.split()]

    # -- using them --------------------------------------------------------

    def in_host(self, i, argv):
        """`argv` run on host `i` (inside its namespace)."""
        return ['ip', 'netns', 'exec', self.namespaces[i]] + list(argv)

    def hostfile(self, path, slots=(1, 1)):
        path.write_text(''.join(f'{h}:{n:d}\n' for h, n in zip(self.hostnames, slots)))
        return path

    def ssh_args(self, hostfile, *args):
        """Launcher arguments of an ssh job on both hosts (no --ssh-port:
        each sshd is on port 22 of its address); the test token and
        PYTHONPATH passed on with --env."""
        out = ['--launcher', 'ssh'] + (['-H', str(hostfile)] if hostfile else []) + [
            '--ssh-command', self.ssh_command, '--env', 'GP_LAUNCH_TEST_TOKEN']
        if 'PYTHONPATH' in os.environ:
            out += ['--env', 'PYTHONPATH']
        return out + [str(a) for a in args]

    def launch_cmd(self, *args):
        """The launcher, run on the first host."""
        return self.in_host(0, [sys.executable, '-m', 'gluon_parallel.launch'] + list(args))

    def cut(self, i=1):
        """Take host `i`'s link down for good (as a cable pulled out)."""
        _run('ip', '-n', self.namespaces[i], 'link', 'set', self.links[i], 'down')

    def restore(self, i=1):
        """Bring host `i`'s link back (after :meth:`cut`, for the next test)."""
        _run('ip', '-n', self.namespaces[i], 'link', 'set', self.links[i], 'up')
        self._wait_for_ssh(i)

    def left_on(self, i, token):
        """Processes of the job still on host `i`: carrying its token, or a
        session of that host's sshd."""
        inode = _netns_inode(self.namespaces[i])
        left = []
        for p in set(carrying(token)) | set(_sessions(self.sshds[i])):
            try:
                if os.stat(f'/proc/{p.pid:d}/ns/net').st_ino == inode:
                    left.append((p.pid, ' '.join(p.cmdline())[:160]))
            except (OSError, psutil.Error):
                pass
        return left

    def wait_gone(self, i, token, within):
        """Seconds until nothing of the job is left on host `i` (at most
        `within`), and what is left then."""
        start = time.monotonic()
        while self.left_on(i, token) and time.monotonic() - start < within:
            time.sleep(0.2)
        return time.monotonic() - start, self.left_on(i, token)


def _sessions(proc):
    """The live processes under an sshd started by ``ip netns exec``."""
    try:
        return [c for c in psutil.Process(proc.pid).children(recursive=True)
                if c.status() != psutil.STATUS_ZOMBIE]
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def start_two_hosts(tmp_path_factory):
    """The body of conftest's module-scoped ``two_hosts`` fixture."""
    missing = daemons.missing('ip', 'sshd', 'ssh', 'ssh-keygen', 'timeout')
    daemons.require(not missing, 'two network namespaces need {} (apt-get install iproute2 '
                    'openssh-server)'.format(', '.join(missing)))
    daemons.require(os.geteuid() == 0, 'two network namespaces need root')
    hosts = TwoHosts(tmp_path_factory.mktemp('two_hosts'))
    try:
        try:
            hosts.start()
        except subprocess.CalledProcessError as e:
            daemons.require(False, f'cannot make network namespaces here: {" ".join(e.cmd)}: '
                            f'{e.stderr.decode(errors="replace").strip()}')
        yield hosts
    finally:
        hosts.close()
