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
variables horovodrun would give it.

In a SLURM allocation the launcher in the batch script (or salloc shell)
hosts the rendezvous and runs one srun step per attempt, as for dist_sync;
each task's launcher starts its worker with the variables of its slot in
the same plan (:func:`slot_env`: srun's block distribution of tasks over
nodes) and the rendezvous address from ``RENDEZVOUS_ENV``.
"""
import collections
import sys

from .gloo_address import ADDRESS_ENV
from .hosts import LaunchError, addresses, place
from .plan import Member, inherited_env, local_spec, startup_path
from .process import Spec
from .slurm import task_hosts
from .ssh import ssh_spec

__all__ = ['horovod_spec', 'Rendezvous', 'RENDEZVOUS_ENV', 'plan', 'slot_env', 'ssh_job',
           'slurm_rendezvous', 'slurm_task_spec']

#: In a SLURM task: ``address:port`` of the rendezvous the batch-level
#: launcher hosts.
RENDEZVOUS_ENV = 'GLUON_PARALLEL_HOROVOD_RENDEZVOUS'


def horovod_spec(num_workers, command, user_env):
    """The Spec of ``horovodrun -np N -H localhost:N --gloo COMMAND`` on
    this machine."""
    _require_runner()
    env = inherited_env()
    env.update(user_env)
    env['PYTHONPATH'] = startup_path(env.get('PYTHONPATH'))
    env.setdefault('PYTHONUNBUFFERED', '1')
    argv = [sys.executable, '-m', 'horovod.runner.launch', '-np', str(num_workers),
            '-H', f'localhost:{num_workers:d}', '--gloo'] + list(command)
    # The launcher's worker: the job ends with it, its status the job's.
    return Spec('horovodrun', 'worker', argv, env)


def _require_runner():
    try:
        import horovod.runner.launch  # noqa: F401,F811  (is horovodrun there?)
    except ImportError as e:
        raise LaunchError(f'--engine horovod needs Horovod (horovod.runner does not import: {e}); '
                          'see the README\'s "Horovod" section') from e


class Rendezvous:
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
        from horovod.runner.http.http_server import RendezvousServer
        self.slots = plan(worker_hosts)
        self.address, self.node_host, self.interface = address, node_host, interface
        self._server = RendezvousServer()
        self.port = self._server.start()
        self.reset()

    def reset(self):
        """Forget what the last workers stored (before a restart)."""
        self._server.init(self.slots)

    def env(self, slot):
        """The variables horovodrun gives the worker of `slot`, and, on
        several hosts, its host's address for Gloo (:mod:`.gloo_address`)."""
        address = self.node_host.get(slot.hostname)
        env = slot_env(slot, self.address, self.port, address or slot.hostname, self.interface)
        if address and slot.cross_size > 1:
            env[ADDRESS_ENV] = address
        return env

    def stop(self):
        self._server.stop()


def plan(worker_hosts):
    """horovodrun's slots for workers on these hosts: ranks host by host,
    in order of first appearance."""
    _require_runner()
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
    counts = collections.OrderedDict()
    for h in worker_hosts:
        counts[h] = counts.get(h, 0) + 1
    return get_host_assignments([HostInfo(h, n) for h, n in counts.items()], len(worker_hosts))


def slot_env(slot, address, port, hostname, interface=None):
    """The variables horovodrun gives the worker of `slot` (Gloo, with the
    rendezvous at `address`:`port`)."""
    env = {'HOROVOD_GLOO_RENDEZVOUS_ADDR': address, 'HOROVOD_GLOO_RENDEZVOUS_PORT': str(port),
           'HOROVOD_CONTROLLER': 'gloo', 'HOROVOD_CPU_OPERATIONS': 'gloo',
           'HOROVOD_HOSTNAME': hostname,
           'HOROVOD_RANK': str(slot.rank), 'HOROVOD_SIZE': str(slot.size),
           'HOROVOD_LOCAL_RANK': str(slot.local_rank), 'HOROVOD_LOCAL_SIZE': str(slot.local_size),
           'HOROVOD_CROSS_RANK': str(slot.cross_rank), 'HOROVOD_CROSS_SIZE': str(slot.cross_size)}
    if interface:
        env['HOROVOD_GLOO_IFACE'] = interface
    return env


def ssh_job(hosts, num_workers, command, user_env, ssh, scheduler_address=None,
            interface=None, strict_slots=False):
    """(Rendezvous, Specs) of a Horovod job over ssh: the rendezvous here,
    each worker over ssh like a dist_sync worker. `ssh`: (ssh command, port,
    working directory, grace) as ``ssh_spec`` takes them."""
    worker_hosts, _ = place(hosts, num_workers, 0, strict_slots)
    # This machine ('localhost': its address as the hosts see it) hosts the
    # rendezvous, as the scheduler's host does in a dist_sync job.
    address, node_host = addresses([h for h, _ in hosts], 'localhost', scheduler_address,
                                   interface)
    rendezvous = Rendezvous(worker_hosts, address, node_host, interface)
    local_env = inherited_env()
    specs = [ssh_spec(Member('worker', slot.rank, None, slot.hostname), command, None,
                      dict(user_env, **rendezvous.env(slot)), local_env, *ssh)
             for slot in rendezvous.slots]
    return rendezvous, specs


def slurm_rendezvous(env, num_workers, scheduler_address=None, interface=None):
    """The batch-level launcher's rendezvous of a Horovod job in a SLURM
    allocation, planned for srun's block distribution of the tasks."""
    hosts = task_hosts(env, step=False)
    if num_workers is not None and num_workers != len(hosts):
        raise LaunchError(f'-n {num_workers:d}: with --launcher slurm every task runs one worker, '
                          f'and this allocation has {len(hosts):d} tasks')
    nodes = list(dict.fromkeys(hosts))
    address, _ = addresses(nodes, 'localhost', scheduler_address, interface,
                           others_remote=len(nodes) > 1)
    return Rendezvous(hosts, address, {}, interface)


def slurm_task_spec(env, task, command, user_env, interface=None):
    """The worker of one task of a Horovod job step, in the slot of its
    SLURM_PROCID in the batch-level launcher's plan."""
    where = env.get(RENDEZVOUS_ENV)
    if not where:
        raise LaunchError('--engine horovod with --launcher slurm: start the launcher in the '
                          'batch script or the salloc shell (it hosts the rendezvous and runs '
                          'srun), not under srun')
    address, port = where.rsplit(':', 1)
    slot = plan(task_hosts(env, step=True))[task.procid]
    return local_spec(Member('worker', task.procid, None, task.node), command, None,
                      dict(user_env, **slot_env(slot, address, port, task.node, interface)))
