import os

import pytest

# A replica that never reaches a barrier should fail a test, not hang it.
os.environ.setdefault('GLUON_PARALLEL_TIMEOUT', '60')


@pytest.fixture(scope='module')
def init(tmp_path_factory):
    """A plain Gluon parameter file of random values for loops.conv_net."""
    from loops import make_init
    return make_init(str(tmp_path_factory.mktemp('init') / 'init.params'))
