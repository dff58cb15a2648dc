"""The walk of one call through gluon_parallel: which modules it enters, and
how often (a test helper, not a test).

A *stop* is a Python call event whose callee frame belongs to a
``gluon_parallel`` module (by ``frame.f_globals['__name__']``) and whose
caller frame belongs to another module: user code, mxnet, the standard
library or another ``gluon_parallel`` module. Calls inside one module are
not stops.

Not stops, as noise rather than descent:

- a generator's or coroutine's resumption (``next`` or ``send`` after its
  first run, a ``contextmanager``'s ``__exit__``): the first run is the
  call, the later ones go back to a frame already entered;
- the package's lazy loader ``gluon_parallel.__getattr__`` (PEP 562): an
  attribute lookup on ``gp``, once per public name;
- a module's body (``<module>``): an import, not a call.

Profile events come from the caller thread (``sys.setprofile``) and from the
threads started during the walk (``threading.setprofile``); threads already
running are seen only if :func:`follow_threads` ran before they started.

:func:`step_walks` walks each part of one steady-state training step
(tests/graph_scripts/walk_report.py prints them; tests/test_walk.py checks
ARCHITECTURE.md's claim about them).
"""
import dis
import sys
import threading
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

import gluon_parallel as gp
import loops

PACKAGE = 'gluon_parallel'
BOUNDARY = 'gluon_parallel._gluon'        # the MXNet boundary, called from many places
_RESUME = dis.opmap['RESUME']             # RESUME 0: a frame's start (3.11)
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200   # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
_active = None                            # the walk recording now: (stops list, base frame)
CTX = (mx.cpu(0), mx.cpu(1))


class Stop(NamedTuple):
    """One entry into a gluon_parallel module.

    Attributes
    ----------
    module : str
        The callee's module.
    function : str
        The callee's qualified name.
    caller : str
        The caller's module.
    depth : int
        Frames between the callee and :func:`walk` (in another thread: the
        thread's first frame).
    thread : str
        ``'caller'``, or the name of the thread the call ran in.
    """
    module: str
    function: str
    caller: str
    depth: int
    thread: str

    def __str__(self):
        where = '' if self.thread == 'caller' else f'  [{self.thread}]'
        return f'{self.caller} -> {self.module}.{self.function}{where}'


def in_boundary(module):
    """Whether `module` is in the ``_gluon`` package."""
    return module == BOUNDARY or module.startswith(BOUNDARY + '.')


@dataclass(frozen=True)
class Walk:
    """The stops of one call, and what they add up to.

    Attributes
    ----------
    all_stops : tuple of Stop
        Every stop, in call order, ``_gluon``'s included.
    result : object
        What the walked function returned.
    skip_gluon : bool
        Whether the derived counts leave out stops into ``_gluon``.

    Notes
    -----
    The counts are over every thread: a replica run in a pool's thread
    re-enters the modules the caller's replica entered.
    """
    all_stops: tuple
    result: Any = None
    skip_gluon: bool = False

    def without_gluon(self):
        """The same walk, its counts without the stops into ``_gluon``."""
        return replace(self, skip_gluon=True)

    @property
    def counted(self):
        """The stops the counts are made of."""
        return [s for s in self.all_stops if not (self.skip_gluon and in_boundary(s.module))]

    @property
    def entries(self):
        """Counter: the stops into each module."""
        return Counter(s.module for s in self.counted)

    @property
    def stops(self):
        """int: the number of stops."""
        return len(self.counted)

    @property
    def modules(self):
        """int: the distinct modules entered."""
        return len(self.entries)

    @property
    def reentries(self):
        """int: the stops into a module the walk had entered already."""
        return self.stops - self.modules

    def entered_again(self):
        """Each module entered more than once, with the stops that entered it.

        Returns
        -------
        dict
            Module name -> list of Stop, in call order.
        """
        return {m: [s for s in self.counted if s.module == m]
                for m, n in self.entries.items() if n > 1}

    def summary(self):
        """One line: stops, modules, re-entries."""
        return f'{self.stops} stops, {self.modules} modules, {self.reentries} re-entries'


def _module(frame):
    return frame.f_globals.get('__name__', '?') if frame is not None else '<thread>'


def _is_resumption(frame):
    # A generator's first run starts at its RESUME 0; a resumption at a
    # later RESUME (its argument > 0), a throw() at its YIELD_VALUE.
    code, i = frame.f_code, frame.f_lasti
    return bool(code.co_flags & _GENERATOR_FLAGS) and \
        (code.co_code[i], code.co_code[i + 1]) != (_RESUME, 0)


def _profile(frame, event, arg):
    active = _active
    if active is None or event != 'call':
        return
    module = _module(frame)
    if not (module == PACKAGE or module.startswith(PACKAGE + '.')):
        return
    caller = _module(frame.f_back)
    name = frame.f_code.co_qualname
    if caller == module or name == '<module>' or _is_resumption(frame) or \
            (module == PACKAGE and name == '__getattr__'):
        return
    stops, base = active
    depth, f = 0, frame
    while f is not None and f is not base:
        depth, f = depth + 1, f.f_back
    thread = 'caller' if f is base else threading.current_thread().name
    stops.append(Stop(module, name, caller, depth, thread))


def follow_threads():
    """Profile every thread started from now on, so that a later walk sees
    the calls of a pool's persistent threads too (cheap between walks)."""
    threading.setprofile(_profile)


def walk(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and record its stops.

    Parameters
    ----------
    fn : callable
        The call to walk; it runs in this thread.
    *args, **kwargs
        Its arguments.

    Returns
    -------
    Walk
        The stops, ``fn``'s result as ``result``.
    """
    global _active
    stops = []
    old_sys, old_threads = sys.getprofile(), threading.getprofile()
    _active = (stops, sys._getframe())
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(old_sys)
        threading.setprofile(old_threads)
        _active = None
    return Walk(tuple(stops), result)


def step_walks(bn=nn.BatchNorm, graph='auto', ctx=CTX, batch=8, warmup=3):
    """Walk each part of one steady-state training step of loops.conv_net.

    Parameters
    ----------
    bn : type
        The network's BatchNorm layer (``gp.nn.SyncBatchNorm``...).
    graph : bool or 'auto'
        DataParallel's ``graph``.
    ctx : sequence of Context
        The devices.
    batch : int
        The batch size.
    warmup : int
        Steps run before the walked one.

    Returns
    -------
    walks : dict
        'network' (``dp(x)`` under record), 'loss' (``dpl(out, y)`` under
        record), 'backward', 'step' (``trainer.step``): a Walk each.
    path : str
        ``dp.last_path`` after the walked network call.
    """
    ctx = list(ctx)
    # The walk of a process that never ran a gluoncv.Parallel round, whose
    # first round routes every backward call (installed again by the next).
    from gluon_parallel import _gluon
    _gluon.unroute_backward()
    mx.random.seed(0)
    net = loops.conv_net(bn)
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize()
    x = nd.random.uniform(shape=(batch, 2, 8, 8))
    y = nd.array([i % 3 for i in range(batch)])
    trainer = gp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    dpl = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    with gp.DataParallel(net, ctx, graph=graph) as dp:
        for _ in range(warmup):
            with autograd.record():
                losses = dpl(dp(x), y)
            autograd.backward(losses)
            trainer.step(batch)
        walks = {}
        with autograd.record():
            walks['network'] = walk(dp, x)
            path = dp.last_path
            walks['loss'] = walk(dpl, walks['network'].result, y)
        walks['backward'] = walk(autograd.backward, walks['loss'].result)
        walks['step'] = walk(trainer.step, batch)
        nd.waitall()
    return walks, path
