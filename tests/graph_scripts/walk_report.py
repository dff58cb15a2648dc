"""The walk of one steady-state training step through gluon_parallel, part
by part (tests/walk.py): (a)-(d) a hybridized Conv/BatchNorm/Dense network
in graph mode on two CPU contexts, (e) the same with SyncBatchNorm, (f)
SyncBatchNorm with DataParallel(graph=False). Prints each part's stops,
modules and re-entries (all, and without _gluon), then its stops."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mxnet.gluon import nn                                  # noqa: E402

import gluon_parallel as gp                                 # noqa: E402
import walk                                                 # noqa: E402

CASES = [('BatchNorm, graph mode', nn.BatchNorm, 'auto', 'abcd'),
         ('SyncBatchNorm, graph mode', gp.nn.SyncBatchNorm, 'auto', 'e'),
         ('SyncBatchNorm, graph=False', gp.nn.SyncBatchNorm, False, 'f')]
CALLS = [('network', 'dp(x)'), ('loss', 'dpl(out, y)'), ('backward', 'autograd.backward(losses)'),
         ('step', 'trainer.step(B)')]


def label(letters, i):
    return letters[i] if len(letters) > 1 else f'{letters}.{"abcd"[i]}'


def stop(s):
    thread = '' if s.thread == 'caller' else f', thread {s.thread}'
    return f'{s.module}.{s.function} <- {s.caller}  (depth {s.depth}{thread})'


def main():
    walk.follow_threads()                 # the pool's threads start during the warm-up
    table, details = [], []
    for title, bn, graph, letters in CASES:
        walks, path = walk.step_walks(bn, graph)
        if graph == 'auto':
            assert path == 'graph', f'{title}: dp.last_path is {path!r}'
        for i, (part, call) in enumerate(CALLS):
            w, inner = walks[part], walks[part].without_gluon()
            name = f'({label(letters, i)}) {title}: {call}'
            table.append(f'{name:<58} {w.stops:>5} {w.modules:>3} {w.reentries:>4}'
                         f'   {inner.stops:>5} {inner.modules:>3} {inner.reentries:>4}')
            details.append(f'\n{name}  [dp.last_path={path}]\n  {w.summary()}; '
                           f'without _gluon: {inner.summary()}')
            details += [f'  {n:3d}. {stop(s)}' for n, s in enumerate(w.all_stops, 1)]
    print(f'{"":<58} {"all":^16}   {"without _gluon":^16}')
    print(f'{"call":<58} {"stops":>5} {"mod":>3} {"re":>4}   {"stops":>5} {"mod":>3} {"re":>4}')
    print('\n'.join(table))
    print('\n'.join(details))


if __name__ == '__main__':
    main()
