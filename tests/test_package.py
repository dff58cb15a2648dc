"""The package's namespace (gluon_parallel/__init__.py): its public names
load on first use, and nothing else shows in it."""
import types

import mxnet as mx
from mxnet import gluon

import gluon_parallel as gp


def _use_the_package():
    """Touch what a training script touches, so that the submodules behind
    the public names are imported (Python binds each in the package)."""
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize(ctx=[mx.cpu(0)])
    with gp.DataParallel(net, [mx.cpu(0)]) as dp:
        dp(mx.nd.ones((2, 3)))
    assert gp.nn.SyncBatchNorm and gp.dist.rank() == 0 and gp.Trainer and gp.export


def test_dir_lists_the_public_names_only():
    _use_the_package()
    names = [n for n in dir(gp) if not (n.startswith('__') and n.endswith('__'))]
    assert names == sorted(gp.__all__)
    assert '__version__' in dir(gp)


def test_no_foreign_module_in_the_namespace():
    """Every module bound in the package is one of its own submodules (an
    ``import importlib`` at the top showed in ``dir(gluon_parallel)``)."""
    _use_the_package()
    foreign = [name for name, value in vars(gp).items()
               if isinstance(value, types.ModuleType)
               and not value.__name__.startswith('gluon_parallel.')]
    assert not foreign


def test_every_public_name_resolves():
    for name in gp.__all__:
        assert getattr(gp, name) is not None
