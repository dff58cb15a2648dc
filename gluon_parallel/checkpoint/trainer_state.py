"""The trainer's optimizer state in a checkpoint, matched to parameters by
structural name.

``gluon.Trainer`` keys its optimizer state (and the optimizer's update
counts, lr/wd multipliers) by the index of each parameter in the order of
their full names, which carry Gluon's global counters ('conv12_weight'):
the same model built after other blocks can list its parameters in another
order ('..10_gamma' < '..9_gamma'). A checkpoint records the structural name
of every index; loading moves each entry to the loading trainer's index.
This module is the only one that opens a ``Trainer.save_states`` pickle;
what it relies on (mxnet 1.9.1): the pickle is ``(states dict keyed by
index, Optimizer)``; the Optimizer's per-index dicts (update counts,
``idx2name``, ``lr_mult``, ``wd_mult``) are read through ``_gluon``.

The update counts are kept per device id (``Updater.__call__`` makes the
weight's device current before each update), while the states file holds
one device's updater states: :func:`spread_update_counts` gives every device of the
loading trainer the counts of the saved run, so a checkpoint loads on any
number of devices with every replica identical.
"""
import functools
import os
import pickle

import mxnet as mx

from .. import _gluon
from .files import tmp_path, write_bytes

__all__ = []

STATES_FORMAT = 'gluon_parallel.trainer_states'
VERSION = 1


def structural_names(block, trainer):
    """The structural name (as in ``save_parameters``) of each parameter of
    `trainer`, in the trainer's order; None for one that is not in `block`."""
    by_id = {}
    for name, p in _gluon.structural_params(block).items():
        by_id.setdefault(id(p), name)
    return [by_id.get(id(p)) for p in _gluon.trainer_params(trainer)]


def trainer_info(t, block):
    # gluon.Trainer orders its parameters, and so keys its optimizer state,
    # by their full names, which carry Gluon's global counters
    # ('conv12_weight'): record which parameter each index belongs to.
    return {'optimizer': type(t.optimizer).__name__,
            'params': [list(p.shape) if p.shape else None for p in _gluon.trainer_params(t)],
            'names': structural_names(block, t)}


def _through_file(folder, use):
    """use(path) for a temporary path in `folder` (Trainer's state methods
    take file names only); the file is removed after."""
    tmp = tmp_path(os.path.join(folder, 'trainer'))
    try:
        return use(tmp)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _save_and_read(trainer, path):
    trainer.save_states(path)
    with open(path, 'rb') as f:
        return f.read()


def pack_states(trainers, folder):
    blobs = [_through_file(folder, functools.partial(_save_and_read, t)) for t in trainers]
    return pickle.dumps({'format': STATES_FORMAT, 'version': VERSION, 'states': blobs})


def load_blob(trainer, blob, folder):
    """Load one trainer's state from the bytes :func:`pack_states` kept."""
    def write_and_load(tmp):
        write_bytes(blob)(tmp)
        trainer.load_states(tmp)
    _through_file(folder, write_and_load)


def _check_blob(blob, trainer, path, which):
    try:
        states = pickle.loads(blob)
    except Exception as e:      # a truncated pickle raises many types
        raise ValueError(f'{path}{which} is not a readable trainer state (truncated or foreign '
                         f'file?): {type(e).__name__}: {e}') from e
    if not (isinstance(states, tuple) and len(states) == 2 and isinstance(states[0], dict)
            and isinstance(states[1], mx.optimizer.Optimizer)):
        raise ValueError(f'{path}{which} is not a trainer state written by Trainer.save_states')
    saved, current = type(states[1]).__name__, type(trainer.optimizer).__name__
    if saved != current:
        raise ValueError(f'{path}{which} holds the state of a {saved} optimizer, but the trainer '
                         f'uses {current}')


def _index_map(saved_names, trainer, block, path, which):
    """{saved index: this trainer's index}, from the structural names
    recorded at save time; None when the order is the same, or unknown
    (a checkpoint of an older version, a parameter outside the block)."""
    names = structural_names(block, trainer)
    if not saved_names or None in saved_names or None in names:
        return None
    if sorted(saved_names) != sorted(names):
        missing = sorted(set(saved_names) - set(names))
        extra = sorted(set(names) - set(saved_names))
        raise ValueError('{}{} holds the optimizer state of other parameters than the trainer\'s: '
                         'saved but not in the trainer: {}; in the trainer but not saved: '
                         '{}'.format(path, which, ', '.join(missing[:5]) or '-',
                                        ', '.join(extra[:5]) or '-'))
    index = {n: j for j, n in enumerate(names)}
    mapping = {i: index[n] for i, n in enumerate(saved_names)}
    return None if all(i == j for i, j in mapping.items()) else mapping


