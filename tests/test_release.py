"""What a team pins: the version and its CHANGELOG section, the license,
the wheel built from the tree, and the README's install lines that CI runs.

The wheel's contents are checked here; .ci/run installs that wheel in a
fresh venv and runs the smoke part (tests/smoke.txt) against it.
"""
import configparser
import os
import re
import shutil
import subprocess
import sys
import zipfile

import gluon_parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION = re.compile(r'\d+\.\d+\.\d+')
#: The section titles of the Apache License 2.0's terms, in order.
APACHE_SECTIONS = ('Definitions', 'Grant of Copyright License', 'Grant of Patent License',
                   'Redistribution', 'Submission of Contributions', 'Trademarks',
                   'Disclaimer of Warranty', 'Limitation of Liability',
                   'Accepting Warranty or Additional Liability')
#: Beside the package, the files a wheel must hold at its top (setup.py).
TOP_LEVEL = ('gluon_parallel_numpy_compat.py', 'gluon_parallel_numpy_compat.pth')


def read(name):
    with open(os.path.join(ROOT, name), encoding='utf-8') as f:
        return f.read()


def changelog_sections(text):
    """The CHANGELOG's second-level headings, in order."""
    return re.findall(r'^## (.+?)\s*$', text, re.M)


def release_problems(text, version):
    """What is wrong with a CHANGELOG's sections for package `version`: an
    "Unreleased" section first, then the releases newest first, the latest
    being `version`."""
    sections = changelog_sections(text)
    if sections[:1] != ['Unreleased']:
        return [f'the first section is {sections[:1]}, not "Unreleased"']
    releases = sections[1:]
    problems = [f'{name!r} is not a version' for name in releases if not VERSION.fullmatch(name)]
    if problems:
        return problems
    if releases[:1] != [version]:
        problems.append(f'the latest release is {releases[:1]}, the package says {version}')
    numbers = [tuple(map(int, name.split('.'))) for name in releases]
    if numbers != sorted(set(numbers), reverse=True):
        problems.append(f'the releases are not newest first, each once: {releases}')
    return problems


def test_the_changelogs_latest_release_is_the_package_version():
    assert VERSION.fullmatch(gluon_parallel.__version__)
    assert release_problems(read('CHANGELOG.md'), gluon_parallel.__version__) == []


def test_the_release_check_sees_what_it_is_for():
    good = '# Changelog\n\n## Unreleased\n\n## 0.3.0\n- a\n\n## 0.2.0\n- b\n'
    assert release_problems(good, '0.3.0') == []
    assert release_problems(good, '0.2.0') != []                   # __version__ not bumped
    assert release_problems(good.replace('## Unreleased\n\n', ''), '0.3.0') != []
    assert release_problems(good.replace('0.2.0', '0.4.0'), '0.3.0') != []
    assert release_problems(good.replace('0.3.0', 'Next'), '0.3.0') != []


def test_the_license_is_the_apache_license_2_0_in_full():
    text = ' '.join(read('LICENSE').split())
    assert text.startswith('Apache License Version 2.0, January 2004')
    positions = [text.find(f' {n}. {title}.') for n, title in enumerate(APACHE_SECTIONS, 1)]
    assert -1 not in positions and positions == sorted(positions), positions
    assert 'END OF TERMS AND CONDITIONS' in text
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, 'setup.cfg'))
    assert setup['metadata']['license'] == 'Apache-2.0'


def package_files():
    """The package's files as a wheel names them: every file under
    gluon_parallel/ but bytecode and the kernel's local builds, and the
    start-up hook's two files."""
    found = list(TOP_LEVEL)
    for folder, dirs, files in os.walk(os.path.join(ROOT, 'gluon_parallel')):
        dirs[:] = [d for d in dirs if d not in ('__pycache__', '_build')]
        rel = os.path.relpath(folder, ROOT).replace(os.sep, '/')
        found += [f'{rel}/{name}' for name in files if not name.endswith(('.pyc', '.so'))]
    return sorted(found)


def build_wheel(tmp_path):
    """The wheel of a copy of the tree (a build in the tree would leave
    build/ there, whose stale files a later wheel would take in)."""
    source = tmp_path / 'source'
    ignore = shutil.ignore_patterns('__pycache__', '_build', '*.pyc', '*.so', '*.egg-info')
    for name in os.listdir(ROOT):
        path = os.path.join(ROOT, name)
        if name == 'gluon_parallel':
            shutil.copytree(path, source / name, ignore=ignore)
        elif os.path.isfile(path):
            os.makedirs(source, exist_ok=True)
            shutil.copy(path, source / name)
    out = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps',
                          '-w', str(tmp_path / 'wheel'), str(source)],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / 'wheel').glob('*.whl')
    return wheel


def test_the_wheel_holds_every_file_of_the_package_and_the_license(tmp_path):
    wheel = build_wheel(tmp_path)
    version = gluon_parallel.__version__
    assert wheel.name == f'gluon_parallel-{version}-py3-none-any.whl'
    names = zipfile.ZipFile(wheel).namelist()
    info = f'gluon_parallel-{version}.dist-info/'
    assert sorted(n for n in names if not n.startswith(info)) == package_files()
    assert any(n.startswith(info) and n.endswith('/LICENSE') for n in names), names


def readme_lines():
    """Every line of README.md's bash blocks."""
    blocks = re.findall(r'^```bash\n(.*?)^```', read('README.md'), re.M | re.S)
    return [line for block in blocks for line in block.splitlines()]


def test_ci_runs_the_readmes_quick_checks_as_written():
    """.ci/run's 3.12 and 3.13 lines are the README's, and 3.13's installs
    mxnet after the project without its requirements (numpy<2)."""
    ci = dict(re.findall(r"^(readme_quick_check\w*)='(.*)'$", read('.ci/run'), re.M))
    assert set(ci) == {'readme_quick_check', 'readme_quick_check_313'}, ci
    assert set(ci.values()) <= set(readme_lines()), ci
    assert ci['readme_quick_check'] == ('pip install -e ".[cpu,test]" && '
                                        'python -m pytest -q @tests/quick.txt')
    install, mxnet, check = ci['readme_quick_check_313'].split(' && ')
    assert (install, check) == tuple(ci['readme_quick_check'].split(' && '))
    assert mxnet == 'pip install --no-deps mxnet==1.9.1'


def requirements(extra, python_version):
    """The requirements pip reads for `extra` (None: install_requires)
    under `python_version`, by name."""
    from packaging.requirements import Requirement
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, 'setup.cfg'))
    text = (setup['options']['install_requires'] if extra is None
            else setup['options.extras_require'][extra])
    reqs = [Requirement(line.strip()) for line in text.strip().splitlines()
            if line.strip() and not line.strip().startswith('#')]
    env = {'python_version': python_version, 'python_full_version': python_version + '.0'}
    return {r.name: str(r.specifier) for r in reqs if r.marker is None or r.marker.evaluate(env)}


def test_on_python_3_13_no_extra_asks_pip_for_mxnet():
    """mxnet 1.9.1's metadata asks numpy<2, which no numpy for 3.13 meets:
    there the README's line installs it with --no-deps, and the extras hold
    its other requirements; before 3.13 they hold mxnet itself."""
    for extra, dist in (('cpu', 'mxnet'), ('cu112', 'mxnet-cu112')):
        assert requirements(extra, '3.12') == {dist: '==1.9.1'}
        assert requirements(extra, '3.13') == {'requests': '<3,>=2.20.0',
                                               'graphviz': '<0.9.0,>=0.8.1'}
    assert requirements(None, '3.13')['numpy'] == '>=2.1'
