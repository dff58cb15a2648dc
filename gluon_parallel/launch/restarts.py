"""``--max-restarts N``: after a failure, run the whole job again.

When a process of the job fails, the watchdog stops every process as
usual; then the job starts again from scratch, on fresh ports (a new
scheduler: ps-lite cannot take a worker back into a running job), up to N
times. Every process sees the attempt number in ``GLUON_PARALLEL_RESTART``
(``0`` first), so a script can resume from its last checkpoint. The exit
status is the last attempt's.

Only a process's failure is restarted: a ``--timeout``, a signal to the
launcher (Ctrl-C, ``scancel``) or a command that cannot be started ends
the run at once.

With ``--launcher slurm`` the restarts happen inside the allocation: the
launcher run in the batch script (or the ``salloc`` shell) starts one
``srun`` job step per attempt, each with a new step id, hence a new
scheduler port.
"""
import re
import signal
import subprocess
import sys

from .process import RESTART_ENV, exit_status

__all__ = ['run_restarting', 'run_steps']

# The watchdog's report of a failure (see Launcher._failure).
_FAILURE = re.compile(rb'^\[launch\] (.+? exited with status (\d+))')


def _note(msg):
    sys.stderr.write(f'[launch] {msg}\n')
    sys.stderr.flush()


def run_restarting(attempt, max_restarts, note=_note):
    """Run attempts 0, 1, ... of a job until one succeeds, one ends in a
    way a restart cannot mend, or `max_restarts` restarts were made.

    Parameters
    ----------
    attempt : callable
        ``attempt(number) -> (status, cause, restartable)``: runs the whole
        job once.
    max_restarts : int
    note : callable
        Prints a ``[launch]`` line.

    Returns
    -------
    int
        The last attempt's exit status.
    """
    number = 0
    while True:
        status, cause, restartable = attempt(number)
        if status == 0 or not restartable or max_restarts == 0:
            return status
        if number == max_restarts:
            note(f'no restart left (--max-restarts {max_restarts:d}): exiting with status '
                 f'{status:d}')
            return status
        number += 1
        note(f'restart {number:d} of {max_restarts:d} after: {cause}; starting the whole job again')


def _first_failure(stream, out):
    """Copy `stream` (srun's stderr) to `out` line by line; return the first
    ``[launch] NAME exited with status N`` line's (N, "NAME exited with
    status N"), or None."""
    first = None
    for line in iter(stream.readline, b''):
        out.write(line)
        out.flush()
        if first is None:
            match = _FAILURE.match(line)
            if match:
                first = int(match.group(2)), match.group(1).decode(errors='replace')
    return first


def run_steps(argv, env, max_restarts, note=_note, before=None):
    """SLURM: run `argv` (an ``srun``) once per attempt, restarting it as
    :func:`run_restarting` does; SIGINT, SIGTERM and SIGHUP are passed on
    to the running srun and end the run.

    srun's own status is the highest of its tasks' (143 for the tasks it
    stopped because another one failed): an attempt's status is instead
    the first failure a task reported (``[launch] ... exited with status
    N`` on srun's stderr, which is copied through).

    `before(number)`, when given, runs before each attempt's srun.

    Returns
    -------
    int
        The last attempt's exit status.
    """
    stopped = []

    def attempt(number):
        if before is not None:
            before(number)
        try:
            proc = subprocess.Popen(argv, env=dict(env, **{RESTART_ENV: str(number)}),
                                    stderr=subprocess.PIPE)
        except OSError as e:
            note(f'cannot run {argv[0]}: {e}')
            return 127, None, False

        def forward(signum, frame):
            stopped.append(signum)
            proc.send_signal(signum)

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM,
                                                        signal.SIGHUP)}
        try:
            first = _first_failure(proc.stderr, sys.stderr.buffer)
            status = exit_status(proc.wait())
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            proc.stderr.close()
        cause = f'job step exited with status {status:d}'
        if status and first is not None:
            status, cause = first
        return status, cause, not stopped

    sys.stdout.flush()
    return run_restarting(attempt, max_restarts, note)
