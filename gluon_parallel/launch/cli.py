"""``python -m gluon_parallel.launch``: the command line of every mode."""
import argparse
import os
import re
import sys
from collections.abc import Sequence

from .horovod import RENDEZVOUS_ENV, horovod_spec, slurm_rendezvous, slurm_task_spec, ssh_job
from .discovery import Discovery, unreachable_hosts
from .elastic import ELASTIC_ENV, AttemptEnd, parse_size, run_elastic
from .hosts import LaunchError, addresses, place, read_hostfile
from .plan import common_env, inherited_env, layout, local_members, local_spec
from .restarts import run_restarting, run_steps
from .slurm import Task, cancel_step, in_task, srun_argv, TASK_ENV
from .ssh import ssh_members, ssh_spec
from .listener import Listener
from .process import RESTART_ENV, find_free_ports
from .stall import DEFAULT_TIMEOUT, STALL_STATUS, timeout_option, watch
from .watchdog import Launcher

# Elastic jobs: waiting for MIN slots (Horovod's default), polling discovery.
_ELASTIC_TIMEOUT, _INTERVAL = 600.0, 5.0

_DESCRIPTION = """\
Run COMMAND as a dist_sync job: one scheduler, SERVERS parameter servers and
WORKERS workers, each running COMMAND with the standard DMLC environment.
Every output line is prefixed with its process ([worker 1], or
[worker 1@host] on other hosts); the first process to exit with a non-zero
status stops every process on every host and its status becomes the
launcher's; --timeout exits 124, Ctrl-C 130, SIGTERM 143; nothing is left
running. When no worker makes progress (a completed reduction, a
DataParallel call) for --stall-timeout seconds, outside dist.busy(), the
launcher names the stalled workers, prints every Python process's stacks
and ends the attempt with a status of its own (see --stall-timeout),
restarted by --max-restarts. Every Python process of the job fails fast: an uncaught exception
or a non-zero sys.exit ends it at once (a start-up hook on PYTHONPATH),
whether or not the script imports gluon_parallel. --max-restarts N runs
the whole job again after a failure, up to N times, on fresh ports; the
processes see the attempt number (0, 1, ...) in GLUON_PARALLEL_RESTART.

elastic jobs (local, ssh): -n MIN:MAX --discover CMD. CMD prints the
available hosts, "host[:slots]" a line ("localhost:N" with --launcher
local); every attempt runs min(MAX, slots) workers and prints its layout,
waits up to --elastic-timeout below MIN, and a failure restarts at the size
discovered then (counted against --max-restarts). More slots while running:
the job ends after its next dist.save_checkpoint (the workers exit with the
reserved status 75) and goes on at the larger size, not counted. A host
whose ssh connection dropped is left out while MIN is reached without it.

modes (--launcher):
  local  (default) every process on this machine, at 127.0.0.1 (--host).
  ssh    the hosts of -H HOSTFILE (one per line, "host" or "host:slots",
         "#" comments): the scheduler on the first host (--scheduler-host),
         servers one per host in turn, workers filling each host's slots in
         order. Each process runs over its own ssh connection in the current
         directory (--workdir), in its own process group that is killed when
         the connection ends; it gets the DMLC variables, DMLC_INTERFACE and
         every --env; a process whose launcher is gone (no heartbeat on its
         connection for 15 s) stops by itself; ssh gets keepalives unless
         --ssh-command sets them; the layout is printed before the start.
         The remote hosts need /bin/sh, setsid (util-linux) and timeout
         (coreutils), and this installation at the same path for the
         fail-fast hook; give the interpreter by its path (-- /venv/bin/python).
  slurm  inside a SLURM allocation (sbatch/salloc): one launcher per task,
         started by `srun python -m gluon_parallel.launch --launcher slurm
         ...` or, when run in the batch script itself, by the launcher
         (srun --kill-on-bad-exit=1). Task 0 (first node) runs the scheduler;
         every task runs worker SLURM_PROCID; server s of S runs on task
         s*N//S. Roles come from SLURM_PROCID, SLURM_STEP_NUM_TASKS and
         SLURM_STEP_NODELIST; -n, if given, must equal the number of tasks.
         With --max-restarts, run the launcher in the batch script (not
         under srun): each attempt is a new job step of the allocation.
"""

