"""Processes on other hosts, over ssh.

Each process is one ssh connection running a small POSIX-shell wrapper on
its host (``/bin/sh`` and util-linux ``setsid`` are all it needs there):

* the command runs in its own session and process group (``setsid``),
  with stdin from /dev/null, in the launcher's working directory, with the
  DMLC variables and the ``--env`` ones;
* a watcher reads the wrapper's stdin, which is the ssh channel: it reaches
  end of file when the launcher closes it (a stop) *or* when the connection
  drops (the launcher or its ssh client died, the network broke). Then it
  sends SIGTERM to the group, and SIGKILL after the grace period, so no
  process of the job outlives its connection;
* when the command exits, whatever it left in its group is killed and the
  wrapper exits with the command's status, which ssh passes on;
* ``PYTHONPATH`` starts with the fail-fast start-up hook
  (:mod:`~gluon_parallel.launch.failfast`) at the path it has here, followed
  by ``--env PYTHONPATH`` or else the remote login's own ``PYTHONPATH``: a
  host that mounts this installation at the same path (a shared file
  system, or the same install location) runs it; Python ignores the entry
  where the path does not exist, and there only scripts that import
  ``gluon_parallel.dist`` fail fast.
"""
import shlex

from .failfast import STARTUP_DIR
from .plan import Member, member_env, rank_members, startup_path
from .hosts import addresses, place
from .process import Spec

#: ``argv[0]`` of the wrapper shell on the remote host, to find it with ps.
WRAPPER_NAME = 'gluon-parallel-launch'

_WRAPPER = (
    'cd {workdir} || exit 127; '
    'exec 3<&0 </dev/null; '
    'setsid env {env} {command} 3<&- & p=$!; '
    # A dead connection must not kill this shell before it cleans up.
    "trap '' PIPE; "
    # The watcher: TERM at end of input, KILL once the grace period is over.
    # To the group and to the process itself: until the child has called
    # setsid() (a busy host can take a while) its group does not exist yet,
    # and a signal to the group alone would miss it for good.
    '(while read -r _ <&3; do :; done; kill -TERM -$p $p; i=0; '
    'while {{ kill -0 -$p || kill -0 $p; }} && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done; '
    'kill -KILL -$p $p) >/dev/null 2>&1 & w=$!; '
    'exec 3<&-; wait $p; s=$?; kill -KILL -$p $w 2>/dev/null; exit $s')


def remote_command(command, env, workdir, grace, startup=None):
    """The command line ssh runs on the remote host (any sh-like login
    shell: it only execs /bin/sh). `startup`, when given, goes in front of
    the remote ``PYTHONPATH`` (`env` has none)."""
    assigns = [f'{k}={shlex.quote(v)}' for k, v in sorted(env.items())]
    if startup:
        assigns.insert(0, f'PYTHONPATH={shlex.quote(startup)}${{PYTHONPATH:+:"$PYTHONPATH"}}')
    script = _WRAPPER.format(
        workdir=shlex.quote(workdir),
        env=' '.join(assigns),
        command=' '.join(shlex.quote(a) for a in command),
        ticks=int(round(grace * 10)))
    return f'exec /bin/sh -c {shlex.quote(script)} {WRAPPER_NAME}'


def ssh_spec(member, command, common, user_env, local_env, ssh_command='ssh -o BatchMode=yes',
             ssh_port=None, workdir='.', grace=5.0):
    """The ssh client that runs `member`'s process on ``member.host``.

    Parameters
    ----------
    member : Member
    command : list of str
    common : dict or None
        The job's DMLC variables (None: not a dist_sync process; `user_env`
        holds what it needs).
    user_env : dict
        ``--env`` variables (and ``DMLC_INTERFACE``) for the remote process.
    local_env : dict
        The ssh client's own environment.
    ssh_command : str
        Split like a shell would; the host and the remote command follow.
    ssh_port : int, optional
    workdir : str
    grace : float
    """
    env = {'PYTHONUNBUFFERED': '1'}
    env.update(user_env)
    if common is not None:
        env.update(member_env(common, member))
    startup = None
    if 'PYTHONPATH' in env:
        env['PYTHONPATH'] = startup_path(env['PYTHONPATH'])
    else:
        startup = STARTUP_DIR       # before the remote login's own PYTHONPATH
    argv = shlex.split(ssh_command)
    if ssh_port:
        argv += ['-p', str(ssh_port)]
    argv += [member.host, remote_command(command, env, workdir, grace, startup)]
    return Spec(member.name, member.role, argv, dict(local_env), remote=True, host=member.host)


def ssh_members(hosts, num_workers, num_servers, ports, scheduler_host=None,
                scheduler_address=None, interface=None, strict_slots=False, resolver=None):
    """The members of a job spread over the hosts of a hostfile.

    Parameters
    ----------
    hosts : list of (str, int)
        From :func:`~gluon_parallel.launch.hosts.read_hostfile`.
    ports : list of int
        ``1 + num_servers + num_workers`` distinct ports: the scheduler's,
        the servers', the workers'.
    scheduler_host : str, optional
        Default: the first host.

    Returns
    -------
    (str, list of Member)
        ``DMLC_PS_ROOT_URI`` and the members (scheduler first).
    """
    worker_hosts, server_hosts = place(hosts, num_workers, num_servers, strict_slots)
    scheduler_host = scheduler_host or hosts[0][0]
    root, node_host = addresses([h for h, _ in hosts], scheduler_host, scheduler_address,
                                interface, resolver=resolver)
    members = [Member('scheduler', None, ports[0], scheduler_host, node_host[scheduler_host])]
    for role, placed, first in (('server', server_hosts, 1),
                                ('worker', worker_hosts, 1 + num_servers)):
        members += rank_members(role, [(h, ports[first + i], node_host[h])
                                       for i, h in enumerate(placed)])
    return root, members
