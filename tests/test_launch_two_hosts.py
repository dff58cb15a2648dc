"""--launcher ssh on two real hosts: two network namespaces joined by a veth
pair, each with its own sshd (conftest's ``two_hosts``,
tests/netns_helpers.py). The launcher runs on the first host; the faults
are real: a worker killed on the second host, the second host's link taken
down for good. After every job nothing of it may be left on either host.
"""
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

import children
import daemons
from launch_helpers import FAKE, HERE, LIMIT, all_ready, carrying, finish, launch_env, read_until

ELASTIC_FAKE = f'{HERE}/dist_scripts/elastic_fake.py'
# ssh's keepalives give up after 2 unanswered probes 5 s apart (10-15 s);
# the wrapper on the cut host after 15 s without the launcher's heartbeat.
DETECT_WITHIN = 20
GONE_WITHIN = 25


FOUR_READY = all_ready(4)       # scheduler, server, 2 workers


def _start(two_hosts, token, *args, ready=FOUR_READY):
    popen = children.popen(two_hosts.launch_cmd(*two_hosts.ssh_args(None, *args)),
                           env=launch_env(token), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        read_until(popen, ready)
    except AssertionError:
        popen.kill()
        raise AssertionError(popen.communicate()[1].decode()) from None
    return popen


def _assert_nothing_left(two_hosts, token, within=10):
    for i in range(2):
        took, left = two_hosts.wait_gone(i, token, within)
        assert not left, f'left running on {two_hosts.hostnames[i]}: {left}'


def _remote_worker(two_hosts, token):
    """The worker process on the second host."""
    there = dict(two_hosts.left_on(1, token))
    found = [p for p in carrying(token)
             if p.pid in there and p.environ().get('DMLC_ROLE') == 'worker']
    assert len(found) == 1, found
    return found[0]


def test_a_killed_worker_on_the_second_host_stops_the_job_promptly(two_hosts, tmp_path):
    token = uuid.uuid4().hex
    hostfile = two_hosts.hostfile(tmp_path / 'hosts')
    popen = _start(two_hosts, token, '-H', hostfile, '-n', '2', '-s', '1', '--grace', '2',
                   '--', sys.executable, FAKE, 'hang')
    try:
        worker = _remote_worker(two_hosts, token)
        rank = worker.environ()['GLUON_PARALLEL_LAUNCH_RANK']
        start = time.monotonic()
        worker.send_signal(signal.SIGKILL)
        popen.wait(timeout=LIMIT)
        took = time.monotonic() - start
    finally:
        rc, out, err = finish([popen])[0]
    assert rc == 137, err
    assert f'[launch] worker {rank}@gp-host2 exited with status 137: stopping the other ' \
           'processes' in err.splitlines(), err
    print(f'killed worker on the second host: the launcher exited {took:.2f} s later')
    assert took < 10, took
    _assert_nothing_left(two_hosts, token)


def test_the_second_hosts_link_down_for_good_ends_the_job_and_leaves_nothing_there(
        two_hosts, tmp_path):
    token = uuid.uuid4().hex
    hostfile = two_hosts.hostfile(tmp_path / 'hosts')
    popen = _start(two_hosts, token, '-H', hostfile, '-n', '2', '-s', '1', '--grace', '2',
                   '--', sys.executable, FAKE, 'hang')
    try:
        assert two_hosts.left_on(1, token), 'nothing of the job runs on the second host'
        time.sleep(2)
        start = time.monotonic()
        two_hosts.cut(1)
        popen.wait(timeout=LIMIT)
        detected = time.monotonic() - start
        gone, left = two_hosts.wait_gone(1, token, GONE_WITHIN + 10)
        gone += detected
    finally:
        rc, out, err = finish([popen])[0]
        two_hosts.restore(1)
    print(f'link down: the launcher exited {detected:.1f} s later, nothing left on the second '
          f'host {gone:.1f} s after the cut')
    assert rc == 255, err
    assert re.search(r'^\[launch\] lost worker \d@gp-host2: connection dropped after \d+ s of '
                     r'running: stopping the other processes$', err, re.M), err
    assert 'ssh could not run it' not in err
    assert detected < DETECT_WITHIN, (detected, err)
    assert not left, f'left running on the cut host: {left}'
    assert gone < GONE_WITHIN, gone
    _assert_nothing_left(two_hosts, token)


def test_an_elastic_job_shrinks_off_a_host_whose_link_is_down(two_hosts, tmp_path):
    token = uuid.uuid4().hex
    discover = 'printf "gp-host1:1\\ngp-host2:1\\n"'
    popen = _start(two_hosts, token, '-n', '1:2', '--discover', discover, '--discover-interval',
                   '1', '--grace', '1', '--max-restarts', '1', '--',
                   sys.executable, ELASTIC_FAKE, tmp_path / 'progress', '500',
                   ready=lambda lines: sum(' from step ' in x for x in lines) == 2)
    try:
        time.sleep(1)
        two_hosts.cut(1)
        rc, out, err = finish([popen], timeout=LIMIT + 30)[0]
    finally:
        if popen.poll() is None:
            popen.kill()
        two_hosts.restore(1)
    assert rc == 0, (out, err)
    assert re.search(r'^\[launch\] lost worker \d@gp-host2: connection dropped after \d+ s of '
                     r'running: stopping the other processes$', err, re.M), err
    assert ('[launch] attempt 1: 1 worker on gp-host1:1 (-n 1:2; discovered gp-host1:1 '
            'gp-host2:1; left out, unreachable: gp-host2)') in err.splitlines(), err
    assert '[worker 0@gp-host1] rank 0 done' in out.splitlines(), out
    _assert_nothing_left(two_hosts, token, within=GONE_WITHIN)


def test_every_process_carries_the_test_token(two_hosts, tmp_path):
    """The harness's own check: the job's processes on each host are found."""
    token = uuid.uuid4().hex
    popen = _start(two_hosts, token, '-H', two_hosts.hostfile(tmp_path / 'hosts'), '-n', '2',
                   '-s', '1', '--', sys.executable, FAKE, 'hang')
    try:
        on = [{p for p, _ in two_hosts.left_on(i, token)} for i in range(2)]
        roles = [sorted(psutil.Process(p).environ().get('DMLC_ROLE', '') for p in pids
                        if 'DMLC_ROLE' in psutil.Process(p).environ()) for pids in on]
    finally:
        popen.send_signal(signal.SIGINT)
        rc, out, err = finish([popen])[0]
    assert roles == [['scheduler', 'server', 'worker'], ['worker']], roles
    assert rc == 130, err
    _assert_nothing_left(two_hosts, token)


def _documented_commands():
    """The hostfile and launcher commands of docs/several-machines.md's
    "Over ssh" section, as lists of words."""
    text = open(f'{HERE}/../docs/several-machines.md').read()
    section = text.split('### Over ssh', 1)[1]
    block = section.split('```bash\n', 1)[1].split('```', 1)[0]
    printf, launch = block.replace('\\\n', ' ').strip().splitlines()
    return shlex.split(printf), shlex.split(launch)


def test_the_documented_two_host_job_trains_and_prints_its_layout(two_hosts, tmp_path):
    """The section's commands, with the test's hosts, interpreter, script
    and key: the job trains across the hosts to the parameters of one
    process with four contexts, after printing where each process runs."""
    import dist_jobs        # imports mxnet: only here
    printf, launch = _documented_commands()
    hosts = dict(zip(('node1', 'node2'), two_hosts.hostnames))
    assert printf[:2] == ['printf', 'node1\\nnode2\\n'] and printf[-2:] == ['>', 'hosts'], printf
    (tmp_path / 'hosts').write_text(''.join(f'{h}\n' for h in two_hosts.hostnames))
    at = launch.index('--')
    assert launch[at + 1:] == ['/path/to/venv/bin/python', 'train.py'], launch
    assert launch[:3] == ['python', '-m', 'gluon_parallel.launch'], launch
    init = tmp_path / 'init.params'
    dist_jobs.write_init(init, None)
    token = uuid.uuid4().hex
    args = [a.replace('hosts', str(tmp_path / 'hosts')) if a == 'hosts' else a
            for a in launch[3:at]]
    args += ['--ssh-command', two_hosts.ssh_command, '--env', 'GP_LAUNCH_TEST_TOKEN',
             '--env', 'OMP_NUM_THREADS=1', '--env', 'MXNET_CPU_WORKER_NTHREADS=1', '--',
             sys.executable, dist_jobs.SCRIPT, '--out', tmp_path / 'job', '--init', init,
             '--steps', dist_jobs.STEPS]
    proc = subprocess.run(two_hosts.launch_cmd(*[str(a) for a in args]), env=launch_env(token),
                          capture_output=True, text=True, timeout=dist_jobs.JOB_TIMEOUT + 30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    layout = [x for x in proc.stderr.splitlines() if x.startswith('[launch] layout: ')]
    # ps-lite ranks workers by address, highest first: rank 0 is on node2.
    assert layout == ['[launch] layout: {0}: scheduler, server 0, worker 1; {1}: worker 0; '
                      'rank 0 (writes checkpoints): worker 0@{1}'.format(*hosts.values())], \
        proc.stderr
    documented = re.search(r'^\[launch\] layout: .*$', open(
        f'{HERE}/../docs/several-machines.md').read(), re.M).group(0)
    assert documented == layout[0].replace('gp-host1', 'node1').replace('gp-host2', 'node2')
    dist_jobs.check_launched_job(tmp_path / 'job', init, tmp_path)
    _assert_nothing_left(two_hosts, token)


def test_horovod_across_the_hosts_whose_names_resolve_to_127_0_1_1(two_hosts, tmp_path):
    """Each host's /etc/hosts says ``127.0.1.1 <its name>`` (Debian's
    default; netns_helpers): Horovod 0.28.1's Gloo would listen there and
    the other host could not connect. The job trains to the parameters of
    one process with four contexts; rank 0 is on the first host."""
    import dist_jobs        # imports mxnet: only here
    daemons.require(daemons.horovod_available(), daemons.HOROVOD_MISSING)
    init = tmp_path / 'init.params'
    dist_jobs.write_init(init, None)
    token = uuid.uuid4().hex
    args = two_hosts.ssh_args(two_hosts.hostfile(tmp_path / 'hosts'), '--engine', 'horovod',
                              '-n', '2', '--timeout', dist_jobs.JOB_TIMEOUT, '--grace', '2',
                              '--env', 'OMP_NUM_THREADS=1', '--env', 'MXNET_CPU_WORKER_NTHREADS=1',
                              '--', sys.executable, dist_jobs.SCRIPT, '--out', tmp_path / 'job',
                              '--init', init, '--steps', dist_jobs.STEPS)
    proc = subprocess.run(two_hosts.launch_cmd(*args), env=launch_env(token), capture_output=True,
                          text=True, timeout=dist_jobs.JOB_TIMEOUT + 30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ('[launch] layout: gp-host1: worker 0; gp-host2: worker 1; rank 0 (writes '
            'checkpoints): worker 0@gp-host1') in proc.stderr.splitlines(), proc.stderr
    for rank, host in enumerate(two_hosts.hostnames):
        assert f'[worker {rank:d}@{host}] rank {rank:d} done' in proc.stdout, proc.stdout
    dist_jobs.check_equal_to_four_contexts(tmp_path / 'job', init, tmp_path)
    _assert_nothing_left(two_hosts, token)


STALL_JOB = f'{HERE}/dist_scripts/stall_job.py'
S = 15      # --stall-timeout in these tests


@pytest.mark.parametrize('engine', ['dist_sync', 'horovod'])
def test_a_frozen_worker_on_the_second_host_is_named_and_nothing_is_left(two_hosts, tmp_path,
                                                                         engine):
    """SIGSTOP the second host's worker: the launcher names it (not the
    worker whose wait would time out first: Gloo's, under Horovod, after
    30 s) within S + 30 s, and nothing of the job stays on either host."""
    from gluon_parallel.launch.stall import STALL_STATUS
    if engine == 'horovod':
        daemons.require(daemons.horovod_available(), daemons.HOROVOD_MISSING)
    token = uuid.uuid4().hex
    hostfile = two_hosts.hostfile(tmp_path / 'hosts')
    popen = _start(two_hosts, token, '-H', hostfile, '--engine', engine, '-n', '2',
                   '--stall-timeout', S, '--timeout', 240, '--grace', '2',
                   '--env', 'MXNET_ENGINE_TYPE=NaiveEngine', '--env', 'OMP_NUM_THREADS=1',
                   '--', sys.executable, STALL_JOB, '--steps', '5000', '--pause', '0.02',
                   ready=lambda lines: sum(' step 20 ' in x for x in lines) >= 2)
    try:
        there = dict(two_hosts.left_on(1, token))
        victim, = [p for p in carrying(token) if p.pid in there and (
            p.environ().get('DMLC_ROLE') == 'worker' or 'HOROVOD_RANK' in p.environ())]
        env = victim.environ()
        rank = env.get('HOROVOD_RANK', env.get('GLUON_PARALLEL_LAUNCH_RANK'))
        start = time.monotonic()
        victim.send_signal(signal.SIGSTOP)
        rc, out, err = finish([popen], S + 60)[0]
        took = time.monotonic() - start
    finally:
        if popen.poll() is None:
            popen.kill()
    print(f'{engine}: frozen worker on the second host, the launcher ended the job {took:.1f} s '
          'later')
    assert rc == STALL_STATUS, err[-4000:]
    stalled = [x for x in err.splitlines() if x.startswith('[launch] ') and ' stalled: ' in x]
    assert stalled and stalled[0].startswith(f'[launch] worker {rank}@gp-host2 stalled: '), \
        err[-4000:]
    assert took <= S + 30, took
    _assert_nothing_left(two_hosts, token, within=GONE_WITHIN)


def test_a_host_cut_off_before_the_start_is_one_ssh_could_not_run_on(two_hosts, tmp_path):
    """Lost is for a process that ran; one that never started is still
    'ssh could not run it'."""
    token = uuid.uuid4().hex
    two_hosts.cut(1)
    try:
        proc = subprocess.run(two_hosts.launch_cmd(*two_hosts.ssh_args(
            two_hosts.hostfile(tmp_path / 'hosts'), '-n', '2', '-s', '1', '--grace', '1',
            '--', sys.executable, FAKE, 'hang')), env=launch_env(token), capture_output=True,
            text=True, timeout=LIMIT)
    finally:
        two_hosts.restore(1)
    assert proc.returncode == 255, proc.stderr
    assert re.search(r'^\[launch\] worker \d@gp-host2 exited with status 255 \(ssh could not run '
                     r'it: see its output\): stopping the other processes$', proc.stderr, re.M), \
        proc.stderr
    assert 'lost worker' not in proc.stderr
    _assert_nothing_left(two_hosts, token)