_EPILOG = """\
examples:
  python -m gluon_parallel.launch -n 2 -s 1 -- python train.py --kvstore dist_sync
  python -m gluon_parallel.launch --engine horovod -n 2 -- python train.py
  python -m gluon_parallel.launch -n 2:4 --discover 'cat hosts' --max-restarts 3 \\
      -- python train.py --kvstore dist_sync
  python -m gluon_parallel.launch --engine horovod --launcher ssh -H hosts -n 4 \\
      -- python train.py --kvstore horovod
  python -m gluon_parallel.launch --launcher ssh -H hosts -n 4 -s 2 \\
      --env OMP_NUM_THREADS=4 -- python train.py --kvstore dist_sync
  srun --kill-on-bad-exit=1 python -m gluon_parallel.launch --launcher slurm -s 2 \\
      -- python train.py --kvstore dist_sync
"""


def _parser():
    p = argparse.ArgumentParser(prog='python -m gluon_parallel.launch', description=_DESCRIPTION,
                                epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--launcher', choices=('local', 'ssh', 'slurm'), default='local',
                   help='where the processes run (default local)')
    p.add_argument('--engine', choices=('dist_sync', 'horovod'), default='dist_sync',
                   help='dist_sync (default): scheduler, servers and workers with the DMLC '
                        'environment; horovod: WORKERS Horovod workers (Gloo): local, '
                        'started by horovodrun --gloo; ssh and slurm, started like dist_sync '
                        'workers around a rendezvous in the launcher (-s unused)')
    p.add_argument('-n', '--num-workers', default=None, metavar='WORKERS|MIN:MAX',
                   help='number of worker processes (required, except with slurm); MIN:MAX '
                        'with --discover: an elastic job')
    p.add_argument('--discover', metavar='CMD',
                   help='elastic job (local, ssh): a shell command printing the available '
                        'hosts, "host[:slots]" a line ("localhost:N" with --launcher local), '
                        'run before every attempt and every --discover-interval seconds; each '
                        'attempt runs min(MAX, slots) workers')
    p.add_argument('--elastic-timeout', type=float, default=None, metavar='S',
                   help='elastic: how long to wait for MIN slots before an attempt (default '
                        f'{_ELASTIC_TIMEOUT:g}s); then the exit status is the last failure\'s '
                        '(124 if none)')
    p.add_argument('--discover-interval', type=float, default=None, metavar='S',
                   help=f'elastic: seconds between discovery runs (default {_INTERVAL:g}s)')
    p.add_argument('-s', '--num-servers', type=int, default=1, metavar='SERVERS',
                   help='number of parameter servers (default 1)')
    p.add_argument('--timeout', type=float, default=None, metavar='S',
                   help='stop everything after S seconds (exit status 124)')
    p.add_argument('--stall-timeout', type=timeout_option, default=DEFAULT_TIMEOUT,
                   metavar='S', help='end the attempt when no worker has made progress for S '
                   f'seconds (default {DEFAULT_TIMEOUT:g}; 4 x S until every worker has moved '
                   f'once; 0: off): exit status {STALL_STATUS:d}')
    p.add_argument('--max-restarts', type=int, default=0, metavar='N',
                   help='after a process fails, stop every process and start the whole job '
                        'again, up to N times (default 0); not after --timeout or a signal')
    p.add_argument('--grace', type=float, default=5.0, metavar='S',
                   help='seconds between SIGTERM and SIGKILL when stopping (default 5)')
    p.add_argument('--port', type=int, default=None,
                   help="the scheduler's port (default: a free one; slurm: derived from the job "
                        "id)")
    p.add_argument('--env', action='append', default=[], metavar='NAME[=VALUE]',
                   help="set NAME in every process (NAME alone: the launcher's value); repeatable")
    p.add_argument('--host', default=None,
                   help='local: the address every process binds and reaches '
                        '(default 127.0.0.1)')
    p.add_argument('-H', '--hostfile', metavar='HOSTFILE', help='ssh: the hosts')
    p.add_argument('--scheduler-host', metavar='HOST',
                   help='ssh: where the scheduler runs (default: the first host)')
    p.add_argument('--scheduler-address', metavar='ADDR',
                   help="ssh, slurm: DMLC_PS_ROOT_URI, the scheduler's address as every "
                        "host reaches it (default: its host's name, resolved here)")
    p.add_argument('--ssh-command', default='ssh -o BatchMode=yes', metavar='CMD',
                   help='ssh: the ssh client and its options (default "%(default)s"); '
                        '-o ServerAliveInterval=5 -o ServerAliveCountMax=2 unless set here, '
                        'then the host and the remote command are appended')
    p.add_argument('--ssh-port', type=int, default=None, metavar='P',
                   help="ssh: the remote sshd's port")
    p.add_argument('--strict-slots', action='store_true',
                   help='ssh: refuse more workers than hostfile slots (default: '
                        'oversubscribe, one more per host in turn)')
    p.add_argument('--workdir', default=None, metavar='DIR',
                   help='ssh: the remote working directory (default: the current one)')
    p.add_argument('command', nargs=argparse.REMAINDER, metavar='COMMAND',
                   help='the command every process runs (after an optional --)')
    return p


