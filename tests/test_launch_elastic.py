"""Elastic jobs on the local launcher (gluon_parallel/launch/elastic.py,
discovery.py): ``-n MIN:MAX --discover CMD``.

The jobs run tests/dist_scripts/elastic_fake.py (no MXNet: a second or two
each); discovery is ``cat`` of a hosts file the fake workers rewrite. The
training jobs at another size are in tests/test_elastic_training.py.
"""
import re
import signal
import subprocess
import sys
import uuid

import pytest

import daemons
from gluon_parallel.launch import main
from launch_helpers import (HERE, assert_nothing_left, finish, launch_cmd, launch_env, read_until,
                            run_launch)

FAKE = f'{HERE}/dist_scripts/elastic_fake.py'
QUICK = ['--discover-interval', '0.2', '--grace', '1']


def _hosts(tmp_path, slots):
    path = tmp_path / 'hosts'
    path.write_text(f'localhost:{slots:d}\n')
    return str(path)


@pytest.fixture(params=['dist_sync', 'horovod'])
def engine(request):
    if request.param == 'horovod':
        daemons.require(daemons.horovod_available(), daemons.HOROVOD_MISSING)
    return request.param


def worker_lines(out, engine):
    """{rank: [lines]} a fake worker printed (dist_sync: '[worker R] ...';
    horovod: horovodrun's '[horovodrun] [R]<stdout>:...')."""
    pattern = (r'^\[worker (\d+)\] (.*)$' if engine == 'dist_sync' else
               r'^\[horovodrun\] \[(\d+)\]<stdout>:(.*)$')
    lines = {}
    for rank, text in re.findall(pattern, out, re.M):
        lines.setdefault(int(rank), []).append(text)
    return lines


def _elastic(tmp_path, size, slots, *fake, launch=()):
    hosts = _hosts(tmp_path, slots)
    args = ['-n', size, '--discover', f'cat {hosts}', *QUICK, *launch, '--',
            sys.executable, FAKE, str(tmp_path / 'progress'), '10',
            *[hosts if a == 'HOSTS' else a for a in fake]]
    return run_launch(args)


def layouts(err):
    """[(attempt, workers)] of the launcher's layout lines."""
    return [(int(a), int(w)) for a, w in
            re.findall(r'^\[launch\] attempt (\d+): (\d+) workers? on ', err, re.M)]


def test_a_killed_worker_resumes_at_one_fewer_and_finishes(tmp_path, engine):
    rc, out, err, token = _elastic(tmp_path, '2:3', 3, 'die', '1', '3', 'HOSTS', '2',
                                   launch=['--max-restarts', '1', '--engine', engine])
    assert rc == 0, (out, err)
    assert layouts(err) == [(0, 3), (1, 2)], err
    assert '[launch] attempt 1: 2 workers on localhost:2 (-n 2:3; discovered localhost:2)' \
        in err.splitlines()
    # (horovodrun ends the job itself, with its own status.)
    cause = 'worker 1 exited with status 137' if engine == 'dist_sync' else \
        'horovodrun exited with status 1'
    assert f'[launch] restart 1 of 1 after: {cause}; starting the whole job again' \
        in err.splitlines(), err
    said = worker_lines(out, engine)
    for rank in (0, 1):
        assert said[rank][-1] == f'rank {rank:d} done', out
        assert re.match(rf'attempt 1 rank {rank:d} of 2 from step \d+$', said[rank][-2]), out
    assert_nothing_left(token)


def test_below_min_it_waits_then_fails_with_the_failures_status(tmp_path):
    rc, out, err, token = _elastic(tmp_path, '2:2', 2, 'die', '1', '2', 'HOSTS', '1',
                                   launch=['--max-restarts', '3', '--elastic-timeout', '1'])
    assert rc == 137, (out, err)
    assert layouts(err) == [(0, 2)], err
    assert re.search(r'^\[launch\] waiting up to 1s: discovery reports localhost:1, fewer than '
                     r'the 2 slots of MIN$', err, re.M), err
    assert ('[launch] no attempt after waiting 1s (--elastic-timeout): discovery reports '
            'localhost:1, fewer than the 2 slots of MIN') in err.splitlines()
    assert_nothing_left(token)


def test_a_discovery_failing_mid_job_makes_the_attempt_wait_and_say_why(tmp_path):
    # Worker 1 removes the hosts file as it dies: cat fails from then on.
    rc, out, err, token = _elastic(tmp_path, '1:2', 2, 'die', '1', '2', 'HOSTS', '-',
                                   launch=['--max-restarts', '1', '--elastic-timeout', '1'])
    assert rc == 137, (out, err)
    assert re.search(r"^\[launch\] waiting up to 1s: --discover 'cat \S+' exited with status 1: "
                     r'cat: \S+: No such file or directory$', err, re.M), err
    assert_nothing_left(token)


