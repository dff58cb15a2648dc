"""--launcher ssh against a real sshd on a free loopback port.

The module starts Debian's /usr/sbin/sshd (package openssh-server; .ci/run
installs it) with a throwaway host key and an authorized key made in a
temporary directory. Where OpenSSH is not installed the tests skip with that
reason (tests/daemons.py), except under .ci/run, where they fail: the ssh
mode is never tested by skipping there. An sshd that is installed but
cannot be started fails the tests everywhere.

"Remote" processes are children of that sshd, not of the launcher, so a
launcher that leaves them behind is caught: after each job no process may
carry the job's token (in its environment or its command line) and the sshd
may have no session left.
"""
import os
import shutil
import signal
import subprocess
import tempfile
import sys
import time
import types
import uuid

import psutil
import pytest

import children
import daemons
from launch_helpers import (FAKE, PLAIN, LIMIT, launch_env, launch_cmd, run_launch, finish,
                            env_lines, carrying, read_until, all_ready,
                            check_plain_sums, check_restarts)
from ssh_helpers import assert_job_gone, ssh_args


@pytest.fixture
def hostfile(tmp_path):
    """127.0.0.1 twice: two "hosts", every process local, all over ssh."""
    path = tmp_path / 'hosts'
    path.write_text('# two entries for one machine\n127.0.0.1\n\n127.0.0.1:1  # again\n')
    return path


def run_ssh(args, token, timeout=LIMIT, **env):
    return run_launch(args, token, timeout, **env)[:3]


def test_ssh_environment_prefixes_and_working_directory(sshd, hostfile, tmp_path):
    token = uuid.uuid4().hex
    workdir = tmp_path / 'wd'
    workdir.mkdir()
    rc, out, err = run_ssh(ssh_args(sshd, hostfile, '-n', '2', '-s', '1', '--env',
                                          'GP_LAUNCH_EXTRA=a b\'c', '--workdir', str(workdir),
                                          '--', sys.executable, FAKE, 'ok'),
                           token, DMLC_INTERFACE='lo')
    assert rc == 0, (out, err)
    env = env_lines(out)
    assert sorted(env) == ['scheduler@127.0.0.1', 'server 0@127.0.0.1',
                           'worker 0@127.0.0.1', 'worker 1@127.0.0.1'], out
    for name, line in env.items():
        role = name.split('@')[0].split()[0]
        assert f'DMLC_ROLE={role} ' in line
        # Every process is local: 127.0.0.1 is the right address here.
        assert 'DMLC_PS_ROOT_URI=127.0.0.1 ' in line and 'DMLC_NODE_HOST=127.0.0.1 ' in line
        assert 'DMLC_NUM_SERVER=1 DMLC_NUM_WORKER=2 ' in line
        assert 'DMLC_INTERFACE=lo ' in line                      # passed through
        assert "GP_LAUNCH_EXTRA=a b'c " in line                  # quoted intact
        assert line.endswith(f' cwd={workdir}')
    assert '[worker 1@127.0.0.1] ready role=worker rank=1' in out.splitlines()
    assert '[worker 0@127.0.0.1] to stderr role=worker' in err.splitlines()
    assert_job_gone(token, sshd)


