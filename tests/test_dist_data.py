"""gluon_parallel/dist/data.py's GlobalBatchSampler: the global batches,
the epochs and the position do not depend on the number of workers.

Each global batch is the same whatever the number of workers W (the
workers' parts, in rank order, are it; they differ by at most one item);
nothing is left out that depends on W (ShardSampler keeps len // W * W
items); an epoch trained across restarts at other sizes uses every item
exactly once, in the order of the run that never changed size.
"""
import numpy as np
import pytest
from mxnet import gluon

from gluon_parallel import dist


def _steps(length, batch, workers, last='keep', shuffle=True, epoch=3, samples=0, steps=None):
    """[[part of worker 0, part of worker 1, ...] per step] of one pass."""
    samplers = [dist.GlobalBatchSampler(length, batch, last, shuffle=shuffle, seed=7,
                                        num_parts=workers, part_index=r)
                for r in range(workers)]
    for s in samplers:
        s.set_epoch(epoch, samples)
    passes = [list(s) for s in samplers]
    assert len({len(p) for p in passes}) == 1          # every worker: the same number of steps
    n = len(passes[0]) if steps is None else steps
    return [[p[k] for p in passes] for k in range(n)], samplers[0]


@pytest.mark.parametrize('length,batch,last', [(37, 8, 'keep'), (40, 10, 'keep'),
                                               (37, 8, 'discard'), (23, 5, 'keep')])
def test_global_batches_do_not_depend_on_the_number_of_workers(length, batch, last):
    one, _ = _steps(length, batch, 1, last)
    want = [parts[0] for parts in one]
    for workers in range(2, batch + 1):
        if last == 'keep' and 0 < length % batch < workers:
            continue        # refused: see test_a_last_batch_too_small_is_refused
        steps, sampler = _steps(length, batch, workers, last)
        assert [sum(parts, []) for parts in steps] == want, workers
        for k, parts in enumerate(steps):
            sizes = [len(p) for p in parts]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1, (workers, sizes)
            assert sampler.global_batch_size(k) == len(want[k])
    used = sum(len(b) for b in want)
    # 'keep': every item; 'discard': the last partial batch only (not W's doing).
    assert used == (length if last == 'keep' else length // batch * batch)
    if last == 'keep':
        assert sorted(sum(want, [])) == list(range(length))


def test_an_epoch_across_restarts_at_other_sizes_uses_every_item_once():
    length, batch = 53, 6
    whole = [x for parts in _steps(length, batch, 1)[0] for x in parts[0]]
    # Attempt 0 at 3 workers for 2 steps, a checkpoint; attempt 1 at 5 for
    # 3 steps; attempt 2 at 2 workers to the end of the epoch.
    seen, position = [], {'epoch': 3, 'samples': 0}
    for workers, steps in ((3, 2), (5, 3), (2, None)):
        done, sampler = _steps(length, batch, workers, epoch=position['epoch'],
                               samples=position['samples'], steps=steps)
        seen += [x for parts in done for part in parts for x in part]
        position = sampler.position(len(done))
    assert seen == whole
    assert sorted(seen) == list(range(length))
    assert position == {'epoch': 4, 'samples': 0}       # the epoch is done


def test_position_counts_global_items():
    sampler = dist.GlobalBatchSampler(20, 6, num_parts=2, part_index=1)
    sampler.set_epoch(2, 6)
    assert len(sampler) == 3                    # 6, 6, 2 items left
    it = iter(sampler)
    assert sampler.position(0) == {'epoch': 2, 'samples': 6}
    assert sampler.position(2) == {'epoch': 2, 'samples': 18}
    assert sampler.position(3) == {'epoch': 3, 'samples': 0}
    assert next(it) == [9, 10, 11]              # items 6..11, parts of 3
    assert (sampler.epoch, sampler.samples) == (3, 0)   # the next pass: the next epoch
    with pytest.raises(ValueError, match='outside an epoch of 20 items'):
        sampler.set_epoch(1, 21)


def test_any_sampler_with_set_epoch():
    class Keys(gluon.data.Sampler):
        def __init__(self):
            self.epoch = None

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __len__(self):
            return 10

        def __iter__(self):
            rng = np.random.RandomState(self.epoch)
            return iter([(int(i), self.epoch) for i in rng.permutation(10)])

    keys = Keys()
    sampler = dist.GlobalBatchSampler(keys, 4, num_parts=2, part_index=0)
    sampler.set_epoch(5)
    parts = list(sampler)
    order = [(int(i), 5) for i in np.random.RandomState(5).permutation(10)]
    assert parts == [order[0:2], order[4:6], order[8:9]]
    with pytest.raises(ValueError, match='needs a dataset length'):
        dist.GlobalBatchSampler(keys, 4, shuffle=True, num_parts=1, part_index=0)


def test_a_last_batch_too_small_is_refused():
    with pytest.raises(ValueError, match="holds 1 items, fewer than the 2 workers: use "
                                         "last_batch='discard'"):
        dist.GlobalBatchSampler(9, 4, num_parts=2, part_index=0)
    assert len(dist.GlobalBatchSampler(9, 4, 'discard', num_parts=2, part_index=0)) == 2
    with pytest.raises(ValueError, match='a global batch of 2 cannot give 3 workers'):
        dist.GlobalBatchSampler(9, 2, num_parts=3, part_index=0)
    with pytest.raises(ValueError, match="last_batch must be 'keep' or 'discard'"):
        dist.GlobalBatchSampler(9, 3, 'rollover', num_parts=1, part_index=0)


def test_alone_it_is_every_batch():
    sampler = dist.GlobalBatchSampler(7, 3)         # no dist job: one worker
    assert list(sampler) == [[0, 1, 2], [3, 4, 5], [6]]
