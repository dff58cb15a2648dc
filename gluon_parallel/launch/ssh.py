"""Processes on other hosts, over ssh.

Each process is one ssh connection running a small POSIX-shell wrapper on
its host (``/bin/sh``, util-linux ``setsid`` and coreutils ``timeout`` are
all it needs there):

* the command runs in its own session and process group (``setsid``),
  with stdin from /dev/null, in the launcher's working directory, with the
  DMLC variables and the ``--env`` ones;
* a watcher (a dead-man's switch) reads the wrapper's stdin, which is the
  ssh channel, where the launcher writes a line every
  :data:`HEARTBEAT_INTERVAL` seconds. It reaches end of file when the
  launcher closes it (a stop) or the connection closes (the launcher or its
  ssh client died); it hears nothing when the link went dark, which TCP
  alone would notice only after many minutes: after
  :data:`HEARTBEAT_DEADLINE` seconds of silence it ends this connection's
  sshd session too. Then it sends SIGTERM (and SIGCONT, for a stopped
  process) to the group, and SIGKILL after the grace period, so no process
  of the job outlives its launcher;
* the ssh client gets keepalives (:data:`KEEPALIVE_OPTIONS`, unless the
  ``--ssh-command`` sets them), so the launcher sees a dark link within
  seconds; the wrapper's own lines (:data:`STARTED_LINE`,
  :data:`EXITED_LINE`) tell it a lost connection (ssh's 255 after the
  start) from a command that never started;
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

from ..channel import MEMBER_ENV
from .failfast import STARTUP_DIR
from .plan import Member, member_env, rank_members, startup_path
from .hosts import addresses, place
from .process import Spec

#: ``argv[0]`` of the wrapper shell on the remote host, to find it with ps.
WRAPPER_NAME = 'gluon-parallel-launch'

#: The wrapper's own lines on stderr (the launcher consumes them): the
#: command has started; the command's status follows (so a 255 that comes
#: without it is ssh's own: the connection, not the command).
STARTED_LINE, EXITED_LINE = f'{WRAPPER_NAME}: started', f'{WRAPPER_NAME}: exited'

#: The launcher writes a line to every remote process's stdin this often;
#: a wrapper that hears nothing for HEARTBEAT_DEADLINE seconds takes its
#: launcher for lost (a link gone dark ends no TCP connection by itself).
HEARTBEAT_INTERVAL, HEARTBEAT_DEADLINE = 1.0, 15

#: ssh client options every job gets unless its --ssh-command sets them:
#: the client gives up on a silent server within about 10-15 s (the
#: launcher then reports the host lost), instead of TCP's minutes.
KEEPALIVE_OPTIONS = (('ServerAliveInterval', '5'), ('ServerAliveCountMax', '2'))

_WRAPPER = (
    'cd {workdir} || exit 127; '
    "command -v timeout >/dev/null || {{ echo '{name}: needs timeout (coreutils)' >&2; "
    'exit 127; }}; '
    'exec 3<&0 </dev/null; '
    "printf '%s\\n' '{started}' >&2; "
    'setsid env {env} {command} 3<&- & p=$!; '
    # A dead connection must not kill this shell before it cleans up.
    "trap '' PIPE; "
    # The watcher (the dead-man's switch): a line of stdin at least every
    # {deadline} s, else the launcher is lost (r=124), and then the sshd
    # session of this connection, which only waits for a link that is
    # gone, is ended first. Then TERM (and CONT, for a stopped process) at
    # end of input or silence, KILL once the grace period is over. To the
    # group and to the process itself: until the child has called setsid()
    # (a busy host can take a while) its group does not exist yet, and a
    # signal to the group alone would miss it for good.
    "(while timeout {deadline} sh -c 'read -r _' <&3; r=$?; [ $r -eq 0 ]; do :; done; "
    'if [ $r -eq 124 ]; then case $(cat /proc/$PPID/comm) in sshd*) kill -TERM $PPID;; esac; '
    'fi; kill -TERM -$p $p; kill -CONT -$p $p; i=0; '
    'while {{ kill -0 -$p || kill -0 $p; }} && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done; '
    'kill -KILL -$p $p) >/dev/null 2>&1 & w=$!; '
    'exec 3<&-; wait $p; s=$?; kill -KILL -$p $w 2>/dev/null; '
    "printf '%s\\n' '{exited}' >&2; exit $s")


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
        ticks=int(round(grace * 10)), deadline=HEARTBEAT_DEADLINE, started=STARTED_LINE,
        exited=EXITED_LINE, name=WRAPPER_NAME)
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
    else:                       # a Horovod worker: named in its progress reports too
        env[MEMBER_ENV] = member.name
    startup = None
    if 'PYTHONPATH' in env:
        env['PYTHONPATH'] = startup_path(env['PYTHONPATH'])
    else:
        startup = STARTUP_DIR       # before the remote login's own PYTHONPATH
    argv = with_keepalives(shlex.split(ssh_command))
    if ssh_port:
        argv += ['-p', str(ssh_port)]
    argv += [member.host, remote_command(command, env, workdir, grace, startup)]
    return Spec(member.name, member.role, argv, dict(local_env), remote=True, host=member.host,
                heartbeat=HEARTBEAT_INTERVAL,
                wrapper_lines=(STARTED_LINE.encode(), EXITED_LINE.encode()))


def _options_set(argv):
    """The ssh options (lower case) an ssh command line sets with ``-o``."""
    keys = set()
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == '-o' and i + 1 < len(argv) else (
            arg[2:] if arg.startswith('-o') else None)
        if value:
            keys.add(value.replace('=', ' ').split()[0].lower())
    return keys


def with_keepalives(argv):
    """An ssh command line with :data:`KEEPALIVE_OPTIONS` after its own
    options, except those it sets itself (the user's value wins)."""
    given = _options_set(argv)
    extra = [f'-o{k}={v}' for k, v in KEEPALIVE_OPTIONS if k.lower() not in given]
    return list(argv) + extra


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
