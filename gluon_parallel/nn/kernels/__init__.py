"""Optional C++ kernels for SyncBatchNorm's per-channel sums and affine map.

``channel_sums.cc`` defines two operators through the MXNet wheel's
extension API (``include/mxnet/lib_api.h`` and ``src/lib_api.cc`` ship with
mxnet 1.9.1): ``gp_channel_sums``, float64 sums of x - q and of its square
in one pass, and their gradient in one pass; ``gp_centred_affine``,
(x - q) * scale + shift and its gradients in one pass each way (graph mode
on CPU contexts). Without them SyncBatchNorm computes the same with MXNet's
own operators (a cast, a square, two matrix-vector products, the centring,
BatchNorm's kernel, their backward); nothing needs them.

Build it once (a C++11 compiler is all it takes, about 10 s)::

    python -m gluon_parallel.nn.kernels build

The library goes next to this file (``_build/``), or to
``~/.cache/gluon_parallel`` when the package directory is read-only, named
after the MXNet version and the source's hash, so a stale build is never
loaded. :func:`load` (run when the first SyncBatchNorm is constructed)
loads it if it exists; ``GLUON_PARALLEL_KERNELS=0`` keeps it off. Only
graphs use the operators (by name, :func:`available`, a :class:`Kernels`
the layers hand syncgraph's arithmetic: ``SyncBatchNorm.kernel_ops``): no ``mx.nd`` function is made
for them.
"""
import hashlib
import os
import subprocess
import sys
import tempfile
import warnings

import mxnet as mx

from typing import NamedTuple

from ... import _gluon

__all__ = ['AFFINE', 'ENV', 'OP', 'Kernels', 'available', 'build', 'library_path', 'load',
           'loaded']

ENV = 'GLUON_PARALLEL_KERNELS'
OP = 'gp_channel_sums'
AFFINE = 'gp_centred_affine'
HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, 'channel_sums.cc')


class Kernels(NamedTuple):
    """The optional C++ operators' names, given as `ops` to syncgraph's
    arithmetic (syncgraph/stats.py); None where they are not loaded."""
    sums: str           # [S1 | S2 | q] of x in one pass, float64
    affine: str         # (x - q) * scale + shift in one pass


def _tag():
    with open(SOURCE, 'rb') as f:
        digest = hashlib.sha1(f.read()).hexdigest()[:12]
    return f'libgp_channel_sums-mx{mx.__version__}-{digest}.so'


def _folders():
    return [os.path.join(HERE, '_build'),
            os.path.join(os.path.expanduser('~'), '.cache', 'gluon_parallel')]


def library_path():
    """Path of an existing build of the kernel for this MXNet, or None."""
    for folder in _folders():
        path = os.path.join(folder, _tag())
        if os.path.exists(path):
            return path
    return None


def build(folder=None, compiler=None):
    """Compile the kernel; returns the library's path. Raises RuntimeError
    (with the compiler's output) when it cannot be built."""
    root = os.path.dirname(mx.__file__)
    include, lib_api = os.path.join(root, 'include'), os.path.join(root, 'src', 'lib_api.cc')
    if not os.path.exists(lib_api):
        raise RuntimeError('this MXNet has no src/lib_api.cc: the kernel cannot be built')
    compiler = compiler or os.environ.get('CXX', 'g++')
    errors = []
    for target in [folder] if folder else _folders():
        try:
            os.makedirs(target, exist_ok=True)
            # Compile to a temporary name and rename: a concurrent build or a
            # crash never leaves a half-written library under the real name.
            fd, tmp = tempfile.mkstemp(suffix='.so', dir=target)
            os.close(fd)
        except OSError as e:
            errors.append(f'{target}: {e}')
            continue
        cmd = [compiler, '-shared', '-fPIC', '-O3', '-std=c++11', '-I', include, SOURCE,
               lib_api, '-o', tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"building the kernel failed:\n{' '.join(cmd)}\n"
                               f'{proc.stdout + proc.stderr}')
        path = os.path.join(target, _tag())
        os.replace(tmp, path)
        return path
    raise RuntimeError('no writable folder for the kernel: {}'.format('; '.join(errors)))


def load(path=None):
    """Load the kernel (from `path`, or an existing build) and let
    SyncBatchNorm use it in the graphs it builds from now on. Returns True
    if it is in use. ``GLUON_PARALLEL_KERNELS=0`` disables it."""
    if _disabled():
        return False
    path = path or library_path()
    if path is None:
        return False
    # Registered once per process (MXNet refuses a second registration, e.g.
    # after this module was imported afresh); every build has the same source.
    if OP not in mx.operator.get_all_registered_operators():
        if 'horovod.mxnet' in sys.modules:
            # MXNet 1.9.1 dies of SIGFPE loading an operator library once
            # horovod.mxnet's is loaded (measured); the other order works.
            warnings.warn('the SyncBatchNorm sums kernel is not loaded: horovod.mxnet was '
                          'imported first, and MXNet 1.9.1 then crashes loading operator '
                          'libraries. Construct a SyncBatchNorm (or let gluon_parallel\'s '
                          'Horovod engine import horovod.mxnet) first to use it; MXNet\'s '
                          'operators are used instead.', RuntimeWarning, stacklevel=2)
            return False
        _gluon.load_operator_library(os.path.abspath(path))
    return True


def _disabled():
    return os.environ.get(ENV, '').strip() == '0'


def available():
    """The kernels' operators (:class:`Kernels`) when MXNet has them
    registered and ``GLUON_PARALLEL_KERNELS=0`` does not keep them off,
    else None. Asked when a graph is built (a look-up of MXNet's operator
    registry: not per call)."""
    if _disabled() or OP not in mx.operator.get_all_registered_operators():
        return None
    return Kernels(OP, AFFINE)


def loaded():
    """True if SyncBatchNorm uses the kernels in the graphs it builds now."""
    return available() is not None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ['build']:
        print('usage: python -m gluon_parallel.nn.kernels build [FOLDER]', file=sys.stderr)
        return 2
    print(build(argv[1] if len(argv) > 1 else None))
    return 0
