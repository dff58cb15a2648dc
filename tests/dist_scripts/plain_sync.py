"""A dist_sync job in plain MXNet, importing nothing from gluon_parallel:
the launcher's fail-fast must hold for such scripts too.

Every role runs it (``import mxnet`` runs the scheduler's and servers'
loops and exits). Each worker pushes ``(rank + 1) * (round + 1)`` to one
key for ``ROUNDS`` rounds, pulls the sum, and prints
``round R sum S`` for each round.

``argv[1]``:
ok     every worker completes
raise  worker 1 completes round 0, then raises: the others wait for its
       round-1 push forever, and it would wait for them in ps-lite's
       finalisation at exit
exit   as raise, with ``sys.exit(3)``
"""
import sys

import mxnet as mx

ROUNDS = 3
SHAPE = (2, 3)


def main(mode):
    kv = mx.kv.create('dist_sync')
    kv.init(7, mx.nd.zeros(SHAPE))
    out = mx.nd.zeros(SHAPE)
    for r in range(ROUNDS):
        if r == 1 and kv.rank == 1 and mode == 'raise':
            raise RuntimeError('worker 1 raises in round 1')
        if r == 1 and kv.rank == 1 and mode == 'exit':
            print('worker 1 exits with status 3', file=sys.stderr, flush=True)
            sys.exit(3)
        kv.push(7, mx.nd.full(SHAPE, (kv.rank + 1) * (r + 1)))
        kv.pull(7, out=out)
        values = set(out.asnumpy().ravel().tolist())
        sums = ' '.join(f'{v:g}' for v in values)
        print(f'rank {kv.rank:d} round {r:d} sum {sums}', flush=True)


if __name__ == '__main__':
    main(sys.argv[1])
