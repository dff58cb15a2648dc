"""--stall-timeout (gluon_parallel/launch/stall.py) with real processes and
real faults on the local launcher: a 2-worker dist_sync job
(tests/dist_scripts/stall_job.py) whose worker blocks in Python, is
SIGSTOPped, whose server is SIGSTOPped, or that takes a step more than the
other; each must end within S + 30 s of the fault, the report's first line
naming the stalled process, nothing left running. A busy() phase longer
than S and a long warm-up are not stalls; a stalled attempt restarted by
--max-restarts ends bit-identical to a run that never stalled. Also the
Monitor's decisions on made-up reports.
"""
import os
import re
import signal
import subprocess
import threading
import time
import uuid

import psutil
import pytest

import daemons
from launch_helpers import (HERE, assert_nothing_left, finish, launch_cmd, launch_env,
                            read_until, run_launch)
from gluon_parallel.launch.stall import STALL_STATUS, Monitor

JOB = os.path.join(HERE, 'dist_scripts', 'stall_job.py')
PEER_WAIT = os.path.join(HERE, 'dist_scripts', 'peer_wait.py')
S = 15
BOUND = S + 30          # seconds from the fault to the launcher's exit
ENGINE = dict(MXNET_ENGINE_TYPE='NaiveEngine', OMP_NUM_THREADS='1')


