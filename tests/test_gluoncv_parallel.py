"""gluon_parallel.gluoncv.Parallel against GluonCV's own Parallel: the same
results and gradients for the same task; and where GluonCV's hangs (a task
that raises), ours raises in get() and goes on.
"""
import gc
import inspect
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

from gluoncv.utils import parallel as gluoncv_parallel

import gluon_parallel as gp
import rcnn_loops
from gluon_parallel import gluoncv as gp_gluoncv

CTX = [mx.cpu(0), mx.cpu(1)]


class DenseTask:
    """GluonCV's pattern: forward and backward inside the task, which
    returns its device and loss (results come in completion order)."""

    def __init__(self, net):
        self.net, self.loss = net, gluon.loss.L2Loss()
        self.threads = []

    def forward_backward(self, x):
        data, label = x
        self.threads.append(threading.current_thread())
        with autograd.record():
            loss = self.loss(self.net(data), label)
        loss.backward()
        return data.context, loss


def dense_net(seed=0, deferred=True):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(5, activation='relu', in_units=0 if deferred else 4),
            gluon.nn.Dense(2, in_units=0 if deferred else 5))
    net.initialize(mx.init.Xavier(), ctx=CTX)
    return net


def rounds(n, seed=1):
    rng = np.random.RandomState(seed)
    return [[(nd.array(rng.randn(3, 4), ctx=c), nd.array(rng.randn(3, 2), ctx=c)) for c in CTX]
            for _ in range(n)]


def run(parallel_cls, serial_init, deferred):
    """Three rounds (one input per device), gradients summed over rounds."""
    net = dense_net(deferred=deferred)
    net.collect_params().setattr('grad_req', 'add')
    task = DenseTask(net)
    parallel = parallel_cls(len(CTX), task, serial_init)
    losses = []
    for inputs in rounds(3):
        for x in inputs:
            parallel.put(x)
        got = dict(parallel.get() for _ in CTX)
        losses.append([got[c].asnumpy() for c in CTX])
    grads = {k: [g.asnumpy() for g in p.list_grad()]
             for k, p in net._collect_params_with_prefix().items()}
    if hasattr(parallel, 'close'):
        parallel.close()
    else:
        parallel.__del__()
    return losses, grads, task.threads


@pytest.mark.parametrize('serial_init,deferred', [(True, True), (False, False)])
def test_results_match_gluoncv_parallel(serial_init, deferred):
    ours, ours_grads, threads = run(gp_gluoncv.Parallel, serial_init, deferred)
    ref, ref_grads, _ = run(gluoncv_parallel.Parallel, serial_init, deferred)
    for a, b in zip(ours, ref):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    for k in ref_grads:
        for x, y in zip(ours_grads[k], ref_grads[k]):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7, err_msg=k)
    caller = threading.current_thread()
    serial = len(CTX) if serial_init else 0
    assert all(t is caller for t in threads[:serial])
    assert all(t is not caller for t in threads[serial:])


class Flaky(gp_gluoncv.Parallelizable):
    """Raises on an input whose first value is negative; records the others."""

    def __init__(self):
        self.done = []

    def forward_backward(self, x):
        if x[0].asscalar() < 0:
            raise KeyError('no box for this image')
        self.done.append(x.context)
        return x * 2


