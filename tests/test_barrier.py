"""ParallelState: the N-party rendezvous, tested with plain threads."""
import threading
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, nd

from gluon_parallel import ParallelState


def run_parties(n, fn, join=30):
    """Run fn(i) in n threads; return (results, errors) indexed by party."""
    results, errors = [None] * n, [None] * n

    def target(i):
        try:
            results[i] = fn(i)
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join)
    assert not any(t.is_alive() for t in threads), 'a party is still blocked'
    return results, errors


@pytest.mark.parametrize('n', [2, 3, 5, 8])
def test_rounds_reuse_one_state_and_run_the_op_once(n):
    calls = []

    def op(*values):
        calls.append(values)
        return sum(values)

    state = ParallelState(n, op)
    rounds = 200

    def party(i):
        out = []
        for r in range(rounds):
            idx = state.push(r * 100 + i)
            out.append(state.pull(idx))
        return out

    results, errors = run_parties(n, party)
    assert errors == [None] * n
    expected = [sum(r * 100 + i for i in range(n)) for r in range(rounds)]
    for res in results:
        assert res == expected
    assert len(calls) == rounds
    for r, values in enumerate(calls):
        assert sorted(values) == [r * 100 + i for i in range(n)]


def test_list_result_gives_each_party_its_entry_and_tuple_goes_whole():
    n = 4
    lst = ParallelState(n, lambda *v: [x * 10 for x in v])
    tup = ParallelState(n, lambda *v: tuple(v))

    def party(i):
        a = lst.pull(lst.push(i, idx=i))
        b = tup.pull(tup.push(i, idx=i))
        return a, b

    results, errors = run_parties(n, party)
    assert errors == [None] * n
    for i, (a, b) in enumerate(results):
        assert a == i * 10
        assert b == (0, 1, 2, 3)


def test_list_of_wrong_length_goes_whole():
    state = ParallelState(2, lambda *v: [1, 2, 3])
    results, errors = run_parties(2, lambda i: state.pull(state.push(i)))
    assert results == [[1, 2, 3], [1, 2, 3]]


def test_len_and_push_order_indices():
    state = ParallelState(3, lambda *v: list(v))
    assert len(state) == 3
    assert state.push('a') == 0
    assert state.push('b') == 1
    assert state.push('c', idx=2) == 2
    assert [state.pull(i) for i in range(3)] == ['a', 'b', 'c']


def test_timeout_names_the_missing_party():
    state = ParallelState(3, lambda *v: sum(v), timeout=0.3)

    def party(i):
        return state.pull(state.push(i, idx=i))

    start = time.monotonic()
    results, errors = run_parties(2, party)    # party 2 never arrives
    assert time.monotonic() - start < 10
    for e in errors:
        assert isinstance(e, TimeoutError)
        assert '[2]' in str(e)


def test_abort_wakes_every_waiter_with_the_error():
    state = ParallelState(4, lambda *v: sum(v))
    boom = ValueError('boom')
    started = threading.Barrier(4)

    def party(i):
        if i == 3:
            started.wait()
            time.sleep(0.2)
            state.abort(boom)
            return 'aborter'
        started.wait()
        return state.pull(state.push(i))

    results, errors = run_parties(4, party)
    assert results[3] == 'aborter'
    assert errors[:3] == [boom, boom, boom]
    # Stays aborted until reset, then works again.
    with pytest.raises(ValueError):
        state.push(1)
    state.reset()
    results, errors = run_parties(4, lambda i: state.pull(state.push(i)))
    assert results == [6, 6, 6, 6]


def test_operation_error_reaches_every_party():
    def op(*v):
        raise KeyError('bad op')

    state = ParallelState(3, op)
    results, errors = run_parties(3, lambda i: state.pull(state.push(i)))
    assert all(isinstance(e, KeyError) for e in errors)


def test_fast_party_waits_for_the_round_to_drain():
    # A party that races ahead into round k+1 must not overwrite round k.
    n, rounds = 3, 50
    state = ParallelState(n, lambda *v: list(v))

    def party(i):
        got = []
        for r in range(rounds):
            idx = state.push((r, i), idx=i)
            if i == 0:
                time.sleep(0.001)     # the slow puller
            got.append(state.pull(idx))
        return got

    results, errors = run_parties(n, party)
    assert errors == [None] * n
    for i, got in enumerate(results):
        assert got == [(r, i) for r in range(rounds)]


def test_bad_arguments():
    with pytest.raises(ValueError):
        ParallelState(0, sum)
    with pytest.raises(TypeError):
        ParallelState(2, 'not callable')


def test_differentiable_through_recorded_operations():
    """Two devices each push x_i; the op sums on cpu(0) and returns the sum to
    each device; each party's loss is sum_i * w_i. d/dx_j = sum_i w_i."""
    ctxs = [mx.cpu(0), mx.cpu(1)]
    xs = [nd.array([1.0, 2.0], ctx=c) for c in ctxs]
    ws = [2.0, 3.0]
    for x in xs:
        x.attach_grad()

    def op(*vals):
        total = nd.add_n(*[v.as_in_context(ctxs[0]) for v in vals])
        return [total.as_in_context(v.context) for v in vals]

    state = ParallelState(2, op)
    losses = [None, None]

    def party(i):
        with autograd.record():
            y = state.pull(state.push(xs[i] * 1.0, idx=i))
            losses[i] = (y * ws[i]).sum()

    results, errors = run_parties(2, party)
    assert errors == [None, None]
    autograd.backward(losses)
    for x in xs:
        np.testing.assert_allclose(x.grad.asnumpy(), [5.0, 5.0])
        assert x.grad.context == x.context
