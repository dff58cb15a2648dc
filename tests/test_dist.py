"""gluon_parallel.dist: real dist_sync jobs on 127.0.0.1, under the launcher.

Each job runs tests/dist_scripts/train_dist.py (2 workers x 2 CPU contexts,
1 server) and is compared with an independent single-process run written
here with plain Gluon (1 process x 4 contexts, or BatchNorm on the whole
batch on one device). Every job is bounded by the launcher's --timeout and
checked to leave no process behind.
"""
import json
import os
import re
import subprocess
import sys
import uuid

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import gluon_parallel as gp
from gluon_parallel import dist

from dist_jobs import (HERE, JOB_TIMEOUT, STEPS, assert_params_close,
                       check_equal_to_four_contexts, check_launched_job,
                       check_syncbn_job, launch, load, params_of,
                       reference_multi_ctx, train_dist, write_init)
from launch_helpers import assert_nothing_left, launch_env

# ----------------------------------------------------------------------------
# Running alone: every helper degrades to one worker

@pytest.fixture
def alone(monkeypatch):
    for k in ('DMLC_ROLE', 'DMLC_PS_ROOT_URI', 'DMLC_PS_ROOT_PORT'):
        monkeypatch.delenv(k, raising=False)


def test_alone_is_one_worker(alone):
    assert not dist.is_distributed()
    assert (dist.rank(), dist.num_workers(), dist.is_root()) == (0, 1, True)
    assert dist.get_kvstore() == 'device'
    assert dist.get_kvstore('local') == 'local'
    assert dist.global_batch_size(8) == 8
    dist.barrier()
    with pytest.raises(RuntimeError, match='gluon_parallel.launch'):
        dist.get_kvstore('dist_sync')
    net = train_dist.make_net(gp.nn.SyncBatchNorm)
    assert dist.sync_batchnorm_across_workers(net) == []


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_worker_reducer_gives_each_use_of_a_layer_its_own_gradient_key(alone, monkeypatch,
                                                                         hybridize, tmp_path):
    # MXNet runs autograd Functions' backward in a thread pool: the two
    # gradient push-pulls of a layer used twice may start in either order,
    # so they must not share a key. A 'local' kvstore stands in for the
    # servers (one worker: the sums are the process's own).
    from gluon_parallel.dist import batchnorm as dist_bn
    ctx = [mx.cpu(0), mx.cpu(1)]
    local = mx.kv.create('local')
    monkeypatch.setattr(dist_bn, 'dist_kv', lambda kv: local)
    net, ref = train_dist.make_net(gp.nn.SyncBatchNorm), train_dist.make_net(gluon.nn.BatchNorm)
    net.initialize(mx.init.Normal(0.5), ctx=ctx)
    net.save_parameters(str(tmp_path / 'init.params'))
    ref.load_parameters(str(tmp_path / 'init.params'))
    assert dist.sync_batchnorm_across_workers(net) == [net[1].bn_a.name, net[1].bn_b.name]
    reducer = net[1].bn_a.reducer
    keys = []
    original = reducer.allreduce
    monkeypatch.setattr(reducer, 'allreduce', lambda key, x: keys.append(key) or original(key, x))
    if hybridize:
        net.hybridize(static_alloc=True)
    x, y = train_dist.make_data(2, 7)
    for step in range(2):
        xb = nd.array(x[step * 7:(step + 1) * 7])
        xr = xb.copy()
        xb.attach_grad()
        xr.attach_grad()
        with gp.DataParallel(net, ctx) as dp, autograd.record():
            losses = [o.sum() for o in dp(xb)]
        autograd.backward(losses)
        with autograd.record():
            loss = ref(xr).sum()
        loss.backward()
        np.testing.assert_allclose(xb.grad.asnumpy(), xr.grad.asnumpy(), rtol=1e-4, atol=1e-5)
    first_a = reducer._keys[net[1].bn_a][0]
    forward_keys = [k for k in keys if k in (first_a, reducer._keys[net[1].bn_b][0])]
    grad_keys_a = sorted(k for k in keys if first_a < k <= first_a + reducer.ROUNDS)
    assert len(forward_keys) == 2 * 3            # 2 steps x 3 uses
    # bn_a: 4 rounds in all, each its own gradient key.
    assert grad_keys_a == list(range(first_a + 1, first_a + 5))


