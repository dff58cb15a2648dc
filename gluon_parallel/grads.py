"""Gradients a Trainer must not sum: stale ones (a parameter a step did not
use) and those of devices left idle by a short batch."""
from collections.abc import Sequence

from mxnet import autograd, gluon

from . import _gluon
from .nn.embedding import is_pinned
from .trainer import zero_in_buckets

__all__ = ['step']


def as_trainers(trainer):
    """A list of gluon.Trainer from one, a list of them, or None."""
    if trainer is None:
        return []
    trainers = list(trainer) if isinstance(trainer, (list, tuple)) else [trainer]
    for t in trainers:
        if not isinstance(t, gluon.Trainer):
            raise TypeError(f'expected a gluon.Trainer (or a list of them), got {type(t).__name__}')
    return trainers


def count_as_zero(p, copies):
    """Make the gradient of `p` on the contexts in `copies` count zero in
    the next step: zeroed (unless accumulating, where it holds what was
    added so far) and marked fresh, so the Trainer sums it without
    complaint and every copy gets the same update."""
    for ctx, data, grad in zip(p.list_ctx(), p.list_data(), p.list_grad()):
        if ctx in copies:
            if p.grad_req == 'write':
                grad[:] = 0
            _gluon.set_grad_fresh(data, True)


def clear_idle_grads(block, idle):
    """Devices idle in a call would hand the Trainer their gradients of the
    previous step: those count zero instead (a gradient bucket of
    ``gluon_parallel.Trainer`` zeroed whole, one operation per device)."""
    idle = set(idle)
    with autograd.pause():
        params = [p for p in block.collect_params().values()
                  if p.grad_req != 'null' and _gluon.has_data(p) and not is_pinned(p)]
        # (a pinned table is no device's copy: never idle)
        zeroed = {id(p) for p in zero_in_buckets(params, idle)}
        for p in params:
            if id(p) in zeroed:
                _gluon.set_grads_fresh([d for c, d in zip(p.list_ctx(), p.list_data())
                                        if c in idle], True)
            else:
                count_as_zero(p, idle)


def step(trainer: gluon.Trainer | Sequence[gluon.Trainer], batch_size: int,
         ignore_stale_grad: bool = False) -> None:
    """``trainer.step(batch_size)`` that skips unused parameters correctly
    on several devices.

    A parameter that got no gradient since the last step (a branch the
    model did not take) makes ``Trainer.step`` raise. Gluon's own
    ``ignore_stale_grad=True`` is exact on one device only: on several,
    the Trainer still sums the stale gradients into the update (with the
    default ``update_on_kvstore`` it applies the previous step's gradient
    again). With ``ignore_stale_grad=True`` this function instead

    - skips a parameter that got no gradient on any of its contexts (no
      update, no weight decay, no momentum: as on one device);
    - counts zero for the contexts of a parameter that some replicas used
      and others did not, so all its copies get the same update from the
      gradients that do exist.

    Frozen parameters (``grad_req='null'``) are always left alone.

    Parameters
    ----------
    trainer : Trainer or list of Trainer
        Several trainers (e.g. one for a table kept on one context by
        :class:`~gluon_parallel.nn.HostEmbedding` and one for the
        replicated parameters) all step with the same batch size.
    batch_size : int
        The global batch size: gradients are divided by it.
    ignore_stale_grad : bool, default False
        False raises like ``Trainer.step`` (a UserWarning naming the
        parameter and the contexts), since a stale gradient is usually a bug.
    """
    trainers = as_trainers(trainer)
    if not trainers:
        raise TypeError('step needs a gluon.Trainer')
    with autograd.pause():
        unused = _settle_stale_grads(trainers, ignore_stale_grad)
    with _gluon.hidden_from_step(unused):
        for t in trainers:
            t.step(batch_size)
            # With update_on_kvstore, Trainer.step never marks gradients as
            # used, so the next step could not tell a stale one: mark them.
            _mark_used(t)


def _settle_stale_grads(trainers, ignore_stale_grad):
    """Raise for a stale gradient unless `ignore_stale_grad`; otherwise count
    zero on the contexts where a parameter got none, and return the
    parameters that got none anywhere (step hides them from the trainers)."""
    unused = []
    for t in trainers:
        for p in _gluon.trainer_params(t):
            if p.grad_req == 'null' or not _gluon.has_data(p):
                continue
            fresh = [_gluon.grad_is_fresh(d) for d in p.list_data()]
            if all(fresh):
                continue
            if not ignore_stale_grad:
                stale = [c for c, f in zip(p.list_ctx(), fresh) if not f]
                raise UserWarning(
                    f'parameter {p.name} got no gradient on {stale} since the last step. If the '
                    'model deliberately leaves it unused, call '
                    'gluon_parallel.step(trainer, batch_size, ignore_stale_grad=True)')
            if any(fresh):
                count_as_zero(p, [c for c, f in zip(p.list_ctx(), fresh) if not f])
            else:
                unused.append(p)
    return unused


def _mark_used(trainer):
    """Mark every gradient of `trainer`'s parameters as used by a step."""
    for p in _gluon.trainer_params(trainer):
        if p.grad_req != 'null' and _gluon.has_data(p):
            for d in p.list_data():
                _gluon.set_grad_fresh(d, False)
