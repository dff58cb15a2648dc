"""The launcher's channel: how the processes of a launched job talk to
``python -m gluon_parallel.launch`` (progress reports, an elastic job's
question after a checkpoint).

One UDP socket in the launcher, bound to the launcher's own address (the
one its processes reach it by, 127.0.0.1 on one machine). A message is
one datagram: an HMAC-SHA256 tag, then a JSON object. The key is a
per-job secret the launcher hands its processes in their environment
(:data:`KEY_ENV`); the tag, not the key, goes on the wire, so a message
seen on the network neither reveals the key nor can be altered, and a
sequence number per sender (``seq``, which the launcher wants rising)
keeps an old one from being replayed. Datagrams keep the launcher's loop
free: one is read whole or not at all, so a client that sends nothing, or
half a message, holds nothing open, and one that fails the check is
dropped unread.

This module imports only the standard library: the launcher, its
start-up hook (loaded from this file) and every worker use it, and a
one-machine program that never reports loads nothing of the launcher.
"""
import hashlib
import hmac
import itertools
import json
import os
import signal
import socket
import time

__all__ = ['CHANNEL_ENV', 'KEY_ENV', 'MEMBER_ENV', 'STACK_SIGNAL', 'seal', 'unseal', 'Client',
           'client', 'member_name']

#: ``host:port`` of the launcher's channel.
CHANNEL_ENV = 'GLUON_PARALLEL_CHANNEL'
#: The job's secret (hex): every message carries its HMAC.
KEY_ENV = 'GLUON_PARALLEL_CHANNEL_KEY'
#: The process's name in the launcher's messages (``worker 1``, ``server 0@node2``).
MEMBER_ENV = 'GLUON_PARALLEL_MEMBER'

_TAG = 32                   # bytes of an HMAC-SHA256
#: The largest message either end sends or reads.
MAX_BYTES = 2048
#: The signal on which every Python process of a launched job prints the
#: stack of each of its threads on its stderr (the launcher's start-up hook
#: registers ``faulthandler`` on it when the job has a channel).
STACK_SIGNAL = signal.SIGUSR2


def seal(key: bytes, fields: dict) -> bytes:
    """The datagram of `fields` (JSON-able), tagged with `key`."""
    body = json.dumps(fields, separators=(',', ':')).encode()
    return hmac.new(key, body, hashlib.sha256).digest() + body


def unseal(key: bytes, data: bytes) -> dict | None:
    """The fields of a datagram tagged with `key`, or None when it is not
    one (wrong tag, too short, not a JSON object)."""
    if len(data) <= _TAG or len(data) > MAX_BYTES:
        return None
    tag, body = data[:_TAG], data[_TAG:]
    if not hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()):
        return None
    try:
        fields = json.loads(body)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None


def member_name(environ=None):
    """This process's name as the launcher prints it."""
    environ = os.environ if environ is None else environ
    name = environ.get(MEMBER_ENV)
    # A Horovod worker the ssh launcher started has its own name (with its
    # host); horovodrun's share one environment.
    if name and (not environ.get('HOROVOD_RANK') or name.startswith('worker ')):
        return name
    if environ.get('HOROVOD_RANK'):     # horovodrun's processes share one environment
        return f'worker {environ["HOROVOD_RANK"]}'
    return name or f'pid {os.getpid():d}'


class Client:
    """A process's end of the channel.

    Parameters
    ----------
    address : (str, int)
    key : bytes
    name : str
        This process's name (:func:`member_name`).
    """

    def __init__(self, address, key, name):
        self.address, self.key, self.name = address, key, name
        self.pid = os.getpid()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self._seq = itertools.count(1)

    def _fields(self, kind, fields):
        return dict(fields, kind=kind, who=self.name, pid=self.pid, seq=next(self._seq))

    def send(self, kind: str, **fields) -> None:
        """Send a message; never blocks, never raises (a lost report is
        followed by the next one)."""
        try:
            self.sock.sendto(seal(self.key, self._fields(kind, fields)), self.address)
        except OSError:
            pass

    def ask(self, kind: str, timeout: float, **fields) -> dict | None:
        """Send a question and return the launcher's answer (a message with
        the same ``seq``), asking again each second; None after `timeout`."""
        message = self._fields(kind, fields)
        data = seal(self.key, message)
        deadline = time.monotonic() + timeout
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            while True:
                s.sendto(data, self.address)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                s.settimeout(min(1.0, left))
                try:
                    while True:
                        reply = unseal(self.key, s.recv(MAX_BYTES))
                        if reply is not None and reply.get('seq') == message['seq']:
                            return reply
                except TimeoutError:
                    continue


def client(environ=None) -> Client | None:
    """The channel of the launcher that started this process, or None (not
    launched by ``python -m gluon_parallel.launch``, or a malformed
    environment)."""
    environ = os.environ if environ is None else environ
    where, key = environ.get(CHANNEL_ENV), environ.get(KEY_ENV)
    if not where or not key:
        return None
    host, _, port = where.rpartition(':')
    try:
        return Client((host, int(port)), bytes.fromhex(key), member_name(environ))
    except (ValueError, OSError):
        return None
