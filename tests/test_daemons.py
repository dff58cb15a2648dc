"""The suite on a machine without its daemons (tests/daemons.py).

The README's test command must pass on a fresh machine, where sshd and
SLURM are not installed: their tests skip, and the run's report says why.
Under .ci/run (REQUIRE_ENV=1) the same tests fail instead, so CI cannot
pass by skipping. The daemons are hidden with HIDE_ENV, so this holds on
machines that have them (as CI does).

The outcome and its reason are read from the child run's JUnit XML report,
not from its terminal summary, whose failure lines pytest cuts to the
terminal's width (COLUMNS when there is no terminal: a file, a CI log); the
child runs with a narrow COLUMNS. The reason must name the hidden daemon
among the missing programs: on a machine without SLURM it names them all.
"""
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import NamedTuple

import pytest

import daemons

HERE = os.path.dirname(os.path.abspath(__file__))
# One test per daemon; each fails in its fixture, before starting anything.
SSH_TEST = 'test_launch_ssh.py::test_ssh_plain_mxnet_job_completes_with_the_right_sums'
SLURM_TEST = 'test_launch_slurm.py::test_real_slurm_plain_mxnet_job_completes_with_the_right_sums'
# The reason names every missing program: on a machine without SLURM at all
# that is more than the one hidden here.
CASES = {'sshd': (SSH_TEST, r'OpenSSH is not installed \(missing ([^)]*)\)'),
         'slurmd': (SLURM_TEST, r'SLURM is not installed \(missing ([^)]*)\)')}
# Narrower than any reason: the summary line of a skip is cut well before it.
COLUMNS = '40'


class Outcome(NamedTuple):
    """One test case of a JUnit XML report."""
    kind: str       # 'passed', 'skipped', 'failure' or 'error'
    message: str    # the reason pytest gives (skip reason, failure text)


class Run(NamedTuple):
    """A child pytest run: its exit status, output and reported outcomes."""
    status: int
    output: str
    outcomes: list


def read_junit(path):
    """The outcomes of every test case in the JUnit XML file at `path`."""
    outcomes = []
    for case in ET.parse(path).getroot().iter('testcase'):
        found = [el for el in case if el.tag in ('skipped', 'failure', 'error')]
        if not found:
            outcomes.append(Outcome('passed', ''))
        for el in found:
            outcomes.append(Outcome(el.tag, (el.get('message') or '') + '\n' + (el.text or '')))
    return outcomes


def names_missing(pattern, message):
    """The programs a skip or failure message names as missing, or None."""
    found = re.search(pattern, message)
    return found and found.group(1).split(', ')


def run_pytest(test, hide, required, tmp_path):
    """The test run as the README's command runs it (the project's pytest
    options), output to a pipe and COLUMNS narrow, with a JUnit report;
    `hide` is hidden besides what this run hides already."""
    env = dict(os.environ, COLUMNS=COLUMNS)
    env[daemons.HIDE_ENV] = ','.join(filter(None, [env.get(daemons.HIDE_ENV), hide]))
    env[daemons.REQUIRE_ENV] = '1' if required else '0'
    report = tmp_path / 'report.xml'
    proc = subprocess.run([sys.executable, '-m', 'pytest', '-p', 'no:cacheprovider',
                           f'--junitxml={report}', os.path.join(HERE, test)],
                          cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True,
                          timeout=240)
    output = proc.stdout + proc.stderr
    assert report.exists(), output
    return Run(proc.returncode, output, read_junit(report))


@pytest.mark.parametrize('daemon', sorted(CASES))
def test_missing_daemon_skips_with_its_reason_in_the_report(daemon, tmp_path):
    test, reason = CASES[daemon]
    run = run_pytest(test, daemon, required=False, tmp_path=tmp_path)
    assert run.status == 0, run.output
    assert [o.kind for o in run.outcomes] == ['skipped'], run
    assert daemon in (names_missing(reason, run.outcomes[0].message) or []), run
    # -rs (setup.cfg) lists the skip in the summary a user reads.
    summary = run.output[run.output.index('short test summary info'):]
    assert '\nSKIPPED [1] ' in summary, run.output


@pytest.mark.parametrize('daemon', sorted(CASES))
def test_missing_daemon_fails_when_ci_requires_it(daemon, tmp_path):
    test, reason = CASES[daemon]
    run = run_pytest(test, daemon, required=True, tmp_path=tmp_path)
    assert run.status == 1, run.output
    assert [o.kind for o in run.outcomes] in (['error'], ['failure']), run
    assert daemon in (names_missing(reason, run.outcomes[0].message) or []), run
    assert daemons.REQUIRE_ENV in run.outcomes[0].message, run