def _listener(args, hosts=None):
    """The job's channel, bound to the launcher's address as its processes
    reach it; None when nothing needs it (no --stall-timeout, not elastic)."""
    if not args.stall_timeout and args.size is None:
        return None
    if args.launcher != 'ssh':
        return Listener(args.host or '127.0.0.1')
    hosts = read_hostfile(args.hostfile) if hosts is None else hosts
    if args.size is None:       # the hostfile's own errors first
        place(hosts, args.num_workers, args.num_servers, args.strict_slots)
    address, _ = addresses([h for h, _ in hosts], 'localhost', None,
                           _interface(parse_env(args.env)))
    return Listener(address)


def _stall(args, listener, number, specs, num_workers):
    """The attempt's StallWatch, or None (--stall-timeout 0)."""
    return watch(args.stall_timeout, listener, number, specs, num_workers)


def parse_env(items, environ=None):
    """``--env`` values -> dict; ``NAME`` alone takes the launcher's value."""
    environ = os.environ if environ is None else environ
    env = {}
    for item in items:
        name, eq, value = item.partition('=')
        if not re.match(r'[A-Za-z_][A-Za-z0-9_]*$', name):
            raise LaunchError(f'--env {item}: not a variable name')
        if not eq:
            if name not in environ:
                raise LaunchError(f"--env {name}: not set in the launcher's environment")
            value = environ[name]
        env[name] = value
    return env


def _check(parser, args):
    command = args.command[1:] if args.command[:1] == ['--'] else args.command
    if not command:
        parser.error('no COMMAND given')
    if args.num_workers is None and args.launcher != 'slurm':
        parser.error('the following arguments are required: -n/--num-workers')
    _check_elastic(parser, args)
    if args.num_servers < 1:
        parser.error('-s must be at least 1: dist_sync keeps its values on the servers')
    if args.timeout is not None and args.timeout <= 0:
        parser.error('--timeout must be positive')
    if args.max_restarts < 0:
        parser.error('--max-restarts must be at least 0')
    if args.launcher != 'local' and args.host is not None:
        parser.error('--host is for --launcher local (see --scheduler-address)')
    if args.launcher == 'local' and args.scheduler_address is not None:
        parser.error('--scheduler-address needs --launcher ssh or slurm (local: --host)')
    if args.launcher != 'ssh':
        for flag, value in (('-H/--hostfile', args.hostfile),
                            ('--scheduler-host', args.scheduler_host),
                            ('--ssh-port', args.ssh_port), ('--workdir', args.workdir)):
            if value is not None:
                parser.error(f'{flag} needs --launcher ssh')
    elif args.hostfile is None and args.discover is None:
        parser.error('--launcher ssh needs -H/--hostfile (or --discover)')
    return command


def _check_elastic(parser, args):
    """-n WORKERS or MIN:MAX, and the elastic options that go with it."""
    args.size = None
    if args.num_workers is not None:
        try:
            low, high, elastic = parse_size(args.num_workers)
        except ValueError as e:
            parser.error(str(e))
        if elastic and args.discover is None:
            parser.error(f'-n {args.num_workers}: an elastic job needs --discover CMD')
        args.num_workers = low
        if args.discover is not None:
            args.size = (low, high)
    if args.discover is None:
        for flag, value in (('--elastic-timeout', args.elastic_timeout),
                            ('--discover-interval', args.discover_interval)):
            if value is not None:
                parser.error(f'{flag} needs --discover')
        return
    if args.elastic_timeout is None:
        args.elastic_timeout = _ELASTIC_TIMEOUT
    if args.discover_interval is None:
        args.discover_interval = _INTERVAL
    if args.launcher == 'slurm':
        parser.error('--discover: a SLURM allocation has a fixed size (elastic jobs run with '
                     '--launcher local or ssh; see docs/elastic.md)')
    if args.num_workers is None:
        parser.error('--discover needs -n MIN:MAX')
    if args.hostfile is not None:
        parser.error('-H/--hostfile and --discover both name the hosts: give one')
    if args.elastic_timeout < 0 or args.discover_interval <= 0:
        parser.error('--elastic-timeout must be >= 0 and --discover-interval positive')


