"""Python children of tests, and the Ctrl-C they get.

A shell that starts a job in the background without job control (``cmd &``
in a script, as many CI runners do) starts it with SIGINT ignored, and a
Python started with SIGINT ignored never raises KeyboardInterrupt. Every
child a test may interrupt is therefore started with SIGINT reset to the
default, so the test measures the program, not how pytest was started.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

__all__ = ['default_sigint', 'popen', 'run_script', 'interrupt_when']


def default_sigint():
    """``preexec_fn``: SIGINT back to the default action in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen(argv, **kwargs):
    """``subprocess.Popen(argv, ...)`` whose child takes Ctrl-C, with
    Python's faulthandler on (SIGABRT prints every thread's stack: what
    interrupt_when reports of a child that does not exit)."""
    env = dict(kwargs.pop('env', None) or os.environ, PYTHONFAULTHANDLER='1')
    return subprocess.Popen(argv, preexec_fn=default_sigint, env=env, **kwargs)


def run_script(body, **kwargs):
    """Run dedented Python source `body` in a child, text pipes."""
    code = textwrap.dedent(body)
    return popen([sys.executable, '-c', code], stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True, **kwargs)


def interrupt_when(proc, marker, settle=0.3):
    """Once the script prints `marker`, send it SIGINT: it must exit with a
    KeyboardInterrupt within seconds."""
    try:
        assert marker in proc.stdout.readline()
        time.sleep(settle)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)        # faulthandler: every thread's stack
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise AssertionError('no exit 30 s after SIGINT; its stderr, ending with its '
                                 'threads at SIGABRT:\n{}'.format((err or '')[-6000:])) from None
        assert time.monotonic() - start < 10
        assert proc.returncode != 0
        assert 'KeyboardInterrupt' in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
