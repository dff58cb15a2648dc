"""Train a hybridized network in graph mode until interrupted (a test sends
SIGINT once it prints 'stepping')."""
import mxnet as mx
from mxnet import autograd, gluon, nd

import gluon_parallel as gp

ctx = [mx.cpu(i) for i in range(4)]
net = gluon.nn.HybridSequential()
for _ in range(6):
    net.add(gluon.nn.Conv2D(32, 3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation('relu'))
net.add(gluon.nn.Dense(10))
net.initialize(ctx=ctx)
net.hybridize()
dp = gp.DataParallel(net, ctx, graph=True)
# Updates in Python: with update_on_kvstore (Gluon's default on several
# devices) MXNet runs the optimizer in a ctypes callback, and a SIGINT that
# lands there raises KeyboardInterrupt inside it, which ctypes prints and
# drops ("Exception ignored on calling ctypes callback function"): the
# script would train on (seen once in about ten runs on a fast machine).
trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01},
                        update_on_kvstore=False)
x, y = nd.random.uniform(shape=(64, 3, 32, 32)), nd.zeros(64)
loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
for step in range(100000):
    with autograd.record():
        losses = loss(dp(x), y)
    autograd.backward(losses)
    trainer.step(64)
    if step == 1:
        print('stepping', flush=True)