# GluonCV's dying thread reports its exception through threading.excepthook.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnhandledThreadExceptionWarning')
def test_failing_task_raises_in_get_where_gluoncv_hangs():
    # GluonCV's Parallel: the task's thread dies, get() blocks for good.
    ref = gluoncv_parallel.Parallel(2, Flaky(), serial_init=False)
    ref.put(-nd.ones(2, ctx=CTX[1]))
    waiter = threading.Thread(target=ref.get, daemon=True)
    waiter.start()
    waiter.join(2.0)
    hung = waiter.is_alive()
    ref._out_queue.put(None)        # release the waiter
    ref.__del__()                   # stop GluonCV's remaining threads
    assert hung

    task = Flaky()
    ours = gp_gluoncv.Parallel(2, task, serial_init=False)
    ours.put(nd.ones(2, ctx=CTX[0]))
    ours.put(-nd.ones(2, ctx=CTX[1]))
    with pytest.raises(KeyError) as info:     # the task's own type, as DataParallel's
        for _ in CTX:
            ours.get(timeout=60)    # the guard: a hang fails the test
    err = info.value
    assert isinstance(err, gp_gluoncv.ParallelTaskError) and err.args == ('no box for this image',)
    assert isinstance(err.exception, KeyError) and err.ctx == CTX[1] and err.index == 1
    message = str(err)
    assert 'KeyError' in message and 'cpu(1)' in message and 'no box for this image' in message
    assert 'in forward_backward' in message      # the task's traceback
    assert task.done == [CTX[0]]                 # the other task ran
    # Usable after: a new round, nothing left over from the failed one.
    for c in CTX:
        ours.put(nd.ones(2, ctx=c) * 3)
    got = sorted((o.context.device_id, o.asnumpy().tolist()) for o in
                 (ours.get(timeout=60) for _ in CTX))
    assert got == [(0, [6.0, 6.0]), (1, [6.0, 6.0])]
    with pytest.raises(RuntimeError, match='no task in flight'):
        ours.get()
    ours.close()


def test_failing_serial_task_raises_in_get_and_serial_start_goes_on():
    task = Flaky()
    ours = gp_gluoncv.Parallel(2, task)
    ours.put(-nd.ones(2, ctx=CTX[0]))
    with pytest.raises(KeyError, match=r'cpu\(0\), run in the caller') as info:
        ours.get()
    assert isinstance(info.value, gp_gluoncv.ParallelTaskError)
    for c in CTX:                   # the serial start still has two tasks to run
        ours.put(nd.ones(2, ctx=c))
    assert ours._pool.threads == []
    assert [ours.get().context for _ in CTX] == CTX
    ours.close()


def test_get_with_nothing_put_raises():
    ours = gp_gluoncv.Parallel(2, Flaky())
    with pytest.raises(RuntimeError, match='no task in flight'):
        ours.get()
    ours.put(nd.ones(1))
    ours.get()
    with pytest.raises(RuntimeError, match='no task in flight'):
        ours.get()


class Sleepy(gp_gluoncv.Parallelizable):
    def __init__(self):
        self.release = threading.Event()

    def forward_backward(self, x):
        self.release.wait(60)
        return x


def test_get_timeout():
    task = Sleepy()
    with gp_gluoncv.Parallel(2, task, serial_init=False) as ours:
        ours.put(nd.ones(1))
        with pytest.raises(TimeoutError, match='1 in flight'):
            ours.get(timeout=0.2)
        task.release.set()
        assert ours.get(timeout=60).asscalar() == 1


def test_put_on_a_device_outside_ctx_list():
    ours = gp_gluoncv.Parallel(2, Flaky(), ctx_list=CTX)
    with pytest.raises(ValueError, match=r'cpu\(2\).*ctx_list'):
        ours.put(nd.ones(1, ctx=mx.cpu(2)))
    with pytest.raises(ValueError, match='num_workers'):
        gp_gluoncv.Parallel(-1, Flaky())
    with pytest.raises(TypeError, match='forward_backward'):
        gp_gluoncv.Parallel(2, lambda x: x)


def _threads_of(ours):
    threads = ours._pool.threads
    assert len(threads) == len(CTX) and all(t.is_alive() for t in threads)
    return threads


def _one_threaded_round(ours):
    for c in CTX:
        ours.put(nd.ones(1, ctx=c))
    for _ in CTX:
        ours.get(timeout=60)


def test_close_and_del_leave_no_thread():
    ours = gp_gluoncv.Parallel(0, Flaky(), serial_init=False)
    _one_threaded_round(ours)
    assert ours._pool.threads == []     # num_workers=0: every task ran in the caller

    ours = gp_gluoncv.Parallel(2, Flaky(), serial_init=False)
    _one_threaded_round(ours)
    threads = _threads_of(ours)
    ours.close()
    ours.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match='closed'):
        ours.put(nd.ones(1))

    ours = gp_gluoncv.Parallel(2, Flaky(), serial_init=False)
    _one_threaded_round(ours)
    threads = _threads_of(ours)
    del ours
    gc.collect()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


