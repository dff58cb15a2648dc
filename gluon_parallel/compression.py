"""What crosses the link for a gradient bucket: the bucket itself, or with
``gp.Trainer(..., compression='fp16')`` a float16 copy of it (Horovod's
``Compression.fp16``, DDP's ``fp16_compress_hook``): half the bytes, each
device's gradients rounded to float16 (11 significant bits) and summed in
float16 by the kvstore or all-reduce, the sum cast back into the bucket.
Float16 buckets are sent as they are."""
import numpy as np
from mxnet import nd

from . import _gluon

__all__ = ['COMPRESSIONS', 'check_compression', 'Wire', 'casting']

#: What ``gp.Trainer``'s `compression` accepts.
COMPRESSIONS = (None, 'fp16')


def check_compression(compression, cap):
    """ValueError for a compression other than :data:`COMPRESSIONS`, or
    'fp16' without buckets (`cap` 0)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be None or 'fp16', got {compression!r}")
    if compression and not cap:
        raise ValueError("compression='fp16' casts the gradient buckets: it needs "
                         'bucket_cap_mb > 0')


class Wire:
    """The arrays a bucket is summed as (one per context): its own, or
    float16 copies with the prepared casts each way.

    Parameters
    ----------
    arrays : list of NDArray
        The bucket's flat array on each context.
    compression : {None, 'fp16'}
    """

    def __init__(self, arrays, compression=None):
        self.dtype = np.dtype(arrays[0].dtype)
        self.compressed = compression == 'fp16' and self.dtype in (np.float32, np.float64)
        self.arrays, self.to_wire, self.from_wire = arrays, [], []
        if self.compressed:
            self.arrays = [nd.zeros(a.shape, ctx=a.context, dtype='float16') for a in arrays]
            self.to_wire = [_gluon.prepared_op('Cast', [a], [w])
                            for a, w in zip(arrays, self.arrays)]
            self.from_wire = [_gluon.prepared_op('Cast', [w], [a])
                              for a, w in zip(arrays, self.arrays)]


def casting(pushpull, wires):
    """`pushpull` (which sums the `wires`' arrays in place) between the
    casts to them and back (prepared operators: one C call each way and
    dtype)."""
    to_half = ([op for w in wires for op in w.to_wire], _gluon.op_params({'dtype': 'float16'}))
    back = {}
    for w in wires:
        back.setdefault(w.dtype.name, []).extend(w.from_wire)
    back = [(ops, _gluon.op_params({'dtype': dtype})) for dtype, ops in back.items()]

    def run():
        _gluon.invoke(*to_half)
        pushpull()
        for ops, params in back:
            _gluon.invoke(ops, params)
    return run