def test_worker_reducer_errors(alone, monkeypatch):
    from gluon_parallel.dist import batchnorm as dist_bn
    monkeypatch.setattr(dist_bn, 'dist_kv', lambda kv: mx.kv.create('local'))
    net = train_dist.make_net(gp.nn.SyncBatchNorm)
    net[1].bn_b.reducer = lambda layer, totals: totals
    with pytest.raises(ValueError, match=f'{net[1].bn_b.name} already has a reducer of its own'):
        dist.sync_batchnorm_across_workers(net)
    net[1].bn_b.reducer = None
    dist.sync_batchnorm_across_workers(net)
    stranger = gp.nn.SyncBatchNorm(in_channels=train_dist.HIDDEN)
    stranger.initialize()
    stranger.reducer = net[1].bn_a.reducer
    with pytest.raises(ValueError, match=f'{stranger.name} has no kvstore keys of this reducer'):
        with autograd.record():
            stranger(nd.ones((4, train_dist.HIDDEN)))


def test_init_trainer_alone_and_deferred_parameters(alone):
    ctx = [mx.cpu(0), mx.cpu(1)]
    net = train_dist.make_net()
    net.initialize(ctx=ctx)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', kvstore=dist.get_kvstore())
    assert dist.init_trainer(trainer) is trainer
    assert trainer._kv_initialized and not trainer._params_to_init
    deferred = gluon.nn.Dense(3)
    deferred.initialize(ctx=ctx)
    with pytest.raises(ValueError, match='deferred'):
        dist.init_trainer(gluon.Trainer(deferred.collect_params(), 'sgd'))


def test_shard_parts_are_equal_disjoint_and_interleaved(alone):
    data = list(range(23))
    parts = [dist.shard(data, 3, i) for i in range(3)]
    assert [len(p) for p in parts] == [7, 7, 7]            # 23 // 3; 2 items left out
    seen = [p[j] for p in parts for j in range(len(p))]
    assert len(set(seen)) == 21 and set(seen) <= set(data)
    # The k-th batches of all parts together: the k-th batch of one process
    # reading batches of 3 * b.
    b = 2
    for k in range(3):
        union = sorted(parts[i][j] for i in range(3) for j in range(k * b, (k + 1) * b))
        assert union == data[k * 3 * b:(k + 1) * 3 * b]
    assert len(dist.shard(data)) == 23                      # alone: everything
    with pytest.raises(ValueError):
        dist.shard(data, 3, 3)
    with pytest.raises(ValueError):
        dist.shard(data[:2], 3, 0)