class GradTask(gp_gluoncv.Parallelizable):
    """GluonCV's pattern with an input gradient: forward and backward
    inside the task; returns the input (to match results to puts) and the
    output."""

    def __init__(self, net):
        self.net, self.loss = net, gluon.loss.L2Loss()

    def forward_backward(self, x):
        data, label = x
        data.attach_grad()
        with autograd.record():
            out = self.net(data)
            loss = self.loss(out, label)
        loss.backward()
        return data, out


def bn_net(layer, ctx, hybridize=False, seed=0):
    """Conv -> `layer` -> ReLU -> Dense, shapes given (no deferred init)."""
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, padding=1, in_channels=2), layer(in_channels=4),
            gluon.nn.Activation('relu'), gluon.nn.Dense(3, in_units=4 * 3 * 3))
    net.initialize(mx.init.Xavier(), ctx=ctx)
    if hybridize:
        net.hybridize()
    return net


def copy_of(net, layer, ctx, tmp_path):
    """`net`'s architecture with `layer`, its parameter values, on `ctx`."""
    ref = bn_net(layer, ctx)
    path = str(tmp_path / f'net{id(ref)}.params')
    net.save_parameters(path)
    ref.load_parameters(path, ctx=ctx)
    return ref


def task_inputs(ctxs, rows, seed):
    rng = np.random.RandomState(seed)
    return [(nd.array(rng.randn(r, 2, 3, 3) + 1, ctx=c), nd.array(rng.randn(r, 3), ctx=c))
            for c, r in zip(ctxs, rows)]


def put_and_get(parallel, inputs):
    """One round: every input put, every result got; (outputs, input
    gradients) in put order."""
    for x in inputs:
        parallel.put(x)
    got = {id(data): (data, out) for data, out in (parallel.get(timeout=60) for _ in inputs)}
    return [got[id(x[0])][1].asnumpy() for x in inputs], \
        [got[id(x[0])][0].grad.asnumpy() for x in inputs]


def whole_batch_step(ref, inputs):
    """plain BatchNorm on one device, the round's whole batch: outputs and
    input gradients split as the tasks', parameter gradients."""
    data = nd.concat(*[x.as_in_context(mx.cpu(0)) for x, _ in inputs], dim=0)
    label = nd.concat(*[y.as_in_context(mx.cpu(0)) for _, y in inputs], dim=0)
    data.attach_grad()
    with autograd.record():
        out = ref(data)
        loss = gluon.loss.L2Loss()(out, label)
    loss.backward()
    bounds = np.cumsum([0] + [x.shape[0] for x, _ in inputs])
    return ([out.asnumpy()[a:b] for a, b in zip(bounds, bounds[1:])],
            [data.grad.asnumpy()[a:b] for a, b in zip(bounds, bounds[1:])],
            {k: p.grad().asnumpy() for k, p in structural(ref).items()})


def structural(net):
    return {k: p for k, p in net._collect_params_with_prefix().items() if p.grad_req != 'null'}


def summed_grads(net):
    return {k: sum(g.asnumpy() for g in p.list_grad()) for k, p in structural(net).items()}


def running_stats(net, ctx):
    bn = net[1]
    return bn.running_mean.data(ctx).asnumpy(), bn.running_var.data(ctx).asnumpy()


def train_step(ref, inputs):
    """A training step of `ref` on the inputs' concatenation (its running
    statistics updated once: MXNet's CPU BatchNorm writes them in backward)."""
    data = nd.concat(*[x.as_in_context(mx.cpu(0)) for x, _ in inputs], dim=0)
    with autograd.record():
        out = ref(data)
    out.backward()


def close(actual, expected, what, rtol=1e-4, atol=1e-5):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


