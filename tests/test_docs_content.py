"""The guide stays a guide: README.md and docs/*.md read as steps for users,
not as the developers' log, and every link in them lands.

- A guide page (README.md and docs/*.md but the two pages whose subject is
  measurement, design-notes.md and performance.md) holds no dates, no
  history phrases ("measured", "this run", "in earlier versions"...) and no
  speed ratio ("0.84 x", "1.21x", "0.98-1.04 x") that performance.md does
  not also hold: a figure in the guide is one of Performance's, so when a
  benchmark is run again there is one page to update.
- A guide page, and the example's README, holds no sentence of test
  evidence ("Tested with 2 workers", "the tests SIGKILL worker 1", "SLURM
  as tested"): what holds is said as what holds, and how it is checked
  goes to design-notes.md's Validation section.
- No page of the site uses a MyST role or directive that GitHub shows as
  raw text ({doc}, {download}, {include}).
- Every relative link of README.md and docs/*.md names an existing file,
  and its #anchor a heading of the page it names.
- A code block the tests skip (``<!-- skip: next "why" -->``, a comment
  the reader does not see) is explained in the visible text next to it.
- No page (README.md, docs/*.md, examples/README.md) makes a claim that the
  code does not bear out or that nothing here has run (CLAIMS: float16 or
  NVLink on GPUs, "nothing hangs", a batch that must be a multiple of the
  worker count...): each says what holds instead.
"""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Pages about measurements and validation: dates and figures belong there.
NOT_GUIDE = ('design-notes.md', 'performance.md')

MONTHS = ('Jan', 'Feb', 'Mar', 'Apr', 'May', 'Jun', 'Jul', 'Aug', 'Sep', 'Oct', 'Nov', 'Dec')
DATE = re.compile(r'\b(?:19|20)\d\d-[01]\d-[0-3]\d\b'
                  r'|\b(?:' + '|'.join(MONTHS) + r')[a-z]*\.? (?:[0-3]?\d, )?(?:19|20)\d\d\b')
HISTORY = re.compile(r'\b(?:measured|this run|in earlier versions?'
                     r'|before this (?:rule|change|issue)|in the same run|session \d+|issue \d+)\b',
                     re.I)
# A ratio: a number, or a range of two, followed by "x" or "×" as a word.
RATIO = re.compile(r'(?<![\w.])(\d+(?:\.\d+)?)(?:\s?[-–]\s?(\d+(?:\.\d+)?))?\s?[x×](?!\w)')
# A sentence of test evidence. "Tested" starts one (lower-case "tested
# with CPU contexts only" is what the GPUs page tells users); "the tests"
# as the subject of what they do; "as tested", "checked by the test
# suite", "we measured".
EVIDENCE = re.compile(r"\bTested\s+(?:with|against|under|on|in)\b"
                      r"|(?i:\btested\s+against\b)"
                      r"|(?i:\b(?:tested|checked)\s+(?:under|against|with|on)\s+a\s+real\b)"
                      r"|(?i:\bas\s+tested\b)"
                      r"|(?i:\bthe\s+(?:[\w-]+(?:'s)?\s+)?(?:test\s+suite|tests?)"
                      r"\s+(?:run|runs|kill|kills|SIGKILL|check|checks|skip|skips)\b)"
                      r"|(?i:\(the\s+tests?:)"
                      r"|(?i:\b(?:checked|verified)\s+by\s+the\s+(?:test\s+suite|tests?)\b)"
                      r"|(?i:\bwe\s+(?:measured|tested|ran|checked)\b)")
COMMENT = re.compile(r'<!--.*?-->', re.S)
RAW_ROLES = re.compile(r'\{(?:doc|download|include|ref)\}')
FENCE = re.compile(r'^(```|~~~).*?^\1', re.M | re.S)
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')
HEADING = re.compile(r'^#{1,6}\s+(.*?)\s*#*\s*$', re.M)


def pages(root=ROOT):
    """README.md and docs/*.md, as paths relative to `root`."""
    found = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, 'docs', '*.md')))
    return ['README.md'] + found


def guide_pages(root=ROOT):
    return [p for p in pages(root) if os.path.basename(p) not in NOT_GUIDE]


def prose(path):
    """The page's text without its fenced code blocks (a block shows what a
    program prints, which may hold anything)."""
    with open(path, encoding='utf-8') as f:
        return prose_of(f.read())


def prose_of(text):
    """`text` without its fenced code blocks."""
    return FENCE.sub('', text)


def ratios(text):
    """The numbers of every ratio figure in `text`."""
    out = set()
    for match in RATIO.finditer(text):
        out.update(n for n in match.groups() if n)
    return out


def numbers(text):
    return set(re.findall(r'\d+(?:\.\d+)?', text))


