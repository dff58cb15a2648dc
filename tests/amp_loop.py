"""Training loops for tests/test_amp.py: three SGD steps of a small conv net,
either the plain single-device Gluon loop (the reference) or DataParallel +
DataParallelLoss, with or without MXNet's AMP.

``amp.init()`` patches MXNet for the whole process, so the AMP loops run in
a subprocess: ``python amp_loop.py INIT.npz OUT.npz``. The float32
reference is imported and run in the test's own process.
"""
import sys
import warnings

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

BATCH = 12
STEPS = 3
SPIKE_STEP = 1          # its loss is weighted 1e34: the scaled gradients overflow
SGD = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-4}


def conv_net(norm=nn.BatchNorm):
    net = nn.HybridSequential(prefix='net_')
    with net.name_scope():
        net.add(nn.Conv2D(8, 3, padding=1, in_channels=1, use_bias=False),
                norm(in_channels=8), nn.Activation('relu'),
                nn.Conv2D(8, 3, strides=2, in_channels=8, use_bias=False),
                norm(in_channels=8), nn.Activation('relu'),
                nn.GlobalAvgPool2D(), nn.Dense(3, in_units=8))
    return net


def make_init(path):
    rng = np.random.RandomState(0)
    values = {}
    for k, p in conv_net()._collect_params_with_prefix().items():
        v = rng.uniform(0.5, 1.5, p.shape) if k.endswith(('var', 'gamma')) \
            else rng.normal(0, 0.3, p.shape)
        values[k] = v.astype(np.float32)
    np.savez(path, **values)


def batches():
    rng = np.random.RandomState(1)
    for step in range(STEPS):
        x = rng.normal(size=(BATCH, 1, 8, 8)).astype(np.float32)
        y = rng.randint(0, 3, BATCH).astype(np.float32)
        w = np.full((BATCH, 1), 1e34 if step == SPIKE_STEP else 1.0, np.float32)
        yield nd.array(x), nd.array(y), nd.array(w)


def _load(net, init, ctx):
    net.initialize(ctx=ctx)
    for k, p in net._collect_params_with_prefix().items():
        p.set_data(nd.array(init[k]))


def _state(net):
    # A static_shape CachedOp's backward writes BatchNorm's running
    # statistics without MXNet's engine knowing (MXNet 1.9.1): a read orders
    # after it only once everything pushed has run (measured: under AMP the
    # read came first and saw the values before the step).
    nd.waitall()
    return {k: p.data(p.list_ctx()[0]).astype('float32').asnumpy()
            for k, p in net._collect_params_with_prefix().items()}


def single_device(init, use_amp, skip=()):
    """Plain Gluon on mx.cpu(0) with gluon.nn.BatchNorm. Without AMP,
    `skip` lists steps whose update is left out (what AMP does on overflow);
    their backward still runs, as under AMP (MXNet's BatchNorm updates its
    running statistics in backward)."""
    net = conv_net()
    _load(net, init, mx.cpu(0))
    trainer = gluon.Trainer(net.collect_params(), 'sgd', SGD)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    if use_amp:
        from mxnet.contrib import amp
        amp.init_trainer(trainer)
    scaler, states = [], []
    for step, (x, y, w) in enumerate(batches()):
        with autograd.record():
            loss = loss_fn(net(x), y, w)
            if use_amp:
                with amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            else:
                loss.backward()
        if use_amp or step not in skip:
            trainer.step(BATCH)
        if use_amp:
            s = trainer._amp_loss_scaler
            scaler.append((s._loss_scale, s._next_loss_scale, s._unskipped))
        states.append(_state(net))
    return scaler, states