def test_ssh_job_equals_the_local_job_and_one_process_with_four_contexts(
        sshd, hostfile, tmp_path_factory, tmp_path):
    import dist_jobs        # imports mxnet: only here
    init = tmp_path / 'init.params'
    dist_jobs.write_init(init, None)
    job = ['--init', init, '--steps', dist_jobs.STEPS]
    local_out = tmp_path_factory.mktemp('local')
    start = time.monotonic()
    rc, out, err = dist_jobs.launch(local_out, *job)
    local_time = time.monotonic() - start
    assert rc == 0, out + err

    token = uuid.uuid4().hex
    ssh_out = tmp_path_factory.mktemp('ssh')
    args = ssh_args(sshd, hostfile, '-n', '2', '-s', '1', '--timeout', dist_jobs.JOB_TIMEOUT,
                    '--grace', '2', '--env', 'OMP_NUM_THREADS=1',
                    '--env', 'MXNET_CPU_WORKER_NTHREADS=1', '--',
                    sys.executable, dist_jobs.SCRIPT, '--out', ssh_out, *job)
    start = time.monotonic()
    rc, out, err = run_ssh([str(a) for a in args], token,
                           timeout=dist_jobs.JOB_TIMEOUT + 30)
    ssh_time = time.monotonic() - start
    assert rc == 0, out + err
    assert_job_gone(token, sshd)
    print(f'2 workers x 1 server: local launcher {local_time:.1f}s, ssh launcher {ssh_time:.1f}s')
    # The check of the dist_sync tests (ps-lite ranks == launch ranks, 2 x 2
    # contexts == 1 x 4 contexts, workers identical), on the ssh job ...
    dist_jobs.check_launched_job(ssh_out, init, tmp_path)
    # ... and the same values as the local launcher's job.
    for r in range(2):
        dist_jobs.assert_params_close(dist_jobs.load(ssh_out / (f'rank{r:d}.params')),
                                      dist_jobs.load(local_out / (f'rank{r:d}.params')),
                                      rtol=1e-6, atol=1e-7, what=f'ssh vs local, rank {r:d}')


@pytest.mark.parametrize('script, workers, message', [
    (FAKE, '3', 'RuntimeError: worker 1 raises'),
    # Plain MXNet, which hangs at exit without the fail-fast hook; sent
    # without --env PYTHONPATH (it needs no gluon_parallel): the hook goes in
    # front of the remote login's own PYTHONPATH.
    (PLAIN, '2', 'RuntimeError: worker 1 raises in round 1')], ids=['fake', 'plain-mxnet'])
def test_ssh_worker_that_raises_stops_every_host_within_20s(sshd, hostfile, script, workers,
                                                             message):
    token = uuid.uuid4().hex
    args = ssh_args(sshd, hostfile, '-n', workers, '-s', '1', '--timeout', '60', '--grace', '2',
                    '--', sys.executable, script, 'raise')
    if script == PLAIN:
        while '--env' in args and args[args.index('--env') + 1] == 'PYTHONPATH':
            del args[args.index('--env'):args.index('--env') + 2]
    start = time.monotonic()
    rc, out, err = run_ssh(args, token)
    took = time.monotonic() - start
    assert rc == 1, (out, err)
    assert message in err
    assert '[launch] worker 1@127.0.0.1 exited with status 1' in err
    assert took < 20, took
    assert_job_gone(token, sshd)


def _horovod_ssh_job(sshd, hostfile, tmp_path, *job):
    """train_dist.py as a 2-worker Horovod job over ssh: (status, stdout,
    stderr, seconds); nothing of it may be left running."""
    import dist_jobs        # imports mxnet: only here
    daemons.require(daemons.horovod_available(), daemons.HOROVOD_MISSING)
    token = uuid.uuid4().hex
    args = ssh_args(sshd, hostfile, '--engine', 'horovod', '-n', '2', '--timeout',
                    dist_jobs.JOB_TIMEOUT, '--grace', '2', '--env', 'OMP_NUM_THREADS=1',
                    '--env', 'MXNET_CPU_WORKER_NTHREADS=1', '--',
                    sys.executable, dist_jobs.SCRIPT, '--out', tmp_path / 'job', *job)
    start = time.monotonic()
    rc, out, err = run_ssh([str(a) for a in args], token, timeout=dist_jobs.JOB_TIMEOUT + 30)
    took = time.monotonic() - start
    assert_job_gone(token, sshd)
    return rc, out, err, took


