"""gluon_parallel.checkpoint: training N steps, saving, loading in a new
process and training M more equals N+M steps without stopping; crashes
mid-save keep the previous checkpoint; bad files are named."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp

import predict_race
from checkpoint_runs import RESUME_CONFIGS, train
from loops import (ADAM, CTX, HERE, SGD, assert_same, conv_net, make_batches, make_init, parallel,
                   values)


# ---------------------------------------------------------------------------
# Checkpoints: exact resumption in a new process (tests/checkpoint_runs.py)

def _run_child(code, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [HERE, os.path.dirname(HERE), os.environ.get('PYTHONPATH', '')]))
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_resume_in_a_new_process_equals_uninterrupted_training(init, tmp_path):
    # Both runs in fresh processes: resuming in a new process is the case
    # this test is about. A process that built other models first numbers
    # its layers differently: test_resume_when_names_sort_in_another_order.
    proc = _run_child(f'''
        import checkpoint_runs
        checkpoint_runs.uninterrupted_child({str(tmp_path)!r}, {init!r})
    ''')
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = nd.load(str(tmp_path / 'uninterrupted.params'))
    expected = {}
    for key, v in saved.items():
        name, k, i = key.split('|')
        expected.setdefault(name, {}).setdefault(k, [None] * len(CTX))[int(i)] = v.asnumpy()
    proc = _run_child(f'''
        import checkpoint_runs
        checkpoint_runs.resume_child({str(tmp_path)!r})
    ''')
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = nd.load(str(tmp_path / 'resumed.params'))
    for name, *_, bn in RESUME_CONFIGS:
        for k, copies in expected[name].items():
            got = [resumed[f'{name}|{k}|{i:d}'].asnumpy() for i in range(len(CTX))]
            if bn == 'plain' and 'running' in k:
                # Per-device statistics drift apart again after the save,
                # identically in both runs.
                for i, (g, e) in enumerate(zip(got, copies)):
                    assert_same({k: [g]}, {k: e}, rtol=1e-5, atol=1e-7,
                                what=f'{name}, context {i:d}: ')
            else:
                assert_same({k: got}, {k: copies}, rtol=1e-5, atol=1e-7, what=name + ': ')


def test_load_twice_then_train(init, tmp_path):
    batches = make_batches([12, 12, 12, 12])
    net = conv_net()
    net.load_parameters(init, ctx=CTX)
    trainer = gluon.Trainer(net.collect_params(), *ADAM)
    train(net, trainer, batches[:2], CTX)
    gp.save_checkpoint(str(tmp_path / 'ck'), net, trainer, epoch=1)
    train(net, trainer, batches[2:], CTX)
    expected = values(net)

    net2 = conv_net()
    net2.initialize(ctx=CTX)
    trainer2 = gluon.Trainer(net2.collect_params(), *ADAM)
    train(net2, trainer2, batches[:1], CTX)            # some other state to overwrite
    for _ in range(2):
        assert gp.load_checkpoint(str(tmp_path / 'ck'), net2, trainer2) == {'epoch': 1}
    train(net2, trainer2, batches[2:], CTX)
    assert_same(values(net2), expected, rtol=1e-6)


def _numbered_bn(numbers):
    """SyncBatchNorm factory for conv_net with the given name numbers."""
    numbers = iter(numbers)
    return lambda **kwargs: gp.nn.SyncBatchNorm(prefix=f'syncbn{next(numbers):d}_', **kwargs)


def _trainer_order(net, trainer):
    names = {id(p): k for k, p in net._collect_params_with_prefix().items()}
    return [names[id(p)] for p in trainer._params]


@pytest.mark.parametrize('opt, uok', [(ADAM, None), (SGD, False)],
                         ids=['adam-kvstore-update', 'sgd-local-update'])
def test_resume_when_names_sort_in_another_order(init, tmp_path, opt, uok):
    # gluon.Trainer orders its parameters, and keys its optimizer state, by
    # full name, and names carry Gluon's global counters. The same model
    # built later (another process, or after other models) can sort its
    # parameters differently: '..10_gamma' < '..9_gamma' but '..11_gamma' <
    # '..12_gamma'. The states of the two (equal-shaped) SyncBatchNorm layers
    # must not be swapped.
    batches = make_batches([12, 12, 12, 12])
    net = conv_net(_numbered_bn([9, 10]))
    net.load_parameters(init, ctx=CTX)
    trainer = gluon.Trainer(net.collect_params(), opt[0], dict(opt[1]), update_on_kvstore=uok)
    train(net, trainer, batches[:2], CTX)
    gp.save_checkpoint(str(tmp_path / 'ck'), net, trainer)
    train(net, trainer, batches[2:], CTX)

    net2 = conv_net(_numbered_bn([11, 12]))
    net2.initialize(ctx=CTX)
    trainer2 = gluon.Trainer(net2.collect_params(), opt[0], dict(opt[1]),
                             update_on_kvstore=uok)
    assert _trainer_order(net2, trainer2) != _trainer_order(net, trainer)
    gp.load_checkpoint(str(tmp_path / 'ck'), net2, trainer2)
    train(net2, trainer2, batches[2:], CTX)
    assert_same(values(net2), values(net), rtol=1e-6)


def test_plain_gluon_files_both_ways(init, tmp_path):
    # A checkpoint of a 4-device SyncBatchNorm model loads into a plain
    # single-device Gluon model...
    batches = make_batches([12, 12])
    _, net, trainer = parallel(init, batches, 4)
    prefix = str(tmp_path / 'ck')
    gp.save_checkpoint(prefix, net, trainer)
    plain = conv_net(nn.BatchNorm)
    plain.load_parameters(prefix + '.params', ctx=mx.cpu(0))
    assert_same(values(plain), values(net), rtol=0, atol=0)
    # ...and a plain Gluon parameter file loads into a multi-device model,
    # initialized or not, identical on every context.
    plain.save_parameters(str(tmp_path / 'plain.params'))
    fresh = conv_net()
    assert gp.load_checkpoint(str(tmp_path / 'plain'), fresh, ctx_list=CTX) == {}
    assert_same(values(fresh), values(plain), rtol=0, atol=0)
    assert fresh[0].weight.list_ctx() == CTX
    other = conv_net()
    other.initialize(ctx=CTX[:2])
    gp.load_checkpoint(str(tmp_path / 'plain'), other, ctx_list=CTX)
    assert_same(values(other), values(plain), rtol=0, atol=0)
    assert other[1].running_var.list_ctx() == CTX


# ---------------------------------------------------------------------------
# Checkpoints: crashes and bad files

def _small_model(tmp_path, seed):
    net = conv_net()
    net.load_parameters(make_init(str(tmp_path / (f'init{seed:d}.params')), seed), ctx=CTX[:2])
    trainer = gluon.Trainer(net.collect_params(), *SGD)
    train(net, trainer, make_batches([6], seed), CTX[:2])
    return net, trainer


def _leftovers(folder):
    return [f for f in os.listdir(folder) if '.tmp-' in f]


def test_failure_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    net, trainer = _small_model(tmp_path, 0)
    prefix = str(tmp_path / 'ck')
    gp.save_checkpoint(prefix, net, trainer, step=1)
    saved = values(net)
    train(net, trainer, make_batches([6]), CTX[:2])

    def broken_save_states(self, fname):
        with open(fname, 'wb') as f:
            f.write(b'half a state')
        raise OSError('disk full')
    monkeypatch.setattr(gluon.Trainer, 'save_states', broken_save_states)
    with pytest.raises(OSError, match='disk full'):
        gp.save_checkpoint(prefix, net, trainer, step=2)
    monkeypatch.undo()
    assert _leftovers(str(tmp_path)) == []

    net2, trainer2 = _small_model(tmp_path, 1)
    assert gp.load_checkpoint(prefix, net2, trainer2) == {'step': 1}
    assert_same(values(net2), saved, rtol=0, atol=0)

    # A crash between the renames still leaves the previous checkpoint whole.
    calls = []

    def crash_on_second_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError('power cut')
        os.rename(src, dst)
    monkeypatch.setattr(os, 'replace', crash_on_second_replace)
    with pytest.raises(OSError, match='power cut'):
        gp.save_checkpoint(prefix, net, trainer, step=2)
    monkeypatch.undo()
    net3, trainer3 = _small_model(tmp_path, 2)
    assert gp.load_checkpoint(prefix, net3, trainer3) == {'step': 1}
    assert_same(values(net3), saved, rtol=0, atol=0)

    # A file that matches neither the json nor a kept previous version is
    # refused by name.
    os.remove(prefix + '.params.prev')
    with open(prefix + '.params', 'r+b') as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=r'ck\.params does not match .*ck\.json'):
        gp.load_checkpoint(prefix, net2, trainer2)


KILLED_SAVE = '''
    import os, sys, time
    import mxnet as mx
    from mxnet import gluon, nd
    import gluon_parallel as gp
    import checkpoint_runs as R
    import loops as T
    folder = %r
    net = T.conv_net()
    net.load_parameters(T.make_init(os.path.join(folder, 'init.params')), ctx=T.CTX[:2])
    trainer = gluon.Trainer(net.collect_params(), *T.SGD)
    R.train(net, trainer, T.make_batches([6]), T.CTX[:2])
    gp.save_checkpoint(os.path.join(folder, 'ck'), net, trainer, step=1)
    nd.save(os.path.join(folder, 'expected.params'),
            {k: nd.array(v[0]) for k, v in T.values(net).items()})
    R.train(net, trainer, T.make_batches([6], 2), T.CTX[:2])
    real_save = nd.save
    def slow_save(fname, data):        # dies half-way through writing
        real_save(fname, data)
        with open(fname, 'r+b') as f:
            f.truncate(os.path.getsize(fname) // 2)
        print('writing', flush=True)
        time.sleep(120)
    mx.nd.save = slow_save
    gp.save_checkpoint(os.path.join(folder, 'ck'), net, trainer, step=2)
'''


def test_killed_save_keeps_the_previous_checkpoint(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [HERE, os.path.dirname(HERE), os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.Popen([sys.executable, '-c', textwrap.dedent(KILLED_SAVE % str(tmp_path))],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()       # blocks until the save is under way
        assert line.strip() == 'writing', proc.stderr.read()
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert _leftovers(str(tmp_path)), 'the child was not killed in the middle of a save'
    net, trainer = _small_model(tmp_path, 1)
    assert gp.load_checkpoint(str(tmp_path / 'ck'), net, trainer) == {'step': 1}
    expected = {k: v.asnumpy() for k, v in nd.load(str(tmp_path / 'expected.params')).items()}
    assert_same(values(net), expected, rtol=0, atol=0)
    # The next save over the debris works.
    gp.save_checkpoint(str(tmp_path / 'ck'), net, trainer, step=3)
    assert gp.load_checkpoint(str(tmp_path / 'ck'), net, trainer) == {'step': 3}


def test_bad_files_are_named(tmp_path):
    net, trainer = _small_model(tmp_path, 0)
    prefix = str(tmp_path / 'ck')
    gp.save_checkpoint(prefix, net, trainer)
    target, target_trainer = _small_model(tmp_path, 1)
    untouched = values(target)

    def expect(error, pattern, *args, **kwargs):
        with pytest.raises(error, match=pattern):
            gp.load_checkpoint(*args, **kwargs)
        assert_same(values(target), untouched, rtol=0, atol=0, what='after a failed load: ')

    expect(FileNotFoundError, r'nothere\.params', str(tmp_path / 'nothere'), target)
    gp.save_checkpoint(str(tmp_path / 'notrainer'), net)
    expect(ValueError, r'notrainer\.json was saved without a trainer',
           str(tmp_path / 'notrainer'), target, target_trainer)

    with open(prefix + '.states', 'rb') as f:
        states = f.read()
    with open(prefix + '.params', 'rb') as f:
        params = f.read()
    # Truncated: named via the size and digest recorded in the json...
    with open(prefix + '.params', 'wb') as f:
        f.write(params[:len(params) // 2])
    expect(ValueError, r'ck\.params does not match', prefix, target, target_trainer)
    # ...and named by the loader without a json.
    os.rename(prefix + '.json', prefix + '.json.bak')
    expect(ValueError, r'ck\.params is not a readable MXNet parameter file', prefix, target)
    with open(prefix + '.params', 'wb') as f:
        f.write(b'not a parameter file at all' * 10)
    expect(ValueError, r'ck\.params is not a readable MXNet parameter file', prefix, target)
    # A parameter file of another model names the parameter.
    nd.save(prefix + '.params', {'0.weight': nd.zeros((4, 2, 3, 3)), 'dense.bias': nd.zeros(3)})
    expect(ValueError, r'ck\.params has no value for parameters 0\.bias', prefix, target)
    nd.save(prefix + '.params', {k: nd.array(v[0][..., None]) for k, v in values(net).items()})
    expect(ValueError, r'ck\.params: parameter .* has shape', prefix, target)
    # Trainer states: truncated, foreign, wrong optimizer.
    with open(prefix + '.params', 'wb') as f:
        f.write(params)
    os.rename(prefix + '.json.bak', prefix + '.json')
    with open(prefix + '.states', 'wb') as f:
        f.write(states[:len(states) // 2])
    expect(ValueError, r'ck\.states does not match', prefix, target, target_trainer)
    os.rename(prefix + '.json', prefix + '.json.bak')
    expect(ValueError, r'ck\.states is not a readable trainer state', prefix, target,
           target_trainer)
    with open(prefix + '.states', 'wb') as f:
        f.write(states)
    adam = gluon.Trainer(target.collect_params(), *ADAM)
    expect(ValueError, r'ck\.states holds the state of a SGD optimizer, but the trainer uses '
           r'Adam', prefix, target, adam)
    expect(ValueError, r'ck\.states holds the states of 1 trainer, but 2 were given',
           prefix, target, [target_trainer, adam])
    os.remove(prefix + '.states')
    expect(FileNotFoundError, r'ck\.states does not exist', prefix, target, target_trainer)
    # A broken description.
    with open(prefix + '.json', 'w') as f:
        f.write('{"format": "gluon_parallel.checkp')
    expect(ValueError, r'ck\.json is not a readable checkpoint', prefix, target)
    with open(prefix + '.json', 'w') as f:
        json.dump({'hello': 1}, f)
    expect(ValueError, r'ck\.json is not a gluon_parallel checkpoint', prefix, target)
    with pytest.raises(TypeError, match='JSON'):
        gp.save_checkpoint(prefix, net, trainer, when=object())


def test_save_warns_when_trained_copies_differ(tmp_path):
    net, trainer = _small_model(tmp_path, 0)
    weight = net[0].weight
    with autograd.pause():
        weight.data(CTX[1])[:] += 1     # something wrote to one copy only
    with pytest.warns(RuntimeWarning, match=r'0\.weight differs between its contexts'):
        gp.save_checkpoint(str(tmp_path / 'ck'), net, trainer)
    saved = nd.load(str(tmp_path / 'ck.params'))['0.weight'].asnumpy()
    np.testing.assert_allclose(saved, weight.data(CTX[0]).asnumpy() + 0.5, rtol=1e-5)


def test_save_right_after_a_predict_forward(tmp_path):
    """The MKL-DNN in-place weight reorder of a predict-mode forward
    (tests/predict_race.py) never reaches a checkpoint: every round loads
    back the values the network holds."""
    prefix = str(tmp_path / 'ck')
    for r in range(predict_race.ROUNDS):
        net = predict_race.fresh_after_predict([mx.cpu(0)], seed=r)
        gp.save_checkpoint(prefix, net)
        saved = {k: v.asnumpy() for k, v in nd.load(prefix + '.params').items()}
        predict_race.assert_values(saved, predict_race.settled_values(net), f'round {r:d}')
