"""The parameters file of a checkpoint: ``Block.save_parameters``' format
under structural names, read and checked against a model before any value
is placed."""
import numpy as np
import mxnet as mx
from mxnet import nd

from .. import _gluon
from ..nn.embedding import is_pinned

__all__ = []


def read_params(path, block):
    """Read and check a params file against `block`: returns a list of
    (Parameter, value), or raises naming the file and the parameter."""
    try:
        loaded = nd.load(path)
    except mx.base.MXNetError as e:
        raise ValueError(f'{path} is not a readable MXNet parameter file (truncated or '
                         f'foreign?): {str(e).strip().splitlines()[0]}') from e
    if not isinstance(loaded, dict) or not loaded:
        raise ValueError(f'{path} holds no named parameters (not a Gluon parameter file?)')
    names = _gluon.structural_params(block)
    by_param = {}
    for name, p in names.items():
        by_param.setdefault(id(p), (p, []))[1].append(name)
    plan, missing = [], []
    for p, pnames in by_param.values():
        found = [n for n in pnames if n in loaded]
        if not found:
            missing.append(pnames[0])
            continue
        value = loaded[found[0]]
        if p.shape and (len(p.shape) != value.ndim or any(
                s not in (0, v) for s, v in zip(p.shape, value.shape))):
            raise ValueError(f'{path}: parameter {found[0]} has shape {value.shape} in the file '
                             f'but {p.shape} in the model')
        if p.dtype is not None and np.dtype(p.dtype) != value.dtype:
            raise ValueError(f'{path}: parameter {found[0]} has dtype {value.dtype} in the file '
                             f'but {np.dtype(p.dtype).name} in the model')
        plan.append((p, value))
    if missing:
        hint = ''
        if all(k.startswith(('arg:', 'aux:')) for k in loaded):
            hint = ' (it looks like an exported inference model: load it with SymbolBlock.imports)'
        elif not any('.' in k for k in loaded):
            hint = (' (it uses full parameter names, as ParameterDict.save writes: load it with '
                    'block.collect_params().load)')
        s = 's' if len(missing) > 1 else ''
        names = ', '.join(missing[:5]) + (' ...' if len(missing) > 5 else '')
        raise ValueError(f'{path} has no value for parameter{s} {names} of the model{hint}')
    extra = sorted(set(loaded) - set(names))
    if extra:
        s = 's' if len(extra) > 1 else ''
        names = ', '.join(extra[:5]) + (' ...' if len(extra) > 5 else '')
        raise ValueError(f'{path} has parameter{s} {names} that the model does not have')
    return plan


def place(p, value, ctx_list):
    """Give `p` the value `value` on every one of its contexts."""
    pinned = is_pinned(p)
    if not _gluon.has_data(p):
        if _gluon.is_deferred(p):
            if ctx_list is not None and not pinned:
                p.reset_ctx(ctx_list)
            _gluon.load_init(p, value, None)
        else:
            _gluon.load_init(p, value, ctx_list if ctx_list is not None else [mx.current_context()])
        return
    if ctx_list is not None and not pinned and p.list_ctx() != list(ctx_list):
        p.reset_ctx(ctx_list)
    # set_data also resets a trainer's kvstore that holds the old weights.
    p.set_data(value)
