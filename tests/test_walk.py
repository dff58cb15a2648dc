"""ARCHITECTURE.md's walk of one recorded graph-mode step: "each module is
entered once on the way down; _gluon/ (the MXNet boundary) is called from
several" (tests/walk.py records the stops)."""
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
