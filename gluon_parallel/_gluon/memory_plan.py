"""The executor's memory plan next to MKL-DNN (mxnet 1.9.1).

``Symbol.bind`` plans the executor's memory with nnvm's PlanMemory pass,
which lets an entry reuse the storage of any finished entry of the same
device between 1/16 and 16 times its size (``NNVM_EXEC_MATCH_RANGE``, read
from the environment by every plan). Every entry is then an
``NDArray::AsArray`` view of its storage's chunk, and the chunk, not the
entry, holds the MKL-DNN memory descriptor (``Chunk::mkl_mem_``) that an
MKL-DNN operator sets when it writes its output in its own (blocked)
layout. Operators computed through FCompute clear it on the outputs they
write (``InvalidateOutputs``); a cross-device copy (``CopyFromToDnsImpl``)
does not: it takes the chunk's descriptor as the destination's layout.
So in a training executor, a chunk that an MKL-DNN operator of the
backward pass left its layout on, reused in the next forward pass by a
smaller entry that a copy writes (graph mode's SyncBatchNorm sums, copied
between devices), reaches the next reader with a descriptor of another
size: ``NDArray::CopyFrom`` fails "The size of NDArray doesn't match the
requested MKLDNN memory desc", from the second step on. With exact-size
reuse (match range 1) a descriptor left on a chunk always has the size of
the entry reading it, and MKL-DNN's reorder into and out of that layout
round-trips the values.
"""
import contextlib
import os

from .environment import setting, user_set

__all__ = ['exact_size_plan']

_VAR = 'NNVM_EXEC_MATCH_RANGE'


@contextlib.contextmanager
def exact_size_plan(active=True):
    """Executors bound inside the block reuse storage only between entries
    of the same size (``NNVM_EXEC_MATCH_RANGE=1`` while they are planned,
    environment.setting), unless the user's environment already asks for
    that or for no reuse (0). `active` False: a no-op."""
    if not active or (user_set(_VAR) and os.environ[_VAR] in ('0', '1')):
        yield
        return
    with setting({_VAR: '1'}):
        yield
