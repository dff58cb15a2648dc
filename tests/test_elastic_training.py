"""Same numbers at another size: an elastic dist_sync job
(tests/dist_scripts/elastic_train.py, Adam, global batch 8, a checkpoint
every 3 steps) that loses a worker and later grows again ends within float32
reduction order of plain Gluon on one device with the whole batch (the
undisturbed run), and under NaiveEngine bit for bit where a run started from
the same checkpoint at the new size ends.

2 workers at most: a dist_sync server sums the workers' gradients in the
order they arrive, so with 3 or more even two runs of one size can differ
in the last bit (measured: 3e-8 after 12 steps); 2 gradients sum the same
either way.
"""
import csv
import os
import re
import shutil
import subprocess
import sys
import uuid

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

from gluon_parallel import dist
from dist_jobs import load, write_init
from launch_helpers import (HERE, assert_nothing_left, carrying, finish, launch_cmd, launch_env,
                            read_until, wait_for_checkpoint)

sys.path.insert(0, os.path.join(HERE, 'dist_scripts'))
import elastic_train  # noqa: E402
import train_dist  # noqa: E402

SCRIPT = os.path.join(HERE, 'dist_scripts', 'elastic_train.py')
EXAMPLE = os.path.join(os.path.dirname(HERE), 'examples', 'train_image_classification.py')
LIMIT = 150
# Bit-reproducible float arithmetic across processes (tests/test_launch_restarts.py).
EXACT = dict(OMP_NUM_THREADS='1', MXNET_CPU_WORKER_NTHREADS='1', MXNET_ENGINE_TYPE='NaiveEngine')


def _launch(*args):
    token = uuid.uuid4().hex
    proc = subprocess.run(launch_cmd('--timeout', str(LIMIT), '--grace', '2', *args),
                          env=launch_env(token, **EXACT), capture_output=True,
                          timeout=LIMIT + 30)
    assert_nothing_left(token)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def _train(out, init, *args):
    return [sys.executable, SCRIPT, '--out', str(out), '--init', str(init), *args]


def reference(init):
    """Plain Gluon, one device, the whole global batch of every step."""
    net = train_dist.make_net(None)
    net.load_parameters(str(init))
    trainer = gluon.Trainer(net.collect_params(), 'adam', {'learning_rate': 0.01})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    x, y = (nd.array(a[:elastic_train.SAMPLES]) for a in train_dist.make_data(7, 8, seed=3))
    sampler = dist.GlobalBatchSampler(elastic_train.SAMPLES, 8, shuffle=True, seed=1)
    for epoch in range(elastic_train.EPOCHS):
        sampler.set_epoch(epoch)
        for batch in sampler:
            idx = nd.array(batch, dtype='int64')
            with autograd.record():
                loss = loss_fn(net(x.take(idx)), y.take(idx))
            loss.backward()
            trainer.step(len(batch))
    return {k: v.data().asnumpy() for k, v in net._collect_params_with_prefix().items()}


def _from_checkpoint(tmp_path, name, elastic, step, workers, init, stop_after=None):
    out = tmp_path / name
    out.mkdir()
    for ext in ('params', 'states', 'json'):
        shutil.copy(elastic / f'ckpt-{step:d}.{ext}', out / f'ckpt-{step:d}.{ext}')
    extra = [] if stop_after is None else ['--stop-after', str(stop_after)]
    rc, out_text, err = _launch('-n', str(workers), '--', *_train(
        out, init, '--resume', str(out / f'ckpt-{step:d}'), *extra))
    assert rc == 0, err[-3000:]
    return out