def evidence_pages(root=ROOT):
    """The guide's pages and the example's README."""
    extra = os.path.join('examples', 'README.md')
    return guide_pages(root) + ([extra] if os.path.exists(os.path.join(root, extra)) else [])


#: Claims the code does not bear out, or about what has never run here,
#: each with what holds instead.
CLAIMS = (
    (re.compile(r'\bfloat16 on GPUs\b', re.I),
     'float16 AMP has never run (nothing has run on a GPU: docs/gpus.md)'),
    (re.compile(r'\bNVLink\b'), 'nothing has run on NVLink or with nccl (docs/gpus.md)'),
    (re.compile(r'\bon GPUs\b[^.]*\b(?:they|it) (?:shares?|runs?|works?)\b', re.I),
     'a behaviour on GPUs, where nothing has run (docs/gpus.md)'),
    (re.compile(r'\b(?:nothing|never) hangs\b', re.I),
     'known waits remain: say which (docs/troubleshooting.md)'),
    (re.compile(r'\bmultiple of the (?:worker|device) count\b', re.I),
     'dist.GlobalBatchSampler needs at least one sample per worker, not a multiple'),
    (re.compile(r'\bnever the learning rate\b', re.I),
     'the learning rate does not depend on the device count; a larger global batch may '
     'want another one (examples/README.md)'),
)


def claim_problems(root=ROOT):
    """(page, what) for every claim of CLAIMS in the prose of any page."""
    problems = []
    for page in evidence_pages(root) + [p for p in pages(root) if p not in guide_pages(root)]:
        text = COMMENT.sub('', prose(os.path.join(root, page)))
        problems += [(page, f'{" ".join(m.group(0).split())!r}: {why}')
                     for pattern, why in CLAIMS for m in pattern.finditer(text)]
    return problems


def evidence_problems(root=ROOT):
    """(page, what) for every sentence of test evidence in the guide's
    prose (not in code blocks, nor in the comments that tell the tests why
    a block is skipped, which the reader does not see)."""
    problems = []
    for page in evidence_pages(root):
        text = COMMENT.sub('', prose(os.path.join(root, page)))
        problems += [(page, f'test evidence {" ".join(m.group(0).split())!r}')
                     for m in EVIDENCE.finditer(text)]
    return problems


def history_problems(root=ROOT):
    """(page, what) for every date, history phrase and ratio the guide
    should not hold."""
    performance = numbers(prose(os.path.join(root, 'docs', 'performance.md'))) \
        if os.path.exists(os.path.join(root, 'docs', 'performance.md')) else set()
    problems = []
    for page in guide_pages(root):
        text = prose(os.path.join(root, page))
        problems += [(page, f'date {m.group(0)!r}') for m in DATE.finditer(text)]
        problems += [(page, f'history {m.group(0)!r}') for m in HISTORY.finditer(text)]
        problems += [(page, f'figure {n} x not on the Performance page')
                     for n in sorted(ratios(text) - performance)]
    return problems


def role_problems(root=ROOT):
    """(page, role) for every MyST role or directive GitHub shows as raw
    text (a directive is a fenced block: the whole text is read)."""
    problems = []
    for page in pages(root):
        with open(os.path.join(root, page), encoding='utf-8') as f:
            text = f.read()
        problems += [(page, f'{m.group(0)} (GitHub shows it as raw text)')
                     for m in RAW_ROLES.finditer(text)]
    return problems


def slug(heading):
    """The anchor GitHub and MyST (myst_heading_anchors) give a heading."""
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading)     # a link: its text
    text = text.lower().replace('`', '')
    text = re.sub(r'[^\w\- ]', '', text)
    return text.replace(' ', '-')


def anchors(path):
    return {slug(h) for h in HEADING.findall(prose(path))}


def link_problems(root=ROOT):
    """(page, link) for every relative link whose file or anchor does not
    exist."""
    problems = []
    for page in pages(root):
        path = os.path.join(root, page)
        for target in LINK.findall(prose(path)):
            if re.match(r'[a-z][a-z0-9+.-]*:', target):       # http:, https:, mailto:
                continue
            file, _, anchor = target.partition('#')
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(dest):
                problems.append((page, f'{target}: no such file'))
            elif anchor and dest.endswith('.md') and anchor not in anchors(dest):
                problems.append((page, f'{target}: no heading with this anchor'))
    return problems


SAYS_WHY = re.compile(r'not run|do(?:es)? not run|cannot run|needs? |excerpt', re.I)


def paragraph(lines, start, step):
    """The paragraph next to line `start` (blank lines skipped), going
    back (`step` -1) or forward (1)."""
    i = start
    while 0 <= i < len(lines) and not lines[i].strip():
        i += step
    found = []
    while 0 <= i < len(lines) and lines[i].strip():
        found.append(lines[i])
        i += step
    return ' '.join(found)


