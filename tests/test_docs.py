"""The documentation site (docs/): it builds with warnings as errors, and
its API reference documents every public name.

The site is built once, into a temporary folder, as `.ci/run` builds it
(``python -m sphinx -W --keep-going -b html docs OUT``); the public names
are then looked up in the built inventory (``objects.inv``, what
intersphinx reads), so a name counts as documented only when a page
really describes it. Needs the ``docs`` extra (``pip install -e
".[docs]"``): without it the tests skip, under `.ci/run` they fail.
"""
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import uuid

import pytest

from daemons import require
from docs_helpers import public_names
from launch_helpers import assert_nothing_left, launch_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, 'docs')
DOCS_PACKAGES = ('sphinx', 'numpydoc', 'myst_parser', 'furo')

def documented(inventory_path):
    """The Python objects a built site's inventory describes: full name ->
    (role, page)."""
    from sphinx.util.inventory import InventoryFile
    with open(inventory_path, 'rb') as f:
        inventory = InventoryFile.load(f, '', os.path.join)
    # Sphinx >= 8.2 returns an _Inventory with .data; older ones a dict.
    data = getattr(inventory, 'data', inventory)
    out = {}
    for role, entries in data.items():
        if role.startswith('py:'):
            for name, item in entries.items():
                out[name] = (role, item[2] if isinstance(item, tuple) else item.uri)
    return out


def undocumented(names, inventory):
    """The names a site's inventory lacks."""
    return [name for name in names if name not in inventory]


@pytest.fixture(scope='module')
def site(tmp_path_factory):
    """(status, output, html folder) of one warnings-as-errors build."""
    require(all(importlib.util.find_spec(p) for p in DOCS_PACKAGES),
            'the docs build needs Sphinx, numpydoc, myst-parser and furo '
            '(pip install -e ".[docs]")')
    out = tmp_path_factory.mktemp('html')
    proc = subprocess.run(
        [sys.executable, '-m', 'sphinx', '-W', '--keep-going', '-q', '-b', 'html', DOCS,
         str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr, out


def test_the_site_builds_without_warnings(site):
    status, output, _ = site
    assert status == 0, f'sphinx -W failed:\n{output}'


def test_every_public_name_is_documented(site):
    _, _, html = site
    inventory = documented(html / 'objects.inv')
    names = public_names()
    assert 'gluon_parallel.DataParallel' in names and 'gluon_parallel.nn.SyncBatchNorm' in names
    missing = undocumented(names, inventory)
    assert not missing, (f'public names on no page of docs/api/ (add a line such as '
                         f'".. autofunction:: NAME" to the page of their topic): {missing}')


def test_the_check_sees_a_missing_name(site):
    """The same check, on the inventory without one name, reports that name
    (and the inventory holds no names of modules that are not public)."""
    _, _, html = site
    inventory = documented(html / 'objects.inv')
    names = public_names()
    without = dict(inventory)
    del without['gluon_parallel.split_sizes']
    assert undocumented(names, without) == ['gluon_parallel.split_sizes']
    assert undocumented(['gluon_parallel.no_such_name'], inventory) == [
        'gluon_parallel.no_such_name']


def test_public_names_follow_subpackages():
    """Subpackages named in the package's `__all__` are walked into."""
    names = public_names(('gluon_parallel',))
    assert 'gluon_parallel.nn' in names and 'gluon_parallel.nn.convert_sync_batchnorm' in names
    assert 'gluon_parallel.dist.init_trainer' in names


def page_code(page):
    """The ```python blocks of docs/PAGE as Sybil reads them (what
    conftest.py runs), in order."""
    from sybil import Document
    from sybil.parsers.markdown import PythonCodeBlockParser
    document = Document.parse(os.path.join(DOCS, page), PythonCodeBlockParser())
    return [str(example.region.parsed) for example in document]


def test_the_several_machines_script_runs_under_the_launcher(tmp_path):
    """The page's script, as written, as a 2-worker dist_sync job (the
    documentation's own run of it is the one-worker case): it trains, rank 0
    alone prints and writes the checkpoint, and both workers agree."""
    script = page_code('several-machines.md')[0]     # (the page's other block needs GPUs)
    (tmp_path / 'train.py').write_text(script + "\nprint('rank', dist.rank(), 'sum', "
                                       "sum(float(p.data(ctx[0]).sum().asscalar()) "
                                       "for p in net.collect_params().values()))\n")
    token = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, '-m', 'gluon_parallel.launch', '-n', '2', '-s', '1',
                           '--timeout', '600', '--', sys.executable, 'train.py'],
                          cwd=tmp_path, env=launch_env(token, OMP_NUM_THREADS='1'),
                          capture_output=True, text=True, timeout=660)
    assert_nothing_left(token)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.findall(r'^\[worker (\d)\] epoch (\d) done$', proc.stdout, re.M) == [
        ('0', '1'), ('0', '2')], proc.stdout
    sums = dict(re.findall(r'^\[worker \d\] rank (\d) sum (\S+)$', proc.stdout, re.M))
    assert sorted(sums) == ['0', '1'] and sums['0'] == sums['1'], proc.stdout
    assert (tmp_path / 'ckpt.params').stat().st_size > 0
