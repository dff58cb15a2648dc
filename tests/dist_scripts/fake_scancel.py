"""Stand-in for SLURM's ``scancel JOB.STEP`` in tests/test_launch_slurm.py.

As slurmstepd does when a step is cancelled, it sends SIGTERM to every task
of the step: here, the processes running ``gluon_parallel.launch`` whose
environment holds ``SLURM_JOB_ID=JOB`` and ``SLURM_STEP_ID=STEP``. Its
arguments are appended to the file named by ``GP_FAKE_SCANCEL_LOG``.
"""
import os
import signal
import sys

import psutil


def main():
    with open(os.environ['GP_FAKE_SCANCEL_LOG'], 'a') as f:
        f.write(' '.join(sys.argv[1:]) + '\n')
    job, _, step = sys.argv[1].partition('.')
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if (env.get('SLURM_JOB_ID') == job and env.get('SLURM_STEP_ID') == step
                    and 'gluon_parallel.launch' in p.cmdline()):
                p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    return 0


if __name__ == '__main__':
    sys.exit(main())
