"""Tests that need a system daemon or a heavy optional package.

On a user's machine such a test skips with its reason when the thing is
not installed (the README's test command must pass on a fresh machine).
Under `.ci/run`, which installs every daemon and sets REQUIRE_ENV=1, a
missing one fails the test instead, so CI can never pass by skipping.
"""
import os
import shutil

import pytest

REQUIRE_ENV = 'GLUON_PARALLEL_REQUIRE_DAEMONS'
# Programs (and 'horovod') to treat as not installed, comma-separated: lets a
# test run the daemon tests as a machine without them would, on one that has them.
HIDE_ENV = 'GLUON_PARALLEL_HIDE_PROGRAMS'


def required():
    """True when a missing daemon must fail the run (CI)."""
    return os.environ.get(REQUIRE_ENV, '') not in ('', '0')


def which(name):
    """Path of program `name` (PATH, then /usr/sbin and /usr/bin, where
    Debian puts daemons that a non-root PATH lacks), or None when it is not
    installed or is listed in HIDE_ENV."""
    if name in os.environ.get(HIDE_ENV, '').split(','):
        return None
    return shutil.which(name) or shutil.which(name, path='/usr/sbin:/usr/bin')


def missing(*names):
    """The programs among `names` that `which` does not find."""
    return [n for n in names if which(n) is None]


def require(available, reason):
    """Skip (or, under REQUIRE_ENV, fail) the calling test unless `available`.

    Parameters
    ----------
    available : bool
        Whether the daemon or package is there.
    reason : str
        What is missing and how to install it; shown in the run's summary.
    """
    if available:
        return
    if required():
        pytest.fail(f'{reason} ({REQUIRE_ENV}=1: daemon tests must run)')
    pytest.skip(reason)


def horovod_available():
    """Horovod with MXNet support, found without importing it: importing
    horovod.mxnet into the test process would keep later tests from
    loading operator libraries (test_kernels.py: MXNet 1.9.1 dies of
    SIGFPE)."""
    import importlib.util
    if 'horovod' in os.environ.get(HIDE_ENV, '').split(','):
        return False
    try:
        return importlib.util.find_spec('horovod.mxnet') is not None
    except ImportError:
        return False


HOROVOD_MISSING = ('Horovod with MXNet support is not installed (see "Installing Horovod" in '
                   'docs/several-machines.md: it builds from source in about 8 minutes)')
