"""Files that are whole or absent: written under a temporary name, flushed,
then renamed into place (``os.replace`` is atomic), the previous version
kept as ``*.prev`` until a set of files is all in place."""
import hashlib
import os
import shutil
import uuid

__all__ = []

PREV = '.prev'


def tmp_path(path):
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f'.{tail}.tmp-{os.getpid():d}-{uuid.uuid4().hex[:8]}')


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path):
    try:
        _fsync(os.path.dirname(os.path.abspath(path)) or '.')
    except OSError:     # not every platform can open a directory
        pass


def digest(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            h.update(chunk)
    return {'bytes': os.path.getsize(path), 'sha256': h.hexdigest()}


class Staged:
    """Files written under temporary names, renamed into place together by
    commit(); close() removes whatever was not committed."""

    def __init__(self):
        self._files = []

    def write(self, path, writer):
        tmp = tmp_path(path)
        self._files.append((tmp, path))
        writer(tmp)
        if not os.path.isfile(tmp):
            raise OSError(f'nothing was written to {tmp}')
        _fsync(tmp)
        return tmp

    def commit(self):
        # The renames are atomic one by one, not together: keep the previous
        # files as *.prev until the last rename (the json) is done, so a
        # crash between two renames still leaves the previous checkpoint
        # whole (load_checkpoint falls back to the *.prev its json vouches for).
        kept = []
        for _, path in self._files:
            if os.path.isfile(path):
                _keep_previous(path)
                kept.append(path + PREV)
        _fsync_dir(self._files[-1][1])
        while self._files:
            tmp, path = self._files[0]
            os.replace(tmp, path)
            self._files.pop(0)
        _fsync_dir(path)
        for prev in kept:
            try:
                os.remove(prev)
            except OSError:
                pass

    def close(self):
        for tmp, _ in self._files:
            try:
                os.remove(tmp)
            except OSError:
                pass
        self._files = []


def _keep_previous(path):
    prev = path + PREV
    if os.path.exists(prev):
        os.remove(prev)
    try:
        os.link(path, prev)         # no copy: the rename only moves the name
    except OSError:
        shutil.copy2(path, prev)


def write_bytes(data):
    def writer(path):
        with open(path, 'wb') as f:
            f.write(data)
    return writer
