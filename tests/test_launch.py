"""The local dist launcher: output, exit status, and nothing left running;
and the command line of every mode (bad arguments exit 2, --help).

The launched processes run tests/dist_scripts/fake_role.py, which imports no
MXNet, so these tests take about a second each. Every launch carries a
unique token in its environment; afterwards no live process may carry it.
"""
import signal
import subprocess
import sys
import uuid

import pytest

import children
from launch_helpers import (FAKE, LIMIT, launch_env, launch_cmd, run_launch, env_lines, carrying,
                            assert_nothing_left, read_until, all_ready)

def test_output_is_prefixed_and_streams_are_kept_apart():
    rc, out, err, token = run_launch(['-n', '2', '-s', '1', '--', sys.executable, FAKE, 'ok'])
    assert rc == 0, err
    lines = out.splitlines()
    for prefix, role in (('[scheduler]', 'scheduler'), ('[server 0]', 'server'),
                         ('[worker 0]', 'worker'), ('[worker 1]', 'worker')):
        assert any(x.startswith(f'{prefix} ready role={role}') for x in lines), out
    assert '[worker 1] ready role=worker rank=1' in lines
    assert '[worker 0] to stderr role=worker' in err.splitlines()
    assert 'to stderr' not in out
    assert_nothing_left(token)


def test_dmlc_environment():
    rc, out, err, token = run_launch(['-n', '3', '-s', '2', sys.executable, FAKE, 'ok'])
    assert rc == 0, err
    env = {name: dict(kv.split('=', 1) for kv in rest.split())
           for name, rest in env_lines(out).items()}
    assert sorted(env) == ['scheduler', 'server 0', 'server 1',
                           'worker 0', 'worker 1', 'worker 2']
    roots = {e['DMLC_PS_ROOT_PORT'] for e in env.values()}
    assert len(roots) == 1
    for name, e in env.items():
        assert e['DMLC_ROLE'] == name.split()[0]
        assert e['DMLC_PS_ROOT_URI'] == '127.0.0.1'
        assert e['DMLC_NODE_HOST'] == '127.0.0.1'
        assert (e['DMLC_NUM_WORKER'], e['DMLC_NUM_SERVER']) == ('3', '2')
    # ps-lite ranks nodes by port: ascending ports make rank == launch index.
    ports = [int(env[f'worker {i:d}']['PORT']) for i in range(3)]
    assert ports == sorted(ports) and len(set(ports)) == 3
    assert int(env['server 0']['PORT']) < int(env['server 1']['PORT'])
    assert_nothing_left(token)


def test_last_line_without_newline_is_flushed():
    rc, out, err, token = run_launch(['-n', '2', '-s', '1', sys.executable, FAKE, 'partial'])
    assert rc == 0, err
    assert '[worker 0] no newline from 0' in out.splitlines()
    assert '[worker 1] no newline from 1' in out.splitlines()
    assert_nothing_left(token)


def test_first_failure_is_propagated_and_the_rest_stopped():
    # The others exit 9 when stopped: the launcher must report worker 1's 3.
    rc, out, err, token = run_launch(['-n', '3', '-s', '1', sys.executable, FAKE, 'fail'])
    assert rc == 3, (out, err)
    assert '[worker 1] worker 1 fails' in err
    assert '[launch] worker 1 exited with status 3' in err
    assert_nothing_left(token)


def test_the_process_that_said_it_fails_first_is_the_failure():
    # Worker 0 fails because worker 1 did (as Horovod's peers do) and exits
    # first: the launcher names worker 1, whose fail-fast hook spoke first.
    rc, out, err, token = run_launch(['-n', '3', '-s', '1', sys.executable, FAKE, 'caused'])
    assert rc == 3, (out, err)
    assert '[launch] worker 1 exited with status 3' in err, err
    assert_nothing_left(token)


def test_timeout_stops_everything():
    rc, out, err, token = run_launch(['-n', '2', '-s', '1', '--timeout', '3',
                                sys.executable, FAKE, 'hang'])
    assert rc == 124, (out, err)
    assert '[launch] timeout after 3s' in err
    assert_nothing_left(token)


