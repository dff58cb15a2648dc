"""ARCHITECTURE.md's walk of one recorded graph-mode step: each module is
entered once on the way down (_gluon/, the MXNet boundary, is called from
several), and the numbered stops it lists are the modules each part of the
step enters (the network's call, the loss's, the backward pass, the
Trainer's step), in order and as often (tests/walk.py records the
stops)."""
import os
import re

import pytest
from mxnet.gluon import nn

import gluon_parallel as gp
import walk


def entered_twice(w):
    """The message naming each module entered more than once, and by what."""
    return '\n'.join(f'{m} entered {len(stops)} times:\n' +
                     '\n'.join(f'    {s}' for s in stops)
                     for m, stops in w.entered_again().items())


@pytest.mark.parametrize('bn', [nn.BatchNorm, gp.nn.SyncBatchNorm],
                         ids=['BatchNorm', 'SyncBatchNorm'])
def test_graph_mode_call_enters_each_module_once(bn):
    """In a steady-state step, the network's graph-mode call dp(x) and the
    loss's dpl(out, y), each under record, enter every gluon_parallel module
    outside _gluon at most once (a SyncBatchNorm network too: its checks
    come through syncgraph/in_graph.py once, not per layer)."""
    walks, path = walk.step_walks(bn)
    assert path == 'graph'
    failures = []
    for part, call in (('network', 'dp(x)'), ('loss', 'dpl(out, y)')):
        w = walks[part].without_gluon()
        if w.reentries:
            failures.append(f'{call}: {w.summary()} (without _gluon)\n{entered_twice(w)}')
    assert not failures, '\n\n'.join(failures)


ARCHITECTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            'ARCHITECTURE.md')
STOP = re.compile(r'^\d+\. `([^`]+)`', re.M)


def documented_stops(start, end):
    """The modules ARCHITECTURE.md's numbered stops name, in order, between
    the lines `start` and `end` (each stop opens with `path/module.name`)."""
    text = open(ARCHITECTURE).read()
    text = text[text.index(start):]
    text = text[:text.index(end)]
    modules = []
    for ref in STOP.findall(text):
        head = ref.split('.')[0].replace('/', '.')
        modules.append('gluon_parallel.' + head.removesuffix('.__init__'))
    return modules


def entered(w):
    """The modules outside _gluon a walk enters, in order."""
    return [s.module for s in w.without_gluon().counted]


def test_architecture_lists_the_stops_of_a_recorded_step():
    """ARCHITECTURE.md's walk of dp(x), dpl(out, y) and a SyncBatchNorm
    network's dp(x) is the walk the code takes: the same modules, in the
    same order."""
    network = documented_stops("#### The network's call", '#### The loss')
    loss = documented_stops("#### The loss's call", '#### `autograd.backward')
    synced = documented_stops('### One SyncBatchNorm call', 'Everything else')
    walks, _ = walk.step_walks()
    assert entered(walks['network']) == network
    assert entered(walks['loss']) == loss
    walks, _ = walk.step_walks(gp.nn.SyncBatchNorm)
    after = network.index('gluon_parallel.nested') + 1
    assert entered(walks['network']) == network[:after] + synced + network[after:]


def test_architecture_lists_the_stops_of_backward_and_the_step():
    """ARCHITECTURE.md's walk of autograd.backward(losses) and
    trainer.step(B) is the walk the code takes, each module entered as
    often as the numbered stops say (a BatchNorm and a SyncBatchNorm
    network alike)."""
    backward = documented_stops('#### `autograd.backward', '#### `trainer.step')
    step = documented_stops('#### `trainer.step', '### One SyncBatchNorm call')
    for bn in (nn.BatchNorm, gp.nn.SyncBatchNorm):
        walks, path = walk.step_walks(bn)
        assert path == 'graph'
        assert entered(walks['backward']) == backward, bn
        assert entered(walks['step']) == step, bn
