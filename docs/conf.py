"""Sphinx configuration of gluon_parallel's documentation site.

Build (warnings are errors, as in ``.ci/run``)::

    pip install -e ".[cpu,docs]"
    python -m sphinx -W --keep-going -b html docs docs/_build/html

The guide's pages are MyST markdown; the API reference is generated from the
numpydoc docstrings by autodoc (``docs/api/``).
"""
import importlib
import pkgutil
import sys
import warnings

from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

import gluon_parallel

project = 'gluon_parallel'
release = version = gluon_parallel.__version__
copyright = 'gluon_parallel authors, Apache-2.0'

extensions = [
    'sphinx.ext.autodoc',
    'numpydoc',
    'myst_parser',
]

source_suffix = {'.md': 'markdown', '.rst': 'restructuredtext'}
root_doc = 'index'
# api/markdown/: the same API reference as plain Markdown for GitHub
# (docs/api_markdown.py), not a page of the site.
exclude_patterns = ['_build', 'api/markdown']

# Section links between the guide's pages (``page.md#a-heading``).
myst_heading_anchors = 3

# The API pages list every public name (tests/test_docs.py checks it):
# classes bring their methods, modules the names of their ``__all__``.
autodoc_default_options = {
    'members': True,
    'undoc-members': True,
    'member-order': 'bysource',
}
autodoc_typehints = 'none'        # the numpydoc "Parameters" sections say the types

# numpydoc: no per-class table of members (autodoc lists them already), and
# no cross-referencing of the free-form types ("NDArray or list").
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# Furo: a maintained theme with a sidebar of the whole guide, a search
# box and light/dark modes (alabaster showed one page's headings only).
html_theme = 'furo'
html_title = f'gluon_parallel {release}'


def _numpydoc_warnings_to_sphinx(app):
    """numpydoc reports a docstring it cannot parse (an unknown section,
    whose text it then drops from the page) with Python's ``warnings``,
    which ``-W`` does not see: hand them to Sphinx's log as warnings."""
    logger = logging.getLogger('numpydoc')
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if 'numpydoc' in filename:
            logger.warning('numpydoc: %s', message)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def _reexported_constant_doc(app, what, name, obj, options, lines):
    """A constant a package re-exports (``launch.RESTART_ENV``, defined in
    ``launch/process.py``) has no ``#:`` comment in the package's own
    source, and autodoc then shows the docstring of its type (``str``):
    take the comment from the submodule that defines it."""
    if what != 'data' or not isinstance(obj, (str, int, float, tuple)):
        return
    if lines[:1] != (type(obj).__doc__ or '').splitlines()[:1]:
        return
    package, attr = name.rsplit('.', 1)
    path = getattr(importlib.import_module(package), '__path__', None)
    for sub in pkgutil.iter_modules(path or [], package + '.'):
        # Only submodules the package has imported: the definer is one, and
        # importing others could run them (launch/__main__.py).
        if getattr(sys.modules.get(sub.name), attr, None) is obj:
            comment = ModuleAnalyzer.for_module(sub.name).find_attr_docs().get(('', attr))
            if comment:
                lines[:] = list(comment)
                return


def setup(app):
    app.connect('builder-inited', _numpydoc_warnings_to_sphinx)
    app.connect('autodoc-process-docstring', _reexported_constant_doc, priority=100)
