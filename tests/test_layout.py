"""The package's layout: no import cycle, every module imports on its own,
and MXNet's private attributes are touched only behind the _gluon/ package."""
import ast
import inspect
import os
import re
import subprocess
import sys

import mxnet
import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'gluon_parallel')
BOUNDARY = '_gluon' + os.sep


def modules():
    """{dotted name: path} of every module of the package."""
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith('.py'):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, '.')
                out[rel[:-len('.__init__')] if rel.endswith('.__init__') else rel] = path
    return out


def _resolve(name, is_pkg, node):
    """Absolute module names a module-level import statement loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = name if is_pkg else name.rsplit('.', 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit('.', 1)[0]
    mod = node.module if node.level == 0 else '.'.join(filter(None, [base, node.module]))
    # `from . import x` may name a submodule
    return [mod] + [f'{mod}.{a.name}' for a in node.names]


def import_graph():
    mods = modules()
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(open(path).read())
        deps = set()
        for node in ast.walk(tree):     # function-level imports too: a cycle all the same
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for dep in _resolve(name, path.endswith('__init__.py'), node):
                    if dep in mods and dep != name:
                        deps.add(dep)
        graph[name] = deps
    return graph


def find_cycle(graph):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            # a package's __init__ importing its own submodules is no cycle
            # unless that submodule imports the package back
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                cycle = visit(d)
                if cycle:
                    return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            cycle = visit(n)
            if cycle:
                return cycle
    return None


def test_no_import_cycle():
    graph = import_graph()
    # A submodule reaching its own package's __init__ (which re-exports the
    # submodule) is how packages work; any other back edge is a cycle.
    pruned = {n: {d for d in deps if not n.startswith(d + '.')} for n, deps in graph.items()}
    assert find_cycle(pruned) is None, 'import cycle: {}'.format(' -> '.join(find_cycle(pruned)))


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
    assert find_cycle({'a': {'b'}, 'b': set()}) is None


def test_every_module_imports_on_its_own():
    code = '''
import importlib, sys
for name in sys.argv[1:]:
    for m in [m for m in sys.modules if m == 'gluon_parallel' or m.startswith('gluon_parallel.')]:
        del sys.modules[m]
    importlib.import_module(name)
print('ok')
'''
    names = sorted(n for n in modules() if n != 'gluon_parallel.launch.__main__')
    proc = subprocess.run([sys.executable, '-c', code] + names, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=os.path.dirname(PKG)))
    assert proc.returncode == 0 and proc.stdout.strip() == 'ok', proc.stderr[-3000:]


def _mxnet_private_names():
    """Underscored attribute names that MXNet's Python sources assign on
    their objects or define as methods."""
    root = os.path.dirname(mxnet.__file__)
    names = set()
    for sub in ('gluon', 'kvstore', 'ndarray', 'optimizer', 'contrib', '.'):
        folder = os.path.join(root, sub)
        for dirpath, _, files in os.walk(folder):
            for f in files:
                if f.endswith('.py'):
                    text = open(os.path.join(dirpath, f), errors='replace').read()
                    names.update(re.findall(r'self\.(_[a-z]\w*)\s*=', text))
                    names.update(re.findall(r'^\s*def (_[a-z]\w*)\(self', text, re.M))
            if sub == '.':
                break
    return names


# Underscored names that are not private, each with why.
NOT_PRIVATE = {
    # namedtuple's documented API (underscored so as not to clash with fields)
    '_make': 'namedtuple', '_replace': 'namedtuple', '_fields': 'namedtuple',
    '_asdict': 'namedtuple',
}
# (module, name): why the module may name another object's private attribute.
ALLOWED_PRIVATE = {}
ATTRIBUTE_FUNCTIONS = ('getattr', 'setattr', 'hasattr', 'delattr')


def _is_super(node):
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
        and node.func.id == 'super'


def _is_own(node):
    """`node` is self, cls or super(): a class's own state (a subclass of a
    Gluon class uses its inherited state as Gluon's subclasses do)."""
    return isinstance(node, ast.Name) and node.id in ('self', 'cls') or _is_super(node)


