"""Start-up hook of every process ``python -m gluon_parallel.launch`` starts.

The launcher prepends this directory to ``PYTHONPATH``, so Python's
``site`` runs this file at start-up in every Python process of the job
(and in the Python processes those start), whether or not the script
imports gluon_parallel. It

1. runs the ``sitecustomize`` this one hides (the next one on
   ``sys.path``: a distribution's or the user's), as Python would have;
2. installs :mod:`gluon_parallel.launch.failfast`, loaded from its file
   next to this directory: the worker may run another copy of
   gluon_parallel, or none;
3. in a job with a channel (``--stall-timeout``, elastic jobs: see
   :mod:`gluon_parallel.channel`, loaded from its file too), registers
   ``faulthandler`` on :data:`~gluon_parallel.channel.STACK_SIGNAL`, so
   the launcher can have every thread's stack printed on the process's
   stderr when the job stalls (faulthandler prints from its signal
   handler, also while native code holds the GIL), and says ``hello``
   with its pid, so the launcher knows whom to ask;
4. in a Horovod worker on several hosts, makes sure Gloo listens on an
   address the other hosts reach (:mod:`gluon_parallel.launch.gloo_address`,
   loaded from its file too);
5. takes this directory off ``sys.path`` again.

It imports only the standard library; a failure here is reported and
never stops the process from starting.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _ours(entry):
    try:
        return os.path.abspath(entry or os.getcwd()) == _HERE
    except OSError:
        return False


def _load(name, spec):
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _chain():
    """Run the sitecustomize this file hides, under its own name."""
    path = [p for p in sys.path if not _ours(p)]
    spec = importlib.machinery.PathFinder.find_spec('sitecustomize', path)
    if spec is not None:
        _load('sitecustomize', spec)


def _install_failfast():
    path = os.path.join(os.path.dirname(_HERE), 'failfast.py')
    spec = importlib.util.spec_from_file_location('_gluon_parallel_failfast', path)
    _load('_gluon_parallel_failfast', spec).install()


def _announce():
    if not os.environ.get('GLUON_PARALLEL_CHANNEL'):    # (channel.CHANNEL_ENV) no channel
        return
    path = os.path.join(os.path.dirname(os.path.dirname(_HERE)), 'channel.py')
    spec = importlib.util.spec_from_file_location('_gluon_parallel_channel', path)
    channel = _load('_gluon_parallel_channel', spec)
    client = channel.client()
    if client is None:
        return
    import faulthandler
    faulthandler.register(channel.STACK_SIGNAL, all_threads=True)
    client.send('hello')


def _gloo_address():
    if 'GLUON_PARALLEL_GLOO_ADDRESS' not in os.environ:
        return
    path = os.path.join(os.path.dirname(_HERE), 'gloo_address.py')
    spec = importlib.util.spec_from_file_location('_gluon_parallel_gloo_address', path)
    _load('_gluon_parallel_gloo_address', spec).apply()


def _main():
    sys.path[:] = [p for p in sys.path if not _ours(p)]
    for step in (_chain, _install_failfast, _announce, _gloo_address):
        try:
            step()
        except Exception as e:      # never keep the job's process from starting
            name = step.__name__.strip('_')
            sys.stderr.write(f'gluon_parallel start-up hook: {name} failed: '
                             f'{type(e).__name__}: {e}\n')


if __name__ == 'sitecustomize':
    _main()
