"""split.py: split_sizes, split_load_kwargs and gather on N CPU contexts."""
import collections

import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mxnet import nd

from gluon_parallel import gather, split_load_kwargs, split_sizes


def reference_sizes(batch_size, num_ctx):
    """numpy.array_split sizes with the empty slices dropped."""
    sizes = [len(a) for a in np.array_split(np.arange(batch_size), num_ctx)]
    return [s for s in sizes if s]


def assert_same(a, b):
    """Structural equality of nested NDArray / numpy / plain structures."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, nd.NDArray):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


# ---------------------------------------------------------------- split_sizes

@pytest.mark.parametrize('batch_size, num_ctx, expected', [
    (8, 4, [2, 2, 2, 2]),
    (7, 4, [2, 2, 2, 1]),
    (5, 3, [2, 2, 1]),
    (10, 4, [3, 3, 2, 2]),
    (1, 1, [1]),
    (9, 1, [9]),
    (3, 4, [1, 1, 1]),      # fewer rows than devices: only 3 devices used
    (1, 4, [1]),
])
def test_split_sizes_examples(batch_size, num_ctx, expected):
    assert split_sizes(batch_size, num_ctx) == expected


@pytest.mark.parametrize('batch_size, num_ctx', [(0, 1), (0, 4), (-1, 2), (4, 0)])
def test_split_sizes_rejects_empty_batch_and_no_context(batch_size, num_ctx):
    with pytest.raises(ValueError):
        split_sizes(batch_size, num_ctx)


@settings(max_examples=300, deadline=None)
@given(batch_size=st.integers(1, 2000), num_ctx=st.integers(1, 16))
def test_split_sizes_is_balanced_property(batch_size, num_ctx):
    sizes = split_sizes(batch_size, num_ctx)
    assert sum(sizes) == batch_size
    assert len(sizes) == min(batch_size, num_ctx)
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    # the larger slices come first, exactly as numpy.array_split puts them
    assert sizes == reference_sizes(batch_size, num_ctx)


# ---------------------------------------------------------- split_load_kwargs

@pytest.mark.parametrize('batch_size', [8, 7, 3, 1])
def test_slices_are_array_split_rows_on_their_contexts(ctx_list, batch_size):
    x = nd.arange(batch_size * 3).reshape((batch_size, 3))
    args, kwargs = split_load_kwargs((x,), {}, ctx_list)
    expected = [a for a in np.array_split(x.asnumpy(), len(ctx_list)) if len(a)]
    assert len(args) == len(kwargs) == min(batch_size, len(ctx_list))
    for i, (a, kw, ref) in enumerate(zip(args, kwargs, expected)):
        assert isinstance(a, tuple) and len(a) == 1 and kw == {}
        assert a[0].context == ctx_list[i]
        np.testing.assert_array_equal(a[0].asnumpy(), ref)


def test_batch_smaller_than_contexts_gives_size_one_slices():
    ctx_list = [mx.cpu(i) for i in range(4)]
    x = nd.array([[1.], [2.], [3.]])
    args, kwargs = split_load_kwargs((x,), {'y': x * 10}, ctx_list)
    assert len(args) == 3
    assert [a[0].shape for a in args] == [(1, 1)] * 3
    assert [a[0].context for a in args] == ctx_list[:3]
    assert [kw['y'].asscalar() for kw in kwargs] == [10., 20., 30.]


def test_nested_tuple_list_dict_are_split_elementwise(ctx_list):
    b = 7
    x = nd.arange(b * 2).reshape((b, 2))
    Pair = collections.namedtuple('Pair', 'left right')
    inputs = ((x, [x + 100, {'a': x + 200, 'n': 5}]), Pair(x + 300, 'tag'))
    kwargs = {'mask': {'m': [x + 400]}, 'flag': True}
    args, kws = split_load_kwargs(inputs, kwargs, ctx_list)
    rows = [a for a in np.array_split(x.asnumpy(), len(ctx_list)) if len(a)]
    for i, (a, kw) in enumerate(zip(args, kws)):
        ctx, r = ctx_list[i], rows[i]
        (x0, (x1, d)), pair = a
        assert type(a[0]) is tuple and type(a[0][1]) is list and type(pair) is Pair
        for arr, offset in [(x0, 0), (x1, 100), (d['a'], 200), (pair.left, 300),
                            (kw['mask']['m'][0], 400)]:
            assert arr.context == ctx
            np.testing.assert_array_equal(arr.asnumpy(), r + offset)
        assert d['n'] == 5 and pair.right == 'tag' and kw['flag'] is True


def test_dict_subclasses_keep_their_type(ctx_list):
    x = nd.arange(5).reshape((5, 1))
    ordered = collections.OrderedDict([('b', x), ('a', x + 1)])
    default = collections.defaultdict(list, {'k': x + 2})
    args, _ = split_load_kwargs((ordered, default), {}, ctx_list)
    for o, d in args:
        assert type(o) is collections.OrderedDict and list(o) == ['b', 'a']
        assert type(d) is collections.defaultdict and d.default_factory is list
    back = gather(args)
    assert_same(back, (ordered, default))
    assert back[1].default_factory is list


@pytest.mark.parametrize('dtype', ['float64', 'float32', 'float16', 'int32', 'int64', 'uint8'])
def test_numpy_inputs_are_loaded_with_their_dtype(ctx_list, dtype):
    x = (np.arange(14).reshape((7, 2)) % 50).astype(dtype)
    args, kws = split_load_kwargs((x,), {'w': x[:, 0]}, ctx_list)
    rows = [a for a in np.array_split(x, len(ctx_list)) if len(a)]
    for i, (a, kw) in enumerate(zip(args, kws)):
        for arr, ref in [(a[0], rows[i]), (kw['w'], rows[i][:, 0])]:
            assert isinstance(arr, nd.NDArray)
            assert arr.dtype == np.dtype(dtype)
            assert arr.context == ctx_list[i]
            np.testing.assert_array_equal(arr.asnumpy(), ref)


def test_non_array_values_are_passed_unchanged_to_every_device(ctx_list):
    sentinel = object()
    x = nd.ones((5, 2))
    args, kws = split_load_kwargs((x, 3, None, 'abc'),
                                  {'obj': sentinel, 'f': 0.5, 's': 'str', 'n': None,
                                   'lst': [1, 2]},
                                  ctx_list)
    assert len(args) == min(5, len(ctx_list))
    for a, kw in zip(args, kws):
        assert a[1:] == (3, None, 'abc')
        assert kw['obj'] is sentinel
        assert (kw['f'], kw['s'], kw['n'], kw['lst']) == (0.5, 'str', None, [1, 2])


@pytest.mark.parametrize('batch_axis', [0, 1, 2, -1, -2, -3])
@pytest.mark.parametrize('as_numpy', [False, True], ids=['nd', 'np'])
def test_any_batch_axis(ctx_list, batch_axis, as_numpy):
    x = np.arange(5 * 6 * 7, dtype='float32').reshape((5, 6, 7))
    data = x if as_numpy else nd.array(x)
    args, kws = split_load_kwargs((data,), {'k': data}, ctx_list, batch_axis=batch_axis)
    rows = [a for a in np.array_split(x, len(ctx_list), axis=batch_axis)
            if a.shape[batch_axis]]
    assert len(args) == len(rows)
    for i, (a, kw) in enumerate(zip(args, kws)):
        for arr in (a[0], kw['k']):
            assert arr.context == ctx_list[i]
            np.testing.assert_array_equal(arr.asnumpy(), rows[i])
    parts = [a[0] for a in args]
    np.testing.assert_array_equal(gather(parts, batch_axis=batch_axis).asnumpy(), x)


@pytest.mark.parametrize('inputs, kwargs, name', [
    ((nd.ones((6, 2)), nd.ones((5, 2))), {}, 'inputs[1]'),
    ((nd.ones((6, 2)),), {'mask': nd.ones((4,))}, 'mask'),
    ((nd.ones((6, 2)), {'a': nd.ones((6,)), 'b': np.ones((3, 1))}), {}, "['b']"),
    ((nd.ones((6, 2)),), {'pair': [nd.ones((6, 1)), nd.ones((7, 1))]}, 'pair[1]'),
])
def test_disagreeing_batch_dimensions_name_the_argument(inputs, kwargs, name):
    with pytest.raises(ValueError) as info:
        split_load_kwargs(inputs, kwargs, [mx.cpu(0), mx.cpu(1)])
    assert name in str(info.value)


def test_disagreement_along_other_batch_axis_is_caught():
    # same first dimension, different batch dimension on axis 1
    with pytest.raises(ValueError, match='seq'):
        split_load_kwargs((nd.ones((4, 6)),), {'seq': nd.ones((4, 5))},
                          [mx.cpu(0), mx.cpu(1)], batch_axis=1)


@pytest.mark.parametrize('as_numpy', [False, True], ids=['nd', 'np'])
def test_empty_batch_raises(as_numpy):
    # MXNet 1.x cannot create a zero-size NDArray with nd.zeros; numpy can
    empty = np.zeros((0, 3)) if as_numpy else nd.array(np.zeros((0, 3)))
    assert empty.shape == (0, 3)
    with pytest.raises(ValueError, match='empty'):
        split_load_kwargs((empty,), {}, [mx.cpu(0), mx.cpu(1)])


def test_invalid_calls_raise_value_error():
    ctx_list = [mx.cpu(0), mx.cpu(1)]
    with pytest.raises(ValueError):        # nothing to split
        split_load_kwargs((1, 'a'), {'k': None}, ctx_list)
    with pytest.raises(ValueError):        # no context
        split_load_kwargs((nd.ones((2, 2)),), {}, [])
    with pytest.raises(ValueError):        # axis out of range
        split_load_kwargs((nd.ones((2, 2)),), {}, ctx_list, batch_axis=2)


# --------------------------------------------------------------------- gather

def test_gather_round_trips_nested_structures(ctx_list):
    b = 7
    x = nd.random.uniform(shape=(b, 3))
    struct = (x, [x * 2, {'a': x + 1, 'b': (x - 1,)}], 'label', {'c': x[:, 0]})
    args, _ = split_load_kwargs(struct, {}, ctx_list)
    assert_same(gather(args), struct)
    # gathering one positional argument at a time gives the same pieces
    for j in range(len(struct)):
        assert_same(gather([a[j] for a in args]), struct[j])


def test_gather_to_given_context_and_default_context():
    ctx_list = [mx.cpu(1), mx.cpu(2), mx.cpu(3)]
    x = nd.arange(6).reshape((6, 1))
    args, _ = split_load_kwargs((x, {'k': x}), {}, ctx_list)
    assert gather([a[0] for a in args]).context == mx.cpu(1)
    out = gather([a[0] for a in args], ctx=mx.cpu(3))
    assert out.context == mx.cpu(3)
    nested = gather([a[1] for a in args], ctx=mx.cpu(2))
    assert nested['k'].context == mx.cpu(2)
    np.testing.assert_array_equal(nested['k'].asnumpy(), x.asnumpy())


def test_gather_rejects_empty_and_mismatched_outputs():
    with pytest.raises(ValueError):
        gather([])
    with pytest.raises(ValueError):
        gather([(nd.ones((1, 1)), nd.ones((1, 1))), (nd.ones((1, 1)),)])


@st.composite
def batches(draw):
    """A random array, a batch axis of it, and a device count."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    axis = draw(st.integers(-ndim, ndim - 1))
    num_ctx = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(['float32', 'float64', 'int32']))
    as_numpy = draw(st.booleans())
    return shape, axis, num_ctx, dtype, as_numpy


@settings(max_examples=60, deadline=None)
@given(batches())
def test_split_then_gather_is_identity_property(case):
    shape, axis, num_ctx, dtype, as_numpy = case
    ctx_list = [mx.cpu(i) for i in range(num_ctx)]
    x = np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)
    data = x if as_numpy else nd.array(x, dtype=dtype)
    struct = (data, {'twice': [data, 'keep']})
    args, kws = split_load_kwargs(struct, {'kw': data}, ctx_list, batch_axis=axis)
    n = min(shape[axis], num_ctx)
    assert len(args) == n
    assert [a[0].shape[axis] for a in args] == split_sizes(shape[axis], num_ctx)
    back = gather(args, batch_axis=axis)
    for arr in (back[0], back[1]['twice'][0], gather(kws, batch_axis=axis)['kw']):
        assert arr.context == ctx_list[0] and arr.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(arr.asnumpy(), x)
    assert back[1]['twice'][1] == 'keep'
