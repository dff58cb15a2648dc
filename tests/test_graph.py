"""Graph mode (gluon_parallel/graph): a hybridized block's replicas run as
one multi-device executor graph. Every test compares against an independent
run: plain Gluon on one context with the whole batch, or the per-replica
path (graph=False) on the same contexts."""
import subprocess
import sys
import threading

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import gluon_parallel as gp
import children
import loops
import soaking
from graph_helpers import HERE, bn_net, identity, mixed_bn_net, run_steps, steps_both_modes

CTX = loops.CTX


def test_graph_mode_runs_one_executor_per_signature(monkeypatch):
    """Three steps of one batch size bind one executor; no replica runs on
    the worker pool and no per-device CachedOp runs (the warm-up builds the
    graph without running it)."""
    from gluon_parallel import workers
    calls = []
    monkeypatch.setattr(workers.WorkerPool, 'run', lambda *a, **k: calls.append(a))
    cached = []
    original = gluon.HybridBlock._call_cached_op
    monkeypatch.setattr(gluon.HybridBlock, '_call_cached_op',
                        lambda self, *a: cached.append(self) or original(self, *a))
    net, dp, _ = run_steps(bn_net(), CTX, [8], graph=True)
    run_steps(net, CTX, [8, 8], dp=dp)
    assert dp.graph_mode.binds == 1
    assert calls == [] and cached == []
    run_steps(net, CTX, [7], graph=True, dp=dp)          # uneven: a second signature
    assert dp.graph_mode.binds == 2


def test_each_whole_input_is_copied_in_once_without_slices(monkeypatch):
    """After the first call, a step copies the batch and the targets into
    the executors once each, whatever the device count, and makes no
    slices; the executors copy each replica's rows to its device. The
    parameters equal the per-replica path's, also with the batch on a
    context that is not a replica's (one executor per such context)."""
    from gluon_parallel import _gluon
    copied, sliced = [], []
    copy_into, row_slices = _gluon.copy_into, _gluon.row_slices

    def copy_counted(srcs, dsts):
        srcs = list(srcs)
        copied.extend(srcs)
        copy_into(srcs, dsts)
    monkeypatch.setattr(_gluon, 'copy_into', copy_counted)
    monkeypatch.setattr(_gluon, 'row_slices', lambda *a: sliced.append(a) or row_slices(*a))
    dp, dl = gp.DataParallel(bn_net(), CTX, graph=True), gp.DataParallelLoss(loops.LOSS)
    for b in (8, 7, 8, 7):              # the first two bind (and slice their arrays)
        if b == 8:
            del copied[:], sliced[:]
        x, y = nd.ones((b, 2, 8, 8)), nd.ones(b)
        with autograd.record():
            losses = dl(dp(x), y)
        autograd.backward(losses)
    assert [c.shape[0] for c in copied] == [8, 8, 7, 7]     # x, y of the last two steps
    assert sliced == [] and dp.graph_mode.binds == 2

    def on(ctx):
        def steps(graph):
            net = bn_net()
            net.collect_params().reset_ctx(CTX[:2])
            dp = gp.DataParallel(net, CTX[:2], graph=graph)
            trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
            dl = gp.DataParallelLoss(loops.LOSS)
            rng = np.random.RandomState(3)
            for b in (8, 8, 5):
                x = nd.array(rng.normal(size=(b, 2, 8, 8)), ctx=ctx)
                y = nd.array(rng.randint(0, 3, b), ctx=ctx)
                with autograd.record():
                    losses = dl(dp(x), y)
                autograd.backward(losses)
                trainer.step(b)
            return dp, [p.data(c).asnumpy() for p in net.collect_params().values()
                        for c in CTX[:2]]
        (_, ref), (dp, got) = steps(False), steps(True)
        assert dp.graph_mode.binds == 2
        for a, b in zip(ref, got):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    on(CTX[3])
    on(CTX[1])


def test_graph_false_keeps_the_per_replica_path():
    net, dp, _ = run_steps(bn_net(), CTX, [8], graph=False)
    assert dp.graph_mode is None
    net2, dp2, _ = run_steps(bn_net(), CTX, [8])           # 'auto' on a hybridized block
    assert dp2.graph_mode.binds == 1
    dp3 = gp.DataParallel(net2, CTX)                       # the default is 'auto'
    with autograd.record():
        dp3(nd.ones((8, 2, 8, 8)))
    assert dp3.graph_mode.binds == 1


def test_auto_leaves_plain_blocks_per_replica():
    net = bn_net(hybridize=False)
    _, dp, _ = run_steps(net, CTX, [8])
    assert dp.graph_mode.binds == 0