def _interface(user_env):
    """``DMLC_INTERFACE`` from ``--env`` or the launcher's environment."""
    return user_env.get('DMLC_INTERFACE', os.environ.get('DMLC_INTERFACE'))


def _job_ports(args, count):
    """The scheduler's port, then `count` more, all distinct and free here
    (for ssh, distinct is what matters: several "hosts" may be one machine,
    and a port free here is very likely free on the others)."""
    if args.port is None:
        return find_free_ports(1 + count)
    return [args.port] + find_free_ports(count, exclude={args.port})


def _specs(args, command, user_env, num_workers=None, hosts=None):
    """Local or ssh: every process of the job, and what to stop after it
    (`num_workers` and the ssh `hosts`: -n's and the hostfile's unless
    given)."""
    num_workers = args.num_workers if num_workers is None else num_workers
    if args.launcher == 'ssh' and hosts is None:
        hosts = read_hostfile(args.hostfile)
    if args.engine == 'horovod':
        if args.launcher == 'ssh':
            rendezvous, specs = ssh_job(
                hosts, num_workers, command, user_env,
                ssh=(args.ssh_command, args.ssh_port, args.workdir or os.getcwd(), args.grace),
                scheduler_address=args.scheduler_address, interface=_interface(user_env),
                strict_slots=args.strict_slots)
            return specs, rendezvous.stop
        return [horovod_spec(num_workers, command, user_env)], None
    ports = _job_ports(args, args.num_servers + num_workers)
    if args.launcher == 'local':
        host = args.host or '127.0.0.1'
        members = local_members(num_workers, args.num_servers, ports, host)
        common = common_env(host, ports[0], args.num_servers, num_workers)
        return [local_spec(m, command, common, user_env) for m in members], None
    interface = _interface(user_env)
    if interface:
        user_env = dict(user_env, DMLC_INTERFACE=interface)
    root, members = ssh_members(hosts, num_workers,
                                args.num_servers, ports, args.scheduler_host,
                                args.scheduler_address, interface, args.strict_slots)
    common = common_env(root, ports[0], args.num_servers, num_workers)
    local_env = inherited_env()
    return [ssh_spec(m, command, common, user_env, local_env, args.ssh_command, args.ssh_port,
                     args.workdir or os.getcwd(), args.grace) for m in members], None


