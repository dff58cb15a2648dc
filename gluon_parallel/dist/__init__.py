"""Training on several machines: MXNet's ``dist_sync`` kvstore, made boring.

Every worker process runs the same script with its own devices; the
parameter servers sum the workers' gradients, and every worker applies the
same update to its own copy of the parameters. The DMLC environment
(``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``, ...) describes the cluster, so a script
runs unchanged under ``python -m gluon_parallel.launch`` (one machine, ssh
hosts, SLURM), dmlc-tracker or Kubernetes::

    import mxnet as mx
    from mxnet import autograd, gluon
    import gluon_parallel as gp
    from gluon_parallel import dist

    ctx = [mx.gpu(i) for i in range(mx.context.num_gpus())] or [mx.cpu()]
    net.initialize(mx.init.Xavier(), ctx=ctx)      # shapes known (no deferred init)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', {...},
                            kvstore=dist.get_kvstore(), update_on_kvstore=False)
    dist.init_trainer(trainer)       # same initial values everywhere, race-free
    loader = gluon.data.DataLoader(dist.shard(dataset), batch_size=per_worker_batch)
    for data, label in loader:
        with autograd.record():
            losses = dp_loss(dp(data), label)
        autograd.backward(losses)
        trainer.step(dist.global_batch_size(data.shape[0]))
    dist.save_checkpoint('ckpt', net, trainer, epoch=epoch)   # rank 0 writes

Alone (no DMLC environment) every helper degrades to one worker: rank 0 of
1, ``get_kvstore()`` gives ``'device'``, ``shard`` keeps everything.

Measured with mxnet 1.9.1 and handled here:

* ``update_on_kvstore=False`` raced on the first step: the Trainer
  broadcasts rank 0's initial values by ``init`` + ``pull``, and nothing
  orders that pull before another worker's first gradient push, so a late
  pull could return the summed gradient as the weight and the workers
  stayed apart for good (3 runs in 25, all with the same wrong values).
  The process's kvstore (:func:`get_kvstore`) waits for every broadcast
  pull and then holds a barrier (0 in 15 runs), and :func:`init_trainer`
  does all of it before the first forward pass, so every worker also
  computes its first gradients with rank 0's values (0 in 15 runs).
* Updates stay on the workers (``update_on_kvstore=False``): with updates on
  the servers, ``trainer.set_learning_rate`` after the first step never
  reaches them, ``trainer.save_states`` cannot save their state, and they
  would run the optimizer on every key, including the statistics that
  cross-worker SyncBatchNorm sums through the same kvstore.
* A worker that raises (or calls ``sys.exit(N)``, N > 0) would hang at exit
  in ps-lite's finalize barrier, waiting for the others:
  :func:`get_kvstore` installs :mod:`gluon_parallel.launch.failfast`, which
  prints the traceback and exits at once, so a launcher's watchdog sees the
  failure and stops the job (``python -m gluon_parallel.launch`` installs it
  in every Python process it starts, whatever the script imports).
* ps-lite skips loopback interfaces when it picks its own address: when the
  scheduler is on a loopback address, workers bind ``DMLC_NODE_HOST=127.0.0.1``
  (the launcher sets it for every process).
"""
from .kvstore import (is_distributed, get_kvstore, rank, num_workers, is_root, barrier,
                      global_batch_size)
from .trainer_init import init_trainer
from .data import shard, ShardSampler, shard_sampler, GlobalBatchSampler
from .checkpoint import save_checkpoint, load_checkpoint, layouts_of
from .batchnorm import sync_batchnorm_across_workers
from ..progress import busy

__all__ = ['is_distributed', 'get_kvstore', 'rank', 'num_workers', 'is_root', 'barrier',
           'init_trainer', 'global_batch_size', 'shard', 'ShardSampler', 'shard_sampler',
           'GlobalBatchSampler',
           'save_checkpoint', 'load_checkpoint', 'layouts_of', 'sync_batchnorm_across_workers',
           'busy']
