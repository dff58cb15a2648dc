"""Fail fast (gluon_parallel/launch/failfast.py and its start-up hook).

The hook is tested alone first, in Python processes whose shutdown would
hang the way a dist worker's does: an object whose destructor waits
forever (ps-lite's finalize barrier) held by the main function. Without
the hook every such process runs into the test's timeout. Then real
plain-MXNet dist_sync jobs under the local launcher (ssh and SLURM:
tests/test_launch_ssh.py, tests/test_launch_slurm.py).
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from gluon_parallel.launch.failfast import STARTUP_DIR
from launch_helpers import PLAIN, assert_nothing_left, check_plain_sums, run_launch

HERE = os.path.dirname(os.path.abspath(__file__))
HANG = 8            # seconds a child may take before it counts as hung

# A stand-in for a dist worker: `kv` waits forever when destroyed (at exit,
# when main's frame goes), as a dist kvstore's finalisation waits for the
# other workers. BODY is what main() does next.
WORKER = '''
import atexit, sys, time
class KV:
    hang = True
    def __del__(self):
        print("finalize waits" if self.hang else "finalized", flush=True)
        time.sleep(600 if self.hang else 0)
atexit.register(lambda: print("atexit ran", flush=True))
def main():
    kv = KV()
%s
main()
print("main returned", flush=True)
'''


def run_python(body, hook=True, pythonpath=(), timeout=HANG):
    """(status, stdout, stderr) of WORKER with `body`; None status if it hung."""
    path = ([STARTUP_DIR] if hook else []) + list(pythonpath)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    code = WORKER % textwrap.indent(textwrap.dedent(body), '    ')
    try:
        proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return None, (e.stdout or b'').decode(), (e.stderr or b'').decode()
    return proc.returncode, proc.stdout, proc.stderr


def test_the_stand_in_hangs_without_the_hook():
    status, out, _ = run_python('raise ValueError("boom")', hook=False, timeout=2)
    assert status is None and 'finalize waits' in out, out


@pytest.mark.parametrize('body, status, says', [
    ('raise ValueError("boom")', 1, 'ValueError: boom'),
    ('sys.exit(3)', 3, 'sys.exit(3)'),
    ('exit(4)', 4, 'sys.exit(4)'),
    ('sys.exit("error: bad flag")', 1, 'error: bad flag'),
    ('raise KeyboardInterrupt', 130, 'KeyboardInterrupt'),
])
def test_a_failing_process_exits_at_once_with_its_status(body, status, says):
    got, out, err = run_python(body)
    assert got == status, (out, err)
    assert says in err
    assert 'finalize waits' not in out
    assert ('atexit ran' in out) == body.startswith(('sys.exit', 'exit')), out


def test_success_and_a_caught_exit_change_nothing():
    # A caught sys.exit, then a normal end: the usual shutdown, status 0
    # (the "kvstore" is finalised: every worker got there).
    status, out, err = run_python("""
        try:
            sys.exit(5)
        except SystemExit:
            pass
        kv.hang = False""", timeout=20)
    assert status == 0, (out, err)
    assert out.splitlines() == ['finalized', 'main returned', 'atexit ran'], out
    assert 'exiting at once' not in err
    # sys.exit(0) with a finalisation that waits: Python's own shutdown,
    # which waits (a healthy worker waits there for the others).
    status, out, _ = run_python('sys.exit(0)', timeout=2)
    assert status is None and 'finalize waits' in out, out


def test_the_hidden_sitecustomize_still_runs(tmp_path):
    (tmp_path / 'sitecustomize.py').write_text('import sys\nsys.own_site_ran = True\n')
    status, out, err = run_python('print("own", getattr(sys, "own_site_ran", False)); sys.exit(2)',
                                  pythonpath=[str(tmp_path)])
    assert status == 2, err
    assert 'own True' in out
    # The hook's directory is not left on sys.path.
    status, out, err = run_python(f'print({STARTUP_DIR!r} in sys.path); kv.hang = False')
    assert status == 0 and 'False' in out, err


# ------------------------------------------------ plain MXNet, local launcher --

def test_plain_mxnet_job_completes_with_the_right_sums():
    rc, out, err, token = run_launch(['-n', '3', '-s', '2', '--timeout', '60', '--',
                                sys.executable, PLAIN, 'ok'])
    assert rc == 0, err
    check_plain_sums(out, 3)
    assert_nothing_left(token)


@pytest.mark.parametrize('mode, status, says', [
    ('raise', 1, 'RuntimeError: worker 1 raises in round 1'),
    ('exit', 3, 'worker 1 exits with status 3'),
])
def test_plain_mxnet_worker_that_fails_stops_the_job_within_20s(mode, status, says):
    start = time.monotonic()
    rc, out, err, token = run_launch(['-n', '2', '-s', '1', '--timeout', '60', '--grace', '2', '--',
                                sys.executable, PLAIN, mode])
    took = time.monotonic() - start
    assert rc == status, (out, err)
    assert says in err
    assert f'[launch] worker 1 exited with status {status:d}' in err
    assert took < 20, took
    assert_nothing_left(token)
