"""Nothing is patched by importing: MXNet's HybridBlock._call_cached_op and
MXAutogradBackwardEx stay MXNet's until the feature that needs each is
first used (a parallel call, or a reducer, while a SyncBatchNorm is alive; a
graph-mode call), and each patch can be removed. In child processes: a
patch of this process's MXNet would hide the import's."""
import subprocess
import sys

IMPORT_ALL = '''
import importlib, os, pkgutil
import mxnet as mx
from mxnet import gluon
call, backward = gluon.HybridBlock._call_cached_op, mx.base._LIB.MXAutogradBackwardEx
import gluon_parallel
names = [m.name for m in pkgutil.walk_packages(gluon_parallel.__path__, 'gluon_parallel.')
         if '.startup' not in m.name and not m.name.endswith('__main__')]
for name in names:
    importlib.import_module(name)
assert len(names) > 40, names
assert gluon.HybridBlock._call_cached_op is call, 'HybridBlock._call_cached_op was patched'
assert mx.base._LIB.MXAutogradBackwardEx is backward, 'MXAutogradBackwardEx was patched'
print('ok', len(names))
'''

FIRST_USE = '''
import mxnet as mx
from mxnet import autograd, gluon, nd
import gluon_parallel as gp
from gluon_parallel import _gluon
call, backward = gluon.HybridBlock._call_cached_op, mx.base._LIB.MXAutogradBackwardEx

net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(4))
dp = gp.DataParallel(net, [mx.cpu(0), mx.cpu(1)], graph=True)
net.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
net.hybridize()
def routed():
    return gluon.HybridBlock._call_cached_op is not call

x = nd.ones((4, 3))
plain = gp.DataParallel(net, [mx.cpu(0), mx.cpu(1)], graph=False)
with autograd.record():
    plain(x)
plain.close()
assert not routed(), 'routed without any SyncBatchNorm'
synced = gluon.nn.HybridSequential()
synced.add(gluon.nn.Dense(4), gp.nn.SyncBatchNorm())
synced.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
synced.hybridize()
assert not routed(), 'a SyncBatchNorm constructed routes nothing'
dps = gp.DataParallel(synced, [mx.cpu(0), mx.cpu(1)], graph=False)
with autograd.record():
    dps(x)
assert routed(), 'a parallel call with a SyncBatchNorm alive routes calls'
_gluon.unroute_cached_op_calls()
assert not routed(), 'the route is removable'
gp.parallel_apply(synced, [x[:2].as_in_context(mx.cpu(0)), x[2:].as_in_context(mx.cpu(1))])
assert routed(), 'parallel_apply routes calls again'
_gluon.unroute_cached_op_calls()
synced[1].reducer = lambda layer, totals: totals
assert routed(), 'a layer given a reducer routes calls (it synchronises outside parallel calls)'
synced[1].reducer = None
_gluon.unroute_cached_op_calls()
dps.close()

assert mx.base._LIB.MXAutogradBackwardEx is backward, 'hooked before a graph-mode call'
with autograd.record():
    loss = sum(o.sum() for o in dp(x))
assert mx.base._LIB.MXAutogradBackwardEx is not backward, 'the graph-mode call hooks backward'
loss.backward()
_gluon.remove_after_backward()
assert mx.base._LIB.MXAutogradBackwardEx is backward, 'the hook is removable'
print('ok')
'''


OWNED = '''
import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd
import gluon_parallel as gp
backward = mx.base._LIB.MXAutogradBackwardEx
ctx = [mx.cpu(0), mx.cpu(1)]

def parallel(seed):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4, in_units=3))
    net.initialize(ctx=ctx)
    net.hybridize()
    return net, gp.DataParallel(net, ctx, graph=True)

def hooked():
    return mx.base._LIB.MXAutogradBackwardEx is not backward

x = nd.ones((4, 3))
net1, dp1 = parallel(0)
net2, dp2 = parallel(0)
dp1(x)
assert hooked(), 'the first graph-mode call installs the hook'
dp1.close()
assert not hooked(), 'its only user closed: removed'
dp1b = gp.DataParallel(net1, ctx, graph=True)
dp1b(x)
with autograd.record():
    loss = sum(o.sum() for o in dp2(x))
assert hooked()
dp1b.close()
assert hooked(), 'dp2 still uses it'
dp2.close()
assert hooked(), 'a recorded call of dp2 still waits for its backward'
loss.backward()
assert not hooked(), 'served, and no user left: removed'
grads = [p.grad(ctx[1]).asnumpy() for p in net2.collect_params().values()]
with autograd.record():
    plain = sum(net1(xi).sum() for xi in gluon.utils.split_and_load(x, ctx))
plain.backward()
for got, p in zip(grads, net1.collect_params().values()):
    np.testing.assert_allclose(got, p.grad(ctx[1]).asnumpy(), rtol=1e-6)
print('ok')
'''


def _run(code):
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_importing_every_module_patches_nothing():
    assert _run(IMPORT_ALL).startswith('ok')


def test_patches_are_installed_on_first_use_and_removable():
    assert _run(FIRST_USE).strip() == 'ok'


def test_the_backward_hook_is_held_by_the_runners_that_use_it():
    """Installed by a DataParallel's first graph-mode call, kept while
    another DataParallel uses it or a recorded call waits for its backward
    (which still gets its gradients after its DataParallel closed), removed
    once neither is left."""
    assert _run(OWNED).strip() == 'ok'