def data_parallel(init, num_ctx, norm, update_on_kvstore=False, graph=None, trainer_cls=None):
    """DataParallel + DataParallelLoss + AMP on num_ctx CPU contexts, the
    Trainer created with `update_on_kvstore` (None: Gluon's default).
    `graph`: None, the network imperative; else hybridized (static_alloc,
    static_shape; False, the per-replica reference: plain), and
    DataParallel's `graph` option. `trainer_cls`:
    gluon.Trainer by default."""
    from mxnet.contrib import amp
    import gluon_parallel as gp
    ctx = [mx.cpu(i) for i in range(num_ctx)]
    net = conv_net(norm)
    _load(net, init, ctx)
    if graph is False:
        # The per-replica reference: without static_alloc, whose BatchNorm
        # backward writes the running statistics outside MXNet's engine
        # ordering (DESIGN.md): a reference that itself varied run to run
        # (a loaded machine's running_mean off by 0.04 at step 0, twice).
        net.hybridize()
    elif graph is not None:
        net.hybridize(static_alloc=True, static_shape=True)
    # Updates on the workers: with update_on_kvstore the kvstore applies an
    # overflowing update before AMP's check could skip it (measured: NaN).
    trainer = (trainer_cls or gluon.Trainer)(net.collect_params(), 'sgd', SGD,
                                             update_on_kvstore=update_on_kvstore)
    amp.init_trainer(trainer)
    dp_loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    scaler, states, dtypes, gathered = [], [], set(), None
    with gp.DataParallel(net, ctx, graph='auto' if graph is None else graph) as dp:
        for x, y, w in batches():
            with autograd.record():
                outputs = dp(x)
                losses = dp_loss(outputs, y, w)
                with amp.scale_loss(losses, trainer) as scaled:
                    autograd.backward(scaled)
            trainer.step(BATCH)
            s = trainer._amp_loss_scaler
            scaler.append((s._loss_scale, s._next_loss_scale, s._unskipped))
            states.append(_state(net))
            dtypes.add(str(outputs[0].dtype))
            if gathered is None:        # bfloat16 outputs, gathered to cpu(0)
                whole = gp.gather(outputs, mx.cpu(0))
                gathered = (str(whole.dtype), nd.amp_cast(whole, dtype='float32').asnumpy(),
                            np.concatenate([nd.amp_cast(o, dtype='float32').asnumpy()
                                            for o in outputs]))
        binds = (dp.graph_mode.binds if dp.graph_mode is not None else 0,
                 dp_loss.graph_loss.binds)
        path = dp.last_path
    return scaler, states, dtypes, gathered, binds, path


def path_of(init, num_ctx, norm, graph):
    """(DataParallel.last_path, executors bound for the network and the
    loss) of one float32 step of the hybridized network of
    :func:`data_parallel`, without AMP: which path a configuration takes
    needs no bfloat16 arithmetic."""
    import gluon_parallel as gp
    ctx = [mx.cpu(i) for i in range(num_ctx)]
    net = conv_net(norm)
    _load(net, init, ctx)
    net.hybridize(static_alloc=True, static_shape=True)
    dp_loss = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    x, y, w = next(batches())
    with gp.DataParallel(net, ctx, graph=graph) as dp:
        with autograd.record():
            losses = dp_loss(dp(x), y, w)
        autograd.backward(losses)
        nd.waitall()
        return dp.last_path, (dp.graph_mode.binds if dp.graph_mode is not None else 0,
                              dp_loss.graph_loss.binds)


def contracts(init, num_ctx, norm):
    """What DataParallel does with the Trainers under AMP before it computes
    anything (so on any CPU, bfloat16 kernels or not): a Trainer that asks
    to update on its kvstore is refused; one left to Gluon's default is
    switched to update_on_kvstore=False with a warning, at the first
    recorded call (whose arithmetic may then fail on a CPU without
    bfloat16 kernels: that is not checked here)."""
    out = {}
    try:
        data_parallel(init, num_ctx, norm, update_on_kvstore=True)
        out['explicit/error'] = np.array('')
    except ValueError as e:
        out['explicit/error'] = np.array(str(e))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            data_parallel(init, num_ctx, norm, update_on_kvstore=None)
        except mx.base.MXNetError:
            pass                    # (no bfloat16 kernels on this CPU)
    out['default/warnings'] = np.array([str(w.message) for w in caught] or [''])
    return out


