"""Running the launcher in the tests and checking what it leaves behind:
the command line, an environment carrying a unique token, the output of
finished launchers, and the promise that no process carrying the token
outlives its launch. Also the checks of the plain-MXNet and restart jobs
that the local, ssh and SLURM launcher tests share.
"""
import os
import re
import selectors
import subprocess
import sys
import time
import uuid

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(HERE, 'dist_scripts', 'fake_role.py')
PLAIN = os.path.join(HERE, 'dist_scripts', 'plain_sync.py')
LIMIT = 60          # hard bound on any launch in the launcher tests, seconds


def launch_env(token, **extra):
    env = dict(os.environ, GP_LAUNCH_TEST_TOKEN=token)
    for k in ('DMLC_ROLE', 'DMLC_PS_ROOT_URI', 'DMLC_PS_ROOT_PORT', 'DMLC_NUM_WORKER',
              'DMLC_NUM_SERVER'):
        env.pop(k, None)
    env.update(extra)
    return env


def launch_cmd(*args):
    return [sys.executable, '-m', 'gluon_parallel.launch'] + list(args)


def run_launch(args, token=None, timeout=LIMIT, **env):
    token = token or uuid.uuid4().hex
    proc = subprocess.run(launch_cmd(*args), env=launch_env(token, **env), capture_output=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode(), token


def finish(popens, timeout=LIMIT):
    """[(status, stdout, stderr)] of launchers started with Popen; any still
    running after `timeout` is killed."""
    results = []
    try:
        for p in popens:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out.decode(), err.decode()))
    finally:
        for p in popens:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def env_lines(out):
    """{process name: the rest of its ``env`` line} from a job's output."""
    env = {}
    for line in out.splitlines():
        name, _, rest = line.partition('] env ')
        if rest:
            env[name.lstrip('[')] = rest
    return env


def carrying(token):
    """Live processes whose environment holds `token`."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue        # dead, waiting for its parent to reap it
            if p.environ().get('GP_LAUNCH_TEST_TOKEN') == token:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def assert_nothing_left(token):
    # A process SIGKILLed by the launcher may take a moment to be torn down
    # by the kernel; give it a bounded grace, then insist.
    left = carrying(token)
    if left:
        psutil.wait_procs(left, timeout=5)
        left = [p for p in carrying(token)]
    assert not left, 'processes left running: %s' % [(p.pid, p.cmdline()) for p in left]


def read_until(popen, predicate, limit=LIMIT, stream=None):
    """Read the launcher's stdout (or `stream`) until predicate(lines) holds."""
    lines, buf = [], b''
    stream = popen.stdout if stream is None else stream
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + limit
    try:
        while not predicate(lines):
            left = deadline - time.monotonic()
            assert left > 0, f'launcher output never satisfied the test: {lines}'
            if sel.select(min(left, 1.0)):
                data = os.read(stream.fileno(), 65536)
                assert data, f'launcher closed stdout early: {lines}'
                buf += data
                *done, buf = buf.split(b'\n')
                lines.extend(x.decode() for x in done)
    finally:
        sel.close()
    return lines


def all_ready(n_procs):
    return lambda lines: sum(' ready role=' in x for x in lines) >= n_procs


def plain_sums(num_workers, rounds=3):
    """The sums every worker of plain_sync.py must print: round r pushes
    (rank + 1) * (r + 1) from each rank."""
    return {r: sum((k + 1) * (r + 1) for k in range(num_workers)) for r in range(rounds)}


def check_plain_sums(out, num_workers, suffix=''):
    want = plain_sums(num_workers)
    for rank in range(num_workers):
        for r, total in want.items():
            line = f'[worker {rank}{suffix}] rank {rank} round {r} sum {total:g}'
            assert line in out.splitlines(), out


def attempts(out, name='worker 0'):
    """[(attempt, scheduler port)] that process `name` printed, in order."""
    return [(int(a), int(p)) for a, p in
            re.findall(rf'^\[{re.escape(name)}\] attempt (\d+) port (\d+)$', out, re.M)]


def check_restarts(out, err, failing_attempts, max_restarts, name='worker 0',
                   cause='worker 1 exited with status 5'):
    """Attempts 0..failing_attempts (fewer if it gave up), each on a new port,
    each restart announced with its cause."""
    last = min(failing_attempts, max_restarts)
    seen = attempts(out, name)
    assert [a for a, _ in seen] == list(range(last + 1)), out
    assert len({p for _, p in seen}) == len(seen), seen         # a fresh scheduler each time
    restarts = re.findall(r'^\[launch\] restart (\d+) of (\d+) after: (.*); starting the whole '
                          r'job again$', err, re.M)
    assert [(int(n), int(m)) for n, m, _ in restarts] == [
        (n, max_restarts) for n in range(1, last + 1)], err
    for _, _, said in restarts:
        assert re.sub(r'@\S+', '', said) == cause, said


def wait_for_checkpoint(popen, save_dir, limit=LIMIT):
    """Wait until SAVE_DIR/checkpoint.json exists (a checkpoint is complete
    once its .json is there), the process `popen` still running."""
    deadline = time.monotonic() + limit
    while not (save_dir / 'checkpoint.json').exists():
        assert popen.poll() is None and time.monotonic() < deadline, 'no checkpoint written'
        time.sleep(0.02)