def test_graph_true_names_the_reason():
    net = bn_net(hybridize=False)
    with pytest.raises(ValueError, match='not a hybridized HybridBlock'):
        run_steps(net, CTX, [8], graph=True)


@pytest.mark.parametrize('n', [1, 2, 4])
@pytest.mark.parametrize('sizes', [[8, 8], [7, 5], [3, 2]], ids=['even', 'uneven', 'short'])
def test_identical_to_one_device_whole_batch(init, n, sizes):
    """No BatchNorm (its statistics are per device): every device count
    gives the single-device whole-batch parameters; a batch smaller than
    the device count runs on fewer devices and the idle ones' stale
    gradients are not summed."""
    batches = loops.make_batches(sizes)
    ref = loops.reference(init, batches, bn=identity)
    got, net, _ = loops.parallel(init, batches, n, bn=identity, hybridize=True, graph=True)
    loops.assert_same(got, ref)


@pytest.mark.parametrize('sizes', [[8, 8, 8], [7, 3, 5]], ids=['even', 'uneven'])
def test_batchnorm_equals_the_per_replica_path(sizes):
    """Parameters, gradients and running statistics (read right after each
    step, as a checkpoint would) equal the per-replica path's."""
    a, b = steps_both_modes(bn_net, CTX, sizes)
    for step_a, step_b in zip(a, b):
        for k in step_a:
            np.testing.assert_allclose(step_a[k], step_b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_running_statistics_of_mixed_and_reused_batchnorms():
    """Layers with different eps and momentum, and a layer used twice per
    call: every context's running statistics equal the per-replica path's
    after each step (MXNet updates a layer's statistics in its backward
    pass: the last use first)."""
    a, b = steps_both_modes(mixed_bn_net, CTX, [8, 7, 8])
    for step_a, step_b in zip(a, b):
        for k in step_a:
            np.testing.assert_allclose(step_a[k], step_b[k], rtol=1e-5, atol=1e-6, err_msg=k)
        assert any('running' in k for k in step_a)


def test_gradient_accumulation_and_frozen_parameters(init):
    """grad_req='add' over two batches per step; a frozen layer stays."""
    batches = loops.make_batches([6, 6, 6, 6])

    def freeze(net):
        net[0].collect_params().setattr('grad_req', 'null')
        for p in net.collect_params().values():
            if p.grad_req != 'null':
                p.grad_req = 'add'
    ref = loops.reference(init, batches, bn=identity, setup=freeze, micro=2)
    got, net, _ = loops.parallel(init, batches, 4, bn=identity, setup=freeze, micro=2,
                                 hybridize=True, graph=True)
    loops.assert_same(got, ref)
    init_values = nd.load(init)
    np.testing.assert_array_equal(got['0.weight'][0], init_values['0.weight'].asnumpy())


def _grads_of_two_losses(graph, x1, x2, kept=0):
    """Parameter gradients after two recorded calls and one backward over
    both losses (after `kept` recorded calls whose backward never comes)."""
    net = bn_net()
    dp = gp.DataParallel(net, CTX, graph=graph)
    with autograd.record():
        for _ in range(kept):
            [o.asnumpy() for o in dp(x2)]
        losses = [o.sum() for o in dp(x1)] + [(o * o).sum() for o in dp(x2)]
    autograd.backward(losses)
    return {name: [g.asnumpy() for g in p.list_grad()]
            for name, p in net._collect_params_with_prefix().items() if p.grad_req != 'null'}


@pytest.mark.parametrize('kept', [0, 1])
def test_two_forwards_then_one_backward_is_exact(kept):
    """Two losses of two calls of one signature, one backward: graph mode
    (a second executor, the later one adding) gives the per-replica
    gradients on every device, also after a recorded call whose backward
    never comes."""
    x1, x2 = nd.random.uniform(shape=(8, 2, 8, 8)), nd.random.uniform(shape=(8, 2, 8, 8))
    ref = _grads_of_two_losses(False, x1, x2)
    got = _grads_of_two_losses(True, x1, x2, kept=kept)
    for name in ref:
        for r, (a, b) in enumerate(zip(ref[name], got[name])):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6,
                                       err_msg=f'{name} on {CTX[r]}')