def _start(*job_args, launch=('-s', '1'), token=None):
    token = token or uuid.uuid4().hex
    args = ['-n', '2', '--stall-timeout', str(S), '--timeout', '240', *launch,
            '--', 'python', JOB, *job_args]
    popen = subprocess.Popen(launch_cmd(*args), env=launch_env(token, **ENGINE),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return popen, token


def _process(token, role, rank=None):
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get('GP_LAUNCH_TEST_TOKEN') == token and env.get('DMLC_ROLE') == role and (
                rank is None or env.get('GLUON_PARALLEL_LAUNCH_RANK') == str(rank)):
            return p
    return None


def _report(err):
    """The [launch] lines from the first 'stalled:' line on."""
    lines = [x for x in err.splitlines() if x.startswith('[launch] ')]
    first = next(i for i, x in enumerate(lines) if ' stalled: ' in x)
    return lines[first:]


def _ended_by_stall(popen, token, fault_at):
    (rc, out, err), = finish([popen], BOUND + 30)
    took = time.monotonic() - fault_at
    assert rc == STALL_STATUS, err[-4000:]
    assert took <= BOUND, (took, err[-4000:])
    assert_nothing_left(token)
    print(f'detected and ended in {took:.1f}s after the fault (S = {S})')
    return out, err


def _sigstopped(role, rank, name):
    popen, token = _start('--steps', '5000', '--pause', '0.02')
    read_until(popen, lambda lines: any(x.startswith('[worker 1] step 20 ') for x in lines))
    victim = _process(token, role, rank)
    assert victim is not None
    victim.send_signal(signal.SIGSTOP)
    out, err = _ended_by_stall(popen, token, time.monotonic())
    report = _report(err)
    assert report[0].startswith(f'[launch] {name} stalled: stopped'), report
    assert f'[launch] {name}: stopped (state T): it cannot print its stack' in report, report
    return out, err


def test_a_worker_blocked_in_python_is_named_with_its_stack():
    popen, token = _start('--fault', 'block', '--rank', '1', '--at', '30', '--steps', '5000',
                          '--pause', '0.02')
    read_until(popen, lambda lines: '[worker 1] blocking at step 30' in lines)
    out, err = _ended_by_stall(popen, token, time.monotonic())
    report = _report(err)
    assert report[0].startswith('[launch] worker 1 stalled: behind the others'), report
    assert any(x.startswith('[launch]   worker 0: waiting in reduction') for x in report)
    assert any(x.startswith('[launch]   worker 1: running its own code, not in a reduction; '
                            'step 29') for x in report), report
    # Every thread of worker 1, the blocking frame included; worker 0 waits in pushpull.
    assert re.search(r'^\[worker 1\] .*stall_job\.py", line \d+ in main$', err, re.M), err
    assert re.search(r'^\[worker 0\] .* in pushpull$', err, re.M), err
    assert '[worker 1] Current thread' in err and '[worker 1] Thread 0x' in err


def test_a_horovod_worker_blocked_in_python_is_named():
    """The stalled worker is named, not the one whose Gloo wait would
    time out first."""
    daemons.require(daemons.horovod_available(), daemons.HOROVOD_MISSING)
    popen, token = _start('--fault', 'block', '--rank', '1', '--at', '30', '--steps', '5000',
                          '--pause', '0.02', launch=('--engine', 'horovod'))
    read_until(popen, lambda lines: any(x.endswith('blocking at step 30') for x in lines))
    out, err = _ended_by_stall(popen, token, time.monotonic())
    report = _report(err)
    assert report[0].startswith('[launch] worker 1 stalled: behind the others'), report


def test_a_sigstopped_worker_is_named_and_killed():
    _sigstopped('worker', 1, 'worker 1')


def test_a_sigstopped_server_is_named_and_killed():
    _sigstopped('server', None, 'server 0')


def test_a_worker_with_a_step_more_is_named():
    popen, token = _start('--fault', 'extra-step', '--rank', '0', '--steps', '30')
    read_until(popen, lambda lines: '[worker 1] done 30 steps' in lines)
    out, err = _ended_by_stall(popen, token, time.monotonic())
    report = _report(err)
    assert report[0].startswith('[launch] worker 0 stalled: waits alone in a reduction'), report
    assert any(x.startswith('[launch]   worker 1: at the end of its program') for x in report)


def test_a_busy_phase_longer_than_the_timeout_is_not_a_stall():
    rc, out, err, token = run_launch(
        ['-n', '2', '-s', '1', '--stall-timeout', str(S), '--', 'python', JOB, '--fault', 'busy',
         '--rank', '1', '--at', '5', '--seconds', str(S + 10), '--steps', '20'],
        timeout=150, **ENGINE)
    assert rc == 0, err[-4000:]
    assert 'stalled' not in err
    assert '[worker 1] done 20 steps' in out.splitlines()
    assert_nothing_left(token)


def test_a_long_first_step_warm_up_is_not_a_stall():
    rc, out, err, token = run_launch(
        ['-n', '2', '-s', '1', '--stall-timeout', str(S), '--', 'python', JOB, '--fault',
         'warmup', '--rank', '1', '--seconds', str(S + 10), '--steps', '20'],
        timeout=150, **ENGINE)
    assert rc == 0, err[-4000:]
    assert 'stalled' not in err
    assert_nothing_left(token)


def test_forged_and_garbage_messages_do_not_mask_a_stall():
    """A client without the key floods the channel with reports of
    progress for worker 1 and with garbage: the stall is still found, on
    time, and named."""
    popen, token = _start('--fault', 'block', '--rank', '1', '--at', '30', '--steps', '5000',
                          '--pause', '0.02')
    read_until(popen, lambda lines: '[worker 1] blocking at step 30' in lines)
    fault_at = time.monotonic()
    where = _process(token, 'worker', 0).environ()['GLUON_PARALLEL_CHANNEL']
    stop = threading.Event()
    thread = threading.Thread(target=_flood, args=(where, stop), daemon=True)
    thread.start()
    try:
        out, err = _ended_by_stall(popen, token, fault_at)
    finally:
        stop.set()
        thread.join()
    assert _report(err)[0].startswith('[launch] worker 1 stalled: '), _report(err)


def _flood(where, stop):
    import json
    import socket
    host, _, port = where.rpartition(':')
    fake = json.dumps(dict(kind='progress', who='worker 1', pid=1, seq=10 ** 9, steps=10 ** 6,
                           reductions=10 ** 6, calls=0, reducing=False, busy=None,
                           busy_ends=0, exiting=False, own=None, restart='0')).encode()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while not stop.is_set():
            for data in (b'\0' * 32 + fake, b'garbage', os.urandom(300), b'x' * 40 + fake):
                try:
                    s.sendto(data, (host, int(port)))
                except OSError:
                    pass
            time.sleep(0.01)


def test_a_stalled_attempt_restarts_and_ends_as_a_run_that_never_stalled(tmp_path):
    common = ['--steps', '60', '--save-every', '10']
    rc, out, err, token = run_launch(['-n', '2', '-s', '1', '--stall-timeout', str(S), '--',
                                      'python', JOB, *common, '--save-dir', str(tmp_path / 'a')],
                                     timeout=150, **ENGINE)
    assert rc == 0, err[-4000:]
    popen, token = _start(*common, '--save-dir', str(tmp_path / 'b'), '--fault', 'block',
                          '--rank', '1', '--at', '25', launch=('-s', '1', '--max-restarts', '1'))
    read_until(popen, lambda lines: '[worker 1] blocking at step 25' in lines)
    (rc, out, err), = finish([popen], 150)
    assert rc == 0, err[-4000:]
    assert re.search(r'^\[launch\] restart 1 of 1 after: worker 1 stalled \(no progress for '
                     r'\d+s\); starting the whole job again$', err, re.M), err[-4000:]
    assert '[worker 0] resumed at step 21' in out.splitlines(), out
    assert_nothing_left(token)
    import mxnet as mx
    want = mx.nd.load(str(tmp_path / 'a' / 'final.params'))
    got = mx.nd.load(str(tmp_path / 'b' / 'final.params'))
    assert sorted(want) == sorted(got)
    for name in want:
        assert (want[name].asnumpy() == got[name].asnumpy()).all(), name


def _peer_wait(folder, *job_args):
    token = uuid.uuid4().hex
    args = ['-n', '2', '-s', '1', '--stall-timeout', str(S), '--timeout', '120', '--',
            'python', PEER_WAIT, str(folder), *job_args]
    return subprocess.Popen(launch_cmd(*args), env=launch_env(token), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE), token


def test_a_peer_timeout_names_the_stalled_worker_not_the_one_that_timed_out(tmp_path):
    """Worker 1 blocks in Python; worker 0's reduction gives up after 10 s
    with a Gloo-like timeout (as under Horovod) and fails first: the report
    names worker 1 as the cause, the status stays worker 0's."""
    popen, token = _peer_wait(tmp_path, '--fault', 'block', '--rank', '1', '--at', '20',
                              '--wait', '10')
    read_until(popen, lambda lines: '[worker 1] block at step 20' in lines)
    fault_at = time.monotonic()
    (rc, out, err), = finish([popen], BOUND + 30)
    took = time.monotonic() - fault_at
    assert rc == 1, err[-4000:]
    assert took <= BOUND, (took, err[-4000:])
    assert_nothing_left(token)
    assert 'Timed out waiting 10000ms' in err, err[-4000:]
    lines = [x for x in err.splitlines() if x.startswith('[launch] ')]
    assert re.match(r'\[launch\] worker 1 had not moved for \d+s when worker 0 failed \(worker 0 '
                    r'had waited \d+s in reduction 20, which worker 1 had not entered\): the '
                    r'likely cause; the failure of worker 0 is likely its consequence', lines[0]), \
        lines
    assert any(x.startswith('[launch]   worker 1: running its own code, not in a reduction; '
                            'step 19 (19 reductions done)') for x in lines), lines
    assert any(x.startswith('[launch]   worker 0: ') and x.endswith('; process exited with '
                                                                  'status 1') for x in lines), lines
    assert re.search(r'^\[worker 1\] .*peer_wait\.py", line \d+ in main$', err, re.M), err
    assert re.match(r'\[launch\] worker 0 exited with status 1 \(likely because worker 1 had not '
                    r'moved for \d+s\): stopping the other processes$', lines[-1]), lines
    assert 'stalled' not in err


@pytest.mark.parametrize('rank', [0, 1])
def test_a_failure_while_everyone_moves_is_reported_as_before(tmp_path, rank):
    popen, token = _peer_wait(tmp_path, '--fault', 'raise', '--rank', str(rank), '--at', '20')
    (rc, out, err), = finish([popen], 90)
    assert rc == 1, err[-4000:]
    assert f'[worker {rank:d}] raise at step 20' in out.splitlines(), out
    lines = [x for x in err.splitlines() if x.startswith('[launch] ')]
    assert lines == [f'[launch] worker {rank:d} exited with status 1: stopping the other '
                     'processes'], err[-4000:]
    assert_nothing_left(token)


@pytest.mark.parametrize('value, says', [('-1', 'expected seconds >= 0'),
                                         ('soon', "expected seconds (a number"),
                                         ('nan', 'expected seconds >= 0')])
def test_bad_stall_timeout_is_a_usage_error(value, says):
    rc, out, err, _ = run_launch(['-n', '1', '--stall-timeout', value, '--', 'true'])
    assert rc == 2 and f'argument --stall-timeout: {says}' in err, err


# ------------------------------------------------------ the Monitor alone --

class _Clock:
    now = 0.0

    def __call__(self):
        return self.now


def _report_of(who, **fields):
    base = dict(who=who, pid=1, seq=1, steps=0, reductions=0, calls=0, reducing=False,
                busy=None, busy_ends=0, exiting=False, own=None, restart='0')
    return dict(base, **fields)


def _monitor(n=2):
    clock = _Clock()
    return Monitor(10, n, 0, ['scheduler', 'server 0'], clock=clock), clock


def test_no_stall_before_the_timeout_nor_while_a_worker_is_busy():
    m, clock = _monitor()
    m.receive(_report_of('worker 0', reductions=5, steps=5, reducing=True))
    m.receive(_report_of('worker 1', reductions=5, steps=5))
    clock.now = 9.9
    assert m.check() is None
    m.receive(_report_of('worker 1', reductions=5, steps=5, busy='evaluating'))
    clock.now = 100
    assert m.check() is None
    m.receive(_report_of('worker 1', reductions=5, steps=5, busy_ends=1))   # leaving: progress
    assert m.check() is None
    clock.now = 110
    assert m.check().suspects == ['worker 1']


def test_the_start_gets_four_times_the_timeout():
    m, clock = _monitor()
    m.receive(_report_of('worker 0', reducing=True))
    clock.now = 39
    assert m.check() is None
    clock.now = 40
    stall = m.check()
    assert stall.suspects == ['1 worker that never reported'], stall


def test_suspects_every_worker_waiting_means_the_servers():
    m, clock = _monitor()
    for w in ('worker 0', 'worker 1'):
        m.receive(_report_of(w, reductions=7, reducing=True))
    clock.now = 11
    assert m.check().suspects == ['scheduler', 'server 0']
    assert m.check(stopped=['server 0']).suspects == ['server 0']


def test_suspects_all_at_exit_with_different_counts():
    m, clock = _monitor()
    m.receive(_report_of('worker 0', reductions=8, exiting=True))
    m.receive(_report_of('worker 1', reductions=6, exiting=True))
    clock.now = 11
    assert m.check().suspects == ['worker 0']


def test_a_slow_worker_is_warned_about_once_a_minute():
    m, clock = _monitor(3)
    for w, own in (('worker 0', 0.1), ('worker 1', 0.11), ('worker 2', 0.25)):
        m.receive(_report_of(w, reductions=9, steps=9, own=own))
    lines = m.slow()
    assert len(lines) == 1 and lines[0].startswith('worker 2 is slow: '), lines
    assert m.slow() == []
    clock.now = 61
    assert len(m.slow()) == 1


def _waited_and_failed(m, clock, worker1=None, wait=8.0):
    """Worker 0 waits in reduction 8 from t=1 for `wait` seconds, then its
    reduction raises (counted as done: progress.reduce); worker 1 as given."""
    clock.now = 1
    m.receive(_report_of('worker 0', reductions=7, steps=8, reducing=True))
    m.receive(worker1 or _report_of('worker 1', reductions=7, steps=7))
    clock.now = 1 + wait
    m.receive(_report_of('worker 0', reductions=8, steps=8))
    clock.now += 0.2


def test_blame_names_the_worker_behind_a_long_wait():
    m, clock = _monitor()
    _waited_and_failed(m, clock)
    found = m.blame('worker 0')
    assert found.suspects == ['worker 1'], found
    assert found.why.startswith('had not moved for 8s when worker 0 failed (worker 0 had '
                                'waited 8s in reduction 8, which worker 1 had not entered)'), found
    horovodrun = m.blame('horovodrun')      # local Horovod: the workers' one process failed
    assert horovodrun.suspects == ['worker 1'], horovodrun
    assert 'when horovodrun failed (worker 0 had waited' in horovodrun.why, horovodrun


def test_blame_a_stopped_process():
    m, clock = _monitor()
    _waited_and_failed(m, clock, _report_of('worker 1', reductions=7, steps=8, reducing=True))
    assert m.blame('worker 0') is None      # both waited in the same reduction
    assert m.blame('worker 0', stopped=['server 0']).suspects == ['server 0']


@pytest.mark.parametrize('case', ['short wait', 'long ago', 'peer at exit', 'peer moved',
                                  'not waiting'])
def test_blame_nobody(case):
    m, clock = _monitor()
    worker1 = _report_of('worker 1', reductions=7, steps=7, exiting=case == 'peer at exit')
    _waited_and_failed(m, clock, worker1, wait=3.0 if case == 'short wait' else 8.0)
    if case == 'long ago':
        clock.now += 6      # it failed long after its wait ended
    if case == 'peer moved':
        m.receive(_report_of('worker 1', reductions=7, steps=7, busy_ends=1))
    if case == 'not waiting':
        m, clock = _monitor()
        m.receive(_report_of('worker 0', reductions=7, steps=7))
        m.receive(worker1)
        clock.now = 20
    assert m.blame('worker 0') is None
