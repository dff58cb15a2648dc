"""The API reference as plain Markdown, for reading where Sphinx does not
run (GitHub): one page in ``docs/api/markdown/`` per page of ``docs/api/``,
generated from the same docstrings that the site's autodoc renders.

Each ``docs/api/*.md`` page names its objects with autodoc directives
(``automodule``, ``autoclass``, ``autofunction``, ``autoexception``,
``autodata``, under a ``currentmodule``); this script reads those
directives, imports the objects and writes their signatures and numpydoc
docstrings as Markdown. ``tests/test_api_markdown.py`` regenerates the
pages and fails when the committed ones differ.

    python docs/api_markdown.py            # rewrite docs/api/markdown/
    python docs/api_markdown.py --check    # list stale pages, exit 1 if any
"""
import argparse
import importlib
import inspect
import os
import re
import sys
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
API = os.path.join(HERE, 'api')
OUT = os.path.join(API, 'markdown')
FENCE = re.compile(r'^```\{eval-rst\}\n(.*?)^```\n', re.M | re.S)
DIRECTIVE = re.compile(r'^\.\. (\w+(?::\w+)?)::\s*(\S*)\s*$')
SECTIONS = ('Parameters', 'Other Parameters', 'Returns', 'Yields', 'Raises', 'Warns',
            'Attributes', 'Examples', 'Notes', 'See Also', 'References', 'Methods')
LISTED = ('Parameters', 'Other Parameters', 'Returns', 'Yields', 'Raises', 'Warns', 'Attributes')
HEADER = ('<!-- Generated from the docstrings by docs/api_markdown.py: do not edit. '
          '`python docs/api_markdown.py` rewrites it. -->\n')
NOTE = ('*The API reference as plain Markdown, generated from the docstrings by '
        '`docs/api_markdown.py`; the documentation site renders the same docstrings '
        '(building it: [README](../../../README.md#documentation)).*')


class Entry(NamedTuple):
    """One object a page documents."""
    kind: str           # 'module', 'class', 'exception', 'function', 'data'
    name: str           # full dotted name
    members: tuple      # a class's members to show; () for all


# --------------------------------------------------------- reading pages --

def page_entries(text):
    """(the page's Markdown outside its directives, [Entry]) of one
    ``docs/api`` page."""
    entries, module = [], None
    for block in FENCE.findall(text):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            m = DIRECTIVE.match(line)
            if not m:
                continue
            kind, arg = m.groups()
            options = {}
            for opt in lines[i + 1:]:
                om = re.match(r'^\s+:(\w[\w-]*):\s*(.*)$', opt)
                if not om:
                    break
                options[om.group(1)] = om.group(2)
            if kind in ('currentmodule', 'py:module'):
                module = arg
            elif kind == 'automodule':
                entries.append(Entry('module', arg, ()))
            elif kind.startswith('auto'):
                members = tuple(n.strip() for n in options.get('members', '').split(',')
                                if n.strip())
                entries.append(Entry(kind[4:], f'{module}.{arg}', members))
    return FENCE.sub('', text), entries


