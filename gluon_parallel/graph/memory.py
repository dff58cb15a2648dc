"""Executors across input signatures: one memory pool shared by the
executors of a network (or of a loss), as MXNet's BucketingModule shares
its buckets' memory.

A pool's *base* executor is bound with memory of its own, for the largest
inputs seen; every other executor of the pool is bound with
``shared_exec=base`` (MXNet 1.9.1, ``GraphExecutor::InitDataEntryMemory``:
each internal array takes the smallest free array of the base's pool on its
context that is large enough, and what the pool lacks is allocated and
added to it). So ten input sizes cost about the largest one's memory. A
larger signature *re-bases* the pool: its executors are dropped first, their
memory freed and given back to the system (:func:`release_memory`), then the
new base is bound alone, so the peak stays the largest signature's.

An executor holds its recorded call's forward pass until the call's
backward is pushed (bridge.py), and another executor of its pool would
overwrite those activations. So a pool is *busy* while one of its
executors holds a call, and a call that finds every pool busy gets a pool of
its own (two forwards, then one backward over both: two pools, each with
its own memory); beyond :data:`MAX_POOLS`, the oldest held call gives its
pool up (a backward that reaches it raises: calls.REUSED).

Each pool keeps at most ``cache_size`` executors (its base included). With
memory shared, keeping one costs little, and binding one costs tens of
milliseconds: a full pool drops the executor used least, the one bound last
among equals (uses halved now and then, so that a schedule that changes is
followed), never its base. A schedule cycling through more signatures than
the pool holds keeps most of them bound, where least-recently-used would
bind on every call.
"""
import ctypes
import ctypes.util
import functools

from mxnet import nd

__all__ = ['Pools', 'Pool', 'MAX_POOLS', 'release_memory']

#: Pools per runner: recorded calls of one network whose backward may come
#: at once (two forwards, then one backward over both).
MAX_POOLS = 2


class Pool:
    """Executors sharing one memory pool.

    Parameters
    ----------
    cache_size : int
        Executors kept, the base included.
    """

    def __init__(self, cache_size):
        self.cache_size = cache_size
        self.base = None
        self.executors = {}             # key -> Executor
        self._sharing = set()           # the keys of the executors in the base's memory
        self._uses = {}                 # key -> (uses, -bind number): uses halved now and then
        self._binds = 0

    def busy(self):
        """Whether an executor holds a recorded call's forward pass."""
        return any(ex.call is not None for ex in self.executors.values())

    def held(self):
        """The recorded calls its executors hold."""
        return [ex.call for ex in self.executors.values() if ex.call is not None]

    def get(self, key):
        """The executor of `key`, or None."""
        ex = self.executors.get(key)
        if ex is not None:
            uses, order = self._uses[key]
            self._uses[key] = (uses + 1, order)
        return ex

    def room_for(self, size, share=True):
        """Make room for a new executor whose inputs have `size` elements;
        returns the executor whose memory it shares, or None when it is to
        be bound with memory of its own: the pool's first, a larger
        signature (the pool re-based), or one that must not share
        (`share` False: it keeps its memory to itself)."""
        if share and self.base is not None and size > self.base.size:
            for key in list(self._sharing):
                self.drop(key)
            self.base = None
            release_memory()
        if len(self.executors) >= self.cache_size:
            least = min((k for k, ex in self.executors.items() if ex is not self.base),
                        key=self._uses.__getitem__, default=None)
            if least is not None:
                self.drop(least)
        return self.base if share else None

    def add(self, key, executor, share=True):
        """Keep `executor` (bound by :meth:`room_for`'s answer) for `key`;
        the first that shares becomes the base."""
        if share and self.base is None:
            self.base = executor
        if share:
            self._sharing.add(key)
        self.executors[key] = executor
        self._binds += 1
        self._uses[key] = (1, -self._binds)
        if self._binds % (4 * self.cache_size) == 0:
            self._uses = {k: (u // 2, o) for k, (u, o) in self._uses.items()}

    def drop(self, key):
        """Forget the executor of `key` (the calls and losses bound to it
        are told: Executor.close)."""
        ex = self.executors.pop(key)
        del self._uses[key]
        self._sharing.discard(key)
        ex.close()

    def drop_if(self, predicate):
        """Forget every executor for which ``predicate(executor)`` holds."""
        for key in [k for k, ex in self.executors.items() if predicate(ex)]:
            self.drop(key)
        if self.base is not None and self.base not in self.executors.values():
            for key in list(self._sharing):
                self.drop(key)
            self.base = None

    def clear(self):
        """Forget every executor, the base too."""
        for key in list(self.executors):
            self.drop(key)
        self.base = None


class Pools:
    """The pools of one runner (a network's or a loss's executors).

    Parameters
    ----------
    cache_size : int
        Executors kept per pool.
    """

    def __init__(self, cache_size):
        self.cache_size = cache_size
        self.pools = []

    def find(self, key, give_up):
        """A pool that holds no recorded call, and its executor of `key` if
        it has one: ``(pool, executor or None)``. When every pool is busy and
        there are :data:`MAX_POOLS`, ``give_up(calls)`` makes the oldest of
        those calls give its executor up (calls.RecordedCalls.give_up_oldest)."""
        for pool in self.pools:
            if not pool.busy():
                return pool, pool.get(key)
        if len(self.pools) < MAX_POOLS:
            self.pools.append(Pool(self.cache_size))
            return self.pools[-1], None
        give_up([c for pool in self.pools for c in pool.held()])
        return self.find(key, give_up)

    def executors(self):
        """Every executor kept."""
        return [ex for pool in self.pools for ex in pool.executors.values()]

    def drop_if(self, predicate):
        """Forget every executor for which ``predicate(executor)`` holds."""
        for pool in self.pools:
            pool.drop_if(predicate)

    def clear(self):
        """Forget every executor (a call whose backward may still come keeps
        its own)."""
        for pool in self.pools:
            pool.clear()
        self.pools = []


def release_memory():
    """Free what dropped executors held, and give it back to the system.
    MXNet frees an array's memory in an engine operation (hence the wait);
    on CPU contexts that memory is the C library's, whose allocator keeps
    freed blocks for reuse (glibc raises its threshold for returning large
    blocks each time one is freed): ``malloc_trim`` returns them, so that a
    re-based pool's peak is the new base's, not the sum of both."""
    nd.waitall()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None elsewhere."""
    name = ctypes.util.find_library('c')
    lib = ctypes.CDLL(name) if name else None
    return getattr(lib, 'malloc_trim', None)
