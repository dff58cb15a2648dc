"""Training helpers: parameter checks, broadcasting, stale gradients and
checkpoints that resume exactly.

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
import hashlib
import json
import os
import pickle
import shutil
import uuid
import warnings

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

from .nn.embedding import is_pinned

__all__ = ['check_params', 'broadcast_params', 'sync_running_stats', 'step',
           'save_checkpoint', 'load_checkpoint']

_FORMAT = 'gluon_parallel.checkpoint'
_STATES_FORMAT = 'gluon_parallel.trainer_states'
_VERSION = 1


def check_params(block, ctx_list):
    """Check that every parameter of `block` is ready for data-parallel use.

    Raises ValueError naming the parameter (and the context) when one is
    uninitialised, missing on a context of `ctx_list`, or on a context twice,
    or when one Parameter object appears under two names. Deferred
    initialisation counts as initialised on the contexts it was given, so
    this runs before any forward pass. A parameter kept on one context on
    purpose (:func:`~gluon_parallel.nn.embedding.is_pinned`: a HostEmbedding
    table, which replicas read through) is allowed; any other parameter on
    fewer contexts than `ctx_list` is an error.

    Parameters
    ----------
    block : Block
    ctx_list : list of Context
    """
    ctx_list = list(ctx_list)
    if len(set(ctx_list)) != len(ctx_list):
        raise ValueError('ctx_list lists a context twice: %s' % ctx_list)
    seen = {}
    for name, p in block.collect_params().items():
        if id(p) in seen:
            raise ValueError('parameter %s is listed twice, also as %s' % (name, seen[id(p)]))
        seen[id(p)] = name
        if p._data is None and not p._deferred_init:
            raise ValueError('parameter %s is not initialized: call initialize(ctx=%s) first'
                             % (name, ctx_list))
        pctx = p.list_ctx()
        if len(set(pctx)) != len(pctx):
            raise ValueError('parameter %s is initialized on a context twice: %s' % (name, pctx))
        if is_pinned(p):
            continue            # replicas read through it from their own devices
        missing = [c for c in ctx_list if c not in pctx]
        if missing:
            raise ValueError('parameter %s is not on context %s (it is on %s): initialize '
                             'the block with ctx=%s' % (name, missing[0], pctx, ctx_list))


def broadcast_params(block, root_ctx=None):
    """Copy every parameter's value (running statistics included) from
    `root_ctx` to all its other contexts.

    Parameters
    ----------
    block : Block
    root_ctx : Context, optional
        Default: each parameter's first context.
    """
    with autograd.pause():
        for name, p in block.collect_params().items():
            if p._data is None:
                continue
            ctxs = p.list_ctx()
            src = root_ctx if root_ctx is not None else ctxs[0]
            if src not in ctxs:
                raise ValueError('parameter %s is not on root context %s (it is on %s)'
                                 % (name, src, ctxs))
            value = p.data(src)
            for c, d in zip(ctxs, p.list_data()):
                if c != src:
                    value.copyto(d)


# ----------------------------------------------------------------------------
# Values across contexts

def _unwrap(block):
    """The model inside a DataParallel (whose own parameter names carry a
    ``_block.`` prefix that a plain model would not recognise)."""
    from .data_parallel import DataParallel
    return block.block if isinstance(block, DataParallel) else block


def _copies(p):
    return [d.asnumpy() for d in p.list_data()]


def _differs(copies):
    return any(not np.array_equal(copies[0], c) for c in copies[1:])


def _mean(copies):
    return np.mean(np.stack(copies), axis=0, dtype=np.float64).astype(copies[0].dtype)


def sync_running_stats(block):
    """Average, over its contexts, every replicated parameter that gets no
    gradient (``grad_req='null'``: BatchNorm running mean and variance,
    frozen layers) wherever the copies differ, in place.

    A plain ``gluon.nn.BatchNorm`` inside DataParallel updates its running
    statistics from its own device's slice, so the copies drift apart (a
    SyncBatchNorm keeps them identical and needs none of this). Call this
    before evaluating on several devices; :func:`save_checkpoint` calls it,
    so a saved model, and the one that keeps training after the save, hold
    the same statistics on every device. With equal slices, the average of
    the per-device running means is the running mean of the whole batches,
    but the average of the running variances misses the spread between
    slices: use SyncBatchNorm when exact statistics matter.

    Parameters
    ----------
    block : Block

    Returns
    -------
    list of str
        Structural names (as in ``save_parameters``) of the parameters whose
        copies differed, and were averaged.
    """
    changed, seen = [], set()
    with autograd.pause():
        for name, p in _unwrap(block)._collect_params_with_prefix().items():
            if id(p) in seen or p.grad_req != 'null' or p._data is None \
                    or len(p.list_ctx()) < 2 or p._stype != 'default':
                continue
            seen.add(id(p))
            copies = _copies(p)
            if _differs(copies):
                value = _mean(copies)
                for d in p.list_data():
                    d[:] = value
                changed.append(name)
    return changed


def _param_value(name, p):
    """One CPU copy of `p`'s value: that of its first context, exactly, when
    the copies agree, else their average (as Gluon's save_parameters does),
    with a warning for a trained parameter, whose copies never differ in a
    correct data-parallel loop."""
    if p._stype != 'default':
        return p._reduce()      # a row_sparse weight: the trainer's kvstore holds it
    datas = p.list_data()
    if len(datas) == 1:         # e.g. a large table on one context: no extra copy
        return datas[0] if datas[0].context.device_type == 'cpu' else datas[0].copyto(mx.cpu())
    copies = _copies(p)
    if not _differs(copies):
        return datas[0].copyto(mx.cpu())
    if p.grad_req != 'null':
        dev = max(float(np.max(np.abs(c.astype(np.float64) - copies[0]))) for c in copies[1:])
        warnings.warn('parameter %s differs between its contexts %s (by up to %g): saving '
                      'the average. Something wrote to one copy only'
                      % (name, p.list_ctx(), dev), RuntimeWarning, stacklevel=3)
    value = _mean(copies)
    return nd.array(value, ctx=mx.cpu(), dtype=value.dtype)


# ----------------------------------------------------------------------------
# Stale gradients

def _as_trainers(trainer):
    if trainer is None:
        return []
    trainers = list(trainer) if isinstance(trainer, (list, tuple)) else [trainer]
    for t in trainers:
        if not isinstance(t, gluon.Trainer):
            raise TypeError('expected a gluon.Trainer (or a list of them), got %s'
                            % type(t).__name__)
    return trainers


def step(trainer, batch_size, ignore_stale_grad=False):
    """``trainer.step(batch_size)`` that skips unused parameters correctly
    on several devices.

    A parameter that got no gradient since the last step (a branch the
    model did not take) makes ``Trainer.step`` raise. Gluon's own
    ``ignore_stale_grad=True`` is exact on one device only: on several,
    the Trainer still sums the stale gradients into the update (with the
    default ``update_on_kvstore`` it applies the previous step's gradient
    again). With ``ignore_stale_grad=True`` this function instead

    - skips a parameter that got no gradient on any of its contexts (no
      update, no weight decay, no momentum: as on one device);
    - counts zero for the contexts of a parameter that some replicas used
      and others did not, so all its copies get the same update from the
      gradients that do exist.

    Frozen parameters (``grad_req='null'``) are always left alone.

    Parameters
    ----------
    trainer : Trainer or list of Trainer
        Several trainers (e.g. one for a table kept on one context by
        :class:`~gluon_parallel.nn.HostEmbedding` and one for the
        replicated parameters) all step with the same batch size.
    batch_size : int
        The global batch size: gradients are divided by it.
    ignore_stale_grad : bool, default False
        False raises like ``Trainer.step`` (a UserWarning naming the
        parameter and the contexts), since a stale gradient is usually a bug.
    """
    trainers = _as_trainers(trainer)
    if not trainers:
        raise TypeError('step needs a gluon.Trainer')
    hidden = []
    try:
        with autograd.pause():
            for t in trainers:
                for p in t._params:
                    if p.grad_req == 'null' or p._data is None:
                        continue
                    datas = p.list_data()
                    fresh = [d._fresh_grad for d in datas]
                    if all(fresh):
                        continue
                    if not ignore_stale_grad:
                        stale = [c for c, f in zip(p.list_ctx(), fresh) if not f]
                        raise UserWarning(
                            'parameter %s got no gradient on %s since the last step. If the '
                            'model deliberately leaves it unused, call '
                            'gluon_parallel.step(trainer, batch_size, ignore_stale_grad=True)'
                            % (p.name, stale))
                    if not any(fresh):
                        # Hide it from this step: the Trainer neither reduces
                        # nor updates a parameter whose grad_req is 'null'.
                        hidden.append((p, p._grad_req))
                        p._grad_req = 'null'
                        continue
                    for d, g, f in zip(datas, p.list_grad(), fresh):
                        if not f:
                            if p.grad_req == 'write':
                                g[:] = 0
                            d._fresh_grad = True
        for t in trainers:
            t.step(batch_size)
            # With update_on_kvstore, Trainer.step never marks gradients as
            # used, so the next step could not tell a stale one: mark them.
            for p in t._params:
                if p.grad_req != 'null' and p._data is not None:
                    for d in p.list_data():
                        d._fresh_grad = False
    finally:
        for p, req in hidden:
            p._grad_req = req


# ----------------------------------------------------------------------------
# Atomic files

def _tmp_path(path):
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, '.%s.tmp-%d-%s' % (tail, os.getpid(), uuid.uuid4().hex[:8]))


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path):
    try:
        _fsync(os.path.dirname(os.path.abspath(path)) or '.')
    except OSError:     # not every platform can open a directory
        pass


def _digest(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            h.update(chunk)
    return {'bytes': os.path.getsize(path), 'sha256': h.hexdigest()}


class _Staged(object):
    """Files written under temporary names, renamed into place together by
    commit(); close() removes whatever was not committed."""

    def __init__(self):
        self._files = []

    def write(self, path, writer):
        tmp = _tmp_path(path)
        self._files.append((tmp, path))
        writer(tmp)
        if not os.path.isfile(tmp):
            raise IOError('nothing was written to %s' % tmp)
        _fsync(tmp)
        return tmp

    def commit(self):
        # The renames are atomic one by one, not together: keep the previous
        # files as *.prev until the last rename (the json) is done, so a
        # crash between two renames still leaves the previous checkpoint
        # whole (load_checkpoint falls back to the *.prev its json vouches for).
        kept = []
        for _, path in self._files:
            if os.path.isfile(path):
                _keep_previous(path)
                kept.append(path + _PREV)
        _fsync_dir(self._files[-1][1])
        while self._files:
            tmp, path = self._files[0]
            os.replace(tmp, path)
            self._files.pop(0)
        _fsync_dir(path)
        for prev in kept:
            try:
                os.remove(prev)
            except OSError:
                pass

    def close(self):
        for tmp, _ in self._files:
            try:
                os.remove(tmp)
            except OSError:
                pass
        self._files = []


_PREV = '.prev'


def _keep_previous(path):
    prev = path + _PREV
    if os.path.exists(prev):
        os.remove(prev)
    try:
        os.link(path, prev)         # no copy: the rename only moves the name
    except OSError:
        shutil.copy2(path, prev)


def _write_bytes(data):
    def writer(path):
        with open(path, 'wb') as f:
            f.write(data)
    return writer


# ----------------------------------------------------------------------------
# Checkpoints

def _paths(prefix):
    prefix = os.fspath(prefix)
    return prefix + '.params', prefix + '.states', prefix + '.json'


def _structural_names(block, trainer):
    """The structural name (as in ``save_parameters``) of each parameter of
    `trainer`, in the trainer's order; None for one that is not in `block`."""
    by_id = {}
    for name, p in block._collect_params_with_prefix().items():
        by_id.setdefault(id(p), name)
    return [by_id.get(id(p)) for p in trainer._params]


def _trainer_info(t, block):
    # gluon.Trainer orders its parameters, and so keys its optimizer state,
    # by their full names, which carry Gluon's global counters
    # ('conv12_weight'): record which parameter each index belongs to.
    return {'optimizer': type(t.optimizer).__name__,
            'params': [list(p.shape) if p.shape else None for p in t._params],
            'names': _structural_names(block, t)}


def save_checkpoint(prefix, block, trainer=None, **meta):
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
    block = _unwrap(block)
    trainers = _as_trainers(trainer)
    params_path, states_path, json_path = _paths(prefix)
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError('checkpoint meta data must be JSON-serialisable: %s' % e)
    params = block._collect_params_with_prefix()
    for name, p in params.items():
        if p._data is None:
            raise ValueError('cannot save %s: parameter %s is not initialized%s'
                             % (params_path, name, ' yet (run one forward pass first)'
                                if p._deferred_init else ''))
    sync_running_stats(block)
    values = {}
    for name, p in params.items():
        values[name] = _param_value(name, p)

    folder = os.path.dirname(os.path.abspath(params_path))
    os.makedirs(folder, exist_ok=True)
    staged = _Staged()
    try:
        info = {'format': _FORMAT, 'version': _VERSION, 'meta': meta, 'files': {}}
        tmp = staged.write(params_path, lambda f: nd.save(f, values))
        info['files']['params'] = dict(_digest(tmp), name=os.path.basename(params_path))
        if trainers:
            if len(trainers) == 1:
                tmp = staged.write(states_path, trainers[0].save_states)
            else:
                tmp = staged.write(states_path, _write_bytes(_pack_states(trainers, folder)))
            info['files']['states'] = dict(_digest(tmp), name=os.path.basename(states_path))
            info['trainers'] = [_trainer_info(t, block) for t in trainers]
        text = json.dumps(info, indent=1, sort_keys=True).encode('utf-8')
        staged.write(json_path, _write_bytes(text))
        staged.commit()         # json last: it vouches for the other two
    finally:
        staged.close()
    out = {'params': params_path, 'json': json_path}
    if trainers:
        out['states'] = states_path
    return out


def _pack_states(trainers, folder):
    blobs = []
    for t in trainers:
        tmp = _tmp_path(os.path.join(folder, 'trainer'))
        try:
            t.save_states(tmp)
            with open(tmp, 'rb') as f:
                blobs.append(f.read())
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return pickle.dumps({'format': _STATES_FORMAT, 'version': _VERSION, 'states': blobs})


def _read_json(path):
    try:
        with open(path, 'rb') as f:
            info = json.loads(f.read().decode('utf-8'))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError('%s is not a readable checkpoint description (truncated or '
                         'foreign file?): %s' % (path, e))
    if not isinstance(info, dict) or info.get('format') != _FORMAT:
        raise ValueError('%s is not a gluon_parallel checkpoint description' % path)
    if info.get('version', 0) > _VERSION:
        raise ValueError('%s was written by a newer gluon_parallel (format version %s)'
                         % (path, info.get('version')))
    return info


def _verify(path, recorded, json_path):
    """The file the json vouches for: `path`, or the previous version kept
    by an interrupted save (see _Staged.commit)."""
    if recorded is None:
        return path
    want = {'bytes': recorded.get('bytes'), 'sha256': recorded.get('sha256')}
    actual = _digest(path)
    if actual == want:
        return path
    if os.path.isfile(path + _PREV) and _digest(path + _PREV) == want:
        return path + _PREV
    raise ValueError('%s does not match %s (%d bytes, recorded %s): the file was '
                     'truncated or replaced, or the save that wrote it was interrupted'
                     % (path, json_path, actual['bytes'], recorded.get('bytes')))


def _read_params(path, block):
    """Read and check a params file against `block`: returns a list of
    (Parameter, value), or raises naming the file and the parameter."""
    try:
        loaded = nd.load(path)
    except mx.base.MXNetError as e:
        raise ValueError('%s is not a readable MXNet parameter file (truncated or '
                         'foreign?): %s' % (path, str(e).strip().splitlines()[0]))
    if not isinstance(loaded, dict) or not loaded:
        raise ValueError('%s holds no named parameters (not a Gluon parameter file?)' % path)
    names = block._collect_params_with_prefix()
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
            raise ValueError('%s: parameter %s has shape %s in the file but %s in the model'
                             % (path, found[0], value.shape, p.shape))
        if p.dtype is not None and np.dtype(p.dtype) != value.dtype:
            raise ValueError('%s: parameter %s has dtype %s in the file but %s in the model'
                             % (path, found[0], value.dtype, np.dtype(p.dtype).name))
        plan.append((p, value))
    if missing:
        hint = ''
        if all(k.startswith(('arg:', 'aux:')) for k in loaded):
            hint = ' (it looks like an exported inference model: load it with SymbolBlock.imports)'
        elif not any('.' in k for k in loaded):
            hint = (' (it uses full parameter names, as ParameterDict.save writes: load it with '
                    'block.collect_params().load)')
        raise ValueError('%s has no value for parameter%s %s of the model%s'
                         % (path, 's' if len(missing) > 1 else '', ', '.join(missing[:5]) +
                            (' ...' if len(missing) > 5 else ''), hint))
    extra = sorted(set(loaded) - set(names))
    if extra:
        raise ValueError('%s has parameter%s %s that the model does not have'
                         % (path, 's' if len(extra) > 1 else '', ', '.join(extra[:5]) +
                            (' ...' if len(extra) > 5 else '')))
    return plan


def _check_blob(blob, trainer, path, which):
    try:
        states = pickle.loads(blob)
    except Exception as e:      # a truncated pickle raises many types
        raise ValueError('%s%s is not a readable trainer state (truncated or foreign '
                         'file?): %s: %s' % (path, which, type(e).__name__, e))
    if not (isinstance(states, tuple) and len(states) == 2 and isinstance(states[0], dict)
            and isinstance(states[1], mx.optimizer.Optimizer)):
        raise ValueError('%s%s is not a trainer state written by Trainer.save_states'
                         % (path, which))
    saved, current = type(states[1]).__name__, type(trainer.optimizer).__name__
    if saved != current:
        raise ValueError('%s%s holds the state of a %s optimizer, but the trainer uses %s'
                         % (path, which, saved, current))


def _index_map(saved_names, trainer, block, path, which):
    """{saved index: this trainer's index}, from the structural names
    recorded at save time; None when the order is the same, or unknown
    (a checkpoint of an older version, a parameter outside the block)."""
    names = _structural_names(block, trainer)
    if not saved_names or None in saved_names or None in names:
        return None
    if sorted(saved_names) != sorted(names):
        missing = sorted(set(saved_names) - set(names))
        extra = sorted(set(names) - set(saved_names))
        raise ValueError('%s%s holds the optimizer state of other parameters than the '
                         'trainer\'s: saved but not in the trainer: %s; in the trainer but not '
                         'saved: %s' % (path, which, ', '.join(missing[:5]) or '-',
                                        ', '.join(extra[:5]) or '-'))
    index = {n: j for j, n in enumerate(names)}
    mapping = {i: index[n] for i, n in enumerate(saved_names)}
    return None if all(i == j for i, j in mapping.items()) else mapping


def _remap_blob(blob, mapping):
    """A ``Trainer.save_states`` blob with its per-parameter entries (state,
    update counts) moved from the saving trainer's indices to the loading
    trainer's."""
    states, optimizer = pickle.loads(blob)
    dicts = [states, getattr(optimizer, '_index_update_count', None),
             getattr(optimizer, 'idx2name', None), getattr(optimizer, 'lr_mult', None),
             getattr(optimizer, 'wd_mult', None)]
    dicts += list(getattr(optimizer, '_all_index_update_counts', {}).values())
    done = set()
    for d in dicts:
        if not isinstance(d, dict) or id(d) in done:
            continue
        done.add(id(d))     # _index_update_count is one of _all_index_update_counts
        items = list(d.items())
        d.clear()           # in place: the optimizer's references stay shared
        d.update((mapping.get(k, k) if isinstance(k, int) else k, v) for k, v in items)
    return pickle.dumps((states, optimizer))


def _read_states(path, trainers, info, block):
    """The trainers' state blobs, checked against the trainers, each with its
    entries under the loading trainer's parameter indices; and whether any
    was changed for that."""
    with open(path, 'rb') as f:
        data = f.read()
    try:
        box = pickle.loads(data)
    except Exception:       # checked, with a better message, in _check_blob
        box = None
    if isinstance(box, dict) and box.get('format') == _STATES_FORMAT:
        blobs = box['states']
    else:
        blobs = [data]
    if len(blobs) != len(trainers):
        raise ValueError('%s holds the states of %d trainer%s, but %d %s given'
                         % (path, len(blobs), 's' if len(blobs) > 1 else '', len(trainers),
                            'were' if len(trainers) > 1 else 'was'))
    recorded = info.get('trainers') if info else None
    remapped = False
    for i, (blob, t) in enumerate(zip(blobs, trainers)):
        which = '' if len(trainers) == 1 else ' (trainer %d)' % i
        _check_blob(blob, t, path, which)
        if recorded and i < len(recorded):
            # The optimizer state is kept by parameter index, in the order of
            # the parameters' full names, which depends on Gluon's global name
            # counters: the same model built after another one may list its
            # parameters in another order ('..10_gamma' < '..9_gamma').
            # Checkpoints record the structural name of every index; older
            # ones are taken in order.
            saved = recorded[i]['params']
            if len(saved) != len(t._params):
                raise ValueError('%s%s was saved by a trainer of %d parameters, but this one '
                                 'has %d' % (path, which, len(saved), len(t._params)))
            mapping = _index_map(recorded[i].get('names'), t, block, path, which)
            for j, old in enumerate(saved):
                p = t._params[mapping[j] if mapping else j]
                if old and p.shape and all(p.shape) and list(p.shape) != old:
                    raise ValueError('%s%s: the trainer\'s parameter %d (%s) has shape %s, but '
                                     'the saved one had %s' % (path, which, j, p.name,
                                                               p.shape, tuple(old)))
            if mapping:
                blobs[i] = _remap_blob(blob, mapping)
                remapped = True
    return blobs, remapped


def _place(p, value, ctx_list):
    """Give `p` the value `value` on every one of its contexts."""
    pinned = is_pinned(p)
    if p._data is None:
        if p._deferred_init:
            if ctx_list is not None and not pinned:
                p.reset_ctx(ctx_list)
            p._load_init(value, None)
        else:
            p._load_init(value, ctx_list if ctx_list is not None else [mx.current_context()])
        return
    if ctx_list is not None and not pinned and p.list_ctx() != list(ctx_list):
        p.reset_ctx(ctx_list)
    # set_data also resets a trainer's kvstore that holds the old weights.
    p.set_data(value)


def load_checkpoint(prefix, block, trainer=None, ctx_list=None):
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
    block = _unwrap(block)
    trainers = _as_trainers(trainer)
    if ctx_list is not None:
        ctx_list = [ctx_list] if isinstance(ctx_list, mx.Context) else list(ctx_list)
    params_path, states_path, json_path = _paths(prefix)
    if not os.path.isfile(params_path):
        raise FileNotFoundError('checkpoint file %s does not exist' % params_path)
    info = _read_json(json_path) if os.path.isfile(json_path) else None
    files = info.get('files', {}) if info else {}
    params_path = _verify(params_path, files.get('params'), json_path)
    plan = _read_params(params_path, block)
    blobs, remapped = None, False
    if trainers:
        if info is not None and 'states' not in files:
            raise ValueError('%s was saved without a trainer: there is no optimizer state '
                             'to load' % json_path)
        if not os.path.isfile(states_path):
            raise FileNotFoundError('checkpoint file %s does not exist' % states_path)
        states_path = _verify(states_path, files.get('states'), json_path)
        blobs, remapped = _read_states(states_path, trainers, info, block)

    with autograd.pause():
        for p, value in plan:
            _place(p, value, ctx_list)
    if trainers:
        # After the parameters: a trainer whose kvstore was reset by
        # set_data rebuilds it from the loaded values here.
        if len(trainers) == 1 and not remapped:
            trainers[0].load_states(states_path)
        else:
            folder = os.path.dirname(os.path.abspath(states_path))
            for t, blob in zip(trainers, blobs):
                tmp = _tmp_path(os.path.join(folder, 'trainer'))
                try:
                    _write_bytes(blob)(tmp)
                    t.load_states(tmp)
                finally:
                    if os.path.exists(tmp):
                        os.remove(tmp)
    return dict(info.get('meta', {})) if info else {}