def test_ssh_horovod_job_equals_one_process_with_four_contexts(sshd, hostfile, tmp_path):
    """--engine horovod over ssh: the launcher hosts Horovod's rendezvous
    and starts each worker over ssh; 2 workers x 2 contexts give the
    parameters of 1 process x 4 contexts, each line prefixed per worker."""
    import dist_jobs
    init = tmp_path / 'init.params'
    dist_jobs.write_init(init, None)
    rc, out, err, _ = _horovod_ssh_job(sshd, hostfile, tmp_path, '--init', init,
                                       '--steps', dist_jobs.STEPS)
    assert rc == 0, out + err
    for r in range(2):
        assert f'[worker {r:d}@127.0.0.1] rank {r:d} done' in out, out
    dist_jobs.check_equal_to_four_contexts(tmp_path / 'job', init, tmp_path)


def test_ssh_horovod_worker_that_raises_stops_the_job(sshd, hostfile, tmp_path):
    import dist_jobs
    init = tmp_path / 'init.params'
    dist_jobs.write_init(init, None)
    rc, out, err, took = _horovod_ssh_job(sshd, hostfile, tmp_path, '--init', init,
                                          '--steps', dist_jobs.STEPS, '--fail-at', 2)
    assert rc == 1, out + err
    assert 'injected failure at step 2 on rank 1' in err
    assert '[launch] worker 1@127.0.0.1 exited with status 1' in err
    assert took < 40, took


def _remote_worker(token, rank):
    found = [p for p in carrying(token)
             if p.environ().get('DMLC_ROLE') == 'worker'
             and p.environ().get('GLUON_PARALLEL_LAUNCH_RANK') == str(rank)]
    assert len(found) == 1, found
    return found[0]


FOUR_READY = all_ready(4)      # scheduler, server, 2 workers


