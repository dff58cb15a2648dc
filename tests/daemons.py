"""Tests that need a system daemon or a heavy optional package.

On a user's machine such a test skips with its reason when the thing is
not installed (the README's test command must pass on a fresh machine).
Under `.ci/run`, which installs every daemon and sets REQUIRE_ENV=1, a
missing one fails the test instead, so CI can never pass by skipping.
"""
import os

import pytest

REQUIRE_ENV = 'GLUON_PARALLEL_REQUIRE_DAEMONS'


def required():
    """True when a missing daemon must fail the run (CI)."""
    return os.environ.get(REQUIRE_ENV, '') not in ('', '0')


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
        pytest.fail('%s (%s=1: daemon tests must run)' % (reason, REQUIRE_ENV))
    pytest.skip(reason)
