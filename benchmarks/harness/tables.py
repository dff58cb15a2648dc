"""Reporting: Markdown tables, the PASS/FAIL/SKIP lines of the targets,
number formats and the JSON results file."""
import json

from .machine import load_str, machine_info


def fmt_ratio(x):
    return '-' if x is None or x != x else f'{x:.2f}'


def table(header, rows):
    """A Markdown table (also readable on a terminal)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r):
        return '| ' + ' | '.join(c.ljust(w) for c, w in zip(r, widths)) + ' |'
    out = [line(cells[0]), '|' + '|'.join('-' * (w + 2) for w in widths) + '|']
    out += [line(r) for r in cells[1:]]
    return '\n'.join(out)


class Targets:
    """Collects PASS/FAIL/SKIP lines for the targets of an issue."""

    def __init__(self):
        self.items = []

    def check(self, name, value, limit, op='<='):
        """value op limit, or SKIP when value is unknown."""
        if value is None or value != value:
            status, shown = 'SKIP', 'n/a'
        else:
            ok = value <= limit if op == '<=' else value >= limit
            status, shown = ('PASS' if ok else 'FAIL'), f'{value:.2f}'
        self.items.append({'target': name, 'value': shown, 'limit': f'{op} {limit:.2f}',
                           'status': status})

    def note(self, name, status, value='-', limit='-'):
        self.items.append({'target': name, 'value': value, 'limit': limit, 'status': status})

    def render(self):
        return table(['target', 'measured', 'limit', 'result'],
                     [[t['target'], t['value'], t['limit'], t['status']] for t in self.items])


def save_json(path, obj):
    if path:
        with open(path, 'w') as f:
            json.dump(obj, f, indent=1, sort_keys=True)


def print_targets(targets):
    """Print the targets' lines and the load after the run (a job
    benchmark's close: its tables printed as it went)."""
    print()
    print(targets.render())
    print(f'{load_str()} after')


def finish(bench, path, tbl, targets, load_before, **results):
    """Print a timed benchmark's closing report (its table, the load before
    and after, its targets) and save it with `results` and the machine's
    description to the JSON file `path` (if any)."""
    print()
    print(tbl)
    print()
    print(f'{load_str(load_before)} before, {load_str()} after')
    print()
    print(targets.render())
    save_json(path, {'bench': bench, 'table': tbl, 'targets': targets.items,
                     'machine': machine_info(), **results})


def mib(nbytes):
    return '-' if nbytes is None else '%.0f' % (nbytes / 2 ** 20)
