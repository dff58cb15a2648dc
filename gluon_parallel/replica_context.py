"""The replica context: which replica this thread is, within which call,
and how a replica's failure is reported.

A layer that synchronises across replicas (SyncBatchNorm) asks
:func:`current_replica` for its rank and for the call's shared
:class:`ParallelState` objects, so it never needs to be told the device
count. Outside a parallel call, :func:`current_replica` returns None and such
layers behave like their single-device versions.
"""
import functools
import os
import threading

from .barrier import ParallelState, ParallelAbort

__all__ = ['ReplicaContext', 'ParallelCall', 'current_replica', 'default_timeout']

_local = threading.local()

#: Environment variable holding the default barrier timeout in seconds.
TIMEOUT_ENV = 'GLUON_PARALLEL_TIMEOUT'


def default_timeout():
    """Seconds a replica waits at a barrier for the others before it raises
    TimeoutError: ``$GLUON_PARALLEL_TIMEOUT`` if set (``0`` or ``none``:
    forever), else 300."""
    value = os.environ.get(TIMEOUT_ENV, '').strip().lower()
    if not value:
        return 300.0
    if value in ('0', 'none', 'inf'):
        return None
    return float(value)


class ParallelCall:
    """State shared by the replicas of one parallel call.

    Parameters
    ----------
    ctx_list : list of Context
        Contexts of the replicas that run in this call, in rank order.
    all_ctx : list of Context, optional
        Every context of the model, including those idle in this call.
    timeout : float, optional
        Timeout of the ParallelStates created for this call.
    num_devices : int, optional
        The device count a layer built for one (``SyncBatchNorm(num_devices=n)``)
        must match; default ``len(all_ctx)``; 0: not checked.
    on_alone : callable, optional
        Called before a synchronising layer runs in a call of one replica
        (with no other to meet): a caller whose lone replica stands for
        several that cannot meet (``gluoncv.Parallel``'s serial start) warns
        there.
    """

    def __init__(self, ctx_list, all_ctx=None, timeout=None, num_devices=None, on_alone=None):
        self.ctx_list = list(ctx_list)
        self.all_ctx = list(all_ctx) if all_ctx is not None else self.ctx_list
        self.timeout = timeout
        self.num_devices = len(self.all_ctx) if num_devices is None else num_devices
        self.on_alone = on_alone
        self._states = {}
        self._lock = threading.Lock()
        self.error = None
        #: Whether replicas ran on worker threads (set by the pool).
        self.used_threads = False
        #: How many parallel calls this one is nested in (made inside a
        #: replica of another): a nested call needs a pool of its own.
        outer = current_replica()
        self.depth = 0 if outer is None else outer.call.depth + 1

    @property
    def size(self):
        """Number of replicas in this call."""
        return len(self.ctx_list)

    @property
    def idle_ctx(self):
        """Contexts of the model that got no slice in this call."""
        return [c for c in self.all_ctx if c not in self.ctx_list]

    @functools.cached_property
    def second_on_device(self):
        """Ranks whose device an earlier replica of the call runs on too
        (gluoncv.Parallel's round of two tasks on one device)."""
        return frozenset(r for r, c in enumerate(self.ctx_list) if c in self.ctx_list[:r])

    @property
    def synchronised(self):
        """Whether a layer has met the other replicas in this call (made a
        ParallelState): their recorded graphs cross from then on."""
        return bool(self._states)

    def state(self, key, operation):
        """The call's ParallelState for `key`, created by its first user."""
        with self._lock:
            st = self._states.get(key)
            if st is None:
                st = self._states[key] = ParallelState(self.size, operation, self.timeout)
                if self.error is not None:
                    st.abort(self.error)
            return st

    def abort(self, exc):
        """Wake every replica waiting on a state of this call."""
        with self._lock:
            if self.error is None:
                self.error = ParallelAbort(f'another replica failed: {type(exc).__name__}: {exc}')
                self.error.__cause__ = exc
            states = list(self._states.values())
        for st in states:
            st.abort(self.error)


class ReplicaContext:
    """What a replica knows about itself while it runs.

    Attributes
    ----------
    rank : int
        Index of this replica in the call (0 .. size-1).
    size : int
        Number of replicas in the call.
    ctx : Context
        This replica's device.
    call : ParallelCall
        The shared state of the call.
    """

    __slots__ = ('rank', 'call', '_uses', '_outers')

    def __init__(self, rank, call):
        self.rank = rank
        self.call = call
        self._uses = {}
        self._outers = []

    @property
    def size(self):
        return self.call.size

    @property
    def ctx(self):
        return self.call.ctx_list[self.rank]

    def next_state(self, layer_key, operation):
        """The ParallelState of the next use of `layer_key` by this replica.

        The k-th use of a layer in one replica meets the k-th use in every
        other replica, so a layer called twice per forward, or two layers,
        never share a round.
        """
        k = self._uses.get(layer_key, 0)
        self._uses[layer_key] = k + 1
        return self.call.state((layer_key, k), operation)

    def __enter__(self):
        """This thread runs this replica until exit; a parallel call made
        inside it finds its own replica, then this one again."""
        self._outers.append(getattr(_local, 'replica', None))
        _local.replica = self
        return self

    def __exit__(self, *exc):
        _local.replica = self._outers.pop()


def current_replica():
    """The :class:`ReplicaContext` of the calling thread, or None outside a
    parallel call."""
    return getattr(_local, 'replica', None)


def annotate(exc, rank, ctx):
    """Name the failing replica in the exception message, keeping its type
    and traceback; returns `exc`."""
    where = f'in replica {rank} on {ctx}'
    try:
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f'{exc.args[0]} [{where}]',) + tuple(exc.args[1:])
        elif not exc.args:
            exc.args = (where,)
        else:
            exc.add_note(where)
    except Exception:   # an exception type with read-only args
        pass
    return exc
