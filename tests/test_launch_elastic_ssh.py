"""Elastic jobs over ssh (gluon_parallel/launch/elastic.py, discovery.py):
``--launcher ssh -n MIN:MAX --discover CMD`` against the test sshd
(conftest's ``sshd``). Two "hosts", 127.0.0.1 and root@127.0.0.1, are this
machine; tests/dist_scripts/elastic_fake.py is the job.

A host whose ssh connection drops (its client exits with 255 while the
command runs: the launcher reports the worker lost) is left out
of the next attempts while discovery lists it, unless the job cannot reach
MIN without it.
"""
import re
import sys
import uuid

import pytest

import daemons
from launch_helpers import HERE, run_launch
from ssh_helpers import assert_job_gone, ssh_args

FAKE = f'{HERE}/dist_scripts/elastic_fake.py'
TWO_HOSTS = 'printf "127.0.0.1:1\\nroot@127.0.0.1:1\\n"'


def _elastic(sshd, tmp_path, size, discover, *fake, launch=()):
    token = uuid.uuid4().hex
    args = ssh_args(sshd, None, '-n', size, '--discover', discover, '--discover-interval', '0.2',
                    '--grace', '1', *launch, '--', sys.executable, FAKE,
                    str(tmp_path / 'progress'), '10', *fake)
    rc, out, err, _ = run_launch(args, token)
    assert_job_gone(token, sshd)
    return rc, out, err


@pytest.mark.parametrize('engine', ['dist_sync', 'horovod'])
def test_an_unreachable_host_is_left_out_while_min_is_reached_without_it(sshd, tmp_path, engine):
    if engine == 'horovod':
        daemons.require(daemons.horovod_available(), daemons.HOROVOD_MISSING)
    rc, out, err = _elastic(sshd, tmp_path, '1:2', TWO_HOSTS, 'cut', '1', '3',
                            launch=['--max-restarts', '1', '--engine', engine])
    assert rc == 0, (out, err)
    assert ('[launch] attempt 0: 2 workers on 127.0.0.1:1 root@127.0.0.1:1 (-n 1:2; discovered '
            '127.0.0.1:1 root@127.0.0.1:1)') in err.splitlines(), err
    assert re.search(r'^\[launch\] lost worker 1@root@127\.0\.0\.1: connection dropped after '
                     r'\d+ s of running: stopping the other processes$', err, re.M), err
    assert ('[launch] attempt 1: 1 worker on 127.0.0.1:1 (-n 1:2; discovered 127.0.0.1:1 '
            'root@127.0.0.1:1; left out, unreachable: root@127.0.0.1)') in err.splitlines(), err
    assert '[worker 0@127.0.0.1] rank 0 done' in out.splitlines(), out


def test_an_unreachable_host_is_used_again_when_min_needs_it(sshd, tmp_path):
    rc, out, err = _elastic(sshd, tmp_path, '2:2', TWO_HOSTS, 'cut', '1', '3',
                            launch=['--max-restarts', '1'])
    assert rc == 0, (out, err)
    assert ('[launch] attempt 1: 2 workers on 127.0.0.1:1 root@127.0.0.1:1 (-n 2:2; discovered '
            '127.0.0.1:1 root@127.0.0.1:1)') in err.splitlines(), err
    for rank, host in ((0, '127.0.0.1'), (1, 'root@127.0.0.1')):
        assert f'[worker {rank:d}@{host}] rank {rank:d} done' in out.splitlines(), out


def test_ssh_grows_onto_a_new_host(sshd, tmp_path):
    hosts = tmp_path / 'hosts'
    hosts.write_text('127.0.0.1:1\n')
    rc, out, err = _elastic(sshd, tmp_path, '1:2', f'cat {hosts}', 'grow', '2', str(hosts),
                            '127.0.0.1:1,root@127.0.0.1:1')
    assert rc == 0, (out, err)
    assert ('[launch] attempt 1: 2 workers on 127.0.0.1:1 root@127.0.0.1:1 (-n 1:2; discovered '
            '127.0.0.1:1 root@127.0.0.1:1)') in err.splitlines(), err
    assert '[worker 1@root@127.0.0.1] rank 1 done' in out.splitlines(), out
