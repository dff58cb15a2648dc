"""The suite on a machine without its daemons (tests/daemons.py).

The README's test command must pass on a fresh machine, where sshd and
SLURM are not installed: their tests skip, and the run's summary shows why.
Under .ci/run (REQUIRE_ENV=1) the same tests fail instead, so CI cannot
pass by skipping. The daemons are hidden with HIDE_ENV, so this holds on
machines that have them (as CI does).
"""
import os
import subprocess
import sys

import pytest

import daemons

HERE = os.path.dirname(os.path.abspath(__file__))
# One test per daemon; each fails in its fixture, before starting anything.
SSH_TEST = 'test_launch_ssh.py::test_ssh_plain_mxnet_job_completes_with_the_right_sums'
SLURM_TEST = 'test_launch_slurm.py::test_real_slurm_plain_mxnet_job_completes_with_the_right_sums'
CASES = {'sshd': (SSH_TEST, 'OpenSSH is not installed (missing sshd)'),
         'slurmd': (SLURM_TEST, 'SLURM is not installed (missing slurmd)')}


def run_pytest(test, hide, required):
    """(status, output) of the test run as the README's command runs it
    (the project's pytest options, so the summary is what a user sees)."""
    env = dict(os.environ)
    env[daemons.HIDE_ENV] = hide
    env[daemons.REQUIRE_ENV] = '1' if required else '0'
    proc = subprocess.run([sys.executable, '-m', 'pytest', '-p', 'no:cacheprovider',
                           os.path.join(HERE, test)],
                          cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True,
                          timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize('daemon', sorted(CASES))
def test_missing_daemon_skips_with_its_reason_in_the_summary(daemon):
    test, reason = CASES[daemon]
    status, out = run_pytest(test, daemon, required=False)
    assert status == 0, out
    assert '1 skipped' in out, out
    summary = out[out.index('short test summary info'):]
    assert 'SKIPPED' in summary and reason in summary, out


@pytest.mark.parametrize('daemon', sorted(CASES))
def test_missing_daemon_fails_when_ci_requires_it(daemon):
    test, reason = CASES[daemon]
    status, out = run_pytest(test, daemon, required=True)
    assert status == 1, out
    assert ('1 error' in out or '1 failed' in out) and reason in out, out
    assert daemons.REQUIRE_ENV in out, out
