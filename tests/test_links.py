"""links.py: the core and gluon_parallel.dist share it, so a one-machine
program loads neither the launcher nor dist."""
import subprocess
import sys

_ONE_MACHINE = """
import sys
import mxnet as mx
from mxnet import autograd, gluon
import gluon_parallel as gp
net = gluon.nn.Dense(3, in_units=4)
ctx = [mx.cpu(0), mx.cpu(1)]
net.initialize(ctx=ctx)
dp = gp.DataParallel(net, ctx)
trainer = gp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
with autograd.record():
    y = dp(mx.nd.ones((4, 4)))
autograd.backward(y)
trainer.step(4)
print([m for m in sys.modules if m.startswith(('gluon_parallel.launch', 'gluon_parallel.dist'))])
"""


def test_one_machine_loads_no_launch_nor_dist_module():
    out = subprocess.run([sys.executable, '-c', _ONE_MACHINE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == '[]'


def test_dist_kvstore_still_names_the_shared_helpers():
    from gluon_parallel import links
    from gluon_parallel.dist import kvstore
    assert kvstore.is_dist is links.is_dist and kvstore.lock is links.lock
    assert links.is_dist('dist_sync') and links.is_dist('horovod') and not links.is_dist('device')
