"""A job in a SLURM allocation: one launcher per task.

``srun`` starts ``python -m gluon_parallel.launch --launcher slurm ...`` once
per task (the launcher runs ``srun`` itself when started in the batch
script or the ``salloc`` shell). Every task derives its part of the job
from ``SLURM_PROCID``, the number of tasks and the node list, with no other
communication:

* every task runs one worker, of rank ``SLURM_PROCID`` (so ``-n`` is the
  number of tasks);
* task 0, which SLURM places on the first node, also runs the scheduler;
* server ``s`` of ``S`` runs on task ``s * N // S`` (``S <= N``): with
  ``--ntasks-per-node=k`` and ``-s`` = the number of nodes, one per node;
* the scheduler's port is ``--port`` or derived from the job and step ids,
  the same in every task; each task takes the other ports from its own band
  of the port range, so on one node ps-lite's ranks follow ``SLURM_PROCID``.

On a failure (or ``--timeout``) a task stops its processes and exits with
the failure's status. Under the launcher's own srun
(``--kill-on-bad-exit=1``, :data:`TASK_ENV` set) srun then ends the step,
stopping every other task's launcher with SIGTERM; under a user's srun,
whose flags it cannot know, the task cancels the job step itself
(``scancel JOB.STEP``), to the same effect. A task that cannot start its
part (task 0 finding the scheduler's port taken) cancels the step too: the
others would wait for it forever.
"""
import re
import signal
import socket
import subprocess
import sys

from .hosts import LaunchError, addresses
from .plan import Member
from .process import PORT_RANGE, find_free_ports

#: Set in the tasks of the srun the launcher starts itself.
TASK_ENV = 'GLUON_PARALLEL_SLURM_TASK'
# SLURM's special step ids (batch script, extern, interactive...) are the
# top of the 32-bit range: such a "step" is not an srun of our tasks.
_SPECIAL_STEPS = 0xfffffff0
# The scheduler's port when not given: above the workers' bands, below
# Linux's ephemeral ports.
_ROOT_PORTS = (32000, 32700)


def expand_nodelist(text):
    """SLURM's compact host list, expanded: ``node[1-3,7]`` ->
    ``node1 node2 node3 node7``; ``a,b``; ``n[01-03]`` keeps the zero
    padding; ``r[1-2]-n[1-2]`` -> ``r1-n1 r1-n2 r2-n1 r2-n2``."""
    parts, depth, current = [], 0, ''
    for ch in text:
        depth += {'[': 1, ']': -1}.get(ch, 0)
        if depth not in (0, 1):
            raise LaunchError(f'bad SLURM node list {text!r}')
        if ch == ',' and depth == 0:
            parts.append(current)
            current = ''
        else:
            current += ch
    parts.append(current)
    if depth:
        raise LaunchError(f'bad SLURM node list {text!r}')
    return [name for part in parts if part.strip() for name in _expand(part.strip(), text)]


def _expand(part, text):
    match = re.match(r'([^\[]*)\[([^\]]*)\](.*)$', part)
    if not match:
        return [part]
    prefix, ranges, rest = match.groups()
    tails = _expand(rest, text)
    names = []
    for item in ranges.split(','):
        lo, dash, hi = item.strip().partition('-')
        if not lo.isdigit() or (dash and (not hi.isdigit() or int(hi) < int(lo))):
            raise LaunchError(f'bad range {item!r} in SLURM node list {text!r}')
        numbers = range(int(lo), int(hi) + 1) if dash else [int(lo)]
        width = len(lo)         # zero-padded as written: n[01-03] is n01, n02, n03
        names += [f'{prefix}{i:0{width}d}{tail}' for i in numbers for tail in tails]
    return names


def expand_tasks_per_node(text):
    """``SLURM_TASKS_PER_NODE`` / ``SLURM_STEP_TASKS_PER_NODE`` ('2(x3),1')
    as one count per node ([2, 2, 2, 1])."""
    counts = []
    for part in text.split(','):
        found = re.fullmatch(r'\s*(\d+)(?:\(x(\d+)\))?\s*', part)
        if not found:
            raise LaunchError(f'bad tasks-per-node list {text!r}')
        counts += [int(found.group(1))] * int(found.group(2) or 1)
    return counts


def task_hosts(env, step):
    """The node of every task, in task order (srun's default block
    distribution), from the step's variables (`step`) or the allocation's."""
    names = (('SLURM_STEP_NODELIST', 'SLURM_STEP_TASKS_PER_NODE') if step else
             ('SLURM_JOB_NODELIST', 'SLURM_TASKS_PER_NODE'))
    if not all(env.get(n) for n in names):
        raise LaunchError(f"{' or '.join(names)} is not set: --launcher slurm runs inside a SLURM "
                          'allocation')
    nodes, counts = expand_nodelist(env[names[0]]), expand_tasks_per_node(env[names[1]])
    if len(nodes) != len(counts):
        raise LaunchError(f'{names[0]}={env[names[0]]} and {names[1]}={env[names[1]]} disagree')
    return [n for n, c in zip(nodes, counts) for _ in range(c)]


