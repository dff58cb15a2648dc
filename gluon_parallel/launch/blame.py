"""Who a worker's failure came from, under ``--stall-timeout``: a worker
that fails after waiting in a reduction (Gloo's own timeout under
Horovod, any collective that gave up on a peer that stopped moving) is
the consequence; the workers it waited for are the likely cause.

The rule (:func:`blame`, on the progress reports :mod:`.stall` keeps):
the failed worker had waited in a reduction at least `lag` seconds
(:data:`LAG`, or S if shorter), its wait ending at most `lag` before it
failed (a collective that raises is left as the process exits); then a
stopped process of the job (``/proc`` state ``T``) is named, else the
workers still in their program that had not moved for `lag` either and
are behind it (fewer completed reductions, or not yet in the reduction it
waited in). With nobody behind, nothing is named: the failure is reported
as any other.
"""
from typing import NamedTuple

__all__ = ['LAG', 'Wait', 'Blame', 'waited', 'blame', 'first_line']

#: Seconds of the failed worker's wait, and of the others' standing
#: still, before they are blamed: well above the delay of a progress
#: report (one a second at most) and a healthy job's skew between workers
#: (their reductions complete together), well below any collective's
#: timeout (Gloo's default is 30 s).
LAG = 5.0


class Wait(NamedTuple):
    """A worker's wait in a reduction, as the launcher saw it."""
    number: int             # the reduction waited in (the first is 1)
    since: float
    until: float | None     # None: still waiting


class Blame(NamedTuple):
    """What a failure likely came from."""
    suspects: list          # names
    why: str
    idle: float             # seconds the suspects had not moved (stopped: the wait)


def waited(wait, reductions, reducing, now):
    """The worker's last :class:`Wait` (or None) after a report of
    `reductions` completed and `reducing` at `now`; `wait`: the one before."""
    if wait is not None and wait.until is None and (not reducing
                                                    or reductions != wait.number - 1):
        wait = wait._replace(until=now)
    if reducing and (wait is None or wait.until is not None):
        wait = Wait(reductions + 1, now, None)
    return wait


def blame(workers, failed, stopped, lag, now):
    """A :class:`Blame` for the failure of `failed`, or None (see the
    module's notes). `workers`: name -> the stall monitor's record of each
    reporting worker (``wait``, ``position()``, ``moved_at``, ``exiting``);
    `failed` is one of them, or a process that started several (local
    ``horovodrun``: each one's wait is looked at); `stopped`: names of
    stopped processes."""
    for who in [failed] if failed in workers else sorted(workers):
        found = _blame(workers, failed, workers[who], stopped, lag, now)
        if found is not None:
            return found
    return None


def _blame(workers, failed, waiter, stopped, lag, now):
    """:func:`blame`, `waiter` being the worker whose wait is looked at."""
    wait = waiter.wait
    if wait is None:
        return None
    until = now if wait.until is None else wait.until
    long = until - wait.since
    if long < lag or now - until > lag:
        return None
    said = f'{waiter.who} had waited {long:.0f}s in reduction {wait.number:d}'
    frozen = sorted(set(stopped) - {failed, waiter.who})
    if frozen:
        return Blame(frozen, f'stopped (state T) when {failed} failed ({said})', long)
    behind = [w for w in workers.values() if w is not waiter and not w.exiting
              and w.position() < (wait.number - 1, True) and now - w.moved_at >= lag]
    if not behind:
        return None
    idle = min(now - w.moved_at for w in behind)
    names = sorted(w.who for w in behind)
    return Blame(names, f'had not moved for {idle:.0f}s when {failed} failed ({said}, which '
                        f'{", ".join(names)} had not entered)', idle)


def first_line(failed, found):
    """The first line of the report of `found` (a :class:`Blame`)."""
    return (f'{", ".join(found.suspects)} {found.why}: the likely cause; the failure of '
            f'{failed} is likely its consequence (a collective that gave up waiting, as '
            "Gloo's timeout under Horovod)")
