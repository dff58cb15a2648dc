"""workers.py: the persistent worker pool, tested with plain callables."""
import subprocess
import sys
import textwrap
import threading
import traceback

import mxnet as mx
import pytest
from mxnet import autograd, nd

from gluon_parallel import WorkerPool, current_replica
from gluon_parallel.workers import Job
from replicas import ReplicaBoom


@pytest.fixture
def pool(ctx_list):
    with WorkerPool(ctx_list) as p:
        p.run(lambda: None, nothing_args(len(ctx_list)))     # its threads started
        yield p


def nothing_args(n):
    return [()] * n


class Interrupt(BaseException):
    """Like KeyboardInterrupt: not an Exception subclass."""


def test_results_in_context_order_each_on_its_context(pool, ctx_list):
    n = len(ctx_list)
    # a barrier every replica must reach: fails if replicas ran one by one
    barrier = threading.Barrier(n, timeout=30)

    def job(i):
        barrier.wait()
        rep = current_replica()
        x = nd.ones((2,)) * i          # created on the thread's current context
        return i, mx.current_context(), x.context, rep.rank, rep.size, threading.get_ident()

    out = pool.run(job, [(i,) for i in range(n)])
    assert [o[0] for o in out] == list(range(n))
    assert [o[1] for o in out] == ctx_list
    assert [o[2] for o in out] == ctx_list
    assert [o[3] for o in out] == list(range(n))
    assert [o[4] for o in out] == [n] * n
    assert len({o[5] for o in out}) == n          # one thread per replica
    assert current_replica() is None              # nothing leaks into the caller


def test_list_of_callables_and_kwargs(pool, ctx_list):
    n = len(ctx_list)

    def replica_fn(k):
        return lambda x, scale: (k, x * scale)
    fns = [replica_fn(k) for k in range(n)]
    out = pool.run(fns, [(nd.ones((1,), ctx=c),) for c in ctx_list],
                   [{'scale': k + 1} for k in range(n)])
    assert [o[0] for o in out] == list(range(n))
    assert [o[1].asscalar() for o in out] == [k + 1.0 for k in range(n)]


def test_fewer_replicas_than_contexts_and_too_many(pool, ctx_list):
    n = len(ctx_list)
    out = pool.run(lambda: mx.current_context(), nothing_args(1))
    assert out == [ctx_list[0]]
    with pytest.raises(ValueError):
        pool.run(lambda: None, nothing_args(n + 1))
    with pytest.raises(ValueError):
        pool.run(lambda: None, [])


# Each case: (context manager factory, expected (is_recording, is_training)).
AUTOGRAD_STATES = {
    'plain': (lambda: _Null(), (False, False)),
    'record': (lambda: autograd.record(), (True, True)),
    'record_predict': (lambda: autograd.record(train_mode=False), (True, False)),
    'train_mode': (lambda: autograd.train_mode(), (False, True)),
    'predict_mode': (lambda: autograd.predict_mode(), (False, False)),
    'pause_in_record': (lambda: _Nested(autograd.record(), autograd.pause()), (False, False)),
    'pause_train': (lambda: _Nested(autograd.record(), autograd.pause(train_mode=True)),
                    (False, True)),
}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Nested:
    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        self.inner.__enter__()

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        self.outer.__exit__(*exc)


def test_caller_autograd_state_holds_in_every_worker(pool, ctx_list):
    n = len(ctx_list)
    # Several states in a row on the same threads: a worker must take the
    # state of each call, not keep the previous one.
    order = ['record', 'plain', 'train_mode', 'record_predict', 'predict_mode',
             'pause_in_record', 'record', 'pause_train', 'plain']
    for name in order:
        make, expected = AUTOGRAD_STATES[name]
        with make():
            out = pool.run(lambda: (autograd.is_recording(), autograd.is_training()),
                           nothing_args(n))
        assert out == [expected] * n, name


@pytest.mark.parametrize('exc_type', [ValueError, ReplicaBoom, KeyError, Interrupt,
                                      KeyboardInterrupt])
def test_exception_in_one_worker_reaches_the_caller(pool, ctx_list, exc_type):
    n = len(ctx_list)
    bad = min(2, n - 1)                     # the 3rd context when there is one
    threads_before = set(threading.enumerate())

    def fails_on_one_context(i):
        if mx.current_context() == ctx_list[bad]:
            raise exc_type(f'replica {i:d} broke')
        return i

    with pytest.raises(exc_type) as info:
        pool.run(fails_on_one_context, [(i,) for i in range(n)])
    text = ''.join(traceback.format_exception(info.value))
    assert str(ctx_list[bad]) in text
    if exc_type is not KeyError:            # KeyError's str() is the repr of its arg
        assert str(ctx_list[bad]) in str(info.value)
        assert f'replica {bad:d} broke' in str(info.value)
    # the replica's own frame, not only the caller's re-raise
    assert 'fails_on_one_context' in text
    assert "raise exc_type(f'replica {i:d} broke')" in text

    # nothing left behind: same threads, all alive, the next call works
    assert set(threading.enumerate()) == threads_before
    assert all(t.is_alive() for t in pool.threads)
    assert pool.run(lambda i: i * 10, [(i,) for i in range(n)]) == [10 * i for i in range(n)]


