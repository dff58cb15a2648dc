"""``--engine horovod``: a Horovod job under the launcher's guarantees.

The launcher runs Horovod's own launcher, ``horovodrun --gloo`` (no MPI),
as the job's one process: horovodrun starts the workers, hosts the Gloo
rendezvous they need, and ends the whole job as soon as one worker exits
non-zero (measured: 5 s from a worker's exception to nothing left). Around
it the launcher adds what it gives a dist_sync job: every line prefixed,
``--timeout``, signals, ``--max-restarts`` (the whole horovodrun again,
``GLUON_PARALLEL_RESTART`` set) and the process-group cleanup, and every
worker gets the fail-fast start-up hook, which horovodrun passes on with the
rest of the environment. Re-implementing the rendezvous would duplicate
Horovod's launcher for no gain.
"""
import sys

from .hosts import LaunchError
from .plan import inherited_env, startup_path
from .process import Spec

__all__ = ['horovod_spec']


def horovod_spec(num_workers, command, user_env):
    """The Spec of ``horovodrun -np N -H localhost:N --gloo COMMAND`` on
    this machine."""
    try:
        import horovod.runner.launch  # noqa: F401,F811  (is horovodrun there?)
    except ImportError as e:
        raise LaunchError('--engine horovod needs Horovod (horovod.runner does not import: %s); '
                          'see the README\'s "Horovod" section' % e)
    env = inherited_env()
    env.update(user_env)
    env['PYTHONPATH'] = startup_path(env.get('PYTHONPATH'))
    env.setdefault('PYTHONUNBUFFERED', '1')
    argv = [sys.executable, '-m', 'horovod.runner.launch', '-np', str(num_workers),
            '-H', 'localhost:%d' % num_workers, '--gloo'] + list(command)
    # The launcher's worker: the job ends with it, its status the job's.
    return Spec('horovodrun', 'worker', argv, env)
