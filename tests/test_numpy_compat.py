"""gluon_parallel_numpy_compat: mxnet 1.9.1 under numpy 1.23, 1.26 and 2.x.

The start-up hook acts when Python starts (site-packages' .pth), so most
tests run a fresh interpreter of this environment. Under numpy 1.23 they
check that the hook changes nothing; .ci/run also runs them under numpy
1.26 and 2.1, where mxnet cannot be imported without it.
"""
import ast
import json
import os
import subprocess
import sys
import types
import warnings

import pytest

import gluon_parallel_numpy_compat as compat

OFF = {compat.OFF_ENV: '0'}


def python(code, **env):
    """Run `code` in a fresh interpreter of this environment; its output is
    JSON on its last line. Returns (returncode, parsed last line or None,
    all output)."""
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, **env))
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        result = None
    return proc.returncode, result, proc.stdout + proc.stderr


# A DataParallel forward and backward over two devices, mx.np and boolean
# indexing (numpy.bool), after both imports.
USE = """
from mxnet import autograd, gluon
net = gluon.nn.Dense(3, in_units=4)
net.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
dp = gp.DataParallel(net, [mx.cpu(0), mx.cpu(1)])
x = mx.nd.ones((4, 4))
with autograd.record():
    outs = dp(x)
    losses = [o.sum() for o in outs]
autograd.backward(losses)
a = mx.np.array([1.0, 2.0, 3.0])
import numpy, json
print(json.dumps({'rows': sum(o.shape[0] for o in outs), 'picked': a[a > 1].tolist(),
                  'numpy': numpy.__version__}))
"""


@pytest.mark.parametrize('first', ['mxnet', 'gluon_parallel'])
def test_import_mxnet_and_gluon_parallel_in_either_order(first):
    imports = {'mxnet': 'import mxnet as mx\nimport gluon_parallel as gp\n',
               'gluon_parallel': 'import gluon_parallel as gp\n'
                                 'from gluon_parallel import DataParallel\nimport mxnet as mx\n'}
    rc, result, out = python(imports[first] + USE)
    assert rc == 0, out
    assert result['rows'] == 4 and result['picked'] == [2.0, 3.0], out


PROBE = """
import json, sys
import numpy
import gluon_parallel_numpy_compat as compat
before = sorted(vars(numpy))
missing = compat.missing_names(numpy)
error = None
if {import_mxnet}:
    try:
        import mxnet
    except Exception as exc:
        error = type(exc).__name__
print(json.dumps({{'installed': compat.installed(), 'missing': missing, 'error': error,
                  'added': sorted(set(vars(numpy)) - set(before)),
                  'names_added': sorted(set(compat.NAMES) & set(vars(numpy)) - set(before)),
                  'mxnet': 'mxnet' in sys.modules}}))
"""


def test_off_switch_leaves_numpy_and_mxnet_alone():
    rc, result, out = python(PROBE.format(import_mxnet=True), **OFF)
    assert rc == 0, out
    assert not result['installed'] and result['names_added'] == [], out
    # Where numpy lacks a name mxnet reads, mxnet's import fails as it
    # does without the hook; where it has them all (1.23), it works.
    assert result['error'] == ('AttributeError' if result['missing'] else None), out


def test_hook_provides_what_is_missing_when_mxnet_is_imported():
    rc, result, out = python(PROBE.format(import_mxnet=True))
    assert rc == 0, out
    assert result['error'] is None and result['mxnet'], out
    assert result['names_added'] == sorted(result['missing']), out
    assert not result['installed'], out     # its work done, it left sys.meta_path


def test_hook_leaves_numpy_untouched_without_mxnet():
    # The launcher and the package itself import without mxnet.
    code = PROBE.format(import_mxnet=False).replace(
        'error = None', 'error = None\nimport gluon_parallel, gluon_parallel.launch')
    rc, result, out = python(code)
    assert rc == 0, out
    assert result['installed'], out         # waiting for mxnet, at start-up
    assert result['added'] == [] and not result['mxnet'], out


def fake_numpy(**names):
    module = types.ModuleType('numpy')
    module.all = lambda a, **kw: ('all', a, kw)
    module.any = lambda a, **kw: ('any', a, kw)
    module.sort = lambda a, **kw: ('sort', a, kw)
    module.trapezoid = lambda y, **kw: ('trapezoid', y, kw)
    module.isin = lambda a, b: [x in b for x in a]
    module.ravel = lambda a: [x for row in a for x in row]
    vars(module).update(names)
    return module


def test_patch_sets_only_what_numpy_lacks():
    mine = object()
    numpy = fake_numpy(bool=mine, NaN=mine)
    added = compat.patch_numpy(numpy)
    assert 'bool' not in added and 'NaN' not in added
    assert numpy.bool is mine and numpy.NaN is mine
    assert compat.missing_names(numpy) == [] and compat.patch_numpy(numpy) == []
    assert numpy.int is int and numpy.object is object and numpy.PZERO == 0.0
    assert str(numpy.NZERO) == '-0.0' and numpy.NINF == -float('inf')
    # numpy 1.x's functions call today's, as numpy 1.x's did.
    assert numpy.alltrue([1], axis=0) == ('all', [1], {'axis': 0})
    assert numpy.sometrue([1]) == ('any', [1], {})
    assert numpy.msort([3, 1]) == ('sort', [3, 1], {'axis': 0})
    assert numpy.trapz([1, 2], dx=2) == ('trapezoid', [1, 2], {'dx': 2})
    assert numpy.in1d([[1, 2], [3, 4]], [2, 3]) == [False, True, True, False]
    assert numpy.alltrue is not numpy.all
    assert numpy.compat.basestring is str
    with pytest.raises(RuntimeError, match='numpy_financial'):
        numpy.npv(0.1, [1, 2])


def test_install_twice_and_uninstall():
    assert not compat.installed()           # mxnet is imported in this process
    try:
        compat.uninstall()
        sys.modules.setdefault('mxnet', None)
        compat.install()        # mxnet imported: patches numpy at once, no finder
        assert not compat.installed()
    finally:
        compat.uninstall()


def numpy_reads(package_dir):
    """{name: files} of the attributes of numpy that the .py files under
    `package_dir` read (``import numpy as X`` then ``X.name``), and of the
    names mxnet's numpy_dispatch_protocol.py registers by string."""
    reads = {}
    for folder, _, files in os.walk(package_dir):
        for file in files:
            if not file.endswith('.py'):
                continue
            path = os.path.join(folder, file)
            with open(path, encoding='utf-8') as f:
                tree = ast.parse(f.read())
            aliases = {alias.asname or alias.name for node in ast.walk(tree)
                       if isinstance(node, ast.Import) for alias in node.names
                       if alias.name == 'numpy'}
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                        and node.value.id in aliases:
                    reads.setdefault(node.attr, set()).add(file)
                if file == 'numpy_dispatch_protocol.py' and isinstance(node, ast.List):
                    for item in node.elts:
                        if isinstance(item, ast.Constant) and isinstance(item.value, str) \
                                and '.' not in item.value:
                            reads.setdefault(item.value, set()).add(file)
    return reads


def test_every_numpy_name_mxnet_reads_is_there():
    import mxnet
    import numpy
    reads = numpy_reads(os.path.dirname(mxnet.__file__))
    assert {'bool', 'PZERO', 'alltrue', 'sometrue', 'mirr'} <= set(reads)   # the scan works
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        lacking = {name: files for name, files in reads.items() if not hasattr(numpy, name)}
    assert lacking == {}, f'numpy {numpy.__version__} lacks what mxnet reads: {lacking}'
