"""The devices a parallel call runs on: the ``ctx_list`` argument checked,
and its default (every GPU, else one CPU context, with a warning naming
them)."""
import os
import sys
import warnings

import mxnet as mx

__all__ = ['check_ctx_list']


def _default_ctx_list():
    """Every GPU, else one CPU context; says which (a UserWarning at the
    caller's line: Python shows it once per line), since with no GPU the
    multi-device path silently runs on one device."""
    n = mx.context.num_gpus()
    if n:
        ctx_list = [mx.gpu(i) for i in range(n)]
        why = f'every GPU MXNet sees, {ctx_list}'
    else:
        ctx_list = [mx.cpu()]
        why = (f'{ctx_list} only: MXNet sees no GPU. For several CPU contexts pass '
               'ctx_list=[mx.cpu(i) for i in range(N)] (docs/training-loop.md, '
               '"How many CPU contexts")')
    warnings.warn(f'gluon_parallel: no ctx_list given, so the replicas run on {why}', UserWarning,
                  stacklevel=_outside_the_package())
    return ctx_list


def _outside_the_package():
    """The `stacklevel` of the innermost caller outside gluon_parallel, as
    seen from a function of the package that calls ``warnings.warn``."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def check_ctx_list(ctx_list):
    """`ctx_list` as a list of distinct Contexts (the default for None), or
    a TypeError/ValueError saying what is wrong with it."""
    if ctx_list is None:
        return _default_ctx_list()
    if isinstance(ctx_list, mx.Context):
        ctx_list = [ctx_list]
    ctx_list = list(ctx_list)
    if not ctx_list:
        raise ValueError('ctx_list is empty: give at least one context')
    for c in ctx_list:
        if not isinstance(c, mx.Context):
            raise TypeError(f'ctx_list must hold mxnet Contexts, got {c!r}')
    if len(set(ctx_list)) != len(ctx_list):
        raise ValueError(f'ctx_list lists a context twice: {ctx_list}')
    return ctx_list


