"""The processes of a job, their DMLC environment, and local processes.

Every mode (local, ssh, slurm) describes its job as :class:`Member` s
(role, rank, host, port, address); :func:`member_env` turns one into the
variables ps-lite reads, and :func:`local_spec` into a process on this
machine.
"""
import os

from ..channel import MEMBER_ENV
from .failfast import STARTUP_DIR
from .hosts import predicted_ranks
from .process import DMLC_VARS, LAUNCH_RANK_ENV, Spec


class Member:
    """One process of a job.

    Parameters
    ----------
    role : str
        ``'scheduler'``, ``'server'`` or ``'worker'``.
    rank : int or None
        The rank ps-lite is expected to give it (its index when unknown).
    port : int or None
        ``PORT`` (the scheduler's is ``DMLC_PS_ROOT_PORT``).
    host : str, optional
        Where it runs, shown in its prefix; None: this machine, not shown.
    node_host : str, optional
        ``DMLC_NODE_HOST``; None: ps-lite picks an interface.
    rank_known : bool
        Whether `rank` is ps-lite's (then the worker is told, and
        gluon_parallel.dist warns if ps-lite disagrees).
    """

    def __init__(self, role, rank, port, host=None, node_host=None, rank_known=True):
        self.role, self.rank, self.port = role, rank, port
        self.host, self.node_host, self.rank_known = host, node_host, rank_known

    @property
    def name(self):
        name = self.role if self.role == 'scheduler' else f'{self.role} {self.rank:d}'
        return name if self.host is None else f'{name}@{self.host}'

    def __repr__(self):
        return f'<{self.name} port={self.port} node_host={self.node_host}>'


def common_env(root_uri, root_port, num_servers, num_workers):
    """The DMLC variables every process of a job shares."""
    return {'DMLC_PS_ROOT_URI': root_uri, 'DMLC_PS_ROOT_PORT': str(root_port),
            'DMLC_NUM_SERVER': str(num_servers), 'DMLC_NUM_WORKER': str(num_workers)}


def member_env(common, member):
    """The DMLC variables of one process."""
    env = dict(common, DMLC_ROLE=member.role)
    env[MEMBER_ENV] = member.name
    if member.role != 'scheduler':
        env['PORT'] = str(member.port)
    if member.node_host:
        env['DMLC_NODE_HOST'] = member.node_host
    if member.role == 'worker' and member.rank_known:
        env[LAUNCH_RANK_ENV] = str(member.rank)
    return env


def inherited_env():
    """The launcher's environment without the variables a launcher sets."""
    return {k: v for k, v in os.environ.items() if k not in DMLC_VARS}


def startup_path(pythonpath=None):
    """``PYTHONPATH`` with the fail-fast start-up hook first (see
    :mod:`~gluon_parallel.launch.failfast`), then `pythonpath`."""
    return STARTUP_DIR + (os.pathsep + pythonpath if pythonpath else '')


def local_spec(member, command, common, user_env):
    """A process of `member` on this machine: the launcher's environment,
    then `user_env`, then the DMLC variables; every Python process of it
    fails fast (the start-up hook on ``PYTHONPATH``)."""
    env = inherited_env()
    env.update(user_env)
    if common is not None:              # (None: not a dist_sync process)
        env.update(member_env(common, member))
    env['PYTHONPATH'] = startup_path(env.get('PYTHONPATH'))
    env.setdefault('PYTHONUNBUFFERED', '1')     # lines as they are printed
    return Spec(member.name, member.role, list(command), env)


def rank_members(role, placed):
    """Members of one role from (host, port, node_host) triples, named by
    the rank ps-lite will give them when that can be told."""
    ranks = predicted_ranks([(node_host, port) for _, port, node_host in placed])
    known = ranks is not None
    members = [Member(role, ranks[i] if known else i, port, host, node_host, known)
               for i, (host, port, node_host) in enumerate(placed)]
    return sorted(members, key=lambda m: m.rank)


def layout(specs, ranks_known=True):
    """A job's layout as the launcher prints it before starting: each host
    with its processes (in order of first appearance), and which worker is
    rank 0, the one that writes checkpoints. `ranks_known`: the names carry
    the ranks ps-lite gives (not when ``DMLC_INTERFACE`` lets it pick the
    addresses)."""
    hosts = {}
    for spec in specs:
        hosts.setdefault(spec.host, []).append(spec.name.rsplit('@', 1)[0])
    where = '; '.join(f'{host}: {", ".join(names)}' for host, names in hosts.items())
    first = next((s.name for s in specs if s.is_worker and s.name.startswith('worker 0')), None)
    if not ranks_known or first is None:
        return f'layout: {where} (worker ranks: as ps-lite assigns them)'
    return f'layout: {where}; rank 0 (writes checkpoints): {first}'


def local_members(num_workers, num_servers, ports, host='127.0.0.1'):
    """Scheduler, servers and workers of a job on this machine, all at
    `host`; ``ports[0]`` is the scheduler's, then the servers', the workers'
    (ascending: ps-lite ranks nodes of one address by port)."""
    members = [Member('scheduler', None, ports[0], node_host=host)]
    for role, count, first in (('server', num_servers, 1),
                               ('worker', num_workers, 1 + num_servers)):
        members += rank_members(role, [(None, p, host) for p in ports[first:first + count]])
    return members