def skip_problems(root=ROOT):
    """(page, line) for every skipped block whose paragraph before, or
    after the block, does not say why it is not run."""
    problems = []
    for page in pages(root):
        with open(os.path.join(root, page), encoding='utf-8') as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            if not line.startswith('<!-- skip: next'):
                continue
            end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith('```')),
                       len(lines) - 1)
            if not (SAYS_WHY.search(paragraph(lines, i - 1, -1))
                    or SAYS_WHY.search(paragraph(lines, end + 1, 1))):
                problems.append((page, f'line {i + 1:d}: a skipped block whose text does not '
                                       'say why it is not run'))
    return problems


def test_the_guide_holds_no_dates_history_or_stray_figures():
    problems = history_problems()
    assert not problems, ('move these to docs/design-notes.md or docs/performance.md '
                          '(or delete them):\n' + '\n'.join(f'{p}: {w}' for p, w in problems))


def test_the_guide_holds_no_test_evidence():
    problems = evidence_problems()
    assert not problems, ('say what holds, and move how it is checked to docs/design-notes.md '
                          '(Validation):\n' + '\n'.join(f'{p}: {w}' for p, w in problems))


@pytest.mark.parametrize('text, found', [
    ('Tested against a real sshd: a Horovod job', ['Tested against']),
    ("behave as GluonCV's (tested against them on small inputs)", ['tested against']),
    ('Tested with 2 workers × 2 contexts: the same', ['Tested with']),
    ('starts its worker; tested under a\nreal SLURM: 2 tasks', ['tested under a real']),
    ('SLURM as tested: the suite starts', ['as tested']),
    ('exactly: the tests SIGKILL worker 1 of a run', ['the tests SIGKILL']),
    ("Ctrl-C: the wrapper's tests run dist_sync jobs", ["the wrapper's tests run"]),
    ('within seconds (the tests: a plain-MXNet job', ['(the tests:']),
    ('it; the test suite runs the same loop in bfloat16', ['the test suite runs']),
    ('with that reason, and the AMP tests skip with it', ['the AMP tests skip']),
    ('Each is checked by the test suite.', ['checked by the test suite']),
    ('on 2 cores we measured 3 s', ['we measured']),
    ('| `nccl` | tested with CPU contexts only |', []),
    ('Which Python and numpy versions are tested: Limitations.', []),
    ('Python 3.12 installs, but is untested. Run the tests: pytest.', []),
    ('This block needs a GPU, so it is not run here.', []),
])
def test_the_evidence_check_sees_what_it_is_for(tmp_path, text, found):
    """The check on a made-up site: a guide page holding `text` (and the
    same words in a code block and in a skip comment, which it ignores)."""
    (tmp_path / 'docs').mkdir()
    (tmp_path / 'docs' / 'design-notes.md').write_text('Tested with 2 workers.\n')
    (tmp_path / 'README.md').write_text(
        f'# Title\n\n{text}\n\n<!-- skip: next "the tests run it" -->\n```\nTested with 2\n```\n')
    seen = [what for _, what in evidence_problems(str(tmp_path))]
    assert seen == [f'test evidence {w!r}' for w in found], seen


def test_no_page_claims_what_the_code_does_not_do_or_never_ran():
    problems = claim_problems()
    assert not problems, '\n'.join(f'{p}: {w}' for p, w in problems)


@pytest.mark.parametrize('text, found', [
    ("MXNet's AMP works unchanged: float16 on GPUs, bfloat16 on CPUs", ['float16 on GPUs']),
    ('`nccl` is an alternative on NVLink machines.', ['NVLink']),
    ('shared memory); on GPUs, and for BatchNorm networks everywhere, they share.',
     ['on GPUs, and for BatchNorm networks everywhere, they share']),
    ('traceback and device; nothing hangs.', ['nothing hangs']),
    ('works on CPU contexts, never hangs', ['never hangs']),
    ('the global batch (it must be a multiple of the worker count);',
     ['multiple of the worker count']),
    ('scale the loss, never the learning rate (weight decay)', ['never the learning rate']),
    ('float16 AMP, on GPUs, has not run (GPUs).', []),
    ('On GPUs it has not been timed.', []),
    ('a barrier raise too instead of waiting for good', []),
])
def test_the_claim_check_sees_what_it_is_for(tmp_path, text, found):
    """The check on a made-up site: `text` on a guide page and on a page
    about measurements alike (and in a code block, which it ignores)."""
    (tmp_path / 'docs').mkdir()
    for page in ('README.md', 'docs/design-notes.md'):
        (tmp_path / page).write_text(f'# Title\n\n{text}\n\n```\nnothing hangs\n```\n')
    seen = [what.split("': ")[0].strip("'") for _, what in claim_problems(str(tmp_path))]
    assert seen == found * 2, seen


