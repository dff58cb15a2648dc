"""Print, as JSON, how many engine operations a graph-mode backward of a
12-layer MLP on 2 CPU contexts runs for the network's operators (those of
the network executor's backward: a bulked segment, which MXNet's profiler
names ``[op1,op2,...]``, counts once), for a gp.Trainer with the kvstore
named by argv[1] ('device', or 'dist_sync': the Trainer's dist kvstore is
created at its first step, which never comes here)."""
import json
import os
import sys
import tempfile

import mxnet as mx
from mxnet import autograd, gluon, nd

import gluon_parallel as gp

# The profiler dump's reader: benchmarks/bench_engine_ops.py's.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..',
                                'benchmarks'))
from bench_engine_ops import operator_counts  # noqa: E402

ctx = [mx.cpu(i) for i in range(2)]
net = gluon.nn.HybridSequential()
for _ in range(12):
    net.add(gluon.nn.Dense(16, activation='relu', in_units=16))
net.initialize(ctx=ctx)
net.hybridize()
trainer = gp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, kvstore=sys.argv[1])
dp = gp.DataParallel(net, ctx, graph=True)
loss = gp.DataParallelLoss(gluon.loss.L2Loss())
x, y = nd.ones((8, 16)), nd.zeros((8, 16))


def step():
    with autograd.record():
        losses = loss(dp(x), y)
    autograd.backward(losses)
    nd.waitall()


step()          # executors bound before the profiler runs (else MXNet bulks nothing)
mx.profiler.set_config(profile_all=True, aggregate_stats=True,
                       filename=os.path.join(tempfile.mkdtemp(), 'profile.json'))
mx.profiler.set_state('run')
step()
mx.profiler.set_state('stop')
counts = operator_counts(mx.profiler.dumps(reset=True))
backward = sum(n for op, n in counts.items() if '_backward_FullyConnected' in op)
print(json.dumps({'path': dp.last_path, 'backward_operations': backward}))
