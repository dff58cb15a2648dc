"""--launcher slurm: roles and ranks from the SLURM variables; jobs of two
tasks on one node with the variables srun sets, set by hand (for the
layouts and failures one node cannot show); and jobs under a real one-node
SLURM (munged, slurmctld, slurmd started by tests/slurm_cluster.py; skipped
with the reason when SLURM is not installed, except under .ci/run)."""
import os
import random
import socket
import subprocess
import sys
import time
import uuid

import pytest

from gluon_parallel.launch import find_free_ports, hosts, slurm
from gluon_parallel.launch.hosts import LaunchError
import daemons
import slurm_cluster
from launch_helpers import (HERE, FAKE, PLAIN, LIMIT, launch_env, launch_cmd, finish, env_lines,
                            assert_nothing_left, check_plain_sums,
                            check_restarts)


@pytest.mark.parametrize('text, nodes', [
    ('node[1-3,7]', ['node1', 'node2', 'node3', 'node7']),
    ('a,b', ['a', 'b']),
    ('n[01-03]', ['n01', 'n02', 'n03']),
    ('n[8-11]', ['n8', 'n9', 'n10', 'n11']),
    ('gpu[1,3],cpu5,x[2-3]', ['gpu1', 'gpu3', 'cpu5', 'x2', 'x3']),
    ('r[1-2]-n[1-2]', ['r1-n1', 'r1-n2', 'r2-n1', 'r2-n2']),
    ('single', ['single']),
])
def test_node_list_expansion(text, nodes):
    assert slurm.expand_nodelist(text) == nodes


@pytest.mark.parametrize('text, counts', [('2', [2]), ('2(x3),1', [2, 2, 2, 1]),
                                          ('1,4(x2)', [1, 4, 4])])
def test_tasks_per_node_expansion(text, counts):
    assert slurm.expand_tasks_per_node(text) == counts


def test_task_hosts_follow_the_block_distribution():
    env = {'SLURM_JOB_NODELIST': 'n[1-3]', 'SLURM_TASKS_PER_NODE': '2(x2),1'}
    assert slurm.task_hosts(env, step=False) == ['n1', 'n1', 'n2', 'n2', 'n3']
    with pytest.raises(LaunchError, match='disagree'):
        slurm.task_hosts(dict(env, SLURM_TASKS_PER_NODE='2'), step=False)
    with pytest.raises(LaunchError, match='bad tasks-per-node'):
        slurm.expand_tasks_per_node('2(3)')


@pytest.mark.parametrize('text', ['node[1-', 'node]1[', 'node[3-1]', 'node[a-b]', 'n[[1]]'])
def test_bad_node_lists(text):
    with pytest.raises(LaunchError, match='node list'):
        slurm.expand_nodelist(text)


def srun_env(procid, ntasks, nodelist, node, job='4242', step='0'):
    """The variables srun sets in the environment of task `procid`."""
    return {'SLURM_JOB_ID': job, 'SLURM_STEP_ID': step, 'SLURM_PROCID': str(procid),
            'SLURM_STEP_NUM_TASKS': str(ntasks), 'SLURM_NTASKS': str(ntasks),
            'SLURM_STEP_NODELIST': nodelist, 'SLURM_JOB_NODELIST': nodelist,
            'SLURM_NODELIST': nodelist, 'SLURMD_NODENAME': node}


ADDRESSES = {'node1': '10.0.0.1', 'node2': '10.0.0.2', 'node3': '10.0.0.3',
             'node7': '10.0.0.7', 'a': '10.1.0.1', 'b': '10.1.0.2'}


