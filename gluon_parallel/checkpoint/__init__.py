"""Checkpoints that resume exactly.

A checkpoint is three files next to each other:

``prefix.params``
    The parameters under their structural names, the format of
    ``Block.save_parameters``: a plain single-device Gluon block loads it
    with ``load_parameters``.
``prefix.states``
    The trainer's optimizer state (momentum, Adam moments, update counts,
    learning-rate schedule), the format of ``Trainer.save_states``; with
    several trainers, one container holding each trainer's state.
``prefix.json``
    The user's meta data (epoch, step...), and the size and SHA-256 of the
    two files above, so a truncated, replaced or half-saved file is named in
    an error instead of being loaded.

Every file is written to a temporary file in the same directory, flushed to
disk and only then renamed over the old one (``os.replace`` is atomic), the
json last: a crash while saving leaves the previous checkpoint whole.
"""
import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import mxnet as mx
from mxnet import autograd, gluon, nd

from .. import _gluon
from ..grads import as_trainers
from ..progress import declared
from ..params import param_value, sync_running_stats, unwrap
from .files import PREV, Staged, digest, write_bytes
from .params_file import place, read_params
from .trainer_state import (load_blob, pack_states, read_states, spread_update_counts,
                            trainer_info)

__all__ = ['save_checkpoint', 'load_checkpoint']

_FORMAT = 'gluon_parallel.checkpoint'
_VERSION = 1


def _paths(prefix):
    prefix = os.fspath(prefix)
    return prefix + '.params', prefix + '.states', prefix + '.json'


@declared('saving a checkpoint')
def save_checkpoint(prefix: str | os.PathLike, block: gluon.Block,
                    trainer: gluon.Trainer | Sequence[gluon.Trainer] | None = None,
                    **meta: Any) -> dict[str, str]:
    """Save a model, its trainer's state and meta data, atomically.

    Writes ``prefix.params`` (loadable by plain ``Block.load_parameters``),
    ``prefix.states`` (when a trainer is given) and ``prefix.json``. Each
    file goes to a temporary file first and is renamed over the old one only
    when all of them are on disk, so a crash mid-save leaves the previous
    checkpoint whole.

    Replicated parameters without gradient whose copies differ (running
    statistics of a plain BatchNorm) are first averaged in place (see
    :func:`sync_running_stats`), so the model that keeps training and the
    one resumed from the checkpoint are the same. Other parameters are saved
    from their first context.

    Parameters
    ----------
    prefix : str
        Path without extension; its directory is created if missing.
    block : Block
        The model (a :class:`~gluon_parallel.DataParallel` is unwrapped).
    trainer : Trainer or list of Trainer, optional
        Its optimizer state is saved. Save after ``trainer.step``, not
        between ``backward`` and ``step``.
    **meta
        JSON-serialisable values (epoch, step, best score...), returned by
        :func:`load_checkpoint`.

    Returns
    -------
    dict
        The paths written, under 'params', 'states' (if any) and 'json'.
    """
    return save_with_record(prefix, block, trainer, meta)


@declared('saving a checkpoint')
def save_with_record(prefix, block, trainer, meta, record=None):
    """:func:`save_checkpoint`, with `record` (a dict of JSON values) kept
    in ``prefix.json`` beside the meta data (:func:`read_record` returns
    it): what gluon_parallel itself keeps, such as a dist job's layouts."""
    block = unwrap(block)
    trainers = as_trainers(trainer)
    params_path, states_path, json_path = _paths(prefix)
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError(f'checkpoint meta data must be JSON-serialisable: {e}') from e
    values = _values_to_save(block, params_path)
    info = {'format': _FORMAT, 'version': _VERSION, 'meta': meta, 'files': {}}
    if record:
        info['record'] = record
    _write_files(values, trainers, block, info, params_path, states_path, json_path)
    out = {'params': params_path, 'json': json_path}
    if trainers:
        out['states'] = states_path
    return out


def _values_to_save(block, params_path):
    """{structural name: value} of every parameter of `block`, running
    statistics averaged across devices first (see save_checkpoint)."""
    params = _gluon.structural_params(block)
    for name, p in params.items():
        if not _gluon.has_data(p):
            yet = ' yet (run one forward pass first)' if _gluon.is_deferred(p) else ''
            raise ValueError(f'cannot save {params_path}: parameter {name} is not initialized{yet}')
    sync_running_stats(block)      # (settles the engine first: params.settle)
    return {name: param_value(name, p) for name, p in params.items()}


def _write_files(values, trainers, block, info, params_path, states_path, json_path):
    """Stage the parameters, the trainers' states and the json describing
    both (filled into `info`), then rename them into place, json last."""
    folder = os.path.dirname(os.path.abspath(params_path))
    os.makedirs(folder, exist_ok=True)
    staged = Staged()
    try:
        tmp = staged.write(params_path, lambda f: nd.save(f, values))
        info['files']['params'] = dict(digest(tmp), name=os.path.basename(params_path))
        if trainers:
            if len(trainers) == 1:
                tmp = staged.write(states_path, trainers[0].save_states)
            else:
                tmp = staged.write(states_path, write_bytes(pack_states(trainers, folder)))
            info['files']['states'] = dict(digest(tmp), name=os.path.basename(states_path))
            info['trainers'] = [trainer_info(t, block) for t in trainers]
        text = json.dumps(info, indent=1, sort_keys=True).encode('utf-8')
        staged.write(json_path, write_bytes(text))
        staged.commit()         # json last: it vouches for the other two
    finally:
        staged.close()