def _start(sshd, hostfile, token, mode, *args, ready=FOUR_READY):
    popen = children.popen(launch_cmd(*ssh_args(sshd, hostfile, '-n', '2', '-s', '1', *args)
                                        + ['--', sys.executable, FAKE, mode]),
                           env=launch_env(token), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    read_until(popen, ready)
    return popen


def drop_a_connection(sshd, hostfile, check_running=lambda: None):
    """Kill worker 1's ssh client during a job: its remote python has no
    connection and must die by itself (the launcher cannot reach it), and
    the job stop, leaving nothing behind."""
    token = uuid.uuid4().hex
    popen = _start(sshd, hostfile, token, 'hang', '--grace', '2')
    try:
        check_running()
        remote = _remote_worker(token, 1)
        # The launcher's child whose command line holds worker 1's launch rank.
        client, = [c for c in psutil.Process(popen.pid).children()
                   if 'GLUON_PARALLEL_LAUNCH_RANK=1 ' in ' '.join(c.cmdline())]
        client.kill()
        gone, alive = psutil.wait_procs([remote], timeout=20)
        assert not alive, 'the remote worker outlived its ssh connection'
    finally:
        err = finish([popen])[0][2]
    assert popen.returncode == 128 + signal.SIGKILL, err
    assert 'worker 1@127.0.0.1 exited with status 137 (its ssh client was killed)' in err
    assert_job_gone(token, sshd)


def test_ssh_dropped_connection_kills_the_remote_process_and_stops_the_job(sshd, hostfile):
    drop_a_connection(sshd, hostfile)


def test_ssh_ctrl_c_stops_every_remote_process(sshd, hostfile):
    token = uuid.uuid4().hex
    popen = _start(sshd, hostfile, token, 'stubborn', '--grace', '1',
                   ready=lambda lines: sum('grandchild up' in x for x in lines) == 4)
    try:
        remote = [p for p in carrying(token) if 'DMLC_ROLE' in p.environ()]
    finally:
        popen.send_signal(signal.SIGINT)
        err = finish([popen])[0][2]
    assert len(remote) == 4 + 4, remote                 # 4 roles, 4 grandchildren
    assert popen.returncode == 130, err
    assert_job_gone(token, sshd)


def test_ssh_shared_connections_keep_every_guarantee(sshd, hostfile):
    # The README's recipe for more than about 10 processes per host (OpenSSH
    # refuses concurrent unauthenticated connections beyond MaxStartups):
    # one connection per host, every process a session in it. The job runs,
    # a session whose client dies still takes its process along, nothing
    # is left behind.
    control = tempfile.mkdtemp(prefix='gpcm', dir='/tmp')   # socket paths must be short
    try:
        shared = types.SimpleNamespace(**vars(sshd))
        shared.ssh_command = sshd.ssh_command + (
            f' -o ControlMaster=auto -o ControlPath={control}/%C -o ControlPersist=no')
        token = uuid.uuid4().hex
        rc, out, err = run_ssh(ssh_args(shared, hostfile, '-n', '2', '-s', '1', '--',
                                                sys.executable, FAKE, 'ok'), token)
        assert rc == 0, (out, err)
        assert '[worker 1@127.0.0.1] ready role=worker rank=1' in out.splitlines()
        assert_job_gone(token, sshd)

        drop_a_connection(shared, hostfile, check_running=lambda: os.listdir(control) or
                          pytest.fail('no shared connection'))
    finally:
        shutil.rmtree(control, ignore_errors=True)


# ------------------------------------------ fail-fast and restarts over ssh --

def test_ssh_plain_mxnet_job_completes_with_the_right_sums(sshd, hostfile):
    token = uuid.uuid4().hex
    rc, out, err = run_ssh(ssh_args(sshd, hostfile, '-n', '2', '-s', '1', '--timeout', '60',
                                    '--', sys.executable, PLAIN, 'ok'), token)
    assert rc == 0, (out, err)
    check_plain_sums(out, 2, '@127.0.0.1')
    assert_job_gone(token, sshd)


def test_ssh_max_restarts(sshd, hostfile):
    token = uuid.uuid4().hex
    rc, out, err = run_ssh(ssh_args(sshd, hostfile, '-n', '2', '-s', '1', '--max-restarts', '1',
                                    '--', sys.executable, FAKE, 'flaky', '99'), token)
    assert rc == 5, (out, err)
    check_restarts(out, err, 99, 1, name='worker 0@127.0.0.1')
    assert_job_gone(token, sshd)


def test_keepalives_by_default_and_the_users_own_win():
    from gluon_parallel.launch.ssh import with_keepalives
    assert with_keepalives(['ssh', '-o', 'BatchMode=yes']) == [
        'ssh', '-o', 'BatchMode=yes', '-oServerAliveInterval=5', '-oServerAliveCountMax=2']
    # Set by the user, in any of ssh's spellings: theirs, and ours not added.
    assert with_keepalives(['ssh', '-o', 'serveraliveinterval 30', '-oServerAliveCountMax=9']) \
        == ['ssh', '-o', 'serveraliveinterval 30', '-oServerAliveCountMax=9']
    assert with_keepalives(['ssh', '-o', 'ServerAliveCountMax=1']) == [
        'ssh', '-o', 'ServerAliveCountMax=1', '-oServerAliveInterval=5']


def test_the_layout_line_names_each_hosts_processes_and_rank_0():
    from gluon_parallel.launch.plan import layout
    from gluon_parallel.launch.process import Spec
    specs = [Spec(name, name.split()[0].split('@')[0], [], {}, remote=True,
                  host=name.rsplit('@', 1)[1])
             for name in ('scheduler@a', 'server 0@a', 'worker 1@a', 'server 1@b', 'worker 0@b')]
    assert layout(specs) == ('layout: a: scheduler, server 0, worker 1; b: server 1, worker 0; '
                             'rank 0 (writes checkpoints): worker 0@b')
    # DMLC_INTERFACE: ps-lite picks the addresses, hence the ranks.
    assert layout(specs, ranks_known=False) == (
        'layout: a: scheduler, server 0, worker 1; b: server 1, worker 0 (worker ranks: as '
        'ps-lite assigns them)')