def resolve(name):
    """The object of a dotted name (a module, or an attribute of one)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        module, _, attr = name.rpartition('.')
        return getattr(importlib.import_module(module), attr)


# ------------------------------------------------------- docstring -> md --

def inline(text):
    """reST inline markup -> Markdown."""
    text = re.sub(r':[\w:]+:`([^`<]*?)\s*<([^>]+)>`', r'`\1`', text)      # :role:`text <target>`
    text = re.sub(r':[\w:]+:`~(?:[\w.]+\.)?([^`]+)`', r'`\1`', text)      # :role:`~a.b.c`
    text = re.sub(r':[\w:]+:`([^`]+)`', r'`\1`', text)                    # :role:`a.b`
    return re.sub(r'``([^`]+)``', r'`\1`', text)


def _is_heading(lines, i):
    return (lines[i].strip() in SECTIONS and i + 1 < len(lines)
            and re.fullmatch(r'-{3,}', lines[i + 1].strip() or 'x') is not None)


def _sections(doc):
    """[(title or None, [lines])] of a cleaned docstring."""
    lines, out, title, body, i = doc.splitlines(), [], None, [], 0
    while i < len(lines):
        if _is_heading(lines, i):
            out.append((title, body))
            title, body, i = lines[i].strip(), [], i + 2
            continue
        body.append(lines[i])
        i += 1
    out.append((title, body))
    return [(t, b) for t, b in out if t or any(x.strip() for x in b)]


def _listed(body):
    """A numpydoc list section ("name : type" lines, indented
    descriptions) as a Markdown list."""
    out, fresh = [], False          # fresh: the last line is an item without its text yet
    for line in body:
        if not line.strip():
            out.append('')
            fresh = False
        elif not line.startswith(' '):
            name, sep, kind = line.partition(' : ')
            if sep:
                names = ', '.join(f'`{n.strip()}`' for n in name.split(','))
                out.append(f'- {names} ({kind.strip()})')
            else:
                out.append(f'- {line.strip()}')
            fresh = True
        elif fresh:
            out[-1] += ': ' + line.strip()
            fresh = False
        else:
            out.append('  ' + line.strip())
    return out


def _prose(body):
    """Paragraphs, bullet lists, doctest sessions and ``::`` literal
    blocks as Markdown."""
    out, i = [], 0
    while i < len(body):
        line = body[i]
        if line.lstrip().startswith('>>>'):
            session = []
            while i < len(body) and body[i].strip():
                session.append(body[i].strip() if body[i].lstrip().startswith(('>>>', '...'))
                               else body[i].rstrip())
                i += 1
            out += ['```pycon', *session, '```']
            continue
        if line.rstrip().endswith('::'):
            head = line.rstrip()[:-2].rstrip()
            out.append(head + ':' if head else '')
            i += 1
            while i < len(body) and not body[i].strip():
                i += 1
            block = []
            while i < len(body) and (not body[i].strip() or body[i].startswith(' ')):
                block.append(body[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            out += ['', '```text', *inspect.cleandoc('\n'.join(block)).splitlines(), '```', '']
            continue
        out.append(re.sub(r'^(\s*)\* ', r'\1- ', line.rstrip()))
        i += 1
    return out


def docstring_markdown(obj):
    """The object's docstring as Markdown lines."""
    doc = inline(inspect.getdoc(obj) or '')     # (inline code may span lines)
    out = []
    for title, body in _sections(doc):
        if title:
            out += ['', f'**{title}**', '']
        out += _listed(body) if title in LISTED else _prose(body)
    return _squeeze(out)


def _squeeze(lines):
    """No runs of blank lines, none at either end."""
    out = []
    for line in lines:
        if line.strip() or (out and out[-1].strip()):
            out.append(line.rstrip())
    while out and not out[-1]:
        out.pop()
    return out


# ------------------------------------------------------------- objects --

def signature(obj):
    """``(a, b=1)`` without annotations (the docstrings say the types)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return '(...)'
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def data_comment(name):
    """The ``#:`` comment above ``NAME =`` in the module that defines it."""
    package, _, attr = name.rpartition('.')
    value = resolve(name)
    for modname, module in sorted(sys.modules.items()):
        if not (modname == package or modname.startswith(package + '.')) \
                or getattr(module, attr, None) is not value:
            continue
        try:
            lines = inspect.getsource(module).splitlines()
        except (OSError, TypeError):
            continue
        for i, line in enumerate(lines):
            if re.match(rf'{attr}\s*(?::[^=]*)?=', line):
                comment = []
                while i > 0 and lines[i - 1].lstrip().startswith('#:'):
                    i -= 1
                    comment.insert(0, lines[i].lstrip()[2:].strip())
                if comment:
                    return [inline(' '.join(comment))]
    return []


