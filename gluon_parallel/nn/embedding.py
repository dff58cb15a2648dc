"""HostEmbedding: an embedding table kept on one context that the replicas
of a data-parallel model read through.

A table of millions of rows is too big to copy to every device and too
sparse to be worth it: each batch reads a few rows. The table lives on one
context (host memory by default); each replica sends its indices there, looks
the rows up, and gets them back on its own device. The copies are recorded,
so one ``autograd.backward(losses)`` gives the table the sum of every
replica's (row-sparse) gradient, and a trainer of its own updates it once.
"""
import threading

import mxnet as mx
from mxnet import gluon, nd

from .. import _gluon
from .tracing import exporting

__all__ = ['HostEmbedding']


def is_pinned(param):
    """True for a parameter kept on one context on purpose (a HostEmbedding
    table), which replicas read through instead of holding a copy.

    The package's one rule for such parameters: the parameter checks allow
    them on a single context, and initialisation, loading and the handling
    of idle devices' gradients leave them where they are. Any other
    parameter must have a copy on every device of a parallel call.
    """
    return isinstance(param, _gluon.PinnedParameter)


class HostEmbedding(gluon.nn.Embedding):
    """An Embedding whose table stays on one context while the rest of the
    model is replicated on many.

    Same arguments and parameter name (``weight``) as
    :class:`mxnet.gluon.nn.Embedding`, so parameter files are interchangeable
    with it, plus the table's context. ``net.initialize(ctx=ctx_list)``
    leaves the table on `ctx`; inside :class:`~gluon_parallel.DataParallel`
    every replica's indices go to `ctx`, the rows come back to the replica's
    device, and ``autograd.backward(losses)`` gives the table the sum of all
    replicas' gradients. A gluon Trainer needs all its parameters on the same
    contexts, so give the table a trainer of its own, and step both with the
    global batch size (``gluon_parallel.step([trainer, table_trainer], n)``
    does that).

    Parameters
    ----------
    input_dim : int
        Number of rows (vocabulary size).
    output_dim : int
        Size of each row.
    ctx : Context, default cpu()
        Where the table lives.
    dtype : str, default 'float32'
    weight_initializer : Initializer, optional
    sparse_grad : bool, default True
        Row-sparse gradient: the trainer touches only the rows read (lazy
        update), as ``gluon.nn.Embedding(sparse_grad=True)`` does.

    Notes
    -----
    The lookup crosses devices, so it runs imperatively: ``hybridize()`` on
    the HostEmbedding itself does nothing, and a hybridized block that
    contains it raises. Hybridize the blocks after it.
    :func:`gluon_parallel.export` writes it as a plain Embedding.

    Examples
    --------
    >>> ctx = [mx.gpu(i) for i in range(4)]
    >>> net = MyModel(embed=HostEmbedding(10**7, 64, ctx=mx.cpu()))
    >>> net.initialize(ctx=ctx)                  # the table stays on the CPU
    >>> table = list(net.embed.collect_params().values())
    >>> rest = [p for p in net.collect_params().values() if p not in table]
    >>> trainers = [gluon.Trainer(rest, 'sgd', {'learning_rate': 0.1}),
    ...             gluon.Trainer(table, 'sgd', {'learning_rate': 0.1})]
    """

    def __init__(self, input_dim, output_dim, ctx=None, dtype='float32',
                 weight_initializer=None, sparse_grad=True, **kwargs):
        super().__init__(input_dim, output_dim, dtype=dtype,
                                            weight_initializer=weight_initializer,
                                            sparse_grad=sparse_grad, **kwargs)
        ctx = ctx if ctx is not None else mx.cpu()
        if not isinstance(ctx, mx.Context):
            raise TypeError(f'ctx must be one mxnet Context, got {ctx!r}')
        weight = self.weight
        if not is_pinned(weight):
            if not _gluon.owns_param(self, weight):
                raise ValueError(f'{self.name}: a HostEmbedding can share its table only with '
                                 'another HostEmbedding')
            pinned = _gluon.PinnedParameter(
                weight.name, ctx, shape=(input_dim, output_dim), init=weight_initializer,
                dtype=dtype, allow_deferred_init=True,
                grad_stype='row_sparse' if sparse_grad else 'default')
            _gluon.replace_param(self, 'weight', pinned)
        # Recording reads of one variable from several threads at once is
        # not documented as safe in MXNet; the lookup is only queued here.
        self._lock = threading.Lock()

    @property
    def ctx(self):
        """The context of the table."""
        return self.weight.pinned_ctx

    def hybridize(self, active=True, **kwargs):
        """The lookup crosses devices and stays imperative: a no-op."""
        super().hybridize(False, **kwargs)

    def forward(self, x, *args):
        if isinstance(x, nd.NDArray):
            table_ctx = self.weight.list_ctx()[0]
            weight = self.weight.data(table_ctx)
            with self._lock:
                rows = nd.Embedding(x.as_in_context(table_ctx), weight, **self._kwargs)
            return rows.as_in_context(x.context)
        if exporting():
            return super().forward(x, *args)
        raise RuntimeError(
            f'{self.name} reads its table across devices and cannot be part of a hybridized graph: '
            'hybridize the blocks after it instead (gluon_parallel.export writes it as a '
            'plain Embedding)')

    def __repr__(self):
        kw = self._kwargs
        return (f"{self.__class__.__name__}({kw['input_dim']} -> {kw['output_dim']}, "
                f"{kw['dtype']}, ctx={self.ctx})")