def _remap_blob(blob, mapping):
    """A ``Trainer.save_states`` blob with its per-parameter entries (state,
    update counts) moved from the saving trainer's indices to the loading
    trainer's."""
    states, optimizer = pickle.loads(blob)
    done = set()
    for d in [states] + _gluon.optimizer_index_dicts(optimizer):
        if not isinstance(d, dict) or id(d) in done:
            continue
        done.add(id(d))     # the current device's counts are one of every device's
        items = list(d.items())
        d.clear()           # in place: the optimizer's references stay shared
        d.update((mapping.get(k, k) if isinstance(k, int) else k, v) for k, v in items)
    return pickle.dumps((states, optimizer))


def spread_update_counts(trainer):
    """After a load: every device of `trainer` starts from the saved
    update counts.

    1.9.1: a count missing for a device starts at ``begin_num_update``
    (``Optimizer._update_count``), and Adam, Adamax, FTML, LAMB and Nadam
    read it (bias corrections, schedules). ``load_states`` restores the
    counts under the saving run's device ids only, so on more devices (or
    on other device ids: gpu(2), gpu(3) saved, gpu(0), gpu(1) loading) the
    new ones started at 0 and the replicas drifted apart (Adam, 2 -> 4
    contexts, 3 steps: 1.3e-2). Each index's count is the largest any
    device recorded (every device updates every index once per step, so
    they agree in a run that kept its size); every device id the trainer
    updates on gets its own copy, those the saving run used too (the
    kvstore's updater, with ``update_on_kvstore``, updates on its own
    devices).
    """
    optimizer = _gluon.trainer_optimizer(trainer)
    counts = _gluon.device_update_counts(optimizer)
    if counts is None:
        return
    merged = {}
    for per_device in counts.values():
        for index, count in per_device.items():
            merged[index] = max(count, merged.get(index, count))
    devices = list(counts) + _gluon.trainer_device_ids(trainer)
    counts.clear()      # in place: the optimizer's other references stay valid
    counts.update((dev, dict(merged)) for dev in devices)
    _gluon.use_device_update_counts(optimizer, devices[0])


def read_states(path, trainers, info, block):
    """The trainers' state blobs, checked against the trainers, each with its
    entries under the loading trainer's parameter indices; and whether any
    was changed for that."""
    with open(path, 'rb') as f:
        data = f.read()
    try:
        box = pickle.loads(data)
    except Exception:       # checked, with a better message, in _check_blob
        box = None
    if isinstance(box, dict) and box.get('format') == STATES_FORMAT:
        blobs = box['states']
    else:
        blobs = [data]
    if len(blobs) != len(trainers):
        raise ValueError(f"{path} holds the states of {len(blobs):d} "
                         f"trainer{'s' if len(blobs) > 1 else ''}, but {len(trainers):d} "
                         f"{'were' if len(trainers) > 1 else 'was'} given")
    recorded = info.get('trainers') if info else None
    remapped = False
    for i, (blob, t) in enumerate(zip(blobs, trainers)):
        which = '' if len(trainers) == 1 else f' (trainer {i:d})'
        _check_blob(blob, t, path, which)
        if recorded and i < len(recorded):
            # The optimizer state is kept by parameter index, in the order of
            # the parameters' full names, which depends on Gluon's global name
            # counters: the same model built after another one may list its
            # parameters in another order ('..10_gamma' < '..9_gamma').
            # Checkpoints record the structural name of every index; older
            # ones are taken in order.
            saved = recorded[i]['params']
            if len(saved) != len(_gluon.trainer_params(t)):
                raise ValueError(f'{path}{which} was saved by a trainer of {len(saved):d} '
                                 'parameters, but this one '
                                 f'has {len(_gluon.trainer_params(t)):d}')
            mapping = _index_map(recorded[i].get('names'), t, block, path, which)
            for j, old in enumerate(saved):
                p = _gluon.trainer_params(t)[mapping[j] if mapping else j]
                if old and p.shape and all(p.shape) and list(p.shape) != old:
                    raise ValueError(f'{path}{which}: the trainer\'s parameter {j:d} ({p.name}) '
                                     f'has shape {p.shape}, but '
                                     f'the saved one had {tuple(old)}')
            if mapping:
                blobs[i] = _remap_blob(blob, mapping)
                remapped = True
    return blobs, remapped
