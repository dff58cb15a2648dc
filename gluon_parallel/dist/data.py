"""Every worker's part of the data: equal lengths, so every worker runs the
same number of steps (a worker with one batch more would wait forever)."""
import numpy as np
from mxnet import gluon

from .kvstore import num_workers, rank

__all__ = ['shard', 'ShardSampler', 'shard_sampler']


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
