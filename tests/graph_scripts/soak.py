"""Soak: ResNet-20 (GluonCV CIFAR) training steps in graph mode on 4
contexts; prints a JSON line: steps, RSS after warm-up and at the end,
thread counts, whether graph mode ran. Usage: soak.py STEPS BATCH SYNC(0|1)."""
import json
import sys
import threading

import mxnet as mx
import numpy as np
import psutil
from gluoncv.model_zoo import get_model
from mxnet import autograd, gluon, nd

import gluon_parallel as gp

steps, batch, sync = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == '1'
ctx = [mx.cpu(i) for i in range(4)]
kwargs = {'norm_layer': gp.nn.SyncBatchNorm} if sync else {}
net = get_model('cifar_resnet20_v1', classes=10, **kwargs)
net.initialize(mx.init.Xavier(), ctx=ctx)
net.hybridize()
dp = gp.DataParallel(net, ctx, graph=True)
trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.05, 'momentum': 0.9})
loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
rng = np.random.RandomState(0)
x = nd.array(rng.normal(size=(batch, 3, 32, 32)))
y = nd.array(rng.randint(0, 10, batch))
proc = psutil.Process()
warmup = max(steps // 10, 5)
for step in range(steps):
    n = batch if step % 7 else batch - 1          # an uneven batch now and then
    with autograd.record():
        losses = loss(dp(x[:n]), y[:n])
    autograd.backward(losses)
    trainer.step(n)
    if step == warmup - 1:
        nd.waitall()
        rss0, threads0 = proc.memory_info().rss, threading.active_count()
nd.waitall()
value = float(sum(l.sum().asscalar() for l in losses))
print(json.dumps({'steps': steps, 'rss0': rss0, 'rss1': proc.memory_info().rss,
                  'threads0': threads0, 'threads1': threading.active_count(),
                  'binds': dp.graph_mode.binds, 'finite': bool(np.isfinite(value))}))
