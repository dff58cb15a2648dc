"""SyncBatchNorm in graph mode against BatchNorm on the whole batch, in
every usage pattern of usage_patterns.py (weights and running statistics
on every context); run with MXNET_MKLDNN_ENABLED=0 or 1. Prints one line
per pattern and whether the calls ran in graph mode."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mxnet as mx                                          # noqa: E402
from mxnet.gluon import nn                                  # noqa: E402

import gluon_parallel as gp                                # noqa: E402
import usage_patterns as up                                 # noqa: E402

ctx = [mx.cpu(i) for i in range(4)]
for pattern in sys.argv[1:] or up.PATTERNS:
    net = up.build(nn.BatchNorm, ctx[:1], {})
    ref = up.run(pattern, net, up.whole_batch(net, ctx[:1]))
    sync = up.build(gp.nn.SyncBatchNorm, ctx, {})
    forward = up.data_parallel(sync, ctx)
    got = up.run(pattern, sync, forward)
    up.assert_close(got, ref, rtol=2e-4, what=pattern + ': ')
    for k, copies in got.items():
        assert all((c == copies[0]).all() for c in copies), f'{pattern}: {k} differs by context'
    print(pattern, 'ok, graph mode:', forward.dp.graph_mode.binds > 0, flush=True)