def statistics(norm, num_ctx, use_amp, hybridize=False):
    """Running mean and variance (on the first context, momentum 0: the
    batch's own statistics) of `norm` inside DataParallel, fed through a
    1x1 convolution of weight 1 with a batch whose values sit far from zero
    (mean 100, std 1), where low-precision sums show. Returns them with the
    exact input the layer saw (the convolution's output, bfloat16-rounded
    under AMP). `hybridize`: BatchNorm runs in graph mode, SyncBatchNorm
    in its stages."""
    import gluon_parallel as gp
    ctx = [mx.cpu(i) for i in range(num_ctx)]
    net = nn.HybridSequential()
    net.add(nn.Conv2D(2, 1, in_channels=1, use_bias=False), norm(in_channels=2, momentum=0))
    net.initialize(mx.init.One(), ctx=ctx)
    if hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    x = nd.array(100 + np.random.RandomState(2).normal(size=(32, 1, 16, 16)))
    seen = net[0](x.as_in_context(ctx[0]))          # the layer's input, whole batch
    with gp.DataParallel(net, ctx) as dp:
        with autograd.record():
            sums = [nd.amp_cast(o, dtype='float32').sum() for o in dp(x)]
        autograd.backward(sums)     # MXNet's BatchNorm updates running statistics in backward
    bn = net[1]
    return (nd.amp_cast(seen, dtype='float32').asnumpy(),
            bn.running_mean.data(ctx[0]).asnumpy(), bn.running_var.data(ctx[0]).asnumpy())


def _flatten(prefix, scaler, states):
    out = {prefix + 'scaler': np.array(scaler)}
    for i, st in enumerate(states):
        out.update({f'{prefix}{i:d}/{k}': v for k, v in st.items()})
    return out


#: The hybridized runs: prefix -> (normalisation, DataParallel's graph).
HYBRID = {'graph/': ('BatchNorm', 'auto'), 'replicas/': ('BatchNorm', False),
          'sync-h/': ('SyncBatchNorm', 'auto')}


def norm_layer(name):
    import gluon_parallel as gp
    return gp.nn.SyncBatchNorm if name == 'SyncBatchNorm' else nn.BatchNorm


def main(init_path, out_path, num_ctx, what):
    """`what`: 'all', every run; 'contracts', only :func:`contracts`."""
    from mxnet.contrib import amp
    amp.init(target_dtype='bfloat16')       # before any network is built
    import gluon_parallel as gp
    init = dict(np.load(init_path))
    norm = gp.nn.SyncBatchNorm
    if what == 'contracts':
        np.savez(out_path, **contracts(init, num_ctx, norm))
        return
    out = _flatten('single/', *single_device(init, use_amp=True))
    scaler, states, dtypes, gathered, _, _ = data_parallel(init, num_ctx, norm)
    out.update(_flatten('dp/', scaler, states))
    out['dp/gathered_dtype'], out['dp/gathered'], out['dp/outputs'] = gathered
    out['dp/output_dtype'] = np.array(sorted(dtypes))
    # gp.Trainer: its fused update behind AMP's overflow check.
    scaler, states, _, _, _, _ = data_parallel(init, num_ctx, norm, trainer_cls=gp.Trainer)
    out.update(_flatten('gp-trainer/', scaler, states))
    # A Trainer left to Gluon's default (updates on the kvstore with several
    # devices): switched with a warning (contracts()), so the same steps as above.
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        scaler, states, _, _, _, _ = data_parallel(init, num_ctx, norm, update_on_kvstore=None)
    out.update(_flatten('default/', scaler, states))
    # Hybridized: BatchNorm and SyncBatchNorm, each on the path DataParallel
    # chooses (tests/test_amp.py checks it is the float32 run's).
    for prefix, (layer, graph) in HYBRID.items():
        scaler, states, dtypes, _, binds, path = data_parallel(init, num_ctx, norm_layer(layer),
                                                               graph=graph)
        out.update(_flatten(prefix, scaler, states))
        out[prefix + 'output_dtype'] = np.array(sorted(dtypes))
        out[prefix + 'binds'] = np.array(binds)
        out[prefix + 'path'] = np.array(path)
    for name, layer in (('BatchNorm', nn.BatchNorm), ('SyncBatchNorm', gp.nn.SyncBatchNorm)):
        for mode, hybridize in (('', False), ('-h', True)):
            values = statistics(layer, num_ctx, True, hybridize)
            for key, value in zip(('input', 'mean', 'var'), values):
                out[f'stats/{name}{mode}/{key}'] = value
    np.savez(out_path, **out)


if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
