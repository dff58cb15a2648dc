"""The launcher's channel: gluon_parallel/channel.py (the wire and the
client) and gluon_parallel/launch/listener.py (the launcher's end). A
message without the job's key, garbage, a replayed report or a client
that sends nothing changes nothing and never holds the launcher's loop;
an elastic question is answered over the same checked path."""
import selectors
import socket
import time

from gluon_parallel import channel
from gluon_parallel.launch.elastic import Endpoint
from gluon_parallel.launch.listener import Listener


def _client(listener, name='worker 0'):
    return channel.client({channel.CHANNEL_ENV: f'127.0.0.1:{listener.port:d}',
                           channel.KEY_ENV: listener.key.hex(), channel.MEMBER_ENV: name})


def _serve_for(listener, seconds):
    sel = selectors.DefaultSelector()
    listener.register(sel)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key, _ in sel.select(0.02):
            key.data()
    listener.unregister(sel)
    sel.close()


def test_a_sealed_message_round_trips_and_a_forged_one_does_not():
    key = b'k' * 32
    data = channel.seal(key, {'kind': 'progress', 'seq': 1})
    assert channel.unseal(key, data) == {'kind': 'progress', 'seq': 1}
    assert channel.unseal(b'x' * 32, data) is None
    assert channel.unseal(key, data[:-1] + b' ') is None
    assert channel.unseal(key, b'') is None


def test_only_well_signed_fresh_messages_reach_the_handlers():
    listener = Listener()
    got = []
    listener.handlers['progress'] = got.append
    try:
        c = _client(listener)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as bogus:
            for data in (b'garbage', b'\0' * 32 + b'{"kind":"progress","seq":9}',
                         channel.seal(b'another job' * 3, {'kind': 'progress', 'seq': 1})):
                bogus.sendto(data, ('127.0.0.1', listener.port))
            c.send('progress', steps=1)
            replay = channel.seal(listener.key, dict(kind='progress', who='worker 0', pid=c.pid,
                                                     seq=1, steps=99))
            bogus.sendto(replay, ('127.0.0.1', listener.port))     # seq 1 again
            c.send('nonsense')
        _serve_for(listener, 0.3)
        assert [m['steps'] for m in got] == [1]
        assert listener.dropped == 5
    finally:
        listener.close()


def test_the_socket_listens_on_the_given_address_only():
    listener = Listener('127.0.0.1')
    try:
        assert listener.sock.getsockname()[0] == '127.0.0.1'
    finally:
        listener.close()


def test_a_silent_client_and_an_empty_socket_never_hold_the_loop():
    listener = Listener()
    try:
        # A TCP client finds nothing to hold (the channel is datagrams);
        # an empty socket returns at once.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            assert s.connect_ex(('127.0.0.1', listener.port)) != 0
        t = time.monotonic()
        listener.serve()
        assert time.monotonic() - t < 0.05
    finally:
        listener.close()


def test_an_elastic_question_is_answered_over_the_channel():
    import threading
    listener = Listener()
    endpoint = Endpoint(listener)
    endpoint.reset(3)
    endpoint.grow = True
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            listener.serve()
            time.sleep(0.01)
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        c = _client(listener)
        assert c.ask('leave?', 5, attempt='3', n=0) == {'answer': 'stop', 'seq': 1}
        assert c.ask('leave?', 5, attempt='2', n=0)['answer'] == 'go'   # another attempt's
        assert endpoint.told
        forged = channel.Client(('127.0.0.1', listener.port), b'wrong' * 8, 'worker 0')
        assert forged.ask('leave?', 1.5, attempt='3', n=1) is None
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_no_channel_outside_a_launched_job():
    assert channel.client({}) is None
    assert channel.client({channel.CHANNEL_ENV: 'nowhere', channel.KEY_ENV: 'zz'}) is None