def in_task(env):
    """Whether this process is a task of an srun step (else: the batch
    script, the salloc shell, or outside SLURM)."""
    if env.get(TASK_ENV):
        return True
    step = env.get('SLURM_STEP_ID', env.get('SLURM_STEPID'))
    return step is not None and step.isdigit() and int(step) < _SPECIAL_STEPS


def srun_argv(launcher_args):
    """The srun that runs one launcher per task of the allocation; a task's
    non-zero exit, or one Ctrl-C, ends the whole step."""
    return (['srun', '--kill-on-bad-exit=1', '--quit-on-interrupt', sys.executable, '-m',
             'gluon_parallel.launch'] + list(launcher_args))


class Task:
    """This task's place in the step, read from the environment srun sets.

    Attributes: ``procid``, ``ntasks``, ``nodes`` (the step's node list,
    expanded), ``node`` (this task's), ``job``, ``step``.
    """

    def __init__(self, env):
        def get(*names):
            for name in names:
                if env.get(name):
                    return env[name]
            raise LaunchError(f'{names[0]} is not set: --launcher slurm runs inside a SLURM '
                              'allocation (sbatch or salloc)')
        try:
            self.procid = int(get('SLURM_PROCID'))
            self.ntasks = int(get('SLURM_STEP_NUM_TASKS', 'SLURM_NTASKS', 'SLURM_NPROCS'))
        except ValueError as e:
            raise LaunchError(f'bad SLURM task variables: {e}') from e
        self.nodes = expand_nodelist(get('SLURM_STEP_NODELIST', 'SLURM_JOB_NODELIST',
                                         'SLURM_NODELIST'))
        self.node = env.get('SLURMD_NODENAME') or socket.gethostname()
        self.job = env.get('SLURM_JOB_ID', env.get('SLURM_JOBID', '0'))
        self.step = env.get('SLURM_STEP_ID', env.get('SLURM_STEPID', '0'))
        if not 0 <= self.procid < self.ntasks:
            raise LaunchError(f'SLURM_PROCID={self.procid:d} is not a task of {self.ntasks:d}')
        self._named = bool(env.get('SLURMD_NODENAME'))

    def roles(self, num_servers):
        """[(role, rank)] this task runs: the scheduler (task 0), server
        ``s`` when ``s * N // S`` is this task, and worker ``SLURM_PROCID``."""
        if not 1 <= num_servers <= self.ntasks:
            raise LaunchError(f'-s {num_servers:d}: a step of {self.ntasks:d} task(s) hosts 1 to '
                              f'{self.ntasks:d} servers')
        roles = [('scheduler', None)] if self.procid == 0 else []
        roles += [('server', s) for s in range(num_servers)
                  if s * self.ntasks // num_servers == self.procid]
        return roles + [('worker', self.procid)]

    def root_port(self):
        """The scheduler's port, the same in every task of the step."""
        def number(text):
            digits = re.sub(r'\D', '', text)
            return int(digits) if digits else 0
        lo, hi = _ROOT_PORTS
        return lo + (number(self.job) * 131 + number(self.step)) % (hi - lo)

    def members(self, num_servers, root_port, scheduler_address=None, interface=None,
                resolver=None):
        """(``DMLC_PS_ROOT_URI``, this task's Members).

        The errors raised here concern this task alone (the others would
        wait for it): the caller cancels the step.
        """
        roles = self.roles(num_servers)
        if self.procid == 0:
            if self._named and self.node != self.nodes[0]:
                raise LaunchError(f'task 0 runs on {self.node}, not on the first node '
                                  f'{self.nodes[0]} of the step: the '
                                  'scheduler would not be where the others look for it')
            try:
                find_free_ports(1, (root_port, root_port + 1))
            except RuntimeError:
                raise LaunchError(f"the scheduler's port {root_port:d} is taken on {self.node}: "
                                  "pass --port") from None
        lo, hi = PORT_RANGE
        band = (hi - lo) // self.ntasks
        if band < len(roles):
            raise LaunchError(f'{self.ntasks:d} tasks: too many for the port range {lo:d}-{hi:d}')
        start = lo + self.procid * band
        ports = find_free_ports(len(roles) - (self.procid == 0), (start, start + band),
                                exclude={root_port})
        several = len(set(self.nodes)) > 1
        # A peer to find this node's outward address when its own name
        # resolves to a loopback address (Debian's 127.0.1.1).
        peer = [n for n in self.nodes if n != self.node][:1]
        lookup = list(dict.fromkeys([self.node, self.nodes[0]] + peer))
        root, node_host = addresses(lookup, self.nodes[0], scheduler_address, interface,
                                    others_remote=several, resolver=resolver)
        members = []
        for role, rank in roles:
            port = root_port if role == 'scheduler' else ports.pop(0)
            # On several nodes ps-lite orders nodes by address: a rank can
            # only be promised on one node.
            members.append(Member(role, rank, port, self.node, node_host[self.node],
                                  rank_known=not several))
        return root, members


def cancel_step(task, note):
    """Cancel this job step, so every other task's launcher stops its
    processes (scancel signals this task too: ignored, it is ending)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    step = f'{task.job}.{task.step}'
    note(f'cancelling job step {step} so that every task stops')
    try:
        subprocess.run(['scancel', step], timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        note(f'could not cancel job step {step} ({e}): the other tasks stop only if srun was '
             'given --kill-on-bad-exit=1')
