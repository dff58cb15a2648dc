"""Parameters: whether their arrays exist, their sparse kinds, gradient
freshness, what the executors bind of them (mxnet 1.9.1; see the package
docstring)."""
import contextlib
import ctypes
import weakref

import mxnet as mx

__all__ = ['has_data', 'is_deferred', 'is_row_sparse', 'has_sparse_grad', 'reduced_value',
           'load_init', 'grad_is_fresh', 'set_grad_fresh', 'mark_grads_fresh', 'set_grads_fresh',
           'grads_fresh', 'hidden_from_step', 'param_trainers', 'param_arrays_state',
           'grad_arrays', 'true_grad_req', 'replace_grads', 'param_trainer']


def has_data(p):
    """``Parameter._data`` is None until the arrays exist (before
    ``initialize``, and while initialisation is deferred)."""
    return p._data is not None


def is_deferred(p):
    """``Parameter._deferred_init`` is a non-empty tuple (init, ctx list,
    default init, data) while the shape waits for the first forward pass."""
    return bool(p._deferred_init)


def is_row_sparse(p):
    """``Parameter._stype`` is 'row_sparse' for sparse weights, whose value a
    kvstore holds; ``Parameter._reduce()`` fetches it."""
    return p._stype != 'default'


def has_sparse_grad(p):
    """``Parameter._grad_stype`` is 'row_sparse' for a sparse gradient
    (``Embedding(sparse_grad=True)``)."""
    return p._grad_stype != 'default'


def reduced_value(p):
    """The value of a row-sparse parameter (``Parameter._reduce``)."""
    return p._reduce()


def load_init(p, value, ctx):
    """``Parameter._load_init(data, ctx)`` initialises an uninitialised or
    deferred parameter from a value (what ``load_parameters`` uses)."""
    p._load_init(value, ctx)


def grad_is_fresh(array):
    """``NDArray._fresh_grad``: set by backward, cleared by ``Trainer.step``
    (without update_on_kvstore); a stale gradient is one not written since."""
    return array._fresh_grad


def set_grad_fresh(array, fresh):
    array._fresh_grad = fresh


def mark_grads_fresh(arrays):
    """Mark every array's gradient fresh, as autograd's backward does.
    ``NDArray._fresh_grad = True`` is ``MXNDArraySetGradState(handle, 1)``
    (1.9.1); called directly, one C call per array and no Python frame
    (graph mode runs this per parameter and device every step)."""
    set_grads_fresh(arrays, True)


def set_grads_fresh(arrays, fresh):
    """``a._fresh_grad = fresh`` for every array, one C call each
    (``MXNDArraySetGradState``, see :func:`mark_grads_fresh`)."""
    setter, state = mx.base._LIB.MXNDArraySetGradState, ctypes.c_int(int(fresh))
    for a in arrays:
        if setter(a.handle, state) != 0:
            mx.base.check_call(-1)              # raises MXNet's last error


def grads_fresh(arrays):
    """``[a._fresh_grad for a in arrays]`` through ``MXNDArrayGetGradState``
    (what the property calls in 1.9.1), one C call each, no Python frame."""
    getter, state = mx.base._LIB.MXNDArrayGetGradState, ctypes.c_int()
    ref, out = ctypes.byref(state), []
    for a in arrays:
        if getter(a.handle, ref) != 0:
            mx.base.check_call(-1)
        out.append(bool(state.value))
    return out


_HIDDEN = weakref.WeakKeyDictionary()     # parameter -> its grad_req while hidden


@contextlib.contextmanager
def hidden_from_step(params):
    """Within the block, `params` have ``grad_req == 'null'`` for the
    Trainer, which then neither reduces nor updates them. Written through
    ``Parameter._grad_req``: the public setter would drop the gradient
    arrays. :func:`true_grad_req` still tells their own, also inside a
    nested block (a parameter hidden already keeps the entry of the
    outer one)."""
    saved = [(p, p._grad_req) for p in params]
    mine = [p for p, _ in saved if p not in _HIDDEN]
    try:
        for p in mine:
            _HIDDEN[p] = p._grad_req
        for p, _ in saved:
            p._grad_req = 'null'
        yield
    finally:
        for p, req in saved:
            p._grad_req = req
        for p in mine:
            _HIDDEN.pop(p, None)


def true_grad_req(p):
    """``p.grad_req``, or the one :func:`hidden_from_step` hides."""
    return _HIDDEN.get(p, p._grad_req)


def param_trainers(params):
    """The Trainers of `params` (``Parameter._trainer``: the last Trainer
    built over a parameter, set by ``Trainer.__init__`` through
    ``_set_trainer``). One comprehension: this runs on every recorded call."""
    return {p._trainer for p in params if p._trainer is not None}


def param_arrays_state(params):
    """(ids of the array lists, grad_req) of each parameter: ``Parameter._data``
    and ``_grad`` are the lists ``list_data()`` and ``list_grad()`` return,
    replaced by ``initialize``, ``reset_ctx``, ``cast`` and a new grad_req. One
    comprehension: this runs on every call."""
    return tuple([(id(p._data), id(p._grad), p._grad_req) for p in params])


# ------------------------------------------------------------- gradients --

def grad_arrays(p):
    """``Parameter._grad``: the list ``list_grad()`` returns, or None (no
    arrays yet, or ``grad_req == 'null'``; ``list_grad()`` raises then)."""
    return p._grad


def param_trainer(p):
    """``Parameter._trainer``: the last Trainer built over `p` (None)."""
    return p._trainer


def replace_grads(p, grads):
    """Make `grads` (one per context, shaped as the data) the gradient
    arrays of `p`: what ``list_grad()`` returns and what autograd writes.
    1.9.1: ``Parameter._init_grad`` sets ``_grad`` and calls
    ``autograd.mark_variables(data, grad, grad_req)``; marking gives each
    data array a new autograd variable whose fresh-gradient flag starts
    False, so the flags are carried over."""
    fresh = grads_fresh(p._data)
    p._grad = list(grads)
    mx.autograd.mark_variables(p._data, p._grad, p._grad_req)
    set_grads_fresh([d for d, f in zip(p._data, fresh) if f], True)
