"""gluon_parallel/progress.py: what a worker reports, at most one message a
second, busy() nested and outside a launched job."""
import subprocess
import sys

from gluon_parallel import progress


class _Recorder:
    def __init__(self):
        self.sent = []

    def send(self, kind, **fields):
        self.sent.append((kind, fields))


def _reporter():
    return progress.Reporter(_Recorder())


def test_reductions_and_steps_are_counted_and_sent_at_most_once_a_second():
    r = _reporter()
    for _ in range(50):
        for key in (0, 1, 2):           # a gluon.Trainer step: a pushpull per parameter
            r.entering(key)
            r.done()
    state = r.state()
    assert (state['steps'], state['reductions'], state['reducing']) == (50, 150, False)
    # Entering the first reduction, then its completion (the end of the
    # start-up): the rest wait for the thread.
    assert len(r.client.sent) == 2
    r.entering(0)
    r.entering('inner')                 # nested: one reduction
    assert r.state()['reducing'] and r.state()['steps'] == 51
    r.done()
    r.done()
    assert r.state()['reductions'] == 151


def test_busy_nested_keeps_the_outer_reason_and_is_sent_at_once():
    r = _reporter()
    r.enter_busy('evaluating')
    r.enter_busy('saving a checkpoint')
    assert r.state()['busy'] == 'evaluating'
    r.leave_busy()
    assert r.state()['busy'] == 'evaluating'
    r.leave_busy()
    assert r.state()['busy'] is None and r.state()['busy_ends'] == 1
    busy = [f['busy'] for _, f in r.client.sent]
    assert busy == ['evaluating', None]


def test_busy_outside_a_launched_job_is_a_no_op():
    code = ('import gluon_parallel.progress as p\n'
            'from gluon_parallel import dist\n'
            'with dist.busy("evaluating"):\n'
            '    with dist.busy("inner"):\n'
            '        pass\n'
            'print(type(p.reporter()).__name__)\n')
    env = {k: v for k, v in __import__('os').environ.items()
           if not k.startswith('GLUON_PARALLEL_')}
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ['_Nobody']


def test_own_time_is_the_step_time_outside_reductions(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress.time, 'monotonic', lambda: now[0])
    r = _reporter()
    for _ in range(5):
        r.entering(0)
        now[0] += 0.3       # waiting in the reduction
        r.done()
        now[0] += 0.1       # its own work
    assert abs(r.state()['own'] - 0.1) < 1e-9