def test_shard_sampler_shuffles_the_same_way_everywhere(alone):
    n, parts, b = 50, 4, 3
    samplers = [dist.ShardSampler(n, parts, i, shuffle=True, seed=5) for i in range(parts)]
    for epoch in range(2):
        passes = [list(s) for s in samplers]
        assert all(len(p) == n // parts for p in passes)
        flat = [i for p in passes for i in p]
        assert len(set(flat)) == len(flat) and set(flat) <= set(range(n))
        # Batch k of all workers together is one set of parts*b indices,
        # disjoint from every other batch: a permutation read in order.
        batches = [sorted(i for p in passes for i in p[k * b:(k + 1) * b])
                   for k in range(len(passes[0]) // b)]
        assert len({i for bt in batches for i in bt}) == sum(len(bt) for bt in batches)
        if epoch == 0:
            first = passes
    assert passes != first                                  # a new permutation each pass
    samplers[0].set_epoch(0)
    assert list(samplers[0]) == first[0]
    plain = dist.ShardSampler(n, parts, 1)
    assert list(plain) == list(range(1, 48, 4))


def test_shard_sampler_splits_any_sampler(alone):
    class Keys(gluon.data.Sampler):
        """Yields (index, seed) pairs, like a sampler for augmented data."""
        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __len__(self):
            return 11

        def __iter__(self):
            return iter([(i, 100 * self.epoch + i) for i in range(11)])

    base = Keys()
    parts = [dist.shard_sampler(base, 3, i) for i in range(3)]
    assert [len(p) for p in parts] == [3, 3, 3]
    assert list(parts[1]) == [(1, 1), (4, 4), (7, 7)]
    parts[0].set_epoch(2)                       # reaches the wrapped sampler
    assert list(parts[2]) == [(2, 202), (5, 205), (8, 208)]
    assert dist.shard_sampler(base) is base     # alone: unchanged


# ----------------------------------------------------------------------------
# Real jobs

@pytest.fixture(scope='module')
def continuous(tmp_path_factory, plain_init):
    """2 workers x 2 contexts, 5 steps; rank 0 checkpoints after step 3."""
    out = tmp_path_factory.mktemp('continuous')
    rc, stdout, stderr = launch(out, '--init', plain_init, '--steps', STEPS, '--save-at', 3)
    assert rc == 0, stdout + stderr
    return out


def test_two_workers_equal_one_process_with_four_contexts(continuous, plain_init, tmp_path):
    check_launched_job(continuous, plain_init, tmp_path)


def test_two_workers_in_graph_mode_equal_one_process_with_four_contexts(plain_init, tmp_path):
    """The hybridized network runs in graph mode (the default) in each
    worker: the same parameters as 1 process x 4 contexts."""
    out = tmp_path / 'graph'
    rc, stdout, stderr = launch(out, '--init', plain_init, '--steps', STEPS, '--hybridize')
    assert rc == 0, stdout + stderr
    info = check_equal_to_four_contexts(out, plain_init, tmp_path)
    assert [i['graph_binds'] for i in info] == [1, 1]


def test_two_workers_with_gp_trainer_equal_one_process_with_four_contexts(plain_init, tmp_path):
    """gp.Trainer, unchanged dist calls (get_kvstore, init_trainer,
    global_batch_size): its batched push/pull through dist_sync's servers,
    the same parameters as Gluon's Trainer on 1 process x 4 contexts. The
    network's four gradients are one bucket: each step is one push/pull of
    one key (its 2 contexts' arrays), not four."""
    out = tmp_path / 'gp-trainer'
    rc, stdout, stderr = launch(out, '--init', plain_init, '--steps', STEPS, '--gp-trainer',
                                '--hybridize')
    assert rc == 0, stdout + stderr
    info = check_equal_to_four_contexts(out, plain_init, tmp_path)
    assert [i['trainer'] for i in info] == ['gluon_parallel.trainer.Trainer'] * 2
    assert [i['reductions'] for i in info] == [[2] * STEPS] * 2


@pytest.mark.parametrize('extra, freeze', [([], False), (['--grad-add', '--freeze'], True)],
                         ids=['write', 'add-frozen'])
def test_buckets_reduced_while_backward_runs_give_the_same_parameters(extra, freeze, plain_init,
                                                                       tmp_path):
    """Graph mode over dist_sync: each replica's backward cut into pieces,
    buckets in backward's order with a cap (419 bytes) that makes two of
    the four gradients (the second layer's and the first bias: their
    reduction can start before backward has run the first layer) and
    leaves the first weight (512 bytes) larger than the cap, in a bucket of
    its own; grad_req='add' and a frozen layer too. The parameters of 1
    process x 4 contexts, as without overlap."""
    out = tmp_path / 'overlap'
    rc, stdout, stderr = launch(out, '--init', plain_init, '--steps', STEPS, '--gp-trainer',
                                '--hybridize', '--bucket-cap', 0.0004, *extra)
    assert rc == 0, stdout + stderr
    info = check_equal_to_four_contexts(out, plain_init, tmp_path, freeze=freeze)
    keys = 1 if freeze else 2           # (frozen: the first layer has no gradient)
    assert [i['reductions'] for i in info] == [[2 * keys] * STEPS] * 2
    assert [i['graph_binds'] for i in info] == [1, 1]


def test_fp16_compression_trains_as_float32_within_float16_rounding(plain_init, tmp_path):
    """compression='fp16' over dist_sync: the buckets are summed as float16
    copies by the servers; the parameters after 5 steps are those of 1
    process x 4 contexts in float32 within float16's rounding (each array
    within 1 % of its largest value: 5 steps of gradients rounded to 11
    significant bits; seen up to 0.24 % over several initialisations,
    which MXNet's global generator draws), and both workers agree
    exactly."""
    got, want = compressed_job('fp16', plain_init, tmp_path)
    for k in want:
        scale = np.abs(want[k]).max()
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-2 * scale, err_msg=k)


def compressed_job(compression, plain_init, tmp_path):
    """(rank 0's parameters, 1 process x 4 contexts' uncompressed ones)
    after a gp.Trainer job with train_dist.py's `compression`; both workers
    agree exactly."""
    out = tmp_path / compression
    rc, stdout, stderr = launch(out, '--init', plain_init, '--steps', STEPS, '--gp-trainer',
                                '--hybridize', '--compression', compression)
    assert rc == 0, stdout + stderr
    ranks = [load(out / (f'rank{r:d}.params')) for r in range(2)]
    want = params_of(reference_multi_ctx(plain_init, STEPS, 16), tmp_path, 'ref.params')
    for k in want:
        np.testing.assert_array_equal(ranks[0][k], ranks[1][k], err_msg=k)
    return ranks[0], want


def test_mxnet_2bit_compression_passes_through_gp_trainer(plain_init, tmp_path):
    """compression_params={'type': '2bit', ...} reaches dist_sync's kvstore
    as with Gluon's Trainer: the buckets' pushes are quantised (the
    parameters move away from the uncompressed run's), and both workers
    still agree exactly."""
    got, want = compressed_job('2bit', plain_init, tmp_path)
    assert any(not np.allclose(got[k], want[k], rtol=1e-3) for k in want)


def test_gp_trainer_bucket_split_over_two_servers(plain_init, tmp_path):
    """MXNet splits a key of MXNET_KVSTORE_BIGARRAY_BOUND elements or more
    evenly over the servers: with 2 servers and a bound of 100, the
    network's one bucket (224 elements) is summed in two halves, one per
    server; the parameters are still those of 1 process x 4 contexts."""
    out = tmp_path / 'split'
    rc, stdout, stderr = launch(out, '--init', plain_init, '--steps', STEPS, '--gp-trainer',
                                servers=2, env={'MXNET_KVSTORE_BIGARRAY_BOUND': '100'})
    assert rc == 0, stdout + stderr
    info = check_equal_to_four_contexts(out, plain_init, tmp_path)
    assert [i['reductions'] for i in info] == [[2] * STEPS] * 2


def test_checkpoint_by_rank_0_resumes_on_both_workers(continuous, plain_init, tmp_path):
    ckpt = continuous / 'ckpt'
    assert (continuous / 'ckpt.params').exists() and (continuous / 'ckpt.states').exists()
    out = tmp_path / 'resumed'
    rc, stdout, stderr = launch(out, '--init', plain_init, '--steps', STEPS, '--resume', ckpt)
    assert rc == 0, stdout + stderr
    info = [json.load(open(out / (f'rank{r:d}.json'))) for r in range(2)]
    assert [i['steps'] for i in info] == [STEPS - 3] * 2
    want = params_of(reference_multi_ctx(plain_init, STEPS, 16), tmp_path, 'ref.params')
    for r in range(2):
        got = load(out / (f'rank{r:d}.params'))
        # Same operations as the job that never stopped (momentum restored).
        assert_params_close(got, load(continuous / (f'rank{r:d}.params')), rtol=1e-6, atol=1e-7,
                            what=f'resumed vs continuous, rank {r:d}')
        assert_params_close(got, want, what=f'resumed vs reference, rank {r:d}')


def test_a_failing_worker_ends_the_job(tmp_path, plain_init):
    rc, stdout, stderr = launch(tmp_path, '--init', plain_init, '--steps', STEPS, '--fail-at', 2)
    # Status 1 from the failing worker (not the launcher's timeout, 124),
    # seen at once thanks to launch.failfast; nothing left (checked in launch).
    assert rc == 1, stdout + stderr
    assert 'RuntimeError: injected failure at step 2 on rank 1' in stderr
    assert '[launch] worker 1 exited with status 1' in stderr
    assert not (tmp_path / 'rank0.params').exists()


def test_workers_whose_parameter_names_differ_are_refused(tmp_path, plain_init):
    # Rank 1 built another Dense first: its parameters are dense1_, dense2_
    # where rank 0 has dense0_, dense1_. The kvstore pairs parameters by
    # position in name order, so init_trainer refuses on every worker.
    rc, stdout, stderr = launch(tmp_path, '--init', plain_init, '--steps', 2, '--skew-names')
    assert rc == 1, stdout + stderr
    assert "Trainers hold parameters with different names" in stderr
    assert not (tmp_path / 'rank0.params').exists()


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_cross_worker_syncbn_equals_batchnorm_on_the_global_batch(tmp_path, hybridize):
    init = tmp_path / 'bn.params'
    write_init(init, gluon.nn.BatchNorm)
    out = tmp_path / 'job'
    # 7 rows per worker: slices of 4 and 3, so the merge must weight by count.
    # Two layers side by side: one barrier for both when hybridized.
    rc, stdout, stderr = launch(out, '--init', init, '--steps', STEPS, '--batch', 7, '--syncbn',
                                *(['--hybridize'] if hybridize else []))
    assert rc == 0, stdout + stderr
    ranks = check_syncbn_job(out, init, tmp_path)
    # And the same as SyncBatchNorm in one process on 4 contexts.
    ctx = [mx.cpu(i) for i in range(4)]
    net = train_dist.make_net(gp.nn.SyncBatchNorm)
    net.load_parameters(str(init), ctx=ctx)
    trainer = gluon.Trainer(net.collect_params(), *train_dist.OPTIMIZER)
    dp = gp.DataParallel(net, ctx)
    dp_loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    x, y = train_dist.make_data(STEPS, 14)
    for k in range(STEPS):
        with autograd.record():
            losses = dp_loss(dp(nd.array(x[k * 14:(k + 1) * 14])), nd.array(y[k * 14:(k + 1) * 14]))
        autograd.backward(losses)
        trainer.step(14)
    dp.close()
    assert_params_close(ranks[0], params_of(net, tmp_path, 'sync4.params'),
                        what='vs SyncBatchNorm 1 x 4')


def test_cross_worker_syncbn_refuses_servers_that_run_the_optimizer(tmp_path):
    # The servers would apply SGD to the summed statistics: garbage. The
    # first forward after the Trainer sent its optimizer raises instead.
    init = tmp_path / 'bn.params'
    write_init(init, gluon.nn.BatchNorm)
    rc, stdout, stderr = launch(tmp_path / 'job', '--init', init, '--steps', 3, '--syncbn',
                                '--server-updates')
    assert rc == 1, stdout + stderr
    assert 'update_on_kvstore=True' in stderr and 'init_trainer' in stderr


EXAMPLE = os.path.join(os.path.dirname(HERE), 'examples', 'train_image_classification.py')
EPOCH_LINE = re.compile(r'^\[worker (\d)\] epoch (\d+) .* val_acc=(\S+) ', re.M)


def run_example(save, *args):
    token = uuid.uuid4().hex
    cmd = [sys.executable, '-m', 'gluon_parallel.launch', '-n', '2', '-s', '1',
           '--timeout', str(JOB_TIMEOUT), '--grace', '2', '--', sys.executable, EXAMPLE,
           '--kvstore', 'dist_sync', '--num-devices', '2', '--batch-size', '32',
           '--max-steps-per-epoch', '3', '--save-dir', str(save)] + list(args)
    proc = subprocess.run(cmd, env=launch_env(token, OMP_NUM_THREADS='1'), capture_output=True,
                          timeout=JOB_TIMEOUT + 30)
    assert_nothing_left(token)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def test_example_trains_and_resumes_under_the_launcher(tmp_path):
    save = tmp_path / 'run'
    rc, out, err = run_example(save, '--epochs', '3', '--print-every-worker')
    assert rc == 0, out + err
    assert 'global batch 32 over 2 worker(s)' in out
    # The workers' progress goes to the launcher's pipes, not a terminal: no
    # bar frames, and every line keeps its process's prefix.
    assert '\r' not in out + err, repr(err[:2000])
    assert all(line.startswith('[') for line in (out + err).splitlines()), out + err
    # Same parameters and (cross-worker SyncBatchNorm) running statistics on
    # both workers: the same validation accuracy, every epoch.
    acc = {}
    for worker, epoch, val in EPOCH_LINE.findall(out):
        acc.setdefault(epoch, {})[worker] = val
    assert sorted(acc) == ['1', '2', '3'] and all(len(v) == 2 for v in acc.values()), out
    assert all(v['0'] == v['1'] for v in acc.values()), acc
    for name in ('checkpoint.params', 'checkpoint.states', 'checkpoint.json', 'metrics.csv'):
        assert (save / name).exists(), name
    # Both workers load rank 0's checkpoint (the last epoch: nothing is
    # left to train; dist_scripts/train_dist.py checks that resuming is exact).
    rc, out, err = run_example(save, '--epochs', '3', '--resume')
    assert rc == 0, out + err
    assert out.count('resumed from %s at epoch 3' % (save / 'checkpoint')) == 2, out
    # Without --print-every-worker the results are rank 0's lines only.
    assert [line.split(' final ')[0] for line in out.splitlines() if ' final ' in line] \
        == ['[worker 0]'], out


def test_example_refuses_a_dist_kvstore_outside_a_dist_job():
    env = launch_env('unused')
    proc = subprocess.run([sys.executable, EXAMPLE, '--kvstore', 'dist_sync', '--epochs', '1'],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert 'gluon_parallel.launch' in proc.stderr


def test_horovod_store_all_reduces_each_bucket_on_its_own_in_order(monkeypatch):
    """The buckets of a step are all-reduced one by one, in the order given
    (backward's), each an engine operation of its own that can start when
    its bucket is written: not one grouped all-reduce, which waits for
    every bucket."""
    from gluon_parallel.dist import horovod as hv
    calls = []

    class Recording:
        def grouped_allreduce_(self, tensors, average, name, priority):
            calls.append(('grouped', len(tensors)))

        def allreduce_(self, tensor, average, name, priority):
            calls.append(('one', name))

    monkeypatch.setattr(hv, 'horovod', Recording)
    hv.HorovodStore().pushpull_group([7, 3, 5], [[nd.ones(4)], [nd.ones(2)], [nd.ones(1)]])
    assert calls == [('one', 'gp.pushpull.7'), ('one', 'gp.pushpull.3'), ('one', 'gp.pushpull.5')]


def test_horovod_store_reduces_a_lone_bucket_in_place(monkeypatch):
    """HorovodStore on a stand-in for horovod.mxnet (two workers holding the
    same values: an all-reduce doubles): one context's flat array (a
    gradient bucket) is all-reduced in place, with no copy either way;
    several contexts' arrays are summed first and the result written to
    each; a 2-D array, or a push/pull into other arrays, goes through a
    copy, leaving the pushed value as it was."""
    from gluon_parallel.dist import horovod as hv
    sent = []

    class TwoWorkers:
        def grouped_allreduce_(self, tensors, average, name, priority):
            for t in tensors:
                self.allreduce_(t, average, name, priority)

        def allreduce_(self, tensor, average, name, priority):
            assert not average
            sent.append(tensor)
            tensor *= 2

    monkeypatch.setattr(hv, 'horovod', TwoWorkers)
    store = hv.HorovodStore()
    bucket = nd.arange(6)
    store.pushpull_group([0], [[bucket]])
    assert sent[-1] is bucket
    np.testing.assert_array_equal(bucket.asnumpy(), 2 * np.arange(6))
    pair = [nd.ones(3, ctx=mx.cpu(0)), 2 * nd.ones(3, ctx=mx.cpu(1))]
    store.pushpull_group([1], [pair])
    assert all(sent[-1] is not a for a in pair)
    for a in pair:
        np.testing.assert_array_equal(a.asnumpy(), [6, 6, 6])
    weight = nd.ones((2, 2))
    store.pushpull(2, weight)
    assert sent[-1] is not weight
    np.testing.assert_array_equal(weight.asnumpy(), 2 * np.ones((2, 2)))
    value, out = nd.ones(3), nd.zeros(3)
    store.pushpull(3, value, out=out)
    np.testing.assert_array_equal(value.asnumpy(), [1, 1, 1])
    np.testing.assert_array_equal(out.asnumpy(), [2, 2, 2])
