"""Soak tests: many calls, then the thread count must be unchanged and RSS
grown by less than 5 % after the warm-up.

Each soak runs in a process of its own: measured inside the test process,
which by then holds every earlier test's arrays and MXNet's pooled memory
(gigabytes), 5 % would hide a leak of hundreds of MiB. A child starts at a
few hundred MiB. The soak's body is a function of a test module returning
``calls(k)``; the child imports it, runs it and prints one JSON line.
"""
import json
import os
import subprocess
import sys
import threading
import time

import psutil

__all__ = ['measure', 'in_child', 'check']

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(calls, warmup, total, segments=1, **extra):
    """Run calls(warmup), then calls(total - warmup) in `segments` equal
    parts; print the JSON line (RSS and threads after the warm-up and at
    the end, RSS after each part, ms per call, and `extra` evaluated at the
    end: callables are called)."""
    proc = psutil.Process()
    calls(warmup)
    threads0, rss0 = threading.active_count(), proc.memory_info().rss
    marks = [rss0]
    start = time.monotonic()
    done = warmup
    for k in range(1, segments + 1):
        upto = warmup + (total - warmup) * k // segments
        calls(upto - done)
        done = upto
        marks.append(proc.memory_info().rss)
    elapsed = time.monotonic() - start
    result = {'calls': total, 'rss0': rss0, 'rss1': marks[-1], 'marks': marks,
              'threads0': threads0, 'threads1': threading.active_count(),
              'ms_per_call': elapsed / (total - warmup) * 1e3}
    result.update({k: v() if callable(v) else v for k, v in extra.items()})
    print(json.dumps(result), flush=True)


def in_child(module, factory, warmup, total, env=None, timeout=900, segments=1):
    """measure(tests/<module>.<factory>(), warmup, total, segments) in a new
    Python process; returns its JSON line as a dict."""
    code = (f'import sys\nsys.path.insert(0, {HERE!r})\nimport soaking, {module}\n'
            f'soaking.measure({module}.{factory}(), {warmup:d}, {total:d}, {segments:d})\n')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=timeout, env=dict(os.environ, **(env or {})))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check(result, what, capsys=None, max_growth=0.05, max_part=None):
    """The soak's verdict: threads constant, RSS growth under 5 % (or
    `max_growth`, for a measured growth that is not ours: say why); with
    `max_part`, also the median part's growth (measure's `segments`): a
    leak grows every part, a stair of MXNet's only one or two."""
    growth = (result['rss1'] - result['rss0']) / float(result['rss0'])
    marks = result['marks']
    parts = sorted((b - a) / float(result['rss0']) for a, b in zip(marks, marks[1:]))
    median = parts[len(parts) // 2]
    split = f'; median of {len(parts):d} parts {100 * median:+.2f}%' if len(parts) > 1 else ''
    line = (f"\n{what}; threads {result['threads0']:d} -> {result['threads1']:d}; RSS "
            f"{result['rss0'] / 2**20:.1f} -> {result['rss1'] / 2**20:.1f} MiB "
            f"({100 * growth:+.2f}%{split}) after warm-up; "
            f"{result['ms_per_call']:.1f} ms/call")
    if capsys is not None:
        with capsys.disabled():
            print(line)
    assert result['threads1'] == result['threads0'], line
    assert growth < max_growth, line
    if max_part is not None:
        assert median < max_part, line
