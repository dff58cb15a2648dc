"""Every worker's part of the data: equal lengths, so every worker runs the
same number of steps (a worker with one batch more would wait forever);
:class:`GlobalBatchSampler`: every worker's part of each global batch, the
same batches and epochs at any number of workers."""
import numpy as np
from mxnet import gluon

from .kvstore import num_workers, rank

__all__ = ['shard', 'ShardSampler', 'shard_sampler', 'GlobalBatchSampler']


class _Shard(gluon.data.Dataset):
    def __init__(self, dataset, indices):
        self._dataset = dataset
        self._indices = indices

    def __len__(self):
        return len(self._indices)

    def __getitem__(self, idx):
        return self._dataset[self._indices[idx]]


def _part(num_parts, part_index):
    if num_parts is None:
        num_parts = num_workers()
    if part_index is None:
        part_index = rank() if num_parts > 1 else 0
    num_parts, part_index = int(num_parts), int(part_index)
    if num_parts < 1 or not 0 <= part_index < num_parts:
        raise ValueError('part_index %d out of range for %d parts' % (part_index, num_parts))
    return num_parts, part_index


def shard(dataset: gluon.data.Dataset, num_parts: int | None = None,
          part_index: int | None = None) -> gluon.data.Dataset:
    """This worker's part of `dataset`: items ``part_index``,
    ``part_index + num_parts``, ...

    Every part has ``len(dataset) // num_parts`` items (the last
    ``len(dataset) % num_parts`` items are left out), so every worker runs
    the same number of steps: a worker with one batch more would wait for
    the others forever at its gradient push. Interleaving makes the k-th
    batches of all the workers together the k-th batch of
    ``num_parts * batch_size`` that one process would read.

    Parameters
    ----------
    dataset : Dataset (anything with ``len`` and ``[]``)
    num_parts : int, optional
        Default: :func:`num_workers`.
    part_index : int, optional
        Default: :func:`rank`.

    Returns
    -------
    gluon.data.Dataset
    """
    num_parts, part_index = _part(num_parts, part_index)
    length = len(dataset) // num_parts
    if length == 0:
        raise ValueError('a dataset of %d items cannot give %d workers one item each'
                         % (len(dataset), num_parts))
    return _Shard(dataset, range(part_index, length * num_parts, num_parts))


