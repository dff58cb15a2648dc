"""Hostfiles, placement, addresses and ranks of the launcher's ssh mode,
without starting anything (tests/test_launch_ssh.py runs real jobs)."""
import shlex

import pytest

from gluon_parallel.launch import hosts, ssh
from gluon_parallel.launch.failfast import STARTUP_DIR
from gluon_parallel.launch.plan import Member
from gluon_parallel.launch.cli import parse_env
from gluon_parallel.launch.hosts import LaunchError


def write(tmp_path, text):
    path = tmp_path / 'hosts'
    path.write_text(text)
    return str(path)


def test_hostfile_slots_comments_and_users(tmp_path):
    path = write(tmp_path, '# cluster\nnode1:4\n\n  node2   # spare\nalice@node3:2\n')
    assert hosts.read_hostfile(path) == [('node1', 4), ('node2', 1), ('alice@node3', 2)]


@pytest.mark.parametrize('text, message', [
    ('', 'names no host'),
    ('# only a comment\n\n', 'names no host'),
    ('node1:0\n', 'line 1'),
    ('node1\nnode2:x\n', 'line 2'),
    ('node1 node2\n', 'line 1'),
])
def test_bad_hostfiles(tmp_path, text, message):
    with pytest.raises(LaunchError, match=message):
        hosts.read_hostfile(write(tmp_path, text))


def test_missing_hostfile(tmp_path):
    with pytest.raises(LaunchError, match='cannot read hostfile'):
        hosts.read_hostfile(str(tmp_path / 'nope'))


def test_placement_fills_slots_then_oversubscribes():
    hostlist = [('a', 2), ('b', 1), ('c', 1)]
    assert hosts.place(hostlist, 3, 2) == (['a', 'a', 'b'], ['a', 'b'])
    assert hosts.place(hostlist, 4, 5) == (['a', 'a', 'b', 'c'], ['a', 'b', 'c', 'a', 'b'])
    # Beyond the 4 slots: one more per host in turn.
    assert hosts.place(hostlist, 7, 1)[0] == ['a', 'a', 'b', 'c', 'a', 'b', 'c']
    assert hosts.place(hostlist, 4, 1, strict=True)[0] == ['a', 'a', 'b', 'c']
    with pytest.raises(LaunchError, match='5 workers do not fit in the 4 slot'):
        hosts.place(hostlist, 5, 1, strict=True)


NAMES = {'node1': '10.0.0.1', 'node2': '10.0.0.2', 'localhost': '127.0.0.1',
         'me': '127.0.1.1', '127.0.0.1': '127.0.0.1'}


def test_addresses_all_local_is_loopback():
    root, node_host = hosts.addresses(['127.0.0.1', 'localhost', 'me'], 'me',
                                      resolver=NAMES.get)
    assert root == '127.0.0.1'
    assert set(node_host.values()) == {'127.0.0.1'}


def test_addresses_on_several_hosts_are_never_loopback(monkeypatch):
    monkeypatch.setattr(hosts, 'outward_address', lambda peer: '10.0.0.9')
    # The scheduler on another host: its address, as resolved here.
    root, node_host = hosts.addresses(['node1', 'localhost'], 'node1', resolver=NAMES.get)
    assert root == '10.0.0.1'
    assert node_host == {'node1': '10.0.0.1', 'localhost': '10.0.0.9'}
    # The scheduler on this machine named by a loopback name: this machine's
    # address on the route to the others.
    root, node_host = hosts.addresses(['localhost', 'node2'], 'me', resolver=NAMES.get)
    assert root == '10.0.0.9' and node_host['me'] == '10.0.0.9'
    # --scheduler-address wins; DMLC_INTERFACE: ps-lite picks each address.
    root, node_host = hosts.addresses(['node1', 'node2'], 'node1', '192.168.1.1', 'ib0',
                                      resolver=NAMES.get)
    assert root == '192.168.1.1' and set(node_host.values()) == {None}