def test_more_slots_end_the_job_after_a_checkpoint_and_it_goes_on_larger(tmp_path, engine):
    # --max-restarts 0: growing does not use a restart.
    rc, out, err, token = _elastic(tmp_path, '1:3', 1, 'grow', '2', 'HOSTS', '4',
                                   launch=['--engine', engine])
    assert rc == 0, (out, err)
    assert layouts(err) == [(0, 1), (1, 3)], err       # 4 slots, MAX 3
    assert ('[launch] discovery reports localhost:4: the job ends after its next checkpoint '
            'and goes on at 3 workers') in err.splitlines()
    if engine == 'dist_sync':
        assert re.search(r'^\[launch\] worker 0 exited with status 75 \(told to leave after '
                         r'its checkpoint, for the larger size\): stopping the other processes$',
                         err, re.M), err
    assert ('[launch] the workers left after their checkpoint to grow; attempt 1 starts at the '
            'size discovery reports (not counted against --max-restarts)') in err.splitlines()
    said = worker_lines(out, engine)
    left = re.match(r'rank 0 leaves after step (\d+)$', said[0][1])
    assert left, out
    # (The fake workers do not wait for each other: rank 0 may be ahead.)
    assert said[0][2] == f'attempt 1 rank 0 of 3 from step {left[1]}', out
    for rank in range(3):
        assert re.match(rf'attempt 1 rank {rank:d} of 3 from step \d+$', said[rank][-2]), out
        assert said[rank][-1] == f'rank {rank:d} done', out
    assert_nothing_left(token)


def test_never_min_slots_exits_124(tmp_path):
    rc, out, err, token = _elastic(tmp_path, '3:4', 2, launch=['--elastic-timeout', '0.5'])
    assert rc == 124, (out, err)
    assert layouts(err) == [] and not out
    assert_nothing_left(token)


@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_waiting_for_slots_ends_the_run(tmp_path, signum):
    hosts = _hosts(tmp_path, 1)
    token = uuid.uuid4().hex
    # SIGINT reset in the child: a background job of a non-interactive
    # shell has it ignored, and the launcher would inherit that.
    popen = subprocess.Popen(
        launch_cmd('-n', '2:2', '--discover', f'cat {hosts}', '--discover-interval', '0.2',
                   '--', sys.executable, FAKE, str(tmp_path / 'progress'), '10'),
        env=launch_env(token), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        read_until(popen, lambda lines: any('[launch] waiting up to' in x for x in lines),
                   stream=popen.stderr)
        popen.send_signal(signum)
    finally:
        (rc, out, err), = finish([popen], 30)
    assert rc == 128 + signum, err
    assert f'[launch] got {signal.Signals(signum).name} while waiting for slots' in err
    assert_nothing_left(token)


@pytest.mark.parametrize('args,message', [
    (['-n', '3:2', '--discover', 'echo localhost:2'], '-n 3:2: MIN is larger than MAX'),
    (['-n', '0:2', '--discover', 'echo localhost:2'], '-n 0:2: MIN must be at least 1'),
    (['-n', 'a:2', '--discover', 'echo localhost:2'], '-n a:2: expected WORKERS or MIN:MAX'),
    (['-n', '0'], '-n 0: at least 1 worker'),
    (['-n', '1:2'], '-n 1:2: an elastic job needs --discover CMD'),
    (['-n', '2', '--elastic-timeout', '3'], '--elastic-timeout needs --discover'),
    (['-n', '1:2', '--discover', 'exit 3'], "--discover 'exit 3' exited with status 3: "
                                            "(no output on stderr)"),
    (['-n', '1:2', '--discover', 'echo oops >&2; false'], 'exited with status 1: oops'),
    (['-n', '1:2', '--discover', 'true'], "--discover 'true' output names no host"),
    (['-n', '1:2', '--discover', 'echo localhost:two'],
     "--discover 'echo localhost:two' output, line 1: expected \"host\" or \"host:slots\" with "
     "slots >= 1, got 'localhost:two'"),
    (['-n', '1:2', '--discover', 'echo node7:2'],
     "names node7: --launcher local runs on this machine only"),
    (['-n', '1:2', '--discover', 'echo x', '--launcher', 'slurm'],
     '--discover: a SLURM allocation has a fixed size'),
    (['-n', '1:2', '--discover', 'echo x', '--launcher', 'ssh', '-H', '/dev/null'],
     '-H/--hostfile and --discover both name the hosts'),
])
def test_bad_input_is_an_error_before_anything_starts(args, message, capfd):
    # In this process (a launcher's start-up each would cost a second).
    with pytest.raises(SystemExit) as e:
        main(args + ['--', sys.executable, '-c', 'print("started")'])
    assert e.value.code == 2
    out, err = capfd.readouterr()
    assert message in err, err
    assert 'started' not in out
