import os

import mxnet as mx
import pytest

# A replica that never reaches a barrier should fail a test, not hang it.
os.environ.setdefault('GLUON_PARALLEL_TIMEOUT', '60')


@pytest.fixture(scope='module')
def init(tmp_path_factory):
    """A plain Gluon parameter file of random values for loops.conv_net."""
    from loops import make_init
    return make_init(str(tmp_path_factory.mktemp('init') / 'init.params'))


@pytest.fixture(scope='module')
def plain_init(tmp_path_factory):
    """Initial parameters of the dist jobs' network (dist_scripts/train_dist.py)."""
    from dist_jobs import write_init
    path = tmp_path_factory.mktemp('init') / 'plain.params'
    write_init(path, None)
    return path


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda n: f'N{n:d}')
def ctx_list(request):
    return [mx.cpu(i) for i in range(request.param)]


@pytest.fixture(params=['auto', True], ids=['auto', 'threads'])
def both_thread_modes(request, monkeypatch):
    """The test runs in both modes: 'auto' (replicas issued by the caller
    until one waits at a ParallelState) and threads=True: DataParallel and
    the test module's parallel_apply default to the mode."""
    from gluon_parallel import DataParallel, parallel_apply
    init = DataParallel.__init__
    monkeypatch.setattr(DataParallel, '__init__', lambda self, *a, **k: init(
        self, *a, **dict(k, threads=k.get('threads', request.param))))
    if hasattr(request.module, 'parallel_apply'):
        monkeypatch.setattr(request.module, 'parallel_apply', lambda *a, **k: parallel_apply(
            *a, **dict(k, threads=k.get('threads', request.param))))
    return request.param


@pytest.fixture(scope='module')
def sshd(tmp_path_factory):
    """A real sshd on a free loopback port, for the ssh launcher tests
    (tests/ssh_helpers.py)."""
    from ssh_helpers import start_sshd
    yield from start_sshd(tmp_path_factory)


@pytest.fixture(scope='module')
def two_hosts(tmp_path_factory):
    """Two network namespaces joined by a veth pair, each with its own sshd
    (tests/netns_helpers.py)."""
    from netns_helpers import start_two_hosts
    yield from start_two_hosts(tmp_path_factory)
