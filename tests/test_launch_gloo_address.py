"""gluon_parallel/launch/gloo_address.py: a Horovod worker on a host whose
name resolves to a loopback address (Debian's ``127.0.1.1 hostname``) gets
its host's reachable address as its host name, so Horovod 0.28.1's Gloo
listens there. Run on the second of the two hosts (conftest's
``two_hosts``), whose /etc/hosts has that line, through the launcher's
start-up hook as every worker is."""
import os
import socket
import subprocess
import sys

from gluon_parallel.launch.failfast import STARTUP_DIR
from gluon_parallel.launch.gloo_address import ADDRESS_ENV, resolves_to_loopback

_SHOW = ('import socket; name = socket.gethostname(); '
         'print(name, socket.getaddrinfo(name, None)[0][4][0])')


def _on_second_host(two_hosts, **env):
    env = dict(os.environ, PYTHONPATH=STARTUP_DIR, **env)
    proc = subprocess.run(two_hosts.in_host(1, [sys.executable, '-c', _SHOW]), env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split(), proc.stderr


def test_a_loopback_host_name_becomes_the_hosts_address_for_that_worker_only(two_hosts):
    address = two_hosts.addresses[1]
    (name, resolved), _ = _on_second_host(two_hosts)
    assert (name, resolved) == (socket.gethostname(), '127.0.1.1')  # the harness's hosts file
    (name, resolved), err = _on_second_host(two_hosts, **{ADDRESS_ENV: address})
    assert (name, resolved) == (address, address), err
    assert socket.gethostname() != address          # this machine's own name is untouched
    (name, _), _ = _on_second_host(two_hosts)
    assert name == socket.gethostname()


def test_a_name_that_resolves_elsewhere_is_left_alone(two_hosts):
    # The worker's address itself loopback: nothing to fix (one machine).
    (name, _), err = _on_second_host(two_hosts, **{ADDRESS_ENV: '127.0.0.1'})
    assert name == socket.gethostname() and not err


def test_resolves_to_loopback():
    assert resolves_to_loopback('localhost')
    assert resolves_to_loopback('127.0.1.1')
    assert not resolves_to_loopback('10.231.0.2')
    assert not resolves_to_loopback('no-such-host.invalid')
