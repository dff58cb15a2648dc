"""Soak: ResNet-20 (GluonCV CIFAR) training steps in graph mode on 4
contexts; prints soaking.measure's JSON line, with whether graph mode ran
(executors bound) and the last loss finite. Usage: soak.py STEPS BATCH
SYNC(0|1)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mxnet as mx                                          # noqa: E402
import numpy as np                                         # noqa: E402
from gluoncv.model_zoo import get_model                     # noqa: E402
from mxnet import autograd, gluon, nd                      # noqa: E402

import gluon_parallel as gp                                # noqa: E402
import soaking                                             # noqa: E402

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
done, last = [0], []


def calls(k):
    for _ in range(k):
        n = batch if (done[0] + 1) % 7 else batch - 1     # an uneven batch now and then
        with autograd.record():
            losses = loss(dp(x[:n]), y[:n])
        autograd.backward(losses)
        trainer.step(n)
        done[0] += 1
    nd.waitall()
    last[:] = losses


soaking.measure(calls, max(steps // 10, 5), steps, binds=lambda: dp.graph_mode.binds,
                finite=lambda: bool(np.isfinite(sum(float(v.sum().asscalar()) for v in last))))