def _read_json(path):
    try:
        with open(path, 'rb') as f:
            info = json.loads(f.read().decode('utf-8'))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f'{path} is not a readable checkpoint description (truncated or '
                         f'foreign file?): {e}') from e
    if not isinstance(info, dict) or info.get('format') != _FORMAT:
        raise ValueError(f'{path} is not a gluon_parallel checkpoint description')
    if info.get('version', 0) > _VERSION:
        raise ValueError(f"{path} was written by a newer gluon_parallel (format version "
                         f"{info.get('version')})")
    return info


def _verify(path, recorded, json_path):
    """The file the json vouches for: `path`, or the previous version kept
    by an interrupted save (see files.Staged.commit)."""
    if recorded is None:
        return path
    want = {'bytes': recorded.get('bytes'), 'sha256': recorded.get('sha256')}
    actual = digest(path)
    if actual == want:
        return path
    if os.path.isfile(path + PREV) and digest(path + PREV) == want:
        return path + PREV
    raise ValueError(f"{path} does not match {json_path} ({actual['bytes']:d} bytes, recorded "
                     f"{recorded.get('bytes')}): the file was "
                     "truncated or replaced, or the save that wrote it was interrupted")


@declared('loading a checkpoint')
def load_checkpoint(prefix: str | os.PathLike, block: gluon.Block,
                    trainer: gluon.Trainer | Sequence[gluon.Trainer] | None = None,
                    ctx_list: mx.Context | Sequence[mx.Context] | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`.

    Every file is read and checked before anything is changed: a missing,
    truncated or foreign file raises (FileNotFoundError or ValueError) naming
    the file, and leaves the model and the trainer as they were. Afterwards
    every context holds the same values (running statistics included).
    Loading twice in a row works. A plain Gluon parameter file
    (``block.save_parameters('x.params')``) loads too (``prefix='x'``; with
    no ``x.json`` there is no meta data and no integrity check).

    Parameters
    ----------
    prefix : str
        The prefix given to save_checkpoint.
    block : Block
        The model (a DataParallel is unwrapped).
    trainer : Trainer or list of Trainer, optional
        Gets the saved optimizer state (the same number of trainers, with
        the same optimizer types, as at save time). Load the parameters and
        the state together, in this call: loading parameters alone resets
        the state a kvstore holds (Gluon's ``update_on_kvstore``).
    ctx_list : list of Context, optional
        Contexts to put the parameters on. Default: where they are; ones not
        initialized yet go to the current context. A table kept on one
        context (HostEmbedding) stays there.

    Returns
    -------
    dict
        The meta data given to save_checkpoint.
    """
    block = unwrap(block)
    trainers = as_trainers(trainer)
    if ctx_list is not None:
        ctx_list = [ctx_list] if isinstance(ctx_list, mx.Context) else list(ctx_list)
    read = _read_checkpoint(prefix, block, trainers)
    with autograd.pause():
        for p, value in read.plan:
            place(p, value, ctx_list)
    if trainers:
        # After the parameters: a trainer whose kvstore was reset by
        # set_data rebuilds it from the loaded values here.
        if len(trainers) == 1 and not read.remapped:
            trainers[0].load_states(read.states_path)
        else:
            folder = os.path.dirname(os.path.abspath(read.states_path))
            for t, blob in zip(trainers, read.blobs):
                load_blob(t, blob, folder)
        for t in trainers:
            spread_update_counts(t)
    return dict(read.info.get('meta', {})) if read.info else {}


def read_record(prefix):
    """The `record` a checkpoint was saved with (:func:`save_with_record`);
    {} when it has none or no description."""
    json_path = _paths(prefix)[2]
    if not os.path.isfile(json_path):
        return {}
    return dict(_read_json(json_path).get('record', {}))


class _Read(NamedTuple):
    """A checkpoint read and checked, nothing changed yet."""
    plan: list              # (parameter, value) to place
    info: dict | None       # the json description; None for a plain params file
    states_path: str        # the states file vouched for (maybe the kept previous one)
    blobs: list | None      # per-trainer states, when not loaded by Trainer.load_states
    remapped: bool          # the states needed renaming to this model's parameters


def _read_checkpoint(prefix, block, trainers):
    """Read and check every file of the checkpoint at `prefix` before
    anything changes (see load_checkpoint)."""
    params_path, states_path, json_path = _paths(prefix)
    if not os.path.isfile(params_path):
        raise FileNotFoundError(f'checkpoint file {params_path} does not exist')
    info = _read_json(json_path) if os.path.isfile(json_path) else None
    files = info.get('files', {}) if info else {}
    params_path = _verify(params_path, files.get('params'), json_path)
    plan = read_params(params_path, block)
    blobs, remapped = None, False
    if trainers:
        if info is not None and 'states' not in files:
            raise ValueError(f'{json_path} was saved without a trainer: there is no optimizer '
                             'state to load')
        if not os.path.isfile(states_path):
            raise FileNotFoundError(f'checkpoint file {states_path} does not exist')
        states_path = _verify(states_path, files.get('states'), json_path)
        blobs, remapped = read_states(states_path, trainers, info, block)
    return _Read(plan, info, states_path, blobs, remapped)