ROUNDS = [pytest.param([0, 1], False, id='2 devices'),
          pytest.param([0, 1, 2], True, id='3 devices hybridized'),
          pytest.param([0, 1, 2, 3], False, id='4 devices'),
          pytest.param([0, 0, 1], False, id='two tasks on one device')]


@pytest.mark.parametrize('devices,hybridize', ROUNDS)
def test_syncbatchnorm_rounds_are_the_whole_batch_on_one_device(devices, hybridize, tmp_path):
    """After the serial start (which warns, once), each round of num_workers
    puts is one batch: outputs, input and parameter gradients, and every
    device's running statistics as plain BatchNorm on the round's whole
    batch on one device (the statistics per device: each device's copy
    saw its own tasks alone in the serial start)."""
    ctxs = [mx.cpu(i) for i in devices]
    distinct = list(dict.fromkeys(ctxs))
    net = bn_net(gp.nn.SyncBatchNorm, distinct, hybridize)
    main = copy_of(net, gluon.nn.BatchNorm, mx.cpu(0), tmp_path)
    per_device = {c: copy_of(net, gluon.nn.BatchNorm, mx.cpu(0), tmp_path) for c in distinct}
    rows = [3, 2, 4, 2][:len(ctxs)]
    with gp_gluoncv.Parallel(len(ctxs), GradTask(net)) as parallel:
        with pytest.warns(UserWarning, match='serial start') as serial:
            put_and_get(parallel, task_inputs(ctxs, rows, seed=0))
        assert sum('SyncBatchNorm' in str(w.message) for w in serial) == 1
        for c, x in zip(ctxs, task_inputs(ctxs, rows, seed=0)):
            train_step(per_device[c], [x])       # each task alone
        for step in (1, 2):
            inputs = task_inputs(ctxs, rows, seed=step)
            with warnings.catch_warnings():
                warnings.simplefilter('error', UserWarning)     # synchronised: no warning
                outs, input_grads = put_and_get(parallel, inputs)
            ref_outs, ref_input_grads, ref_grads = whole_batch_step(main, inputs)
            for i in range(len(ctxs)):
                close(outs[i], ref_outs[i], f'step {step}: task {i}\'s output', 1e-5, 1e-6)
                close(input_grads[i], ref_input_grads[i], f'step {step}: task {i}\'s input grad')
            grads = summed_grads(net)
            for k, g in ref_grads.items():
                close(grads[k], g, f'step {step}: {k}\'s gradient')
            for c in distinct:
                train_step(per_device[c], inputs)
                ref_stats = running_stats(per_device[c], mx.cpu(0))
                for a, b, what in zip(running_stats(net, c), ref_stats, ('mean', 'var')):
                    close(a, b, f'step {step}: {what} on {c}', 1e-5, 1e-6)