def test_backward_through_a_call_whose_executor_was_reused_raises():
    """Three recorded calls of one signature wait for a backward: the first
    gives its executor up, and a backward reaching it raises (it would
    compute the third call's gradients), while the other two stay usable."""
    dp = gp.DataParallel(bn_net(), CTX, graph=True)
    x = nd.random.uniform(shape=(8, 2, 8, 8))
    with autograd.record():
        first, second, third = [[o.sum() for o in dp(x)] for _ in range(3)]
    assert dp.graph_mode.binds == 2
    with pytest.raises(RuntimeError, match='has reused'):
        autograd.backward(first)
    autograd.backward(second + third)
    nd.waitall()


def test_gradient_clipping_between_backward_and_step():
    """clip_global_norm reads the gradients with operators that take
    temporary workspace, between backward and step: graph mode must have
    pushed its backward first (an executor backward pushed later, from
    inside an autograd node, deadlocked here every time). In a child: a
    deadlock cannot be interrupted."""
    proc = children.run_script('''
        import mxnet as mx
        from mxnet import autograd, gluon, nd
        import gluon_parallel as gp
        ctx = [mx.cpu(i) for i in range(4)]
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(8, 3, padding=1), gluon.nn.Activation('relu'),
                gluon.nn.Conv2D(8, 3, strides=2), gluon.nn.Dense(3))
        net.initialize(mx.init.Xavier(), ctx=ctx)
        net.hybridize()
        dp = gp.DataParallel(net, ctx, graph=True)
        trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
        loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
        for step in range(5):
            x, y = nd.random.uniform(shape=(64, 2, 8, 8)), nd.ones(64)
            with autograd.record():
                losses = loss(dp(x), y)
            autograd.backward(losses)
            grads = [g for p in net.collect_params().values() for g in p.list_grad()]
            norm = gluon.utils.clip_global_norm(grads, 1.0)
            trainer.step(64)
        print('clipped', norm)
    ''')
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail('graph-mode training hung in clip_global_norm')
    assert proc.returncode == 0, err
    assert 'clipped' in out


def test_recorded_forward_without_backward_then_predict_and_train():
    """A metric computed under record() whose backward never comes: a
    predict call runs, and once the metric's outputs are dropped, training
    runs in graph mode again, exact, running statistics included (the
    abandoned call leaves them, as Gluon's BatchNorm does: it updates them
    in its backward pass)."""
    results = []
    for graph in (False, 'auto'):
        mx.random.seed(3)
        net = bn_net()
        dp = gp.DataParallel(net, CTX, graph=graph)
        x = nd.random.uniform(shape=(8, 2, 8, 8))
        with autograd.record():
            metric = [o.asnumpy() for o in dp(x)]       # outputs not kept
        predicted = [o.asnumpy() for o in dp(x)]
        _, _, steps = run_steps(net, CTX, [8, 8], graph=graph, dp=dp)
        results.append((metric[0], predicted[0], steps[-1]))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    assert np.isfinite(results[1][1]).all()
    for k in results[0][2]:
        np.testing.assert_allclose(results[0][2][k], results[1][2][k], rtol=1e-5,
                                   atol=1e-6, err_msg=k)


def test_an_input_autograd_recorded_runs_per_replica():
    """An input computed under record() needs its own gradient, which one
    executor graph does not give: graph='auto' runs the call per replica
    (the input's gradient equals one device's, whole batch), graph=True
    names the reason."""
    x0 = nd.array(np.random.RandomState(3).normal(size=(8, 2, 8, 8)))

    def input_grad(run):
        x = x0.copy()
        x.attach_grad()
        with autograd.record():
            outs = run(x * 2)
            total = [(o * o).sum() for o in (outs if isinstance(outs, list) else [outs])]
        autograd.backward(total)
        return x.grad.asnumpy()
    net = bn_net(bn=identity)
    dp = gp.DataParallel(net, CTX)
    run_steps(net, CTX, [8], dp=dp)                            # graph mode warmed up
    binds = dp.graph_mode.binds
    got = input_grad(lambda x: dp(x))
    assert dp.graph_mode.binds == binds
    want = input_grad(lambda x: net(x.as_in_context(CTX[0])))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    strict = gp.DataParallel(net, CTX, graph=True)
    with pytest.raises(ValueError, match='needs its own gradient'):
        input_grad(lambda x: strict(x))


