"""The documentation's code runs as tests: every ```python block of
README.md and docs/*.md is a pytest item (Sybil), run in order, the blocks
of one page sharing one namespace as a reader's session would; a block
written as a session (``>>>`` prompts) must print what it shows.

A block that cannot run here (it needs a GPU, ssh hosts, a SLURM
allocation, the launcher's workers) is preceded by an HTML comment that
GitHub and Sphinx do not show, ``<!-- skip: next "why" -->``, and the page
says why in its text too. Each page runs in a fresh temporary working
directory (the files a snippet writes, such as ``ckpt/``, go there); that
is the only setup a page gets that the reader does not see.
"""
import doctest
import os
import shutil
import tempfile

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser


def _enter_a_scratch_directory(namespace):
    namespace['__cwd__'] = os.getcwd()
    namespace['__scratch__'] = tempfile.mkdtemp(prefix='gluon-parallel-docs-')
    os.chdir(namespace['__scratch__'])


def _leave_it(namespace):
    os.chdir(namespace.pop('__cwd__'))
    import mxnet as mx
    from gluon_parallel import DataParallel
    for value in list(namespace.values()):
        if isinstance(value, DataParallel):
            value.close()       # its worker threads, if it started any
    mx.nd.waitall()         # nothing of the page may still be writing there
    scratch = namespace.pop('__scratch__')
    namespace.clear()
    shutil.rmtree(scratch, ignore_errors=True)


pytest_collect_file = Sybil(
    # A block that starts with ">>>" is a doctest: its printed output is checked.
    parsers=[PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS
                                   | doctest.NORMALIZE_WHITESPACE), SkipParser()],
    patterns=['README.md', 'docs/*.md'],
    excludes=['*/README.md'],           # examples/README.md: the example's own notes
    setup=_enter_a_scratch_directory,
    teardown=_leave_it,
).pytest()


def mxnet_missing():
    """What to do when mxnet cannot be imported, or None: on Python 3.13
    the package's extras leave mxnet out (its metadata asks numpy < 2,
    which has no build there), and the README's line for 3.13 installs it
    after the package."""
    try:
        import mxnet  # noqa: F401
    except ImportError as e:
        return (f'mxnet cannot be imported ({e}). On Python 3.13 it is installed after the '
                'package, without its requirements: pip install --no-deps mxnet==1.9.1 '
                "(the README's line for Python 3.13; docs/quickstart.md, 'Python 3.13')")
    return None


# Before tests/conftest.py, which imports mxnet: the run stops here, saying
# what to install, rather than at each test module.
if mxnet_missing():
    import pytest
    raise pytest.UsageError(mxnet_missing())


def pytest_sessionfinish(session, exitstatus):
    """A run that left /dev/null a regular file fails: every later ssh
    (``-F /dev/null``) and daemon on the machine breaks (MXNet's profiler,
    given /dev/null as its file, replaces it)."""
    import stat
    if not stat.S_ISCHR(os.stat(os.devnull).st_mode):
        print(f'\n{os.devnull} is no longer a character device: a test replaced it', flush=True)
        session.exitstatus = 1