def index_problems(root=ROOT):
    """The pages docs/index.md's toctrees hold (the site's sidebar, hidden:
    GitHub shows a toctree as raw text) that its visible links do not
    name, and the other way round."""
    with open(os.path.join(root, 'docs', 'index.md'), encoding='utf-8') as f:
        text = f.read()
    toctree = set()
    for block in re.findall(r'^```\{toctree\}\n(.*?)^```', text, re.M | re.S):
        toctree.update(line.strip() for line in block.splitlines()
                       if line.strip() and not line.startswith(':'))
    linked = {target[:-3] for target in LINK.findall(prose_of(text))
              if target.endswith('.md') and ':' not in target}
    return sorted(f'{page}: in a toctree, not linked' for page in toctree - linked) + \
        sorted(f'{page}: linked, in no toctree' for page in linked - toctree)


def test_the_index_links_every_page_of_its_toctrees():
    problems = index_problems()
    assert not problems, '\n'.join(problems)


def test_no_page_uses_roles_github_shows_raw():
    problems = role_problems()
    assert not problems, '\n'.join(f'{p}: {w}' for p, w in problems)


def test_every_skipped_block_says_why_in_visible_text():
    problems = skip_problems()
    assert not problems, '\n'.join(f'{p}: {w}' for p, w in problems)


def test_every_relative_link_and_anchor_resolves():
    problems = link_problems()
    assert not problems, '\n'.join(f'{p}: {w}' for p, w in problems)


@pytest.mark.parametrize('text, found', [
    ('on 2026-11-26, load 2', ['date']),
    ('the run of Nov 2026', ['date']),
    ('(measured: 1 run in 27)', ['history']),
    ('an intermittent hang seen in earlier versions', ['history']),
    ('at 0.84 x the loop and 1.21x Module', ['figure 0.84', 'figure 1.21']),
    ('0.98-1.04 x across runs', ['figure 0.98', 'figure 1.04']),
    ('32x32 images, 2 workers x 2 contexts, 1e-4 relative', []),
])
def test_the_checks_see_what_they_are_for(tmp_path, text, found):
    """The checks on a made-up site: a guide page holding `text`, a
    Performance page holding none of its figures."""
    (tmp_path / 'docs').mkdir()
    (tmp_path / 'docs' / 'performance.md').write_text('# Performance\n\n| a | 3.10 |\n')
    (tmp_path / 'README.md').write_text(f'# Title\n\n{text}\n\n```\n2026-11-26 0.5 x\n```\n')
    seen = [what for _, what in history_problems(str(tmp_path))]
    kinds = [' '.join(w.split()[:2]) if w.startswith('figure') else w.split()[0] for w in seen]
    assert kinds == found, seen


def test_a_figure_the_performance_page_holds_is_allowed(tmp_path):
    (tmp_path / 'docs').mkdir()
    (tmp_path / 'docs' / 'performance.md').write_text('| graph mode | 1856 | 0.93 |\n')
    (tmp_path / 'README.md').write_text('It runs at 0.93 x Module.\n')
    assert history_problems(str(tmp_path)) == []


def test_the_link_check_sees_missing_files_and_anchors(tmp_path):
    (tmp_path / 'docs').mkdir()
    (tmp_path / 'docs' / 'a.md').write_text('# A page\n\n## Many input sizes: `cache_size`\n')
    (tmp_path / 'README.md').write_text(
        '# R\n\n[ok](docs/a.md#many-input-sizes-cache_size) [ok](docs/a.md) [ok](#r) '
        '[web](https://example.org/x#y) [bad](docs/b.md) [bad](docs/a.md#nope) [bad](#nope)\n')
    assert [w for _, w in link_problems(str(tmp_path))] == [
        'docs/b.md: no such file', 'docs/a.md#nope: no heading with this anchor',
        '#nope: no heading with this anchor']
    (tmp_path / 'docs' / 'a.md').write_text('See {doc}`b` and {download}`c <c.csv>`.\n')
    (tmp_path / 'docs' / 'b.md').write_text('```{include} ../B.md\n```\n')
    assert len(role_problems(str(tmp_path))) == 3


def test_the_skip_check_sees_a_silent_skip(tmp_path):
    (tmp_path / 'docs').mkdir()
    block = '<!-- skip: next "a GPU" -->\n```python\nx = 1\n```\n'
    (tmp_path / 'README.md').write_text(
        f'# R\n\nThis one needs a GPU:\n\n{block}\nSilent:\n\n{block}\n'
        f'Another:\n\n{block}\nThis block is not run here.\n')
    assert [w.split(':')[0] for _, w in skip_problems(str(tmp_path))] == ['line 12']
