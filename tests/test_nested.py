"""gluon_parallel/nested.py: the one walker over nested arguments and
outputs (split.py's scatter and gather and the dist kvstore's copies build
on it: tests/test_split.py checks those end to end)."""
import collections

import numpy as np
import pytest
from mxnet import nd

from gluon_parallel.nested import arrays, combine, rebuild

Pair = collections.namedtuple('Pair', 'a b')


def structure():
    counts = collections.defaultdict(int, k=nd.ones(1))
    return [Pair(nd.zeros(2), 'tag'), (np.arange(3), None), {'d': counts}]


def test_rebuild_keeps_every_container_type_and_the_non_array_leaves():
    obj = structure()
    seen = []
    out = rebuild(obj, lambda a: seen.append(a) or ('leaf', len(seen)))
    assert [a for _, a in arrays(obj)] == seen                  # the walk's order
    assert type(out) is list and type(out[0]) is Pair and type(out[1]) is tuple
    assert out[0] == Pair(('leaf', 1), 'tag') and out[1] == (('leaf', 2), None)
    counts = out[2]['d']
    assert type(counts) is collections.defaultdict and counts.default_factory is int
    assert dict(counts) == {'k': ('leaf', 3)} and obj[2]['d']['k'].shape == (1,)


def test_combine_gives_each_leaf_every_structures_values():
    objs = [structure(), structure()]
    out = combine(objs, lambda values: len(values))
    assert out[0] == Pair(2, 2) and out[1] == (2, 2) and dict(out[2]['d']) == {'k': 2}
    with pytest.raises(ValueError, match=r'lengths differ: \[2, 3\]'):
        combine([[1, 2], [1, 2, 3]], lambda values: values, 'lengths differ')