@pytest.mark.parametrize('nodelist, per_node, servers, want_servers', [
    ('node[1-3,7]', 1, 2, {0: [0], 2: [1]}),        # one task per node
    ('node[1-3,7]', 1, 4, {0: [0], 1: [1], 2: [2], 3: [3]}),
    ('a,b', 2, 2, {0: [0], 2: [1]}),                  # 4 tasks: one server per node
    ('a,b', 2, 1, {0: [0]}),
])
def test_roles_and_ranks_from_the_slurm_variables(nodelist, per_node, servers, want_servers):
    nodes = slurm.expand_nodelist(nodelist)
    ntasks = len(nodes) * per_node
    roots, seen_servers = set(), {}
    for procid in range(ntasks):
        node = nodes[procid // per_node]                # srun's block distribution
        task = slurm.Task(srun_env(procid, ntasks, nodelist, node))
        assert (task.procid, task.ntasks, task.nodes, task.node) == (procid, ntasks, nodes, node)
        root, members = task.members(servers, task.root_port(), resolver=ADDRESSES.get)
        roots.add((root, task.root_port()))
        roles = [(m.role, m.rank) for m in members]
        assert roles[-1] == ('worker', procid)          # every task: worker SLURM_PROCID
        assert (('scheduler', None) in roles) == (procid == 0)
        for role, rank in roles:
            if role == 'server':
                seen_servers.setdefault(procid, []).append(rank)
        for m in members:
            assert m.node_host == ADDRESSES[node]       # its own node's address
            assert m.name.endswith('@' + node)
            assert not m.rank_known                     # several nodes: ps-lite orders by address
    # Every task agrees on the scheduler: the first node's address, one port.
    assert len(roots) == 1 and roots.pop()[0] == ADDRESSES[nodes[0]]
    assert seen_servers == want_servers


def test_a_node_whose_own_name_is_loopback_uses_its_outward_address(monkeypatch):
    # Debian maps a machine's own name to 127.0.1.1: node2 must still give
    # the others an address they can reach.
    monkeypatch.setattr(hosts, 'outward_address', lambda peer: '10.0.0.2')
    resolver = dict(ADDRESSES, node2='127.0.1.1').get
    task = slurm.Task(srun_env(1, 2, 'node[1-2]', 'node2'))
    root, members = task.members(1, 32100, resolver=resolver)
    assert root == '10.0.0.1'
    assert [(m.role, m.rank, m.node_host) for m in members] == [('worker', 1, '10.0.0.2')]
    # DMLC_INTERFACE given: ps-lite finds each process's own address.
    root, members = task.members(1, 32100, interface='eth0', resolver=resolver)
    assert root == '10.0.0.1' and members[0].node_host is None


def test_one_node_on_loopback_is_all_local():
    task = slurm.Task(srun_env(1, 2, 'localhost', 'localhost'))
    root, members = task.members(1, task.root_port())
    assert root == '127.0.0.1'
    assert [(m.role, m.rank, m.node_host, m.rank_known) for m in members] == [
        ('worker', 1, '127.0.0.1', True)]


@pytest.mark.parametrize('env, servers, message', [
    ({'SLURM_PROCID': None}, 1, 'SLURM_PROCID is not set'),
    ({'SLURM_PROCID': '2'}, 1, 'not a task of 2'),
    ({'SLURMD_NODENAME': 'node2'}, 1, 'task 0 runs on node2, not on the first node node1'),
    ({}, 3, 'a step of 2 task'),
])
def test_bad_slurm_variables(env, servers, message):
    full = srun_env(0, 2, 'node[1-2]', 'node1')
    full.update(env)
    full = {k: v for k, v in full.items() if v is not None}
    with pytest.raises(LaunchError, match=message):
        slurm.Task(full).members(servers, 32100, resolver=ADDRESSES.get)


def test_which_processes_are_srun_tasks():
    assert slurm.in_task({'SLURM_JOB_ID': '1', 'SLURM_STEP_ID': '0'})
    assert not slurm.in_task({'SLURM_JOB_ID': '1'})                    # batch script, salloc
    assert not slurm.in_task({'SLURM_JOB_ID': '1', 'SLURM_STEP_ID': '4294967291'})  # batch step
    assert slurm.in_task({'SLURM_JOB_ID': '1', slurm.TASK_ENV: '1'})


# ----------------------------------------------------------------------------
# Jobs: two launchers started as srun would start them (2 tasks, 1 node)

@pytest.fixture
def slurm_bin(tmp_path):
    """A PATH entry whose scancel is tests/dist_scripts/fake_scancel.py: a
    test never reaches a real SLURM, even on a machine that has one."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'scancel').write_text('#!/bin/sh\nexec {} {} "$@"\n'.format(
        sys.executable, os.path.join(HERE, 'dist_scripts', 'fake_scancel.py')))
    (bin_dir / 'scancel').chmod(0o755)
    return bin_dir


def start_tasks(slurm_bin, args, token, ntasks=2, **extra):
    """One launcher per task, with the variables srun would set; returns
    (job id, Popens, file where the fake scancel logs its calls)."""
    job = str(random.randrange(10000, 99999))
    log = slurm_bin / (f'scancel-{job}.log')
    popens = []
    for procid in range(ntasks):
        env = launch_env(token, **srun_env(procid, ntasks, 'localhost', 'localhost', job=job))
        env.update(extra, GP_FAKE_SCANCEL_LOG=str(log),
                   PATH=str(slurm_bin) + os.pathsep + os.environ['PATH'])
        popens.append(subprocess.Popen(
            launch_cmd('--launcher', 'slurm', *args),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return job, popens, log


def test_two_tasks_take_their_roles_and_share_one_scheduler(slurm_bin):
    token = uuid.uuid4().hex
    _, popens, _ = start_tasks(slurm_bin, ['-s', '1', '--', sys.executable, FAKE, 'ok'], token)
    results = finish(popens)
    assert [rc for rc, _, _ in results] == [0, 0], results
    env = {}
    for procid, (_, out, _) in enumerate(results):
        for name, rest in env_lines(out).items():
            env[name] = (procid, dict(kv.split('=', 1) for kv in rest.split()))
    # Task 0: scheduler, server and worker 0; task 1: worker 1 only.
    assert {name: procid for name, (procid, _) in env.items()} == {
        'scheduler@localhost': 0, 'server 0@localhost': 0, 'worker 0@localhost': 0,
        'worker 1@localhost': 1}
    assert len({e['DMLC_PS_ROOT_PORT'] for _, e in env.values()}) == 1
    for name, (_, e) in env.items():
        assert e['DMLC_ROLE'] == name.split()[0].split('@')[0]
        assert (e['DMLC_PS_ROOT_URI'], e['DMLC_NODE_HOST']) == ('127.0.0.1', '127.0.0.1')
        assert (e['DMLC_NUM_WORKER'], e['DMLC_NUM_SERVER']) == ('2', '1')
    # One node: ps-lite ranks by port, and task 1's ports are above task 0's.
    assert int(env['worker 0@localhost'][1]['PORT']) < int(env['worker 1@localhost'][1]['PORT'])
    assert_nothing_left(token)


def test_two_tasks_run_a_real_job_and_ps_lite_ranks_are_the_task_ids(tmp_path, slurm_bin):
    import dist_jobs        # imports mxnet: only here
    init = tmp_path / 'init.params'
    dist_jobs.write_init(init, None)
    out = tmp_path / 'job'
    token = uuid.uuid4().hex
    _, popens, _ = start_tasks(slurm_bin, ['-s', '1', '--timeout', str(dist_jobs.JOB_TIMEOUT),
                                           '--grace', '2', '--', sys.executable, dist_jobs.SCRIPT,
                                           '--out', str(out), '--init', str(init),
                                           '--steps', str(dist_jobs.STEPS)],
                               token, OMP_NUM_THREADS='1', MXNET_CPU_WORKER_NTHREADS='1')
    (rc0, out0, err0), (rc1, out1, err1) = finish(popens, dist_jobs.JOB_TIMEOUT + 30)
    assert (rc0, rc1) == (0, 0), (out0, err0, out1, err1)
    assert '[worker 0@localhost] rank 0 done: 5 steps' in out0.splitlines()
    assert '[worker 1@localhost] rank 1 done: 5 steps' in out1.splitlines()
    assert_nothing_left(token)
    # ps-lite's ranks are the SLURM_PROCIDs, and the job is the 2 x 2 == 1 x 4 one.
    dist_jobs.check_launched_job(out, init, tmp_path)


def test_a_failing_task_cancels_the_step_and_every_task_stops(slurm_bin):
    token = uuid.uuid4().hex
    start = time.monotonic()
    job, popens, log = start_tasks(slurm_bin, ['-s', '1', '--grace', '2', '--', sys.executable,
                                               FAKE, 'fail'], token)
    (rc0, out0, err0), (rc1, out1, err1) = finish(popens)
    assert time.monotonic() - start < 20
    # Task 1's worker exits 3: task 1 reports that status, whichever task
    # noticed a failure first and cancelled the step (task 0's server may
    # abort first when the worker vanishes); the other one is stopped by the
    # cancellation (SIGTERM) and never cancels again.
    assert rc1 == 3, (out1, err1)
    assert '[launch] worker 1@localhost exited with status 3' in err1
    cancels = log.read_text().splitlines()
    assert cancels and set(cancels) == {f'{job}.0'}, cancels
    assert ('cancelling' in err0) or ('cancelling' in err1), (err0, err1)
    assert rc0 != 0, (out0, err0)
    if 'cancelling' not in err0:                # stopped by task 1's cancellation
        assert rc0 == 143 and 'got SIGTERM: stopping every process' in err0, (out0, err0)
    assert_nothing_left(token)


def test_a_task_that_cannot_start_cancels_the_step(slurm_bin):
    # Task 0 finds the scheduler's port taken: it exits 2 and cancels the
    # step, or task 1 would wait for a scheduler forever.
    token = uuid.uuid4().hex
    port = find_free_ports(1, slurm._ROOT_PORTS)[0]
    taken = socket.socket()
    taken.bind(('', port))
    taken.listen(1)
    try:
        job, popens, log = start_tasks(slurm_bin, ['--port', str(port), '--',
                                                   sys.executable, FAKE, 'hang'], token)
        (rc0, out0, err0), (rc1, out1, err1) = finish(popens)
    finally:
        taken.close()
    assert rc0 == 2, (out0, err0)
    assert f"the scheduler's port {port:d} is taken on localhost: pass --port" in err0, err0
    assert log.read_text() == f'{job}.0\n'
    assert rc1 in (143, -15), (out1, err1)          # SIGTERM, handled or not yet
    assert_nothing_left(token)


def test_outside_a_task_the_launcher_runs_srun(tmp_path):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    record = tmp_path / 'srun.args'
    (bin_dir / 'srun').write_text(f'#!/bin/sh\necho "$@" > {record}\n'
                                  f'echo "${slurm.TASK_ENV}" >> {record}\nexit 7\n')
    (bin_dir / 'srun').chmod(0o755)
    env = launch_env('unused', SLURM_JOB_ID='77', SLURM_NTASKS='4', SLURM_JOB_NODELIST='n[1-2]',
               PATH=str(bin_dir) + os.pathsep + os.environ['PATH'])
    env.pop('SLURM_STEP_ID', None)
    proc = subprocess.run([sys.executable, '-m', 'gluon_parallel.launch', '--launcher', 'slurm',
                           '-s', '2', '--', 'python', 'train.py'], env=env,
                          capture_output=True, timeout=LIMIT)
    assert proc.returncode == 7, proc.stderr        # srun replaced the launcher
    args, marker = record.read_text().splitlines()
    assert args == (f'--kill-on-bad-exit=1 --quit-on-interrupt {sys.executable} -m '
                    'gluon_parallel.launch '
                    '--launcher slurm -s 2 -- python train.py')
    assert marker == '1'


# ----------------------------------------------------------------------------
# A real SLURM: one node, two CPUs, tasks overcommitted

@pytest.fixture(scope='module')
def real_slurm(tmp_path_factory):
    daemons.require(*slurm_cluster.available())
    with slurm_cluster.cluster(tmp_path_factory.mktemp('slurm')) as cluster:
        yield cluster


def run_in_slurm(real_slurm, client, args, token, timeout=LIMIT):
    """(status, stdout, stderr) of `client` (srun or salloc options)
    running the launcher with `args` in the test SLURM."""
    env = launch_env(token, SLURM_CONF=real_slurm['env']['SLURM_CONF'])
    for k in [k for k in env if k.startswith('SLURM_') and k != 'SLURM_CONF']:
        del env[k]
    proc = subprocess.run(client + ['-n', '2', '--overcommit', sys.executable, '-m',
                                    'gluon_parallel.launch', '--launcher', 'slurm'] + args,
                          env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def test_real_slurm_plain_mxnet_job_completes_with_the_right_sums(real_slurm):
    token = uuid.uuid4().hex
    rc, out, err = run_in_slurm(real_slurm, ['srun', '--kill-on-bad-exit=1'],
                                ['-s', '1', '--timeout', '60', '--', sys.executable, PLAIN, 'ok'],
                                token)
    assert rc == 0, (out, err)
    check_plain_sums(out, 2, '@' + real_slurm['node'])
    assert_nothing_left(token)


@pytest.mark.parametrize('client', ['salloc', 'srun'])
def test_real_slurm_plain_mxnet_worker_that_raises_stops_the_job_within_20s(real_slurm, client):
    # In an allocation (salloc here, sbatch alike) the launcher runs srun
    # itself and reports the first failure's status. Under a user's srun the
    # failing task cancels the step, and srun reports the highest status of
    # its tasks (the killed ones' 137).
    token = uuid.uuid4().hex
    start = time.monotonic()
    rc, out, err = run_in_slurm(real_slurm, [client],
                                ['-s', '1', '--timeout', '60', '--grace', '2', '--',
                                 sys.executable, PLAIN, 'raise'], token)
    took = time.monotonic() - start
    assert 'RuntimeError: worker 1 raises in round 1' in err
    assert '[launch] worker 1@{} exited with status 1'.format(real_slurm['node']) in err
    if client == 'salloc':
        assert rc == 1 and 'cancelling' not in err, (out, err)
    else:
        assert rc != 0 and '[launch] cancelling job step' in err, (out, err)
    assert took < 20, took
    assert_nothing_left(token)


@pytest.mark.parametrize('failing, status', [(1, 0), (99, 5)])
def test_real_slurm_max_restarts_runs_one_step_per_attempt(real_slurm, failing, status):
    # salloc runs the launcher as a batch script would: it starts one srun
    # job step per attempt.
    token = uuid.uuid4().hex
    rc, out, err = run_in_slurm(real_slurm, ['salloc'], ['-s', '1', '--max-restarts', '1', '--',
                                                         sys.executable, FAKE, 'flaky',
                                                         str(failing)], token)
    assert rc == status, (out, err)
    check_restarts(out, err, failing, 1, name='worker 0@' + real_slurm['node'])
    assert_nothing_left(token)


def test_max_restarts_under_a_users_srun_is_refused(real_slurm):
    rc, out, err = run_in_slurm(real_slurm, ['srun'], ['--max-restarts', '1', '--', 'true'],
                                uuid.uuid4().hex)
    assert rc == 2, (out, err)
    assert 'start the launcher in the batch script or the salloc shell, not under srun' in err


def _horovod_in_slurm(real_slurm, client, tmp_path, *job):
    """train_dist.py as a 2-task Horovod job in the test SLURM."""
    import dist_jobs        # imports mxnet: only here
    daemons.require(daemons.horovod_available(), daemons.HOROVOD_MISSING)
    token = uuid.uuid4().hex
    args = ['--engine', 'horovod', '--timeout', str(dist_jobs.JOB_TIMEOUT), '--grace', '2',
            '--env', 'OMP_NUM_THREADS=1', '--env', 'MXNET_CPU_WORKER_NTHREADS=1', '--',
            sys.executable, dist_jobs.SCRIPT, '--out', str(tmp_path / 'job')]
    start = time.monotonic()
    rc, out, err = run_in_slurm(real_slurm, client, args + [str(a) for a in job], token,
                                timeout=dist_jobs.JOB_TIMEOUT + 30)
    took = time.monotonic() - start
    assert_nothing_left(token)
    return rc, out, err, took


def test_real_slurm_horovod_job_equals_one_process_with_four_contexts(real_slurm, tmp_path):
    """In an allocation the launcher hosts Horovod's rendezvous and runs
    the step; each task's launcher starts its worker in its slot: 2 workers
    x 2 contexts give the parameters of 1 process x 4 contexts."""
    import dist_jobs
    init = tmp_path / 'init.params'
    dist_jobs.write_init(init, None)
    rc, out, err, _ = _horovod_in_slurm(real_slurm, ['salloc'], tmp_path, '--init', init,
                                        '--steps', dist_jobs.STEPS)
    assert rc == 0, (out, err)
    for r in range(2):
        assert f"[worker {r:d}@{real_slurm['node']}] rank {r:d} done" in out, out
    dist_jobs.check_equal_to_four_contexts(tmp_path / 'job', init, tmp_path)


def test_real_slurm_horovod_worker_that_raises_stops_the_job(real_slurm, tmp_path):
    import dist_jobs
    init = tmp_path / 'init.params'
    dist_jobs.write_init(init, None)
    rc, out, err, took = _horovod_in_slurm(real_slurm, ['salloc'], tmp_path, '--init', init,
                                           '--steps', dist_jobs.STEPS, '--fail-at', 2)
    assert rc == 1, (out, err)
    assert 'injected failure at step 2 on rank 1' in err
    assert took < 40, took


def test_real_slurm_horovod_under_a_users_srun_is_refused(real_slurm, tmp_path):
    rc, out, err, _ = _horovod_in_slurm(real_slurm, ['srun'], tmp_path, '--steps', 1)
    assert rc != 0
    assert 'start the launcher in the batch script or the salloc shell' in err, (out, err)
