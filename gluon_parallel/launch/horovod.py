"""``--engine horovod``: a Horovod job under the launcher's guarantees.

On this machine (``--launcher local``) the launcher runs Horovod's own
launcher, ``horovodrun --gloo`` (no MPI), as the job's one process:
horovodrun starts the workers, hosts the Gloo rendezvous they need, and
ends the whole job as soon as one worker exits non-zero (measured: 5 s from
a worker's exception to nothing left). Around it the launcher adds what it
gives a dist_sync job: every line prefixed, ``--timeout``, signals,
``--max-restarts`` (the whole horovodrun again, ``GLUON_PARALLEL_RESTART``
set) and the process-group cleanup, and every worker gets the fail-fast
start-up hook, which horovodrun passes on with the rest of the environment.

Over ssh (``--launcher ssh``) horovodrun would start the remote workers
with ssh clients of its own, outside the launcher's ssh wrapper (no
cleanup when a connection drops, no per-worker prefix); and it treats every
address of this machine as local, so its ssh path cannot be exercised on one
machine. So the launcher hosts the rendezvous itself (:class:`Rendezvous`:
horovod.runner's own ``RendezvousServer`` with horovodrun's slot plan) and
starts each worker over ssh exactly like a dist_sync worker, with the
variables horovodrun would give it. SLURM is not supported yet.
"""
import collections
import sys

from .hosts import LaunchError
from .plan import inherited_env, startup_path
from .process import Spec

__all__ = ['horovod_spec', 'Rendezvous']


def horovod_spec(num_workers, command, user_env):
    """The Spec of ``horovodrun -np N -H localhost:N --gloo COMMAND`` on
    this machine."""
    _require_runner()
    env = inherited_env()
    env.update(user_env)
    env['PYTHONPATH'] = startup_path(env.get('PYTHONPATH'))
    env.setdefault('PYTHONUNBUFFERED', '1')
    argv = [sys.executable, '-m', 'horovod.runner.launch', '-np', str(num_workers),
            '-H', 'localhost:%d' % num_workers, '--gloo'] + list(command)
    # The launcher's worker: the job ends with it, its status the job's.
    return Spec('horovodrun', 'worker', argv, env)


def _require_runner():
    try:
        import horovod.runner.launch  # noqa: F401,F811  (is horovodrun there?)
    except ImportError as e:
        raise LaunchError('--engine horovod needs Horovod (horovod.runner does not import: %s); '
                          'see the README\'s "Horovod" section' % e)


class Rendezvous(object):
    """Horovod's Gloo rendezvous for workers the launcher starts itself.

    Parameters
    ----------
    worker_hosts : list of str
        The host of each worker (ranks are assigned host by host, in order
        of first appearance, as horovodrun assigns them).
    address : str
        This machine's address as the workers' hosts see it.
    node_host : dict
        host -> the address its workers bind and advertise to each other
        (``HOROVOD_HOSTNAME``; None: the host's name).
    interface : str, optional
        ``HOROVOD_GLOO_IFACE`` (the network interface Gloo uses).
    """

    def __init__(self, worker_hosts, address, node_host, interface=None):
        _require_runner()
        from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
        from horovod.runner.http.http_server import RendezvousServer
        counts = collections.OrderedDict()
        for h in worker_hosts:
            counts[h] = counts.get(h, 0) + 1
        self.slots = get_host_assignments([HostInfo(h, n) for h, n in counts.items()],
                                          len(worker_hosts))
        self.address, self.node_host, self.interface = address, node_host, interface
        self._server = RendezvousServer()
        self.port = self._server.start()
        self._server.init(self.slots)

    def env(self, slot):
        """The variables horovodrun gives the worker of `slot`."""
        env = {'HOROVOD_GLOO_RENDEZVOUS_ADDR': self.address,
               'HOROVOD_GLOO_RENDEZVOUS_PORT': str(self.port),
               'HOROVOD_CONTROLLER': 'gloo', 'HOROVOD_CPU_OPERATIONS': 'gloo',
               'HOROVOD_HOSTNAME': self.node_host.get(slot.hostname) or slot.hostname,
               'HOROVOD_RANK': str(slot.rank), 'HOROVOD_SIZE': str(slot.size),
               'HOROVOD_LOCAL_RANK': str(slot.local_rank),
               'HOROVOD_LOCAL_SIZE': str(slot.local_size),
               'HOROVOD_CROSS_RANK': str(slot.cross_rank),
               'HOROVOD_CROSS_SIZE': str(slot.cross_size)}
        if self.interface:
            env['HOROVOD_GLOO_IFACE'] = self.interface
        return env

    def stop(self):
        self._server.stop()
