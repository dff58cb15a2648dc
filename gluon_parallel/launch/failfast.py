"""Fail fast: a Python process of a dist job that fails exits at once.

A worker of a ``dist_sync`` job that raises, or calls ``sys.exit(1)``,
would not exit: at interpreter exit MXNet destroys its dist kvstore, and
ps-lite's finalisation waits there for every other worker, which wait for
this one (measured with mxnet 1.9.1: the job ran until the launcher's
``--timeout``). :func:`install` makes a failing process exit at once,
with its status, so the launcher's watchdog sees the failure and stops the
job:

* an uncaught exception in the main thread: its traceback is printed (by
  the previous ``sys.excepthook``), then the process exits with status 1
  (130 for KeyboardInterrupt), skipping Python's shutdown;
* ``sys.exit(status)``, ``exit(status)`` or ``quit(status)`` with a
  non-zero status that ends the program (not one the program catches):
  the atexit handlers run (their output, logs...), then the process exits
  with that status, before the frames of the program and the modules are
  torn down (which would destroy the kvstore). A ``raise
  SystemExit(status)`` written out is not seen: use ``sys.exit``.

A status of 0 changes nothing: the workers meet at ps-lite's finalisation
and exit normally.

The launcher installs this in every Python process it starts, whether or
not the script imports gluon_parallel, through the ``sitecustomize`` of
:data:`STARTUP_DIR` (prepended to ``PYTHONPATH``); ``gluon_parallel.dist``
installs it too when it creates the kvstore. The module imports only the
standard library, and :func:`install` is idempotent also across two copies
of it (the launcher's start-up copy and the script's gluon_parallel): its
state lives on the hooks it installs.
"""
import atexit
import builtins
import os
import sys

__all__ = ['install', 'failing_status', 'exit_now_if_failing', 'STARTUP_DIR']

#: The directory whose ``sitecustomize.py`` installs this module at start-up.
STARTUP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'startup')

_MARK = '_gluon_parallel_failfast'
#: The line a process says before it leaves (the launcher's watchdog reads
#: it: the first process to say it with a non-zero status is the job's
#: failure, whichever exit the launcher happens to see first).
SAYS = 'gluon_parallel: %s: exiting at once with status %d'


def _state():
    """The installed state (a dict shared by every copy of this module), or None."""
    return getattr(sys.exit, _MARK, None)


def _status_of(code):
    """The exit status Python gives ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xff
    return 1        # a message: printed to stderr, status 1


def _leave(status, why):
    """Flush, say why, exit now: no module teardown, no ps-lite finalisation."""
    try:
        sys.stderr.write(SAYS % (why, status) + ' (a dist worker would otherwise wait for the '
                         'others at exit)\n')
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


class _Exit(SystemExit):
    """What the installed ``sys.exit`` raises; its status is recorded when it
    is made.

    Freed while Python code runs, it was caught and handled: the record is
    cleared. Uncaught, it is freed once the main module's frame is gone (no
    Python frame below ``__del__``) and *before* its traceback's frames, whose
    variables may hold a dist kvstore whose destruction would wait for the
    other workers: the atexit handlers run there and then, and the process
    exits. (No frame may hold it in a variable: the cycle through its
    traceback would delay its release to a collection; the atexit handler
    :func:`exit_now_if_failing` still catches that case.)"""

    def __init__(self, code=None):
        super().__init__(code)
        state = _state()
        if state is not None:
            state['exit'] = self._token = object()
            state['status'] = _status_of(code)

    def __del__(self):
        state = _state()
        if state is None or state.get('exit') is not getattr(self, '_token', None):
            return
        try:
            sys._getframe(1)
        except ValueError:          # no Python frame: the interpreter is exiting
            if state['status']:
                if self.code is not None and not isinstance(self.code, int):
                    # Python prints a message status after freeing this.
                    sys.stderr.write(f'{self.code}\n')
                # CPython's own exit path, run now: exit_now_if_failing,
                # registered first hence run last, exits.
                atexit._run_exitfuncs()
                _leave(state['status'], f"sys.exit({state['status']:d})")
            return
        state['exit'] = None


class _Quitter:
    """``exit()`` / ``quit()`` (site's), raising :class:`_Exit`."""

    def __init__(self, original):
        self._original = original

    def __repr__(self):
        return repr(self._original)

    def __call__(self, code=None):
        try:                    # as site's Quitter does
            sys.stdin.close()
        except Exception:
            pass
        raise _Exit(code)


def failing_status():
    """The non-zero status this process is exiting with through
    ``sys.exit``, or None."""
    state = _state()
    if state is None or state.get('exit') is None or not state.get('status'):
        return None
    return state['status']


def exit_now_if_failing():
    """Exit at once if the program is ending with a non-zero ``sys.exit``
    status. For atexit handlers that would wait for other processes (a dist
    kvstore's finalisation)."""
    status = failing_status()
    if status:
        _leave(status, f'sys.exit({status:d})')


def install():
    """Make this process fail fast (see the module's notes). Idempotent."""
    if _state() is not None:
        return
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        status = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
        try:
            previous(exc_type, exc, tb)
        finally:
            _leave(status, f'uncaught {exc_type.__name__}')

    def exit(status=None):
        """Exit the interpreter by raising SystemExit(status) (gluon_parallel's
        fail-fast ``sys.exit``: a non-zero status that ends the program exits
        at once after the atexit handlers)."""
        raise _Exit(status)

    setattr(exit, _MARK, {'exit': None, 'status': None})
    sys.excepthook = excepthook
    sys.exit = exit
    for name in ('exit', 'quit'):
        if hasattr(builtins, name):
            setattr(builtins, name, _Quitter(getattr(builtins, name)))
    # Registered first, so it runs after every atexit handler registered later.
    atexit.register(exit_now_if_failing)
