"""The benchmark scripts' shared machinery (not part of the library), one
module per concern:

- ``machine``: load average, hardware and versions, gluoncv's presence;
- ``workers``: the worker protocol (a contender per process, JSON lines);
- ``timing``: interleaved timing rounds across the workers;
- ``tables``: Markdown tables, targets, the JSON results file;
- ``options``: the options every script takes;
- ``jobs``: multi-process jobs under gluon_parallel.launch;
- ``link``: an emulated cluster link (a network namespace, ``tc tbf``).
"""
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # benchmarks/
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:            # run from a checkout without installing
    sys.path.insert(0, ROOT)
