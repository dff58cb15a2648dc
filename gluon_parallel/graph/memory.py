"""Executors across input signatures: one memory (an *arena*) shared by the
executors of a network (or of a loss), as MXNet's BucketingModule shares
its buckets' memory.

An arena's *base* executor is bound with memory of its own, for the largest
inputs seen; every other executor of the arena is bound with
``shared_exec=base`` (MXNet 1.9.1, ``GraphExecutor::InitDataEntryMemory``:
each internal array takes the smallest free array of the base's memory pool
on its context that is large enough, and what the pool lacks is allocated
and added to it). So ten input sizes cost about the largest one's memory. A
larger signature *re-bases* the arena: its executors are dropped first, their
memory freed and given back to the system (:func:`release_memory`), then the
new base is bound alone, so the peak stays the largest signature's.

An executor holds its recorded call's forward pass until the call's
backward is pushed (recording.py), and another executor of its arena would
overwrite those activations. So an arena is *busy* while one of its
executors holds a call, and a call that finds every arena busy gets an arena of
its own (two forwards, then one backward over both: two arenas, each with
its own memory); beyond :data:`MAX_ARENAS`, the oldest held call gives its
arena up (a backward that reaches it raises: calls.REUSED).

Each arena keeps at most ``cache_size`` executors (its base included). With
memory shared, keeping one costs little, and binding one costs tens of
milliseconds: a full arena drops the executor used least, the one bound last
among equals (uses halved now and then, so that a schedule that changes is
followed), never its base. A schedule cycling through more signatures than
the arena holds keeps most of them bound, where least-recently-used would
bind on every call.
"""
import ctypes
import ctypes.util
import functools

from mxnet import nd

__all__ = ['Arenas', 'Arena', 'MAX_ARENAS', 'release_memory']

#: Arenas per runner: recorded calls of one network whose backward may come
#: at once (two forwards, then one backward over both).
MAX_ARENAS = 2


class Arena:
    """Executors sharing one memory (MXNet's ``shared_exec``).

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
        be bound with memory of its own: the arena's first, a larger
        signature (the arena re-based), or one that must not share
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


class Arenas:
    """The arenas of one runner (a network's or a loss's executors).

    Parameters
    ----------
    cache_size : int
        Executors kept per arena.
    """

    def __init__(self, cache_size):
        self.cache_size = cache_size
        self.arenas = []

    def find(self, key, give_up):
        """An arena that holds no recorded call, and its executor of `key` if
        it has one: ``(arena, executor or None)``. When every arena is busy and
        there are :data:`MAX_ARENAS`, ``give_up(calls)`` makes the oldest of
        those calls give its executor up (calls.RecordedCalls.give_up_oldest)."""
        for arena in self.arenas:
            if not arena.busy():
                return arena, arena.get(key)
        if len(self.arenas) < MAX_ARENAS:
            self.arenas.append(Arena(self.cache_size))
            return self.arenas[-1], None
        give_up([c for arena in self.arenas for c in arena.held()])
        return self.find(key, give_up)

    def executors(self):
        """Every executor kept."""
        return [ex for arena in self.arenas for ex in arena.executors.values()]

    def drop_if(self, predicate):
        """Forget every executor for which ``predicate(executor)`` holds."""
        for arena in self.arenas:
            arena.drop_if(predicate)

    def clear(self):
        """Forget every executor (a call whose backward may still come keeps
        its own)."""
        for arena in self.arenas:
            arena.clear()
        self.arenas = []


def release_memory():
    """Free what dropped executors held, and give it back to the system.
    MXNet frees an array's memory in an engine operation (hence the wait);
    on CPU contexts that memory is the C library's, whose allocator keeps
    freed blocks for reuse (glibc raises its threshold for returning large
    blocks each time one is freed): ``malloc_trim`` returns them, so that a
    re-based arena's peak is the new base's, not the sum of both."""
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
