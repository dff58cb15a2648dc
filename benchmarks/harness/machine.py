"""What the benchmarks record about the machine they ran on: its load, its
hardware and package versions, and whether gluoncv (a contender) is here."""
import os
import platform

from .workers import Skip


def load_avg():
    """The 1, 5 and 15 minute load averages."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        return (float('nan'),) * 3


def load_str(load=None):
    return 'load average %.2f, %.2f, %.2f' % (load or load_avg())


def gluoncv_version():
    try:
        from importlib.metadata import version
        return version('gluoncv')
    except Exception:
        return None


def import_gluoncv_parallel():
    """gluoncv.utils.parallel, or Skip('gluoncv not installed').

    BENCH_HIDE_GLUONCV=1 pretends it is missing (to check that path)."""
    if os.environ.get('BENCH_HIDE_GLUONCV'):
        raise Skip('gluoncv not installed')
    try:
        from gluoncv.utils import parallel
    except Exception:
        raise Skip('gluoncv not installed') from None
    return parallel


def machine_info():
    from importlib.metadata import version
    info = {'python': platform.python_version(), 'platform': platform.platform(),
            'cpu_count': os.cpu_count(), 'processor': platform.processor() or platform.machine()}
    try:
        import psutil
        info['physical_cores'] = psutil.cpu_count(logical=False)
        info['memory_gb'] = round(psutil.virtual_memory().total / 2 ** 30, 1)
    except Exception:
        pass
    for pkg in ('mxnet', 'numpy', 'gluoncv'):
        try:
            info[pkg] = version(pkg)
        except Exception:
            info[pkg] = None
    info['env'] = {k: v for k, v in os.environ.items()
                   if k.startswith(('MXNET_', 'OMP_')) or k == 'GLUON_PARALLEL_TIMEOUT'}
    return info