def _slurm(args, argv, command, user_env):
    """Run this task's part of the job, or srun one launcher per task."""
    if not in_task(os.environ):
        if not os.environ.get('SLURM_JOB_ID'):
            raise LaunchError('--launcher slurm runs inside a SLURM allocation (sbatch or '
                              'salloc): SLURM_JOB_ID is not set')
        # srun runs as a child, not in this process's place: its status
        # is the highest of its tasks', the first failure's is wanted.
        env = dict(os.environ, **{TASK_ENV: '1'})
        if args.engine != 'horovod':
            return run_steps(srun_argv(argv), env, args.max_restarts)
        rendezvous = slurm_rendezvous(os.environ, args.num_workers, args.scheduler_address,
                                      _interface(user_env))
        env[RENDEZVOUS_ENV] = f'{rendezvous.address}:{rendezvous.port:d}'
        try:
            return run_steps(srun_argv(argv), env, args.max_restarts,
                             before=lambda number: rendezvous.reset())
        finally:
            rendezvous.stop()
    if args.max_restarts and not os.environ.get(TASK_ENV):
        raise LaunchError('--max-restarts with --launcher slurm: start the launcher in the batch '
                          'script or the salloc shell, not under srun (it restarts the job as '
                          'a new job step)')
    task = Task(os.environ)
    # The attempt number the batch-level launcher gave this step.
    user_env = dict(user_env, **{RESTART_ENV: os.environ.get(RESTART_ENV, '0')})
    if args.engine == 'horovod':
        return Launcher([slurm_task_spec(os.environ, task, command, user_env,
                                         _interface(user_env))],
                        timeout=args.timeout, grace=args.grace).run()
    if args.num_workers is not None and args.num_workers != task.ntasks:
        raise LaunchError(f'-n {args.num_workers:d}: with --launcher slurm every task runs one '
                          'worker, and this '
                          f'step has {task.ntasks:d} tasks')
    task.roles(args.num_servers)        # an error every task finds: no need to cancel
    root_port = args.port if args.port is not None else task.root_port()
    interface = _interface(user_env)
    try:
        root, members = task.members(args.num_servers, root_port, args.scheduler_address,
                                     interface)
    except LaunchError:
        # This task alone cannot start: the others would wait for it forever.
        cancel_step(task, lambda msg: sys.stderr.write(f'[launch] {msg}\n'))
        raise
    common = common_env(root, root_port, args.num_servers, task.ntasks)
    # This task's own processes report to this task's launcher.
    listener = _listener(args)
    if listener is not None:
        user_env = dict(user_env, **listener.env())
    specs = [local_spec(m, command, common, user_env) for m in members]
    launcher = Launcher(specs, timeout=args.timeout, grace=args.grace,
                        stall=_stall(args, listener, int(user_env[RESTART_ENV]), specs,
                                     sum(s.is_worker for s in specs)))
    try:
        status = launcher.run()
    finally:
        if listener is not None:
            listener.close()
    # The launcher's own srun (--kill-on-bad-exit=1) ends the step when this
    # task exits non-zero, and reports this status; a cancelled step would
    # have this task killed and reported as 137.
    if status and not launcher.signalled and not os.environ.get(TASK_ENV):
        cancel_step(task, launcher.note)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    command = _check(parser, args)
    try:
        user_env = parse_env(args.env)
        if args.launcher == 'slurm':
            return _slurm(args, argv, command, user_env)
        if args.size is not None:
            return _elastic(args, command, user_env, Discovery(args.discover,
                                                               args.launcher == 'local'))
        listener = _listener(args)
        if listener is not None:
            user_env = dict(user_env, **listener.env())
        first = _specs(args, command, dict(user_env, **{RESTART_ENV: '0'}))
    except LaunchError as e:
        parser.error(str(e))

    def attempt(number):
        try:
            specs, stop = first if number == 0 else _specs(
                args, command, dict(user_env, **{RESTART_ENV: str(number)}))
        except (LaunchError, RuntimeError) as e:
            sys.stderr.write(f'[launch] cannot restart: {e}\n')
            return 2, str(e), False
        launcher = Launcher(specs, timeout=args.timeout, grace=args.grace,
                            stall=_stall(args, listener, number, specs, args.num_workers))
        if args.launcher == 'ssh':
            launcher.note(layout(specs, args.engine == 'horovod' or not _interface(user_env)))
        try:
            status = launcher.run()
        finally:
            if stop is not None:
                stop()
        return status, launcher.cause, launcher.restartable

    try:
        return run_restarting(attempt, args.max_restarts)
    finally:
        if listener is not None:
            listener.close()


def _elastic(args, command, user_env, discovery):
    """An elastic job (:mod:`.elastic`): discovery checked before anything
    starts (a usage error), then the attempts."""
    hosts = discovery.run()             # DiscoveryError: a LaunchError, status 2
    listener = _listener(args, hosts)

    def attempt(number, layout, watcher):
        env = dict(user_env, **{RESTART_ENV: str(number), ELASTIC_ENV: '1'}, **listener.env())
        try:
            specs, stop = _specs(args, command, env, layout.workers, layout.hosts)
        except (LaunchError, RuntimeError) as e:
            sys.stderr.write(f'[launch] cannot start attempt {number:d}: {e}\n')
            return AttemptEnd(2, str(e), False, set())
        launcher = Launcher(specs, timeout=args.timeout, grace=args.grace, watcher=watcher,
                            stall=_stall(args, listener, number, specs, layout.workers))
        try:
            status = launcher.run()
        finally:
            if stop is not None:
                stop()
        return AttemptEnd(status, launcher.cause, launcher.restartable,
                          unreachable_hosts(launcher.procs) | launcher.stalled_hosts)

    try:
        return run_elastic(discovery, args.size, attempt, args.max_restarts,
                           args.elastic_timeout, args.discover_interval, listener, first=hosts,
                           grow_on_any_status=args.engine == 'horovod'
                           and args.launcher == 'local')
    finally:
        listener.close()
