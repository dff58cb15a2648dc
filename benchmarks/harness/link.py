"""An emulated cluster link: the job runs in a private network namespace
(``unshare -n``) whose loopback is rate-limited by a token bucket (``tc
qdisc ... tbf``; ``netem`` is not available on every kernel, ``tbf`` is).
Every packet of a job on 127.0.0.1 leaves through that loopback once, so the
rate caps the bytes per second of the whole job (a parameter server's
replies included), as a machine's network interface would.

Nothing here pretends: a tool that is missing or not permitted raises
`LinkError`, and the caller runs nothing.
"""
import math
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple

TOOLS = ('unshare', 'ip', 'tc')
MTU = 9000                  # a 9000-byte packet fits the 256 kb burst
BURST, LATENCY = '256kb', '400ms'


class LinkError(RuntimeError):
    """The emulated link cannot be set up here (what is missing, and why)."""


class Rate(NamedTuple):
    """A link rate: `mbit` Mbit/s, or None for the bare loopback."""
    label: str
    mbit: float | None


BARE = Rate('bare', None)
_UNITS = {'kbit': 1e-3, 'mbit': 1.0, 'gbit': 1e3, '': 1.0}


def parse_rate(text):
    """'bare', or a rate in Mbit/s: '200', '200mbit', '1.5gbit', '800kbit'."""
    t = text.strip().lower()
    if t == 'bare':
        return BARE
    m = re.fullmatch(r'(\d+(?:\.\d*)?)\s*(kbit|mbit|gbit)?', t)
    if not m:
        raise ValueError(f'bad rate {text!r}: give "bare" or a number of Mbit/s '
                         '(e.g. 200, 200mbit, 1gbit)')
    mbit = float(m.group(1)) * _UNITS[m.group(2) or '']
    if not mbit > 0:
        raise ValueError(f'bad rate {text!r}: it must be positive')
    return Rate(f'{mbit:g} Mbit/s', mbit)


def parse_rates(text):
    """A comma-separated list of rates (see `parse_rate`), duplicates refused."""
    rates = [parse_rate(t) for t in text.split(',') if t.strip()]
    if not rates:
        raise ValueError('no rate given')
    if len(set(rates)) != len(rates):
        raise ValueError(f'a rate is given twice in {text!r}')
    return rates


def nice_rate(mbit):
    """`mbit` rounded to two significant digits (a rate worth printing)."""
    if not mbit > 0:
        raise ValueError(f'rate {mbit!r} is not positive')
    return float(f'{mbit:.2g}')


def missing_tools():
    """The tools of `TOOLS` that are not on PATH (nor in /sbin)."""
    path = '/usr/sbin:/sbin:/usr/bin:/bin'
    return [t for t in TOOLS if not shutil.which(t) and not shutil.which(t, path=path)]


def _tool(name):
    return shutil.which(name) or shutil.which(name, path='/usr/sbin:/sbin:/usr/bin:/bin') \
        or name


def namespace_command(argv):
    """The command that runs ``python`` `argv` in a new network namespace."""
    return [_tool('unshare'), '-n', sys.executable] + list(argv)


def _run(*cmd):
    proc = subprocess.run([_tool(cmd[0])] + list(cmd[1:]), capture_output=True, text=True)
    if proc.returncode != 0:
        raise LinkError(f'"{" ".join(cmd)}" failed (status {proc.returncode:d}): '
                        f'{(proc.stderr or proc.stdout).strip()}')
    return proc.stdout


def setup_loopback():
    """Bring the namespace's loopback up with a 9000-byte MTU."""
    _run('ip', 'link', 'set', 'lo', 'mtu', str(MTU), 'up')


def set_rate(rate, had_qdisc):
    """Make the loopback's rate `rate` (a Rate): add, change or remove the
    token bucket. `had_qdisc` says whether one is installed; returns
    whether one is now."""
    if rate.mbit is None:
        if had_qdisc:
            _run('tc', 'qdisc', 'del', 'dev', 'lo', 'root')
        return False
    _run('tc', 'qdisc', 'change' if had_qdisc else 'add', 'dev', 'lo', 'root', 'tbf',
         'rate', f'{rate.mbit * 1000:.0f}kbit', 'burst', BURST, 'latency', LATENCY)
    return True


def qdisc():
    """``tc qdisc show dev lo`` (what the kernel says it applies)."""
    return _run('tc', 'qdisc', 'show', 'dev', 'lo').strip()


def check_bytes(mbit, seconds=1.0, least=8 << 20, most=64 << 20):
    """The size of a socket check at `mbit` Mbit/s (None: no tc): about
    `seconds` of transfer, so TCP's slow start and the bucket's first burst
    weigh little, within [`least`, `most`] bytes."""
    if mbit is None:
        return least
    return int(min(most, max(least, mbit * 1e6 / 8 * seconds)))


def socket_mbit(nbytes=8 << 20, timeout=120.0):
    """Mbit/s of one plain TCP transfer of `nbytes` on 127.0.0.1 (from the
    connection to the receiver's last byte)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(('127.0.0.1', 0))
    server.listen(1)
    server.settimeout(timeout)
    done = {}

    def receive():
        conn, _ = server.accept()
        conn.settimeout(timeout)
        got = 0
        with conn:
            while got < nbytes:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                got += len(chunk)
        done['bytes'], done['end'] = got, time.perf_counter()

    reader = threading.Thread(target=receive, daemon=True)
    reader.start()
    payload = b'\0' * nbytes
    start = time.perf_counter()
    with socket.create_connection(server.getsockname(), timeout=timeout) as client:
        client.sendall(payload)
    reader.join(timeout)
    server.close()
    if done.get('bytes') != nbytes:
        raise LinkError(f'the socket check received {done.get("bytes", 0):d} of '
                        f'{nbytes:d} bytes')
    return nbytes * 8 / (done['end'] - start) / 1e6


def overlap(compute, reduce, step):
    """The share of the shorter of compute and reduction hidden under the
    other: (compute + reduce - step) / min(compute, reduce); 0 when the
    step is their sum, 1 when it is their maximum. None when a figure is
    missing."""
    if None in (compute, reduce, step) or min(compute, reduce) <= 0:
        return None
    return (compute + reduce - step) / min(compute, reduce)


#: ResNet-50's 25.6 M float32 gradients, and V100's ResNet-50 step (fp32,
#: 64 images per GPU, forward and backward: ~0.2 s).
RESNET50_BYTES = 25.6e6 * 4
V100_STEP_S = 0.2


def cluster_link_gbit(ratio, grad_bytes=RESNET50_BYTES, compute_s=V100_STEP_S):
    """The link (Gbit/s per machine) at which a ring all-reduce of
    `grad_bytes` (each machine sends and receives ~2 x the bytes for many
    machines) takes `ratio` x `compute_s`."""
    if not ratio > 0:
        raise ValueError(f'ratio {ratio!r} is not positive')
    return 2 * grad_bytes * 8 / (ratio * compute_s) / 1e9


def ethernet_class(gbit):
    """The Ethernet whose usable rate (~80% of line rate) is nearest `gbit`."""
    classes = (1, 10, 25, 40, 100, 200, 400)
    return min(classes, key=lambda c: abs(math.log(0.8 * c / gbit)))