def test_every_replica_failing_reports_one_and_recovers(pool, ctx_list):
    n = len(ctx_list)

    def always(i):
        raise ReplicaBoom(f'rank {i:d}')

    with pytest.raises(ReplicaBoom):
        pool.run(always, [(i,) for i in range(n)])
    assert pool.run(lambda: 1, nothing_args(n)) == [1] * n


def test_close_stops_threads_and_further_runs_raise(ctx_list):
    before = set(threading.enumerate())
    p = WorkerPool(ctx_list)
    assert set(threading.enumerate()) == before       # started by the first hand-off
    p.run(lambda: None, nothing_args(len(ctx_list)))
    created = set(threading.enumerate()) - before
    assert len(created) == len(ctx_list) - 1          # the caller runs replica 0
    assert all(t.daemon for t in created)
    p.close()
    assert p.closed
    assert not any(t.is_alive() for t in created)
    with pytest.raises(RuntimeError):
        p.run(lambda: None, nothing_args(1))
    p.close()                                         # idempotent


def test_context_manager_closes(ctx_list):
    before = set(threading.enumerate())
    with WorkerPool(ctx_list) as p:
        created = set(threading.enumerate()) - before
        p.run(lambda: None, nothing_args(len(ctx_list)))
    assert p.closed
    assert not any(t.is_alive() for t in created)


EXIT_SCRIPT = textwrap.dedent('''
    import mxnet as mx
    from mxnet import gluon, nd
    import gluon_parallel as gp

    ctx = [mx.cpu(i) for i in range(4)]
    net = gluon.nn.Dense(3)
    net.initialize(ctx=ctx)
    dp = gp.DataParallel(net, ctx)
    out = dp(nd.ones((8, 5)))            # outputs deliberately never read

    class Boom(gluon.Block):
        def forward(self, x):
            if x.context == ctx[2]:
                raise ValueError('boom')
            return x
    failing = gp.DataParallel(Boom(), ctx)
    try:
        failing(nd.ones((4, 1)))
    except ValueError:
        pass
    gp.parallel_apply(lambda x: x * 2, [nd.ones((1,), ctx=c) for c in ctx])
    print('done', len(out), flush=True)
    # no close(): the interpreter must still exit on its own
''')


def test_interpreter_exits_with_unclosed_pools(tmp_path):
    script = tmp_path / 'unclosed.py'
    script.write_text(EXIT_SCRIPT)
    # A pool that keeps the interpreter alive makes this hit the timeout.
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == 'done 4'


def test_nested_parallel_call_keeps_the_outer_replica_context():
    """A parallel call made inside a replica must leave the outer replica's
    context in place (else SyncBatchNorm after it would run unsynchronised)."""
    import gluon_parallel as gp
    outer = [mx.cpu(0), mx.cpu(1)]
    inner = [mx.cpu(2), mx.cpu(3)]
    seen = {}

    def replica(x):
        before = gp.current_replica()
        gp.parallel_apply(lambda y: y * 2, [nd.ones(1, ctx=c) for c in inner], ctx_list=inner)
        after = gp.current_replica()
        seen[before.rank] = (before is after, after.rank if after else None)
        return x

    pool = WorkerPool(outer)
    try:
        pool.run(replica, [(nd.ones(1, ctx=c),) for c in outer])
    finally:
        pool.close()
    assert seen == {0: (True, 0), 1: (True, 1)}


# ---------------------------------------------- threads='auto' (the default of DataParallel)

def test_auto_runs_in_the_caller_and_creates_no_thread(ctx_list):
    n = len(ctx_list)
    before = set(threading.enumerate())
    with WorkerPool(ctx_list) as p:
        def job(i):
            rep = current_replica()
            x = nd.ones((2,)) * i
            return mx.current_context(), x.context, rep.rank, rep.size, threading.get_ident()

        from gluon_parallel.replica_context import ParallelCall
        call = ParallelCall(ctx_list)
        out = p.run(job, [(i,) for i in range(n)], call=call, threads='auto')
        assert [o[0] for o in out] == ctx_list
        assert [o[1] for o in out] == ctx_list
        assert [o[2] for o in out] == list(range(n))
        assert [o[3] for o in out] == [n] * n
        assert {o[4] for o in out} == {threading.get_ident()}
        assert not call.used_threads and p.threads == []
        assert set(threading.enumerate()) == before
        assert current_replica() is None


