"""The launcher's end of its channel (:mod:`gluon_parallel.channel`): one
UDP socket, bound to the launcher's own address, read in the watchdog's
loop without ever waiting.

Every datagram is checked (:func:`~gluon_parallel.channel.unseal` with
the job's key) before anything reads it; a datagram that fails, or a
progress report older than one already seen from its process, is
dropped and counted (:attr:`Listener.dropped`). A handler per kind of
message: ``progress`` (the stall monitor, :mod:`.stall`), ``hello`` (a
process announcing its pid at start-up), ``leave?`` (an elastic job's
question after a checkpoint, answered by :class:`~.elastic.Endpoint`).
"""
import secrets
import socket

from ..channel import CHANNEL_ENV, KEY_ENV, MAX_BYTES, seal, unseal

__all__ = ['Listener']

# Datagrams read in one turn of the loop at most: a flood cannot hold it.
_PER_TURN = 256


class Listener:
    """The channel's socket, its key, and who handles what.

    Parameters
    ----------
    bind : str
        The launcher's address as its processes reach it (127.0.0.1 for a
        job on this machine): the only address the socket listens on.
    """

    def __init__(self, bind: str = '127.0.0.1') -> None:
        self.key = secrets.token_bytes(32)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((bind, 0))
        self.sock.setblocking(False)
        self.address = bind
        self.port = self.sock.getsockname()[1]
        self.handlers = {}          # kind -> handler(fields) -> reply fields or None
        self.dropped = 0
        self._seen = {}             # (who, pid) -> last progress seq

    def env(self) -> dict[str, str]:
        """The variables a process of the job needs to reach the channel."""
        return {CHANNEL_ENV: f'{self.address}:{self.port:d}', KEY_ENV: self.key.hex()}

    def register(self, selector):
        """Watch the socket in `selector` (once, however many ask)."""
        import selectors
        try:
            selector.register(self.sock, selectors.EVENT_READ, self.serve)
        except KeyError:            # already there (the elastic watcher and the stall watch)
            pass

    def unregister(self, selector):
        try:
            selector.unregister(self.sock)
        except (KeyError, ValueError):
            pass

    def serve(self) -> None:
        """Read and handle what has arrived (never waits)."""
        for _ in range(_PER_TURN):
            try:
                data, sender = self.sock.recvfrom(MAX_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self._handle(data, sender)

    def _handle(self, data, sender):
        fields = unseal(self.key, data)
        kind = fields.get('kind') if fields is not None else None
        handler = self.handlers.get(kind) if isinstance(kind, str) else None
        if handler is None or not self._fresh(fields):
            self.dropped += 1
            return
        try:
            reply = handler(fields)
        except (KeyError, TypeError, ValueError):     # well signed, badly formed
            self.dropped += 1
            return
        if reply is not None:
            try:
                self.sock.sendto(seal(self.key, dict(reply, seq=fields.get('seq'))), sender)
            except OSError:
                pass

    def _fresh(self, fields):
        """A progress report newer than the last one of its process (a
        question may come again: its answer is the same)."""
        if fields['kind'] != 'progress':
            return True
        seq, who = fields.get('seq'), (str(fields.get('who')), fields.get('pid'))
        if not isinstance(seq, int) or seq <= self._seen.get(who, 0):
            return False
        self._seen[who] = seq
        return True

    def close(self) -> None:
        self.sock.close()