def test_a_partial_round_synchronises_the_tasks_put_and_a_lone_task_warns(tmp_path):
    """get() with no started task left starts the round put so far: two of
    three tasks are one batch of theirs; a round of one task cannot
    synchronise and says so."""
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = bn_net(gp.nn.SyncBatchNorm, ctxs)
    main = copy_of(net, gluon.nn.BatchNorm, mx.cpu(0), tmp_path)
    with gp_gluoncv.Parallel(3, GradTask(net), serial_init=False) as parallel:
        inputs = task_inputs(ctxs, [3, 2], seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter('error', UserWarning)
            outs, input_grads = put_and_get(parallel, inputs)
        ref_outs, ref_input_grads, ref_grads = whole_batch_step(main, inputs)
        for i in range(2):
            close(outs[i], ref_outs[i], f'task {i}\'s output', 1e-5, 1e-6)
            close(input_grads[i], ref_input_grads[i], f'task {i}\'s input grad')
        for k, g in ref_grads.items():
            close(summed_grads(net)[k], g, f'{k}\'s gradient')
        alone = task_inputs(ctxs[1:], [4], seed=1)
        with pytest.warns(UserWarning, match='its round held that task only'):
            outs, _ = put_and_get(parallel, alone)
        close(outs[0], whole_batch_step(main, alone)[0][0], 'the lone task\'s output', 1e-5, 1e-6)


def test_every_task_in_the_caller_normalises_alone_and_says_so_once(tmp_path):
    """num_workers=0 (GluonNLP's script with one device) runs every task in
    the caller: nothing to synchronise with, a warning once, BatchNorm's
    result per task."""
    net = bn_net(gp.nn.SyncBatchNorm, CTX)
    main = copy_of(net, gluon.nn.BatchNorm, mx.cpu(0), tmp_path)
    with gp_gluoncv.Parallel(0, GradTask(net)) as parallel:
        with pytest.warns(UserWarning, match='runs every task in the caller') as caught:
            for seed in (0, 1):
                inputs = task_inputs(CTX, [3, 2], seed)
                outs, _ = put_and_get(parallel, inputs)
                for i, x in enumerate(inputs):
                    close(outs[i], whole_batch_step(main, [x])[0][0], f'task {i} alone', 1e-5,
                          1e-6)
    assert sum('SyncBatchNorm' in str(w.message) for w in caught) == 1


class FailsBeforeItsNetwork(GradTask):
    """The task on cpu(1) raises before its network runs (the others wait
    for it at their SyncBatchNorm); records what each task raised."""

    def __init__(self, net):
        super().__init__(net)
        self.raised = {}

    def forward_backward(self, x):
        ctx = x[0].context
        try:
            if ctx == mx.cpu(1):
                time.sleep(0.3)         # the other task waits at the barrier by then
                raise ValueError('an image without boxes')
            return super().forward_backward(x)
        except Exception as e:
            self.raised[ctx] = e
            raise


def test_a_task_failing_in_a_synchronising_round_aborts_the_others():
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = bn_net(gp.nn.SyncBatchNorm, ctxs)
    task = FailsBeforeItsNetwork(net)
    with gp_gluoncv.Parallel(2, task, serial_init=False) as parallel:
        start = time.monotonic()
        with pytest.raises(ValueError, match='an image without boxes') as info:
            put_and_get(parallel, task_inputs(ctxs, [3, 2], seed=0))
        assert time.monotonic() - start < 30        # not the barrier's 300 s timeout
        assert isinstance(info.value, gp_gluoncv.ParallelTaskError)
        assert info.value.ctx == mx.cpu(1) and info.value.dropped == 1
        assert isinstance(task.raised[mx.cpu(0)], gp.ParallelAbort)    # woken, not finished
        outs, _ = put_and_get(parallel, task_inputs(ctxs[:1] * 2, [3, 2], seed=1))
        assert [o.shape for o in outs] == [(3, 3), (2, 3)]      # the Parallel goes on


CONTRIB_SYNCBN = '''
import sys
import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd
from gluon_parallel import gluoncv as gp_gluoncv

assert 'gluoncv' not in sys.modules, 'importing gluon_parallel.gluoncv imported GluonCV'

CTX = [mx.cpu(0), mx.cpu(1)]


class Task:
    def __init__(self, net):
        self.net = net

    def forward_backward(self, x):
        with autograd.record():
            y = self.net(x)
        y.backward()
        return y


rng = np.random.RandomState(0)
xs = [nd.array(rng.randn(4, 3, 2, 2), ctx=c) for c in CTX]
whole = nd.concat(*[x.as_in_context(CTX[0]) for x in xs], dim=0)
with autograd.train_mode():             # the whole batch on one device
    ref = nd.BatchNorm(whole, nd.ones(3), nd.zeros(3), nd.zeros(3), nd.ones(3), eps=1e-5,
                       fix_gamma=False).asnumpy()
for serial_init in (True, False):
    net = gluon.contrib.nn.SyncBatchNorm(in_channels=3, num_devices=len(CTX))
    net.initialize(ctx=CTX)
    with gp_gluoncv.Parallel(len(CTX), Task(net), serial_init) as parallel:
        for _ in range(2):              # (with serial_init, the serial start, then threads)
            for x in xs:
                parallel.put(x)
            out = {y.context: y.asnumpy() for y in (parallel.get() for _ in CTX)}
            np.testing.assert_allclose(np.concatenate([out[c] for c in CTX]), ref, rtol=1e-4,
                                       atol=1e-5)
    stats = [net.running_var.data(c).asnumpy() for c in CTX]
    np.testing.assert_allclose(stats[0], stats[1], rtol=1e-6)
print('ok')
'''


def test_mxnet_contrib_syncbatchnorm_in_tasks_as_in_gluoncv(tmp_path):
    """GluonCV's ``--norm-layer syncbn`` (MXNet's contrib SyncBatchNorm, which
    meets the other devices inside MXNet's engine): the serial start issues
    the devices' tasks without waiting for them, so they meet; each device
    is normalised with the whole batch's statistics, as with GluonCV's
    Parallel. In a subprocess (a hang fails by the timeout), which also
    shows that importing gluon_parallel.gluoncv does not import GluonCV."""
    script = tmp_path / 'contrib_syncbn.py'
    script.write_text(CONTRIB_SYNCBN)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == 'ok'


# ------------------------------------------- Faster and Mask R-CNN, as their scripts train them

@pytest.mark.parametrize('mask', [False, True], ids=['faster', 'mask'])
def test_rcnn_training_as_with_gluoncv_parallel(tmp_path, mask):
    """GluonCV's ForwardBackwardTask (Faster or Mask R-CNN), two images of
    different sizes a step, through our Parallel and GluonCV's: the serial
    start's step compares whole (losses, every gradient), the threaded step
    the RPN's losses and gradients (rcnn_loops says why), and its other
    losses are finite."""
    params = str(tmp_path / 'rcnn.params')
    net = rcnn_loops.rcnn_net(mask=mask)
    net.save_parameters(params)
    inputs = rcnn_loops.rcnn_inputs(net, steps=2, mask=mask)
    ours = rcnn_loops.rcnn_train(gp_gluoncv, params, inputs, CTX, mask=mask)
    ref = rcnn_loops.rcnn_train(gluoncv_parallel, params, inputs, CTX, mask=mask)
    (serial_metrics, threaded_metrics), (serial_grads, threaded_grads), _ = ours
    assert np.array(serial_metrics).shape == (len(CTX), 5 if mask else 4)
    np.testing.assert_allclose(serial_metrics, ref[0][0], rtol=1e-5, atol=1e-7)
    for k, g in ref[1][0].items():
        np.testing.assert_allclose(serial_grads[k], g, rtol=1e-4, atol=1e-7, err_msg=k)
    rpn = [k for k in threaded_grads if k.startswith('rpn.')]
    assert len(rpn) == 6
    for k in rpn:
        np.testing.assert_allclose(threaded_grads[k], ref[1][1][k], rtol=1e-4, atol=1e-7,
                                   err_msg=k)
    np.testing.assert_allclose(np.array(threaded_metrics)[:, :2], np.array(ref[0][1])[:, :2],
                               rtol=1e-5, atol=1e-7)
    assert np.isfinite(threaded_metrics).all()


# ------------------------------------------- GluonNLP's Parallel (its BERT pretraining script's)

def _gluonnlp():
    try:
        import gluonnlp
    except Exception as e:      # not built here (it needs Cython and a compiler)
        pytest.skip(f'gluonnlp is not importable: {type(e).__name__}: {e}')
    return gluonnlp


def tiny_bert(nlp, params=None):
    """GluonNLP's BERTModel with the next-sentence classifier, as its
    constructors build it (no dropout: both contenders draw nothing)."""
    encoder = nlp.model.BERTEncoder(num_layers=1, units=16, hidden_size=32, max_length=12,
                                    num_heads=2, dropout=0.0)
    net = nlp.model.BERTModel(encoder, vocab_size=20, token_type_vocab_size=2, units=16,
                              embed_size=16, use_pooler=True, use_decoder=False,
                              use_classifier=True)
    if params is None:
        mx.random.seed(0)
        net.initialize(mx.init.Normal(0.02), ctx=CTX)
        ones = nd.ones((1, 12), ctx=CTX[0])
        net(ones, ones, nd.ones(1, ctx=CTX[0]))       # (predict mode) the deferred shapes
    else:
        net.load_parameters(params, ctx=CTX)
    net.hybridize()
    return net


def nlp_task(nlp, net):
    """The pattern of GluonNLP's run_pretraining.py: a Parallelizable whose
    forward_backward records the loss, calls backward and returns it."""
    class ParallelBERT(nlp.utils.Parallelizable):
        def __init__(self, model, rescale_factor):
            self._model, self._rescale = model, rescale_factor
            self._loss = gluon.loss.SoftmaxCELoss()

        def forward_backward(self, x):
            tokens, types, valid_length, label = x
            with autograd.record():
                _, _, classified = self._model(tokens, types, valid_length)
                ls = self._loss(classified, label).sum() / self._rescale
            ls.backward()
            return ls
    return ParallelBERT(net, rescale_factor=8)


def nlp_steps(steps, seed=0):
    rng = np.random.RandomState(seed)
    return [[(nd.array(rng.randint(0, 20, (4, 12)), ctx=c), nd.array(rng.randint(0, 2, (4, 12)),
                                                                        ctx=c),
              nd.array(rng.randint(3, 13, 4), ctx=c), nd.array(rng.randint(0, 2, 4), ctx=c))
             for c in CTX] for _ in range(steps)]


def run_nlp(parallel_cls, nlp, params):
    """The script's loop: per step, one input per device put, len(ctx)
    losses got, the gradients (summed over devices) read, a Trainer step."""
    net = tiny_bert(nlp, params)
    trainer = gluon.Trainer(net.collect_params(), 'adam', {'learning_rate': 1e-3})
    parallel = parallel_cls(len(CTX), nlp_task(nlp, net))
    losses, grads = [], []
    for step in nlp_steps(3):
        for x in step:
            parallel.put(x)
        losses.append(sorted((ls.context.device_id, ls.asscalar()) for ls in
                             (parallel.get() for _ in CTX)))
        grads.append({k: sum(g.asnumpy() for g in p.list_grad()) for k, p in
                      net._collect_params_with_prefix().items() if p.grad_req != 'null'})
        trainer.step(1)
    parallel.__del__()
    return losses, grads


def test_gluonnlp_parallel_drop_in(tmp_path):
    """gluonnlp.utils.Parallel and Parallelizable are GluonCV's (the same
    signatures and code): ours replaces them by the import line, with the
    same losses and gradients over three steps (the serial start, then two
    threaded rounds) of a BERT through GluonNLP's pretraining pattern."""
    nlp = _gluonnlp()
    from gluonnlp.utils import parallel as nlp_parallel
    for name in ('Parallel', 'Parallelizable'):
        theirs, cv = getattr(nlp_parallel, name), getattr(gluoncv_parallel, name)
        assert inspect.signature(theirs) == inspect.signature(cv)
        for method in ('put', 'get', 'forward_backward'):
            if hasattr(cv, method):
                assert inspect.getsource(getattr(theirs, method)) == \
                    inspect.getsource(getattr(cv, method))
    params = str(tmp_path / 'bert.params')
    tiny_bert(nlp).save_parameters(params)
    ours = run_nlp(gp_gluoncv.Parallel, nlp, params)
    ref = run_nlp(nlp.utils.Parallel, nlp, params)
    for step, (a, b) in enumerate(zip(ours[0], ref[0])):
        np.testing.assert_allclose([v for _, v in a], [v for _, v in b], rtol=1e-5, atol=1e-7,
                                   err_msg=f'step {step}')
    for step, (a, b) in enumerate(zip(ours[1], ref[1])):
        assert a.keys() == b.keys()
        for k in b:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-7,
                                       err_msg=f'step {step}: {k}')