def test_losing_a_worker_then_growing_gives_the_same_numbers(tmp_path):
    init = tmp_path / 'init.params'
    write_init(init, None)
    hosts = tmp_path / 'hosts'
    hosts.write_text('localhost:2\n')
    elastic = tmp_path / 'elastic'
    elastic.mkdir()
    # Attempt 0 at 2 workers; worker 1 dies before step 5 (the last
    # checkpoint: step 3); attempt 1 at 1 worker from it; before step 8 a
    # second slot comes back: attempt 2 at 2 workers from step 9's checkpoint.
    rc, out, err = _launch(
        '-n', '1:2', '--discover', f'cat {hosts} && touch {hosts}.seen', '--discover-interval',
        '0.2', '--max-restarts', '1', '--', *_train(
            elastic, init, '--hosts', str(hosts), '--event', '0:1:5:1:kill',
            '--event', '1:0:8:2:grow'))
    assert rc == 0, err[-3000:]
    layouts = [line for line in err.splitlines() if line.startswith('[launch] attempt ')]
    assert [line.split(' on ')[0] for line in layouts] == [
        '[launch] attempt 0: 2 workers', '[launch] attempt 1: 1 worker',
        '[launch] attempt 2: 2 workers'], err
    for rank in range(2):
        assert f'[worker {rank:d}] attempt 2: 2 workers from ckpt-9' in out.splitlines(), out
    assert '[worker 0] attempt 1: 1 workers from ckpt-3' in out.splitlines(), out
    assert [(x['attempt'], x['workers'], x['devices']) for x in
            dist.layouts_of(elastic / 'ckpt-12')] == [
        (0, 2, ['cpu(0)']), (1, 1, ['cpu(0)']), (2, 2, ['cpu(0)'])]

    got = load(elastic / 'final.params')
    want = reference(init)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # The shrink: step 9's checkpoint as a 1-worker run from step 3's makes it.
    shrunk = _from_checkpoint(tmp_path, 'shrunk', elastic, 3, 1, init, stop_after=9)
    for k, v in load(elastic / 'ckpt-9.params').items():
        assert np.array_equal(load(shrunk / 'ckpt-9.params')[k], v), k
    # The growth: the end as a 2-worker run from step 9's checkpoint makes it.
    grown = _from_checkpoint(tmp_path, 'grown', elastic, 9, 2, init)
    for k, v in got.items():
        assert np.array_equal(load(grown / 'final.params')[k], v), k
    mx.nd.waitall()


def test_the_example_resumes_mid_epoch_at_another_size(tmp_path):
    """examples/train_image_classification.py under -n 1:2 with
    --checkpoint-every 4: a second slot while it runs ends the job after a
    checkpoint in the middle of epoch 1 (of 24 steps), and it goes on there
    at 2 workers."""
    hosts, save, token = tmp_path / 'hosts', tmp_path / 'run', uuid.uuid4().hex
    hosts.write_text('localhost:1\n')
    popen = subprocess.Popen(launch_cmd(
        '-n', '1:2', '--discover', f'cat {hosts}', '--discover-interval', '0.2', '--timeout',
        str(LIMIT), '--grace', '2', '--', sys.executable, EXAMPLE, '--dataset', 'digits',
        '--kvstore', 'dist_sync', '--epochs', '2', '--max-steps-per-epoch', '24',
        '--batch-size', '16', '--num-devices', '1', '--checkpoint-every', '4', '--no-progress',
        '--save-dir', str(save)), env=launch_env(token, **EXACT), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        # The worker is held still from its first checkpoint (step 4) until
        # the launcher has seen the second slot: it leaves at the next one.
        wait_for_checkpoint(popen, save, LIMIT)
        workers = [p for p in carrying(token) if p.environ().get('DMLC_ROLE') == 'worker']
        for p in workers:
            p.suspend()
        hosts.write_text('localhost:2\n')
        seen = read_until(popen, lambda lines: any('discovery reports localhost:2' in x
                                                   for x in lines), stream=popen.stderr)
        for p in workers:
            p.resume()
    finally:
        (rc, out, err), = finish([popen], LIMIT + 30)
    err = '\n'.join(seen) + '\n' + err
    assert rc == 0, err[-3000:]
    assert '[launch] attempt 1: 2 workers on localhost:2' in err, err
    # Step 8's checkpoint, or a later one of epoch 1 if the test was slow to
    # stop the worker: one of 4 steps of 16 samples each, before step 24.
    for rank in range(2):
        m = re.search(rf'^\[worker {rank:d}\] resumed from {re.escape(str(save))}/checkpoint at '
                      r'epoch 0, sample (\d+) of epoch 1, on 2 worker\(s\)$', out, re.M)
        assert m and int(m[1]) % 64 == 0 and 64 < int(m[1]) < 384, out
    assert [(x['attempt'], x['workers']) for x in dist.layouts_of(save / 'checkpoint')] == [
        (0, 1), (1, 2)]
    with open(save / 'metrics.csv') as f:
        assert [r['epoch'] for r in csv.DictReader(f)] == ['1', '2']
    assert_nothing_left(token)