def members(cls, wanted):
    """(name, object) of the class's own public methods and properties,
    in source order (or those named in `wanted`)."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith('_') or (wanted and name not in wanted):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            found.append((name, value))
    if wanted:
        found.sort(key=lambda item: wanted.index(item[0]))
    return found


def entry_markdown(entry, level=2):
    """Markdown lines of one documented object."""
    obj = resolve(entry.name)
    h = '#' * level
    if entry.kind == 'module':
        out = [f'{h} `{entry.name}`', '', *docstring_markdown(obj)]
        for name in getattr(obj, '__all__', ()):
            value = getattr(obj, name)
            kind = ('module' if inspect.ismodule(value) else
                    'exception' if inspect.isclass(value) and issubclass(value, BaseException)
                    else 'class' if inspect.isclass(value)
                    else 'function' if callable(value) else 'data')
            if kind == 'module':
                continue
            out += ['', *entry_markdown(Entry(kind, f'{entry.name}.{name}', ()), level + 1)]
        return out
    short = entry.name
    if entry.kind == 'data':
        return [f'{h} `{short}` = `{resolve(entry.name)!r}`', '', *data_comment(entry.name)]
    if entry.kind in ('class', 'exception'):
        init = obj.__init__ if '__init__' in vars(obj) else obj
        sig = signature(init).replace('(self, ', '(').replace('(self)', '()')
        out = [f'{h} {entry.kind} `{short}{sig}`', '', *docstring_markdown(obj)]
        for name, member in members(obj, entry.members):
            if isinstance(member, property):
                out += ['', f'{h}# property `{short}.{name}`', '', *docstring_markdown(member)]
            else:
                sig = signature(member).replace('(self, ', '(').replace('(self)', '()')
                out += ['', f'{h}# `{short}.{name}{sig}`', '', *docstring_markdown(member)]
        return out
    return [f'{h} `{short}{signature(obj)}`', '', *docstring_markdown(obj)]


# --------------------------------------------------------------- pages --

def api_pages():
    """The ``docs/api`` page names, index first."""
    names = sorted(f[:-3] for f in os.listdir(API) if f.endswith('.md'))
    return ['index'] + [n for n in names if n != 'index']


def render(page):
    """The Markdown page of ``docs/api/PAGE.md``."""
    with open(os.path.join(API, page + '.md'), encoding='utf-8') as f:
        text = f.read()
    prose, entries = page_entries(text)
    prose = re.sub(r'^```\{toctree\}\n.*?^```\n', '', prose, flags=re.M | re.S)
    lines = _squeeze(prose.splitlines())
    out = [HEADER, lines[0], '', NOTE, *lines[1:]]
    if page == 'index':
        package = importlib.import_module('gluon_parallel')
        out += ['', '## `gluon_parallel`', '', *docstring_markdown(package), '', '## Pages', '']
        for name in api_pages()[1:]:
            with open(os.path.join(API, name + '.md'), encoding='utf-8') as f:
                title = f.readline().lstrip('# ').strip()
            out.append(f'- [{title}]({name}.md)')
    for entry in entries:
        out += ['', *entry_markdown(entry)]
    return '\n'.join(_squeeze(out)) + '\n'


def generate(out_dir=OUT):
    """Write every page into `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for page in api_pages():
        path = os.path.join(out_dir, page + '.md')
        with open(path, 'w', encoding='utf-8') as f:
            f.write(render(page))
        paths.append(path)
    return paths


def stale(out_dir=OUT):
    """The pages of `out_dir` that differ from a fresh rendering (or are
    missing, or are no page's rendering)."""
    problems = []
    wanted = {page + '.md' for page in api_pages()}
    for page in api_pages():
        path = os.path.join(out_dir, page + '.md')
        try:
            with open(path, encoding='utf-8') as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != render(page):
            problems.append(page + '.md')
    if os.path.isdir(out_dir):
        problems += sorted(set(os.listdir(out_dir)) - wanted)
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--check', action='store_true', help='list stale pages; exit 1 if any')
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for page in problems:
            print(f'stale: docs/api/markdown/{page} (run python docs/api_markdown.py)')
        return 1 if problems else 0
    for path in generate():
        print(os.path.relpath(path))
    return 0


if __name__ == '__main__':
    sys.exit(main())
