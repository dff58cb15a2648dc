"""Export a trained data-parallel model for single-device inference (module
named so that it does not shadow the function ``gluon_parallel.export``).

The model is traced symbolically (``block(mx.sym.var('data'))``), which
needs neither ``hybridize()`` nor a forward pass and leaves the model
untouched: SyncBatchNorm layers are traced as the BatchNorm they are at
inference, a HostEmbedding as a plain Embedding (a flag of the exporting
thread, nn/tracing.py: other threads may go on training the model). Only
the parameters the graph uses are written, one copy each: no gradients,
optimizer state, per-device copies or training-only heads.
"""
import os
from collections.abc import Sequence

from mxnet import gluon, nd, sym

from .nn.tracing import for_export
from . import _gluon
from .checkpoint.files import Staged
from .params import param_value, settle, unwrap

__all__ = ['export']


def export(block: gluon.Block, path: str, epoch: int = 0,
           input_names: str | Sequence[str] = 'data') -> tuple[str, str]:
    """Write a single-device inference graph and its parameters.

    The files are those of ``HybridBlock.export``: ``path-symbol.json`` and
    ``path-%04d.params`` (epoch), loadable on any one device with
    ``gluon.SymbolBlock.imports(path + '-symbol.json', input_names,
    params_file, ctx=ctx)``, by the Module API or by the C++ predictor.

    Works on a model being trained on several devices (with SyncBatchNorm,
    HostEmbedding, inside a DataParallel, hybridized or not) without
    changing it. Every block on the path from the inputs to the outputs must
    be able to run on symbols (HybridBlocks, or Blocks whose forward only
    calls HybridBlocks). Parameters are taken from their first context
    (running statistics that differ across contexts are averaged, see
    :func:`~gluon_parallel.sync_running_stats`).

    Parameters
    ----------
    block : Block
        The trained model, or the DataParallel wrapping it.
    path : str
        Path prefix of the two files.
    epoch : int, default 0
        Number in the params file name.
    input_names : str or list of str, default 'data'
        Names of the graph's inputs, one per positional input of the model.

    Returns
    -------
    (str, str)
        The paths of the symbol file and of the params file.
    """
    block = unwrap(block)
    names = [input_names] if isinstance(input_names, str) else list(input_names)
    out = _trace(block, names)
    values = _graph_values(block, out, names)
    sym_path = f'{path}-symbol.json'
    params_path = f'{path}-{epoch:04d}.params'
    _write(out, values, sym_path, params_path)
    return sym_path, params_path


def _trace(block, names):
    """The inference graph of `block` on symbolic inputs named `names`."""
    inputs = [sym.var(n) for n in names]
    with for_export():
        try:
            out = block(*inputs)
        except Exception as e:
            raise RuntimeError(f'cannot trace {block.name} symbolically for export: '
                               f'{type(e).__name__}: {e}') from e
    if isinstance(out, (list, tuple)):
        out = sym.Group(list(out))
    if not isinstance(out, sym.Symbol):
        raise TypeError(f'{block.name} returned {type(out).__name__}, not symbols: '
                        'it cannot be exported')
    return out


def _graph_values(block, out, names):
    """{'arg:name' or 'aux:name': value} of every parameter the graph `out`
    uses, one copy each (the params file format of HybridBlock.export)."""
    params = {p.name: (name, p) for name, p in _gluon.structural_params(block).items()}
    values = {}
    settle()
    for kind, graph_names in (('arg', out.list_arguments()), ('aux', out.list_auxiliary_states())):
        for n in graph_names:
            if kind == 'arg' and n in names:
                continue
            if n not in params:
                raise ValueError(f'the exported graph has an input {n!r} that is neither a '
                                 f'parameter nor in input_names={names}')
            values[f'{kind}:{n}'] = param_value(*params[n])
    return values


def _write(out, values, sym_path, params_path):
    """Both files, staged and renamed into place together."""
    folder = os.path.dirname(os.path.abspath(sym_path))
    os.makedirs(folder, exist_ok=True)
    staged = Staged()
    try:
        staged.write(sym_path, lambda f: out.save(f, remove_amp_cast=True))
        staged.write(params_path, lambda f: nd.save(f, values))
        staged.commit()
    finally:
        staged.close()