@pytest.mark.parametrize('first_waiter', [0, 1])
def test_auto_hands_the_rest_to_threads_when_a_replica_waits(first_waiter):
    """A replica that waits at a ParallelState (here one the user made, not
    one of the call) needs the replicas after it: they move to the workers.
    Replicas before the first waiter ran in the caller already."""
    from gluon_parallel import ParallelState
    from gluon_parallel.replica_context import ParallelCall
    ctx_list = [mx.cpu(i) for i in range(4)]
    state = ParallelState(4 - first_waiter, lambda *v: sum(v), timeout=30)
    caller = threading.get_ident()

    def job(i):
        total = None
        if i >= first_waiter:
            total = state.pull(state.push(i + 1, i - first_waiter))
        return total, threading.get_ident()

    with WorkerPool(ctx_list) as p:
        call = ParallelCall(ctx_list)
        out = p.run(job, [(i,) for i in range(4)], call=call, threads='auto')
        expected = sum(range(first_waiter + 1, 5))
        assert [o[0] for o in out] == [None] * first_waiter + [expected] * (4 - first_waiter)
        in_caller = [o[1] == caller for o in out]
        assert in_caller == [True] * (first_waiter + 1) + [False] * (3 - first_waiter)
        assert call.used_threads and len(p.threads) == 3
        assert len({o[1] for o in out}) == 4 - first_waiter


def test_auto_waiter_whose_partners_already_returned_times_out():
    # Replica 1 waits for replica 0, which ran before it and never pushed:
    # a program error that must end in a TimeoutError, not a hang.
    from gluon_parallel import ParallelState
    ctx_list = [mx.cpu(0), mx.cpu(1)]
    state = ParallelState(2, lambda *v: sum(v), timeout=1)

    def job(i):
        if i == 1:
            state.pull(state.push(i, 1))
        return i

    with WorkerPool(ctx_list) as p:
        with pytest.raises(TimeoutError, match=r'parties \[0\] never arrived.*cpu\(1\)'):
            p.run(job, [(0,), (1,)], threads='auto')
        assert p.run(lambda i: i, [(0,), (1,)], threads='auto') == [0, 1]


def test_auto_error_stops_later_replicas_and_sync_waits(ctx_list):
    n = len(ctx_list)
    ran = []

    def job(i):
        ran.append(i)
        if i == n - 1 and n > 1:
            raise ReplicaBoom(f'replica {i:d}')
        return nd.ones((3,)) * i

    with WorkerPool(ctx_list) as p:
        if n > 1:
            with pytest.raises(ReplicaBoom, match=fr'replica {n - 1:d} \[in replica {n - 1:d} on '
                                                  fr'cpu\({n - 1:d}\)\]'):
                p.run(job, [(i,) for i in range(n)], threads='auto')
            assert ran == list(range(n))
        ran.clear()
        out = p.run(lambda i: nd.ones((3,)) * i, [(i,) for i in range(n)], sync=True,
                    threads='auto')
        assert [o.asnumpy().tolist() for o in out] == [[i] * 3 for i in range(n)]
        assert p.threads == []


NESTED_SAME_CONTEXTS = textwrap.dedent('''
    import sys
    import mxnet as mx
    from mxnet import nd
    import gluon_parallel as gp

    ctx = [mx.cpu(0), mx.cpu(1), mx.cpu(2)]
    threads = sys.argv[1] == 'threads'

    def inner(y):
        return y * 2

    def outer(x):
        # the same contexts as the call this replica belongs to
        ys = gp.parallel_apply(inner, [nd.ones(1, ctx=c) * x.asscalar() for c in ctx],
                               ctx_list=ctx, threads=True if threads else 'auto')
        return sum(y.asscalar() for y in ys)

    out = gp.parallel_apply(outer, [nd.ones(1, ctx=c) * (i + 1) for i, c in enumerate(ctx)],
                            ctx_list=ctx, threads=True if threads else 'auto')
    print(out, flush=True)
''')


@pytest.mark.parametrize('mode', ['auto', 'threads'])
def test_nested_parallel_apply_on_the_same_contexts_does_not_deadlock(tmp_path, mode):
    # The outer call holds its pool until its replicas return; the inner
    # call (same contexts) must not wait for that pool. In a subprocess: a
    # deadlock fails the test by its timeout instead of hanging the session.
    script = tmp_path / 'nested.py'
    script.write_text(NESTED_SAME_CONTEXTS)
    proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str([6.0 * k for k in (1, 2, 3)])


def test_a_worker_for_every_context_added_as_they_come():
    """first_worker=0 (gluoncv.Parallel's pool): every context has a worker,
    results come under the submitter's key, contexts join while running."""
    job = Job(lambda: (mx.current_context(), threading.current_thread()), (), {}, False, False,
              None, False)
    with WorkerPool([mx.cpu(0)], first_worker=0) as p:
        with pytest.raises(RuntimeError, match='first_worker=1'):
            p.run(lambda: None, [()])
        p.submit(0, job, key='a')
        assert p.add_context(mx.cpu(1)) == 1
        p.submit(1, job, key='b')
        got = {r.key: r.value for r in (p.result(timeout=30) for _ in range(2))}
        assert [got[k][0] for k in 'ab'] == [mx.cpu(0), mx.cpu(1)]
        assert [got[k][1] for k in 'ab'] == p.threads and len(p.threads) == 2
    assert not any(t.is_alive() for t in p.threads)
    with pytest.raises(ValueError, match='first_worker'):
        WorkerPool([mx.cpu(0)], first_worker=2)
