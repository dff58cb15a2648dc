"""A stand-in for an elastic job's script, without MXNet, for the launcher's
elastic tests: every worker "trains" STEPS steps of 0.05 s, a "checkpoint"
after each (rank 0 writes the next step to PROGRESS; every worker asks the
launcher whether to leave, as dist.save_checkpoint does). The scheduler and
servers exit 0 at once. Under ``--engine horovod`` the workers are
horovodrun's (HOROVOD_RANK, HOROVOD_SIZE).

    elastic_fake.py PROGRESS STEPS [die RANK STEP HOSTS_FILE SLOTS]
                                   [grow STEP HOSTS_FILE SLOTS]

                                   [cut RANK STEP]

die: in attempt 0, worker RANK writes "localhost:SLOTS" (or, SLOTS "-",
removes HOSTS_FILE; SLOTS with a ":", the lines "," separates) and SIGKILLs
itself at step STEP. grow: in attempt 0, worker 0 writes the same at step
STEP; then the workers go on (past STEPS) until the launcher tells them to
leave. cut (ssh): in attempt 0, worker RANK kills the sshd process its
connection runs in, at step STEP (its host becomes unreachable).
"""
import importlib.util
import os
import signal
import sys
import time

# gluon_parallel.launch without the package's __init__, which imports
# MXNet (seconds per worker): the launcher's package imports nothing of it.
_spec = importlib.util.find_spec('gluon_parallel')
_package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(
    'gluon_parallel', None, is_package=True))
_package.__path__ = list(_spec.submodule_search_locations)
sys.modules['gluon_parallel'] = _package
from gluon_parallel.launch.elastic import GROW_STATUS, should_leave  # noqa: E402


def write(path, text):
    with open(f'{path}.{os.getpid():d}', 'w') as f:
        f.write(text)
    os.replace(f'{path}.{os.getpid():d}', path)


def write_hosts(path, slots):
    if slots == '-':
        os.remove(path)
    elif ':' in slots:
        write(path, slots.replace(',', '\n') + '\n')
    else:
        write(path, f'localhost:{slots}\n')


def cut_connection():
    """SIGKILL the nearest sshd above this process: its ssh client then
    exits with 255, as when a host drops off the network."""
    pid = os.getppid()
    while pid > 1:
        with open(f'/proc/{pid:d}/comm') as f:
            if f.read().startswith('sshd'):
                os.kill(pid, signal.SIGKILL)
                return
        with open(f'/proc/{pid:d}/stat') as f:
            pid = int(f.read().rsplit(')', 1)[1].split()[1])
    raise SystemExit('cut: no sshd above this process')


def main():
    progress, steps, rest = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    horovod = 'HOROVOD_RANK' in os.environ      # (the fake never initialises Horovod)
    if os.environ.get('DMLC_ROLE') != 'worker' and not horovod:
        return 0
    attempt = int(os.environ['GLUON_PARALLEL_RESTART'])
    rank = int(os.environ['HOROVOD_RANK' if horovod else 'GLUON_PARALLEL_LAUNCH_RANK'])
    size = int(os.environ['HOROVOD_SIZE' if horovod else 'DMLC_NUM_WORKER'])
    step = int(open(progress).read()) if os.path.exists(progress) else 0
    print(f'attempt {attempt:d} rank {rank:d} of {size:d} from step {step:d}', flush=True)
    growing = False
    first = True        # a late worker, past STEPS already, still meets its event
    while step < steps or growing or first:
        first = False
        time.sleep(0.05)
        if rest[:1] == ['die'] and attempt == 0 and rank == int(rest[1]) and step >= int(rest[2]):
            write_hosts(rest[3], rest[4])
            os.kill(os.getpid(), signal.SIGKILL)
        if rest[:1] == ['cut'] and attempt == 0 and rank == int(rest[1]) and step >= int(rest[2]):
            cut_connection()
            time.sleep(30)          # killed with the connection's process group
        if rest[:1] == ['grow'] and attempt == 0 and step >= int(rest[1]) and not growing:
            if rank == 0:
                write_hosts(rest[2], rest[3])
            growing = True
        step += 1
        if rank == 0:
            write(progress, str(step))
        if should_leave():
            print(f'rank {rank:d} leaves after step {step:d}', flush=True)
            return GROW_STATUS
        if step > steps + 200:
            return 3        # never told to leave
    print(f'rank {rank:d} done', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
