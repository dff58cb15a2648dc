"""The API reference as plain Markdown (docs/api/markdown/, for GitHub):
generated from the docstrings by docs/api_markdown.py, it is fresh (the
committed pages are what the script writes today) and names every public
object."""
import importlib.util
import os
import re

from docs_helpers import public_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_generator():
    spec = importlib.util.spec_from_file_location(
        'api_markdown', os.path.join(ROOT, 'docs', 'api_markdown.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def headed_names(folder):
    """The dotted names the pages of `folder` have a heading for."""
    names = set()
    for page in os.listdir(folder):
        with open(os.path.join(folder, page), encoding='utf-8') as f:
            for heading in re.findall(r'^#+ .*?`([\w.]+)', f.read(), re.M):
                names.add(heading)
    return names


def missing(names, headed):
    return [name for name in names if name not in headed]


def test_the_markdown_pages_are_fresh():
    stale = load_generator().stale()
    assert not stale, ('docs/api/markdown/ differs from the docstrings: run '
                       f'python docs/api_markdown.py and commit the pages ({stale})')


def test_the_freshness_check_sees_a_stale_page(tmp_path):
    generator = load_generator()
    generator.generate(str(tmp_path))
    assert generator.stale(str(tmp_path)) == []
    page = tmp_path / 'training.md'
    page.write_text(page.read_text().replace('few Python calls', 'many Python calls'))
    (tmp_path / 'old.md').write_text('# a page no docs/api page renders\n')
    os.remove(tmp_path / 'nn.md')
    assert generator.stale(str(tmp_path)) == ['nn.md', 'training.md', 'old.md']


def test_every_public_name_has_a_heading():
    headed = headed_names(os.path.join(ROOT, 'docs', 'api', 'markdown'))
    names = public_names()
    assert 'gluon_parallel.Trainer' in names and 'gluon_parallel.dist.init_trainer' in names
    assert not missing(names, headed), missing(names, headed)
    assert missing(names, headed - {'gluon_parallel.split_sizes'}) == ['gluon_parallel.split_sizes']
