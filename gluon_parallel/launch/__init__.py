"""Run a dist_sync job: ``python -m gluon_parallel.launch``.

::

    python -m gluon_parallel.launch [--launcher {local,ssh,slurm}] -n WORKERS
        [-s SERVERS] [-H HOSTFILE] [--ssh-port P] [--timeout S] [--stall-timeout S]
        [--max-restarts N] -- COMMAND...

Starts one scheduler, ``SERVERS`` parameter servers and ``WORKERS`` workers,
every one of them running ``COMMAND`` with the standard DMLC environment
(``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``,
``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``, ``DMLC_NODE_HOST``, ``PORT``), so
a script written for any DMLC launcher runs unchanged:

* ``local`` (default): on this machine, at 127.0.0.1 and free ports;
* ``ssh``: on the hosts of a hostfile, one ssh connection per process
  (:mod:`.ssh`);
* ``slurm``: one launcher per task of a SLURM job step (:mod:`.slurm`).

Every line a process prints is streamed with a prefix naming it
(``[worker 1] ...``, ``[worker 1@node2] ...`` on another host), stdout to
stdout and stderr to stderr.

The launcher is a watchdog (:mod:`.watchdog`): ps-lite never notices a
dead peer, so a worker that dies would leave the others blocked forever.
The first process that exits with a non-zero status ends the job: every
other process is stopped (SIGTERM, then SIGKILL after ``--grace``
seconds) and the launcher exits with that status. The same happens on
``--timeout``, on Ctrl-C (SIGINT) and on SIGTERM/SIGHUP sent to the
launcher. Each process runs in its own session, so the stop reaches
whatever it started; a local one is killed if the launcher itself is
killed (Linux), a remote one when its ssh connection ends.

A job that stops moving is found too (:mod:`.stall`): every worker
reports its progress over the launcher's channel (:mod:`.listener`,
:mod:`gluon_parallel.channel`); after ``--stall-timeout`` seconds (600
by default) without progress, outside ``dist.busy``, the launcher names
the stalled processes, prints every Python process's stacks and ends the
attempt.

Every Python process of the job fails fast (:mod:`.failfast`): an
uncaught exception or a non-zero ``sys.exit`` ends it at once, even in a
script that never imports gluon_parallel, where ps-lite's finalisation
would otherwise keep it waiting for the other workers. ``--max-restarts
N`` runs the whole job again after a failure (:mod:`.restarts`); the
processes see the attempt number in ``GLUON_PARALLEL_RESTART``.

``-n MIN:MAX --discover CMD`` makes the job elastic (:mod:`.elastic`,
:mod:`.discovery`, local and ssh): every attempt runs at the size a
discovery command reports, and more slots end the job after its next
``dist.save_checkpoint`` to go on at the larger size.

This package imports nothing from MXNet: in a process whose ``DMLC_ROLE``
is ``scheduler`` or ``server``, ``import mxnet`` runs the server loop
instead of returning.

Exit status: 0 when every worker exited with 0; else the first non-zero
status (``128 + N`` for a process killed by signal N, 255 when ssh itself
failed); 121 after a stall; 124 on timeout (or when an elastic job never
had MIN slots);
``128 + N`` when the launcher got signal N (130 for Ctrl-C); 2 for bad
arguments.
"""
from .cli import main
from .process import LAUNCH_RANK_ENV, RESTART_ENV, Spec, find_free_ports
from .watchdog import Launcher

__all__ = ['Launcher', 'Spec', 'main', 'find_free_ports', 'LAUNCH_RANK_ENV', 'RESTART_ENV']