class ShardSampler(gluon.data.Sampler):
    """Sample this worker's part of a dataset, shuffled the same way on
    every worker.

    Each pass draws one permutation of all ``length`` indices from
    ``seed + epoch`` (the same on every worker) and yields its items
    ``part_index::num_parts``, ``length // num_parts`` of them, so the
    workers' parts are disjoint, of equal lengths, and their k-th batches
    together are the k-th batch of one process shuffling with that
    permutation. The epoch advances by one after every pass;
    :meth:`set_epoch` sets it.

    Parameters
    ----------
    length : int
        Length of the dataset.
    num_parts, part_index : int, optional
        Default: :func:`num_workers`, :func:`rank`.
    shuffle : bool, default False
    seed : int, default 0

    Examples
    --------
    >>> sampler = dist.ShardSampler(len(dataset), shuffle=True)
    >>> loader = gluon.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    """

    def __init__(self, length: int, num_parts: int | None = None, part_index: int | None = None,
                 shuffle: bool = False, seed: int = 0) -> None:
        self._length = int(length)
        self._num_parts, self._part_index = _part(num_parts, part_index)
        if self._length // self._num_parts == 0:
            raise ValueError('a dataset of %d items cannot give %d workers one item each'
                             % (self._length, self._num_parts))
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of `epoch` for the next pass."""
        self.epoch = int(epoch)

    def __len__(self):
        return self._length // self._num_parts

    def __iter__(self):
        if self._shuffle:
            order = np.random.RandomState(self._seed + self.epoch).permutation(self._length)
        else:
            order = np.arange(self._length)
        self.epoch += 1
        used = len(self) * self._num_parts
        return iter(order[self._part_index:used:self._num_parts].tolist())


class _ShardedSampler(gluon.data.Sampler):
    def __init__(self, sampler, num_parts, part_index):
        self._sampler = sampler
        self._num_parts, self._part_index = num_parts, part_index

    def __len__(self):
        return len(self._sampler) // self._num_parts

    def __iter__(self):
        used = len(self) * self._num_parts
        for i, item in enumerate(self._sampler):
            if i >= used:
                break
            if i % self._num_parts == self._part_index:
                yield item

    def __getattr__(self, name):        # set_epoch and the like reach the sampler
        return getattr(self.__dict__['_sampler'], name)


def shard_sampler(sampler: gluon.data.Sampler, num_parts: int | None = None,
                  part_index: int | None = None) -> gluon.data.Sampler:
    """This worker's part of every pass of `sampler`: the items it yields at
    positions ``part_index``, ``part_index + num_parts``, ...

    What it leaves out, and so the global batches, depend on the number of
    workers: a job that may restart at another size (an elastic job) uses
    :class:`GlobalBatchSampler` instead.

    For a sampler that must yield more than indices (e.g. ``(index, seed)``
    keys for reproducible augmentation): it must yield the same sequence on
    every worker (seed it identically). As with :func:`shard`, every part
    has ``len(sampler) // num_parts`` items. Attributes such as
    ``set_epoch`` are those of `sampler`. With one part, `sampler` itself is
    returned.

    Parameters
    ----------
    sampler : gluon.data.Sampler (anything with ``len`` and ``iter``)
    num_parts, part_index : int, optional
        Default: :func:`num_workers`, :func:`rank`.

    Returns
    -------
    gluon.data.Sampler
    """
    num_parts, part_index = _part(num_parts, part_index)
    if num_parts == 1:
        return sampler
    if len(sampler) // num_parts == 0:
        raise ValueError('a sampler of %d items cannot give %d workers one item each'
                         % (len(sampler), num_parts))
    return _ShardedSampler(sampler, num_parts, part_index)


def part_slice(size, num_parts, part_index):
    """The rows ``[start, stop)`` of part `part_index` when `size` rows are
    split into `num_parts`: the first ``size % num_parts`` parts one row
    larger (the rule :func:`gluon_parallel.split_sizes` splits a batch over
    devices by, so the workers' parts, then each worker's devices' rows,
    are the global batch in order)."""
    base, extra = divmod(size, num_parts)
    start = part_index * base + min(part_index, extra)
    return start, start + base + (part_index < extra)


class GlobalBatchSampler(gluon.data.Sampler):
    """This worker's part of every global batch: the global batches, the
    epochs and the position in them do not depend on the number of workers.

    A batch sampler (``DataLoader(dataset, batch_sampler=...)``). Each pass
    takes the items of one pass of `sampler` (the same sequence on every
    worker), from the position set by :meth:`set_epoch`, in global batches
    of `batch_size` items; each step yields this worker's part of its global
    batch: ``part_slice`` of it, parts differing by at most one item. The
    last global batch of an epoch holds the remaining items (``'keep'``) or
    is left out (``'discard'``): which items a step trains on depends on
    the epoch, the batch size and the position only, so a job that restarts
    at another number of workers (an elastic job) goes on with the very
    batches it would have trained on, and every epoch uses each item once.

    The position is counted in global items: :meth:`position` after some
    steps of a pass, saved in a checkpoint, and :meth:`set_epoch` with it
    on resuming, at any number of workers.

    Parameters
    ----------
    sampler : int or gluon.data.Sampler
        A dataset length (its indices, in order or shuffled per epoch) or a
        sampler yielding the same items on every worker for each epoch
        (``set_epoch`` is passed on when it has one).
    batch_size : int
        The global batch size, at least the number of workers.
    last_batch : {'keep', 'discard'}
    shuffle : bool, default False
        With an int `sampler`: a permutation per epoch from ``seed + epoch``.
    seed : int, default 0
    num_parts, part_index : int, optional
        Default: :func:`num_workers`, :func:`rank`.

    Examples
    --------
    >>> sampler = dist.GlobalBatchSampler(len(dataset), 256, shuffle=True)
    >>> loader = gluon.data.DataLoader(dataset, batch_sampler=sampler)
    >>> sampler.set_epoch(epoch, samples_done)          # 0 when not resuming
    >>> for step, (data, label) in enumerate(loader):
    ...     ...
    ...     trainer.step(sampler.global_batch_size(step))
    """

    def __init__(self, sampler: 'int | gluon.data.Sampler', batch_size: int,
                 last_batch: str = 'keep', shuffle: bool = False, seed: int = 0,
                 num_parts: int | None = None, part_index: int | None = None) -> None:
        if isinstance(sampler, int):
            sampler = ShardSampler(sampler, 1, 0, shuffle=shuffle, seed=seed)
        elif shuffle:
            raise ValueError('shuffle=True needs a dataset length; a sampler shuffles itself')
        if last_batch not in ('keep', 'discard'):
            raise ValueError(f"last_batch must be 'keep' or 'discard', got {last_batch!r}")
        self._sampler, self._batch, self._last = sampler, int(batch_size), last_batch
        self._num_parts, self._part_index = _part(num_parts, part_index)
        self._length = len(sampler)
        if self._batch < self._num_parts:
            raise ValueError(f'a global batch of {self._batch:d} cannot give {self._num_parts:d} '
                             'workers one item each')
        self.epoch, self.samples = 0, 0
        self._pass = (0, 0)
        self._check_last(0)

    @property
    def epoch_samples(self) -> int:
        """The items an epoch trains on (all of them with ``'keep'``)."""
        if self._last == 'keep':
            return self._length
        return self._length // self._batch * self._batch

    def set_epoch(self, epoch: int, samples: int = 0) -> None:
        """The next pass is epoch `epoch`, from its item `samples` (the
        global items done before a checkpoint)."""
        samples = int(samples)
        if not 0 <= samples <= self.epoch_samples:
            raise ValueError(f'position {samples:d} is outside an epoch of '
                             f'{self.epoch_samples:d} items')
        self.epoch, self.samples = int(epoch), samples

    def _sizes(self, start):
        left = self.epoch_samples - start
        sizes = [self._batch] * (left // self._batch)
        if left % self._batch:
            sizes.append(left % self._batch)
        return sizes

    def _check_last(self, start):
        sizes = self._sizes(start)
        if sizes and sizes[-1] < self._num_parts:
            raise ValueError(
                f'the last global batch of the epoch holds {sizes[-1]:d} items, fewer than the '
                f'{self._num_parts:d} workers: use last_batch=\'discard\' or another batch size')

    def __len__(self):
        return len(self._sizes(self.samples))

    def global_batch_size(self, step: int) -> int:
        """The size of the global batch of step `step` (0, 1, ... from the
        start of the current pass): what ``trainer.step`` takes."""
        return self._sizes(self._pass[1])[step]

    def position(self, steps: int) -> dict:
        """``{'epoch': E, 'samples': S}`` after `steps` steps of the
        current pass: the next item to train on, in global items;
        ``samples`` is 0 of the next epoch once an epoch is done."""
        epoch, start = self._pass
        done = start + sum(self._sizes(start)[:steps])
        if done >= self.epoch_samples:
            return {'epoch': epoch + 1, 'samples': 0}
        return {'epoch': epoch, 'samples': done}

    def __iter__(self):
        epoch, start = self.epoch, self.samples
        self._check_last(start)
        self._pass = (epoch, start)
        self.epoch, self.samples = epoch + 1, 0
        if hasattr(self._sampler, 'set_epoch'):
            self._sampler.set_epoch(epoch)
        return self._parts(iter(self._sampler), start, self._sizes(start))

    def _parts(self, items, start, sizes):
        for _ in range(start):
            next(items)
        for size in sizes:
            batch = [next(items) for _ in range(size)]
            lo, hi = part_slice(size, self._num_parts, self._part_index)
            yield batch[lo:hi]