def test_processes_ignoring_sigterm_and_their_children_are_killed():
    rc, out, err, token = run_launch(['-n', '2', '-s', '1', '--timeout', '4', '--grace', '1',
                                sys.executable, FAKE, 'stubborn'])
    assert rc == 124, (out, err)
    assert out.count('grandchild up') == 4, out      # every role started one
    assert_nothing_left(token)


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_launcher_stops_everything(sig):
    token = uuid.uuid4().hex
    popen = children.popen(launch_cmd('-n', '2', '-s', '1', sys.executable, FAKE, 'hang'),
                           env=launch_env(token), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        read_until(popen, all_ready(4))
        assert len(carrying(token)) == 5       # launcher + 4 processes
        popen.send_signal(sig)
        _, err = popen.communicate(timeout=LIMIT)
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
    assert popen.returncode == 128 + sig, err
    assert (f'got {sig.name}') in err.decode()
    assert_nothing_left(token)


def test_children_die_with_a_killed_launcher():
    # Linux's PR_SET_PDEATHSIG: the kernel kills them.
    token = uuid.uuid4().hex
    popen = subprocess.Popen(launch_cmd('-n', '2', '-s', '1', sys.executable, FAKE, 'hang'),
                             env=launch_env(token), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        read_until(popen, all_ready(4))
        popen.kill()            # no chance to clean up
        popen.wait(timeout=LIMIT)
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
        popen.stdout.close()
        popen.stderr.close()
    assert_nothing_left(token)


def test_launcher_needs_no_mxnet():
    # In a scheduler or server process, `import mxnet` runs the server loop
    # and never returns: the launcher must not import it, even through the
    # package, and must work with a DMLC_ROLE left in its own environment.
    code = ('import sys, gluon_parallel, gluon_parallel.launch; '
            'assert "mxnet" not in sys.modules, "mxnet imported"')
    subprocess.run([sys.executable, '-c', code], check=True, timeout=LIMIT)
    rc, out, err, token = run_launch(['-n', '1', '-s', '1', sys.executable, FAKE, 'ok'],
                               DMLC_ROLE='scheduler', DMLC_PS_ROOT_URI='127.0.0.1',
                               DMLC_PS_ROOT_PORT='1', DMLC_NUM_WORKER='1', DMLC_NUM_SERVER='1')
    assert rc == 0, err
    assert '[worker 0] ready role=worker rank=0' in out.splitlines()
    assert_nothing_left(token)


@pytest.mark.parametrize('args', [['-n', '0', 'true'], ['-n', '2', '-s', '0', 'true'],
                                  ['-n', '2'], ['-n', '2', '--'], ['-n', '2', '--timeout', '0',
                                                                   'true']])
def test_bad_arguments(args):
    rc, out, err, token = run_launch(args)
    assert rc == 2, (out, err)
    assert 'usage:' in err


@pytest.mark.parametrize('hostfile, args, message', [
    (None, ['-H', '{dir}/missing'], 'cannot read hostfile {dir}/missing: No such file'),
    ('', [], 'hostfile {dir}/hosts names no host'),
    ('# nothing but a comment\n', [], 'names no host'),
    ('a:2\nb\n', ['--strict-slots', '-n', '4'], '4 workers do not fit in the 3 slot(s)'),
    ('a:zero\n', [], 'line 1: expected "host" or "host:slots"'),
    ('a\n', ['--env', 'GP_SURELY_UNSET_VAR'], "GP_SURELY_UNSET_VAR: not set in the launcher's"),
])
def test_bad_ssh_arguments(tmp_path, hostfile, args, message):
    if hostfile is not None:
        (tmp_path / 'hosts').write_text(hostfile)
    args = [a.format(dir=tmp_path) for a in args]
    if '-H' not in args:
        args = ['-H', str(tmp_path / 'hosts')] + args
    if '-n' not in args:
        args = ['-n', '2'] + args
    rc, out, err, token = run_launch(['--launcher', 'ssh'] + args + ['--', 'true'])
    assert rc == 2, (out, err)
    assert 'usage:' in err and message.format(dir=tmp_path) in err, err
    assert_nothing_left(token)


@pytest.mark.parametrize('args, message', [
    (['--launcher', 'ssh', '-n', '2', 'true'], '--launcher ssh needs -H/--hostfile'),
    (['-H', 'hosts', '-n', '2', 'true'], '-H/--hostfile needs --launcher ssh'),
    (['--launcher', 'slurm', 'true'], 'runs inside a SLURM allocation'),
    (['--launcher', 'ssh', '--host', '1.2.3.4', '-H', 'h', '-n', '1', 'true'], '--host is for'),
])
def test_bad_mode_arguments(args, message):
    rc, out, err, token = run_launch(args)
    assert rc == 2, (out, err)
    assert 'usage:' in err and message in err, err


def test_bad_slurm_task_arguments():
    slurm = dict(SLURM_JOB_ID='5', SLURM_STEP_ID='0', SLURM_PROCID='0', SLURM_STEP_NUM_TASKS='2',
                 SLURM_STEP_NODELIST='localhost', SLURMD_NODENAME='localhost')
    for args, message in ((['-n', '3'], '-n 3: with --launcher slurm every task runs one worker'),
                          (['-s', '3'], '-s 3: a step of 2 task(s) hosts 1 to 2 servers')):
        rc, out, err, token = run_launch(['--launcher', 'slurm'] + args + ['true'], **slurm)
        assert rc == 2, (out, err)
        assert message in err, err


def test_help_documents_every_mode():
    proc = subprocess.run(launch_cmd('--help'), capture_output=True, text=True, timeout=LIMIT)
    assert proc.returncode == 0
    text = ' '.join(proc.stdout.split())
    for words in ('--launcher {local,ssh,slurm}', 'local (default)', 'ssh the hosts of -H HOSTFILE',
                  'slurm inside a SLURM allocation', '--ssh-command', '--ssh-port', '--env',
                  '--strict-slots', '--scheduler-host', '--scheduler-address', '--timeout',
                  '--grace', 'SLURM_PROCID', 'DMLC_INTERFACE', 'srun --kill-on-bad-exit=1',
                  '--max-restarts N', 'GLUON_PARALLEL_RESTART', 'fails fast'):
        assert words in text, words
