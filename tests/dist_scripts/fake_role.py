"""A stand-in for a dist job's script, without MXNet, for launcher tests.

Every role (scheduler, server, worker) runs it, as under a real launcher.
``argv[1]`` picks the behaviour; it prints ``ready`` once started so a test
knows every process is up.

ok        every process prints its environment (and working directory)
          and exits 0
fail      worker 1 exits with status 3; the others wait to be stopped and
          exit 9 on SIGTERM (a later non-zero status, not to be reported)
raise     worker 1 raises an exception (status 1); the others wait forever
hang      every process waits forever
stubborn  every process ignores SIGTERM and starts a grandchild that waits
          forever too (both must still be killed)
partial   workers print a last line without a newline, then exit 0
caused    worker 1 says it fails (the fail-fast hook's line) and exits
          with status 3 a second later; worker 0, failing because of it,
          exits with status 1 first, without a word (as a Horovod peer seen
          over ssh may); the others wait to be stopped
flaky N   every process prints ``attempt A port P`` (GLUON_PARALLEL_RESTART,
          the scheduler's port); worker 1 exits with status 5 while A < N
"""
import os
import signal
import subprocess
import sys
import time


def wait_forever():
    while True:
        time.sleep(1)


def main():
    mode = sys.argv[1]
    role = os.environ.get('DMLC_ROLE', '?')
    rank = os.environ.get('GLUON_PARALLEL_LAUNCH_RANK', '-')
    print(f'ready role={role} rank={rank}', flush=True)
    if mode == 'ok':
        keys = ('DMLC_ROLE', 'DMLC_PS_ROOT_URI', 'DMLC_PS_ROOT_PORT', 'DMLC_NUM_SERVER',
                'DMLC_NUM_WORKER', 'DMLC_NODE_HOST', 'PORT', 'DMLC_INTERFACE', 'GP_LAUNCH_EXTRA')
        print('env ' + ' '.join(f'{k}={os.environ.get(k)}' for k in keys)
              + f' cwd={os.getcwd()}', flush=True)
        print(f'to stderr role={role}', file=sys.stderr, flush=True)
        return 0
    if mode == 'partial':
        if role == 'worker':
            sys.stdout.write(f'no newline from {rank}')
            sys.stdout.flush()
        return 0
    if mode == 'fail':
        if role == 'worker' and rank == '1':
            time.sleep(0.5)
            print('worker 1 fails', file=sys.stderr, flush=True)
            return 3
        signal.signal(signal.SIGTERM, lambda *a: os._exit(9))
        wait_forever()
    if mode == 'caused':
        from gluon_parallel.launch.failfast import SAYS
        if role == 'worker' and rank == '1':
            time.sleep(0.3)
            print(SAYS % ('uncaught RuntimeError', 3), file=sys.stderr, flush=True)
            time.sleep(1.0)
            return 3
        if role == 'worker' and rank == '0':
            time.sleep(0.8)
            return 1
        wait_forever()
    if mode == 'raise':
        if role == 'worker' and rank == '1':
            time.sleep(0.5)
            raise RuntimeError('worker 1 raises')
        wait_forever()
    if mode == 'flaky':
        attempt = os.environ.get('GLUON_PARALLEL_RESTART')
        print('attempt {} port {}'.format(attempt, os.environ.get('DMLC_PS_ROOT_PORT')), flush=True)
        if role == 'worker' and rank == '1' and int(attempt) < int(sys.argv[2]):
            time.sleep(0.3)
            return 5
        if role == 'worker':
            return 0
        time.sleep(0.3)     # the scheduler and servers: a moment longer, as ps-lite's
        return 0
    if mode == 'hang':
        wait_forever()
    if mode == 'stubborn':
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, '-c',
                                  'import signal, time\n'
                                  'signal.signal(signal.SIGTERM, signal.SIG_IGN)\n'
                                  'print("grandchild up", flush=True)\n'
                                  'time.sleep(3600)'])
        print(f'child pid {child.pid:d}', flush=True)
        wait_forever()
    raise SystemExit(f'unknown mode {mode!r}')


if __name__ == '__main__':
    sys.exit(main())