def test_unresolvable_scheduler_host_asks_for_its_address():
    with pytest.raises(LaunchError, match='--scheduler-address'):
        hosts.addresses(['alias1', 'node2'], 'alias1', resolver=NAMES.get)
    root, node_host = hosts.addresses(['alias1', 'node2'], 'alias1', '10.0.0.5',
                                      resolver=NAMES.get)
    assert root == '10.0.0.5' and node_host == {'alias1': None, 'node2': '10.0.0.2'}


def test_predicted_ranks_follow_ps_lite_order():
    # van.cc sorts by address (descending), then by port.
    nodes = [('10.0.0.1', 9000), ('10.0.0.2', 9002), ('10.0.0.2', 9001), ('10.0.0.1', 8000)]
    assert hosts.predicted_ranks(nodes) == [3, 1, 0, 2]
    assert hosts.predicted_ranks([('10.0.0.1', 1), (None, 2)]) is None


def test_ssh_members_names_and_ranks(monkeypatch):
    monkeypatch.setattr(hosts, 'outward_address', lambda peer: '10.0.0.9')
    root, members = ssh.ssh_members([('node1', 1), ('node2', 1)], 2, 1, [100, 101, 102, 103],
                                     resolver=NAMES.get)
    assert root == '10.0.0.1'
    got = [(m.name, m.port, m.node_host, m.rank_known) for m in members]
    # node2 sorts first in ps-lite: its worker is rank 0.
    assert got == [('scheduler@node1', 100, '10.0.0.1', True),
                   ('server 0@node1', 101, '10.0.0.1', True),
                   ('worker 0@node2', 103, '10.0.0.2', True),
                   ('worker 1@node1', 102, '10.0.0.1', True)]


def test_remote_command_quotes_everything():
    line = ssh.remote_command(['python', 'a b.py', "it's"], {'X': 'a "b" $c'}, '/w d', 2)
    assert line.startswith('exec /bin/sh -c ') and line.endswith(' ' + ssh.WRAPPER_NAME)
    script = shlex.split(line)[3]
    assert "cd '/w d' ||" in script
    assert """X='a "b" $c'""" in script
    assert """python 'a b.py' 'it'"'"'s'""" in script
    assert '-lt 20 ]' in script                     # the grace period, in 0.1 s ticks
    assert 'PYTHONPATH' not in script


def test_env_arguments():
    environ = {'HOME': '/h', 'EMPTY': ''}
    assert parse_env(['A=1', 'B=x=y', 'HOME', 'EMPTY', 'C='], environ) == {
        'A': '1', 'B': 'x=y', 'HOME': '/h', 'EMPTY': '', 'C': ''}
    with pytest.raises(LaunchError, match="NOPE: not set in the launcher's environment"):
        parse_env(['NOPE'], environ)
    with pytest.raises(LaunchError, match='not a variable name'):
        parse_env(['1X=2'], environ)


def test_the_fail_fast_hook_goes_first_on_the_remote_pythonpath():
    # Without --env PYTHONPATH: in front of the remote login's own value.
    line = ssh.remote_command(['python'], {'X': '1'}, '/w', 2, startup='/opt/gp dir/startup')
    script = shlex.split(line)[3]
    assert ("env PYTHONPATH='/opt/gp dir/startup'${PYTHONPATH:+:\"$PYTHONPATH\"} X=1 python"
            in script), script
    # With it: in front of that value.
    member = Member('worker', 0, 9000, 'node1', '10.0.0.1')
    spec = ssh.ssh_spec(member, ['python'], {}, {'PYTHONPATH': '/src'}, {})
    assert f'PYTHONPATH={STARTUP_DIR}:/src ' in shlex.split(spec.argv[-1])[3]
    spec = ssh.ssh_spec(member, ['python'], {}, {}, {})
    assert f'{STARTUP_DIR}${{PYTHONPATH:+' in shlex.split(spec.argv[-1])[3]