def _literal(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def attribute_uses(tree):
    """(object node, name, line, is_store) of every attribute named by an
    identifier in `tree`: ``x.name``, ``getattr(x, 'name')`` and its
    siblings, ``x.__dict__['name']`` and ``x.__dict__.get('name')``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.value, node.attr, node.lineno, isinstance(node.ctx, ast.Store)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ATTRIBUTE_FUNCTIONS and len(node.args) >= 2 \
                and _literal(node.args[1]):
            yield node.args[0], _literal(node.args[1]), node.lineno, node.func.id == 'setattr'
        elif isinstance(node, ast.Subscript) and _is_dict_of(node.value) \
                and _literal(node.slice):
            yield node.value.value, _literal(node.slice), node.lineno, \
                isinstance(node.ctx, ast.Store)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ('get', 'setdefault', 'pop') \
                and _is_dict_of(node.func.value) and node.args and _literal(node.args[0]):
            yield node.func.value.value, _literal(node.args[0]), node.lineno, \
                node.func.attr == 'setdefault'


def _is_dict_of(node):
    return isinstance(node, ast.Attribute) and node.attr == '__dict__'


def _defined_names(tree):
    """The names a module defines itself: at module level and in class
    bodies (functions, classes, assignments, imports), and every attribute
    it assigns on self or cls."""
    names = set()
    bodies = [tree.body]
    while bodies:
        for stmt in bodies.pop():
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
                if isinstance(stmt, ast.ClassDef):
                    bodies.append(stmt.body)
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split('.')[0] for a in stmt.names)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names.update(n.id for t in targets for n in ast.walk(t)
                             if isinstance(n, ast.Name))
            elif isinstance(stmt, (ast.If, ast.Try)):
                bodies.append(stmt.body + stmt.orelse + getattr(stmt, 'finalbody', []))
    names.update(attr for obj, attr, _, store in attribute_uses(tree) if store and _is_own(obj))
    return names


def _foreign_modules(tree):
    """Names a module binds to modules outside MXNet (``import sys``):
    ``sys._getframe`` is Python's, not MXNet's."""
    return {(a.asname or a.name).split('.')[0] for node in ast.walk(tree)
            if isinstance(node, ast.Import) for a in node.names
            if a.name.split('.')[0] not in ('mxnet', 'gluoncv', 'gluon_parallel')}


def private_uses(trees=None):
    """(file, line, name) of every underscored attribute of another object
    than self/cls/super() (or a module outside MXNet) whose name the package
    does not define itself, or that MXNet defines too (so that the package's
    own ``_params`` does not hide a Trainer's)."""
    if trees is None:
        trees = {os.path.relpath(p, PKG): ast.parse(open(p).read()) for p in modules().values()}
    ours = set().union(*map(_defined_names, trees.values())) - _mxnet_private_names()
    found = []
    for path, tree in trees.items():
        outside = _foreign_modules(tree)
        for obj, attr, line, _ in attribute_uses(tree):
            if not attr.startswith('_') or attr.startswith('__') or attr in ours \
                    or attr in NOT_PRIVATE or _is_own(obj) \
                    or isinstance(obj, ast.Name) and obj.id in outside:
                continue
            found.append((path, line, attr))
    return sorted(found)


def test_mxnet_private_attributes_only_behind_gluon_module():
    outside = [u for u in private_uses()
               if not u[0].startswith(BOUNDARY) and (u[0], u[2]) not in ALLOWED_PRIVATE]
    assert not outside, f'private attributes outside _gluon/: {outside}'
    assert any(u[0].startswith(BOUNDARY) for u in private_uses())      # the scan sees them


def test_the_private_scan_finds_any_private_name():
    """Names the package never heard of, through each way of naming an
    attribute; not its own (unless MXNet has it too), nor self's, nor a
    Python module's, nor namedtuple's API."""
    code = '''
import sys
class Mine:
    _count = 0
    def __init__(self, x):
        self._mine = x._asdict()
        self._params = []
def f(trainer, block, x, other):
    trainer._anything_at_all = 1
    getattr(block, '_reg_params', None)
    block.__dict__['_gp_cache'] = x
    block.__dict__.get('_children')
    return sys._getframe(), other._mine, other._count, trainer._params, self._hidden
'''
    found = {(line, attr) for _, line, attr in private_uses({'m.py': ast.parse(code)})}
    assert found == {(9, '_anything_at_all'), (10, '_reg_params'), (11, '_gp_cache'),
                     (12, '_children'), (13, '_params')}, found


def nested_walkers(trees=None):
    """(module, function) of every recursive function that tests for a list
    or a tuple: a walk over nested arguments or outputs, which only
    nested.py writes (the others build on its arrays, rebuild and combine).
    A walker with an explicit stack or mutual recursion is not seen."""
    if trees is None:
        trees = {os.path.relpath(p, PKG): ast.parse(open(p).read()) for p in modules().values()}
    found = []
    for path, tree in sorted(trees.items()):
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and _calls_itself(fn) and _tests_for_sequences(fn):
                found.append((path, fn.name))
    return found


def _calls_itself(fn):
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == fn.name or isinstance(f, ast.Attribute) \
                    and f.attr == fn.name and isinstance(f.value, ast.Name) \
                    and f.value.id in ('self', 'cls'):     # (super()'s is another function)
                return True
    return False


def _tests_for_sequences(fn):
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == 'isinstance' and len(node.args) == 2:
            if {'list', 'tuple'} & {n.id for n in ast.walk(node.args[1])
                                   if isinstance(n, ast.Name)}:
                return True
    return False


def test_nested_py_is_the_one_walker():
    walkers = nested_walkers()
    assert walkers and all(path == 'nested.py' for path, _ in walkers), walkers


def test_the_walker_scan_finds_walkers():
    code = '''
def walk(x):
    if isinstance(x, (list, tuple)):
        return [walk(v) for v in x]
    return x
def blocks(b):
    return [b] + [c for k in b.children for c in blocks(k)]
class W(list):
    def flat(self, x):
        return sum((self.flat(v) for v in x), []) if isinstance(x, list) else [x]
    def append(self, x):
        if isinstance(x, tuple):
            super().append(x)
'''
    assert nested_walkers({'m.py': ast.parse(code)}) == [('m.py', 'walk'), ('m.py', 'flat')]


def test_every_module_is_tracked_by_git():
    """A module git ignores (a .gitignore pattern matching a package name)
    would work here and be missing from every clone."""
    root = os.path.dirname(PKG)
    proc = subprocess.run(['git', 'ls-files', 'gluon_parallel'], cwd=root, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return      # not a git checkout (an installed copy): nothing to compare
    tracked = {os.path.normpath(os.path.join(root, f)) for f in proc.stdout.split()}
    missing = sorted(os.path.relpath(p, root) for p in modules().values()
                     if os.path.normpath(p) not in tracked)
    assert not missing, f'modules git does not track: {missing}'


def test_every_module_is_in_the_architecture_notes():
    """ARCHITECTURE.md names every module (launch/ and dist/ as packages),
    so a newcomer finds each concept where the notes say it is."""
    root = os.path.dirname(PKG)
    notes = open(os.path.join(root, 'ARCHITECTURE.md')).read()
    missing = []
    for name, path in modules().items():
        parts = name.split('.')[1:]
        if not parts:
            continue
        if parts[0] in ('launch', 'dist'):
            want = parts[0] + '/'
        elif path.endswith('__init__.py'):
            want = parts[-1] + '/'
        elif parts[-1] == '__main__':
            want = parts[-2] + '/'
        else:
            want = parts[-1]
        if not re.search(r'(?<![\w/]){}\b'.format(re.escape(want.rstrip('/'))) +
                         ('/' if want.endswith('/') else ''), notes):
            missing.append(name)
    assert not missing, f'modules ARCHITECTURE.md does not name: {missing}'


def reachable(graph, start):
    """The modules `start` imports, directly or through others (the
    package's own __init__ left out: `from .. import _gluon` names it, and
    it imports everything)."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep != 'gluon_parallel' and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def syncgraph_imports_of_nn(graph=None):
    """(syncgraph module, nn module it reaches) for every module of
    syncgraph/ importing gluon_parallel.nn, directly or not."""
    graph = import_graph() if graph is None else graph
    return sorted((name, dep) for name in graph if name.startswith('gluon_parallel.syncgraph')
                  for dep in reachable(graph, name)
                  if dep == 'gluon_parallel.nn' or dep.startswith('gluon_parallel.nn.'))


def test_syncgraph_never_imports_nn():
    """SyncBatchNorm's dependencies run one way: the layer (nn/) imports
    syncgraph/, whose modules find the layers through its registry
    (syncgraph/layers.py) and never import nn/."""
    found = syncgraph_imports_of_nn()
    assert not found, f'syncgraph/ imports nn/: {found}'


def test_the_direction_scan_finds_an_indirect_import():
    graph = {'gluon_parallel.syncgraph.a': {'gluon_parallel', 'gluon_parallel.b'},
             'gluon_parallel.b': {'gluon_parallel.nn.kernels'},
             'gluon_parallel': {'gluon_parallel.nn'}, 'gluon_parallel.nn.kernels': set()}
    assert syncgraph_imports_of_nn(graph) == [('gluon_parallel.syncgraph.a',
                                               'gluon_parallel.nn.kernels')]


def readers_of(attribute, trees=None):
    """The modules reading ``_gluon.<attribute>``."""
    trees = trees if trees is not None else {
        name: ast.parse(open(path).read()) for name, path in modules().items()}
    return sorted(name for name, tree in trees.items() for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr == attribute
                  and isinstance(node.value, ast.Name) and node.value.id == '_gluon')


def test_the_installed_backward_hook_is_reached_through_its_owner():
    """The patched backward function's hook is graph/recording.py's
    BACKWARD_HOOK (told when it is removed): the runners and the graph-mode
    loss reach the recorded calls through that object, never through the
    patched MXNet function's attribute."""
    assert readers_of('after_backward_hook') == []


def test_the_reader_scan_finds_a_reader():
    trees = {'m': ast.parse('from . import _gluon\nx = _gluon.after_backward_hook()'),
             'n': ast.parse('after_backward_hook = 1')}
    assert readers_of('after_backward_hook', trees) == ['m']


#: What graph mode (graph/) may use of syncgraph/ besides SyncBatchNorm's
#: graph-mode home (in_graph.py): the traced graph's parse, the graph
#: writer, the input kinds, the layer registry (which layers a graph holds,
#: why they cannot run as one graph).
GRAPH_USES_OF_SYNCGRAPH = {'traced', 'writer', 'inputs', 'in_graph', 'layers'}
#: ... and of the layer module (nn/sync_batchnorm.py): nothing (its checks
#: for a graph-mode call come through syncgraph/layers.py).
GRAPH_USES_OF_LAYER = set()


def _defining_module(package, name):
    """The last part of the module that defines `name` of `package`."""
    import importlib
    import importlib.util
    if importlib.util.find_spec(f'{package}.{name}') is not None:
        value = importlib.import_module(f'{package}.{name}')   # a submodule, imported or not
    else:
        value = getattr(importlib.import_module(package), name)
    module = value.__name__ if inspect.ismodule(value) else value.__module__
    return module.rsplit('.', 1)[-1]


def sync_batchnorm_reaches_from_graph():
    """(graph/ module, what) for every use under gluon_parallel/graph/ of
    SyncBatchNorm's (or BatchNorm's) graph-mode behaviour that does not go
    through syncgraph/in_graph.py: a name of syncgraph defined in another
    of its modules than GRAPH_USES_OF_SYNCGRAPH's (its running statistics,
    merge, node rewrite), a name of nn/sync_batchnorm.py but the switch
    to the staged path, the kernels."""
    found = []
    for name, path in sorted(modules().items()):
        if not name.startswith('gluon_parallel.graph'):
            continue
        tree = ast.parse(open(path).read())
        layer_aliases = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            mod = _resolve(name, path.endswith('__init__.py'), node)[0]
            for a in node.names:
                where = None
                if mod == 'gluon_parallel.syncgraph':
                    where = _defining_module(mod, a.name)
                elif mod.startswith('gluon_parallel.syncgraph.'):
                    where = mod.rsplit('.', 1)[-1]
                if where is not None and where not in GRAPH_USES_OF_SYNCGRAPH:
                    found.append((name, f'{a.name} (syncgraph/{where}.py)'))
                full = f'{mod}.{a.name}'
                if full == 'gluon_parallel.nn.sync_batchnorm':
                    layer_aliases.add(a.asname or a.name)
                elif 'kernels' in full.split('.') or (
                        mod == 'gluon_parallel.nn.sync_batchnorm'
                        and a.name not in GRAPH_USES_OF_LAYER):
                    found.append((name, full))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in layer_aliases and node.attr not in GRAPH_USES_OF_LAYER:
                found.append((name, f'sync_batchnorm.{node.attr}'))
    return found


def test_graph_mode_reaches_sync_batchnorm_through_its_home():
    """SyncBatchNorm's graph-mode life (statistics merge, running
    statistics, their order against backward) is in syncgraph/in_graph.py,
    which a reader finds from nn/sync_batchnorm.py: graph/ uses nothing
    else of it."""
    found = sync_batchnorm_reaches_from_graph()
    assert not found, f'graph/ reaches SyncBatchNorm around syncgraph/in_graph.py: {found}'


TESTS = os.path.dirname(os.path.abspath(__file__))
IMPORTS_A_TEST = re.compile(r'^\s*(?:import|from)\s+(test_\w+)', re.M)


def imports_of_test_modules():
    """(file, test module) for every import of a test_* module in the tests'
    code, the code they run in child processes included: shared helpers
    live in helper modules, so that a test file is never run a second time
    under another name and never reaches into another file's tests."""
    found = []
    for root, _, files in os.walk(TESTS):
        for f in sorted(files):
            if f.endswith('.py'):
                path = os.path.join(root, f)
                for name in IMPORTS_A_TEST.findall(open(path).read()):
                    found.append((os.path.relpath(path, TESTS), name))
    return found


def test_no_test_module_imports_another():
    found = imports_of_test_modules()
    assert not found, f'imports of test modules (share through a helper module): {found}'


MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 450


def long_functions_and_modules():
    """(module, function or None, lines) of every function of the package
    longer than MAX_FUNCTION_LINES (decorators and docstring included) and
    every module longer than MAX_MODULE_LINES."""
    found = []
    for path in sorted(modules().values()):
        text = open(path).read()
        rel = os.path.relpath(path, PKG)
        if text.count('\n') > MAX_MODULE_LINES:
            found.append((rel, None, text.count('\n')))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                    found.append((rel, node.name, node.end_lineno - start + 1))
    return found


def test_functions_and_modules_are_readable_in_one_sitting():
    found = long_functions_and_modules()
    assert not found, f'split these where a name explains the part: {found}'


def node_ids(name):
    """The pytest arguments listed in tests/NAME, one a line: smoke.txt
    (what .ci/run runs again under other numpy versions; '#' starts a
    comment) or quick.txt (the README's quick check, read by pytest itself
    as ``@tests/quick.txt``: no comments)."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, name)) as f:
        lines = [line.split('#')[0].strip() for line in f]
    return here, [line for line in lines if line]


@pytest.mark.parametrize('name', ['smoke.txt', 'quick.txt'])
def test_every_listed_test_exists(name):
    # A renamed test would fail only the smoke run at the end of CI ("not
    # found"), after the full suite passed; or a user's quick check.
    here, ids = node_ids(name)
    missing = []
    for node in ids:
        path, _, test = node.partition('::')
        source = open(os.path.join(os.path.dirname(here), path)).read()
        if test and not re.search(rf'^def {re.escape(test)}\(', source, re.M):
            missing.append(node)
    assert ids and not missing, missing
    if name == 'quick.txt':     # pytest passes every line as it is
        with open(os.path.join(here, name)) as f:
            assert f.read().splitlines() == ids
