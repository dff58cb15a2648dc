"""replica_context.py: the thread's current replica, the call's states, the
default timeout and the naming of a failing replica."""
import mxnet as mx
import pytest

from gluon_parallel import current_replica, default_timeout
from gluon_parallel.replica_context import ParallelCall, ReplicaContext, annotate


def test_current_replica_nests_and_unwinds():
    call = ParallelCall([mx.cpu(0), mx.cpu(1)])
    outer, inner = ReplicaContext(0, call), ReplicaContext(1, call)
    assert current_replica() is None
    with outer:
        with inner:
            assert current_replica() is inner
            with inner:                   # the same one again
                assert current_replica() is inner
            assert current_replica() is inner
        assert current_replica() is outer
    assert current_replica() is None


def test_next_state_gives_each_use_its_own_round():
    call = ParallelCall([mx.cpu(0), mx.cpu(1)])
    a, b = ReplicaContext(0, call), ReplicaContext(1, call)
    first, second = a.next_state('layer', sum), a.next_state('layer', sum)
    assert first is not second
    assert b.next_state('layer', sum) is first and b.next_state('layer', sum) is second
    assert len(first) == 2


def test_a_call_knows_its_devices_count_and_shared_devices():
    c0, c1 = mx.cpu(0), mx.cpu(1)
    call = ParallelCall([c0], [c0, c1])
    assert call.num_devices == 2 and not call.synchronised
    call.state('layer', sum)
    assert call.synchronised
    assert ParallelCall([c0, c1], num_devices=4).num_devices == 4
    assert ParallelCall([c0, c1, c0, c0]).second_on_device == {2, 3}


@pytest.mark.parametrize('value, expected', [('', 300.0), ('12.5', 12.5), ('0', None),
                                             ('none', None)])
def test_default_timeout_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv('GLUON_PARALLEL_TIMEOUT', value)
    assert default_timeout() == expected


def test_annotate_names_replica_and_device_keeping_the_type():
    e = annotate(KeyError('k'), 2, mx.cpu(2))
    assert isinstance(e, KeyError) and 'in replica 2 on cpu(2)' in str(e)
    e = annotate(ValueError(), 1, mx.cpu(1))
    assert str(e) == 'in replica 1 on cpu(1)'
