"""A Horovod worker's Gloo address, whatever its host's name resolves to.

Horovod 0.28.1 opens the Gloo connections of its process sets (the global
one included) on a device made without ``HOROVOD_GLOO_IFACE``
(``GlooContext::InitializeForProcessSet`` does not pass it on), so Gloo
takes the address this machine's name resolves to (``gethostname()``,
then ``getaddrinfo``) and listens there. Where the name resolves to a
loopback address, as Debian's ``127.0.1.1 hostname`` line makes it, the
other hosts cannot connect: ``gloo::IoException ... connect
[127.0.0.1]:PORT``. No variable of Horovod or Gloo changes that address.

So a worker of a Horovod job on several hosts (``--launcher ssh``, which
sets :data:`ADDRESS_ENV` to the host's address as the launcher resolved
it) checks its host's name at start-up (the launcher's ``sitecustomize``
calls :func:`apply`): when the name resolves to a loopback address, the
process gets a UTS namespace of its own (``unshare(CLONE_NEWUTS)``, which
needs root or CAP_SYS_ADMIN) whose host name is that address, so Gloo
listens where the other hosts reach it. Only this process and the ones it
starts see the changed name. Where that is not allowed, it says what to
fix on that host.

Imports only the standard library: it runs before the script, in every
Python process of the job.
"""
import ctypes
import os
import socket
import sys

__all__ = ['ADDRESS_ENV', 'apply', 'resolves_to_loopback']

#: Set by the launcher for each worker of a Horovod job on several hosts:
#: the address of its host that the other hosts reach.
ADDRESS_ENV = 'GLUON_PARALLEL_GLOO_ADDRESS'

_CLONE_NEWUTS = 0x04000000


def resolves_to_loopback(name):
    """Whether `name` resolves first to a loopback address, as Gloo takes
    it (any family, the first answer)."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    address = infos[0][4][0] if infos else ''
    return address.startswith('127.') or address == '::1'


def _own_uts_namespace():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def apply(environ=None, stderr=None):
    """In a worker given :data:`ADDRESS_ENV` whose host name resolves to a
    loopback address, make that address its host name (see the module's
    notes). Returns what it did: ``'renamed'``, ``'cannot'`` (and says
    why on `stderr`) or None (nothing to do)."""
    environ = os.environ if environ is None else environ
    stderr = stderr or sys.stderr
    address = environ.get(ADDRESS_ENV)
    name = socket.gethostname()
    if not address or resolves_to_loopback(address) or not resolves_to_loopback(name):
        return None
    try:
        _own_uts_namespace()
        socket.sethostname(address)
    except OSError as e:
        stderr.write(f'gluon_parallel: this host\'s name {name!r} resolves to a loopback '
                     'address, where Horovod\'s Gloo would listen and the other hosts cannot '
                     f'connect; giving this worker the host name {address} failed ({e}: it '
                     f'needs root). Make {name!r} resolve to {address} on this host (its '
                     '/etc/hosts line).\n')
        stderr.flush()
        return 'cannot'
    return 'renamed'