def test_an_input_read_under_record_without_gradient_runs_in_graph_mode(monkeypatch):
    """An input that a recorded operator read alongside an array with a
    gradient (so autograd keeps it as a leaf of that history) needs no
    gradient of its own: the call still runs as one graph, with the
    per-replica path's gradients."""
    from gluon_parallel.graph import recording
    ran = []
    original = recording.run
    monkeypatch.setattr(recording, 'run', lambda *a, **k: ran.append(1) or original(*a, **k))
    x = nd.array(np.random.RandomState(3).normal(size=(8, 2, 8, 8)))
    w = nd.ones((1,))
    w.attach_grad()
    grads = []
    for graph in (True, False):
        net = bn_net(bn=identity)
        dp = gp.DataParallel(net, CTX, graph=graph)
        with autograd.record():
            side = (x * w).sum()                    # x becomes a leaf of a recorded graph
            outs = dp(x)
            total = [(o * o).sum() for o in outs]
        autograd.backward(total + [side])
        grads.append({k: p.grad(CTX[0]).asnumpy()
                      for k, p in net._collect_params_with_prefix().items()})
    assert ran == [1]
    for k in grads[0]:
        np.testing.assert_allclose(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_predict_mode_equals_per_replica():
    outs = []
    for graph in (False, True):
        mx.random.seed(4)
        net = bn_net()
        dp = gp.DataParallel(net, CTX, graph=graph)
        outs.append([o.asnumpy() for o in dp(nd.random.uniform(shape=(7, 2, 8, 8)))])
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bad_input_raises_in_the_caller_and_the_next_call_works():
    net = bn_net()
    dp = gp.DataParallel(net, CTX, graph=True)
    run_steps(net, CTX, [8], dp=dp)
    with pytest.raises(Exception, match='graph mode could not bind'):
        with autograd.record():
            dp(nd.ones((8, 5, 8, 8)))               # 5 channels, not 2
    run_steps(net, CTX, [8], dp=dp)


def test_close_between_steps():
    net = bn_net()
    dp = gp.DataParallel(net, CTX, graph=True)
    run_steps(net, CTX, [8], dp=dp)
    dp.close()
    with pytest.raises(RuntimeError, match='closed'):
        dp(nd.ones((8, 2, 8, 8)))
    run_steps(net, CTX, [8], graph=True)


def test_a_failing_backward_raises_and_the_next_step_works(monkeypatch):
    from gluon_parallel.graph.executor import Executor
    net = bn_net()
    dp = gp.DataParallel(net, CTX, graph=True)
    run_steps(net, CTX, [8], dp=dp)
    original = Executor.backward
    monkeypatch.setattr(Executor, 'backward', lambda self, accumulate=False: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run_steps(net, CTX, [8], dp=dp)
    monkeypatch.setattr(Executor, 'backward', original)
    _, _, steps = run_steps(net, CTX, [8], dp=dp)
    assert all(np.isfinite(v).all() for v in steps[-1].values())


def test_ctrl_c_during_a_long_step_ends_the_script():
    """SIGINT while the main thread waits for the executor's previous
    forward (graph mode's bounded run-ahead)."""
    proc = children.popen([sys.executable, '-u', str(HERE / 'graph_scripts' / 'long_steps.py')],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children.interrupt_when(proc, 'stepping')


def test_syncbatchnorm_without_mkldnn_is_exact():
    """SyncBatchNorm merged inside the graph with MXNet's operators (the
    kernels' case: test_kernels.py) (MKL-DNN off, in a process of its own):
    one SGD step of model-zoo ResNets against the float64 truth, within
    float32 BatchNorm's own distance, for even, uneven and short batches;
    the layer's output, parameter gradients and running statistics against
    BatchNorm on the whole batch (even, uneven, short, channels last);
    float16 and float64 data against the staged path."""
    out = subprocess.run([sys.executable, str(HERE / 'graph_scripts' / 'syncbn_exact.py')],
                         capture_output=True, text=True, timeout=600,
                         env=dict(__import__('os').environ, MXNET_MKLDNN_ENABLED='0',
                                  GLUON_PARALLEL_KERNELS='0'))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert 'graph mode ran' in out.stdout and 'calls, 0 with the kernels' in out.stdout


def test_syncbatchnorm_with_mkldnn_is_exact():
    """The same checks with MKL-DNN on (the default CPU wheel), where
    'auto' now runs SyncBatchNorm networks in graph mode (in a child)."""
    from gluon_parallel.graph import mkldnn_cpu
    if not mkldnn_cpu(CTX):
        pytest.fail('this MXNet has no MKL-DNN: the test needs the CPU wheel')
    out = subprocess.run([sys.executable, str(HERE / 'graph_scripts' / 'syncbn_exact.py')],
                         capture_output=True, text=True, timeout=900,
                         env=dict(__import__('os').environ, MXNET_MKLDNN_ENABLED='1'))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert 'MKL-DNN: True' in out.stdout and 'graph mode ran' in out.stdout


def test_syncbatchnorm_without_kernels_reads_the_data_in_one_pass(monkeypatch):
    """Without the kernels, graph mode's SyncBatchNorm centres the data with
    BatchNorm's kernel and sums it as matrix-vector products: no broadcast
    operator and no sum() takes a data-sized input (a broadcast
    subtraction's backward reduces the whole tensor again, and sum() over
    the batch and spatial axes is slow: together two thirds of ResNet-20's
    step with MKL-DNN on, BENCHMARKS.md)."""
    import json
    from gluon_parallel.nn import kernels
    monkeypatch.setattr(kernels, 'available', lambda: None)
    net, dp, _ = run_steps(bn_net(gp.nn.SyncBatchNorm), CTX, [16], graph=True)
    (ex,) = dp.graph_mode.arenas.executors()
    internals = ex.symbol.get_internals()
    arrays = dict(ex.bound.arg_dict, **ex.bound.aux_dict)
    _, shapes, _ = internals.infer_shape(**{k: a.shape for k, a in arrays.items()})
    graph = json.loads(internals.tojson())
    size = {tuple(h[:2]): int(np.prod(s)) for h, s in zip(graph['heads'], shapes)}
    smallest_data = 4 * 4 * 3 * 3                  # the second layer's input per replica
    assert max(size.values()) >= 4 * 4 * 8 * 8     # (the shapes are the replicas')
    checked = 0
    for node in graph['nodes']:
        if node['op'] == 'sum' or node['op'].startswith('broadcast_'):
            checked += 1
            for e in node['inputs']:
                assert size[tuple(e[:2])] < smallest_data, (node['name'], size[tuple(e[:2])])
    assert checked                                  # (the merges use both)


def test_threads_stay_constant():
    net = bn_net()
    dp = gp.DataParallel(net, CTX, graph='auto')
    run_steps(net, CTX, [8], dp=dp)
    before = threading.active_count()
    run_steps(net, CTX, [8] * 5, dp=dp)
    # (<=: arenas of other tests' dropped DataParallels may end meanwhile)
    assert threading.active_count() <= before


@pytest.mark.soak
@pytest.mark.parametrize('steps,batch,sync,env', [
    (500, 4, '0', {}),
    (500, 4, '1', {'MXNET_MKLDNN_ENABLED': '0'}),
    (500, 4, '1', {'MXNET_MKLDNN_ENABLED': '1'})],
    ids=['batchnorm', 'syncbatchnorm-no-mkldnn', 'syncbatchnorm-mkldnn'])
def test_soak_resnet20(steps, batch, sync, env, capsys):
    """500 steps of ResNet-20 in graph mode on 4 contexts: no hang or crash,
    RSS growth < 5 % after warm-up, thread count constant (in a child:
    graph_scripts/soak.py)."""
    import json
    import os
    out = subprocess.run([sys.executable, str(HERE / 'graph_scripts' / 'soak.py'), str(steps),
                          str(batch), sync], capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r['binds'] == 2 and r['finite']
    soaking.check(r, f"graph-mode soak: {steps:d} steps of ResNet-20 "
                     f"({'SyncBatchNorm' if sync == '1' else 'BatchNorm'})", capsys)


def test_forward_hooks_run_per_replica():
    """Graph mode does not call the block, so a block with a forward hook
    runs per replica, where the hook runs once per replica."""
    net = bn_net()
    seen = []
    net.register_forward_hook(lambda block, inputs, output: seen.append(output.context))
    dp = gp.DataParallel(net, CTX)
    dp(nd.ones((8, 2, 8, 8)))
    assert set(seen) == set(CTX) and dp.graph_mode.binds == 0


def test_an_output_the_loss_leaves_out_contributes_nothing():
    """A step whose loss uses every replica's output, then one that uses
    replica 0's only: replica 0's gradients equal the per-replica path's,
    and the other replicas' are zeros (their head-gradient buffers are
    reset, not left at the first step's values; the per-replica path
    leaves those gradients stale and not fresh, which gp.step counts as
    zeros too)."""
    x = nd.random.uniform(shape=(8, 2, 8, 8))
    grads = []
    for graph in (False, True):
        net = bn_net()
        dp = gp.DataParallel(net, CTX, graph=graph)
        for used in (4, 1):
            with autograd.record():
                loss = [o.sum() for o in dp(x)[:used]]
            autograd.backward(loss)
        grads.append({name: [g.asnumpy() for g in p.list_grad()]
                      for name, p in net._collect_params_with_prefix().items()
                      if p.grad_req != 'null'})
    for name in grads[0]:
        np.testing.assert_allclose(grads[1][name][0], grads[0][name][0], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        for g in grads[1][name][1:]:
            assert not g.any(), name
