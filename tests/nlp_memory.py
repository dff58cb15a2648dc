"""The memory a BERT fine-tuning run through graph mode takes, in a process
of its own (its peak RSS is its own): ``python nlp_memory.py buckets|largest``
prints the peak of MXNet's array storage in use on the devices (the
profiler's device storage counters, summed over the contexts: what the
executors' arenas share), the peak resident memory grown, both in bytes
from just before the first call, the lengths seen and the largest:
`buckets` trains on the batches of FixedBucketSampler's 8 buckets in its
shuffled order (each padded to its bucket's length; a bucket's short last
batch left out, so that the 8 lengths are the 8 input signatures) with
cache_size=8, `largest` on the largest bucket length alone."""
import os
import sys
import tempfile

import numpy as np

BATCH = 32
BUCKETS = 8
STEPS = 24


def lengths(mode, nlp):
    """The padded length and batch size of every step."""
    rng = np.random.RandomState(0)
    sample_lengths = rng.randint(8, 129, 40 * BATCH).tolist()
    sampler = nlp.data.FixedBucketSampler(sample_lengths, batch_size=BATCH,
                                          num_buckets=BUCKETS, shuffle=True)
    keys = sorted(sampler._bucket_keys)
    np.random.seed(0)                           # (the sampler shuffles with numpy)
    if mode == 'largest':
        return [(keys[-1], BATCH)] * STEPS, keys
    steps = []
    for ids in sampler:
        if len(ids) == BATCH:
            longest = max(sample_lengths[i] for i in ids)
            steps.append((min(k for k in keys if k >= longest), BATCH))
    return steps[:STEPS], keys


def status(field):
    """A /proc/self/status memory field (VmRSS, VmHWM), in bytes."""
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak():
    """Start the peak (VmHWM) again from the current RSS (Linux 4.0 on)."""
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')


def main(mode):
    import mxnet as mx
    from mxnet import autograd, gluon
    import gluonnlp as nlp

    import gluon_parallel as gp
    import nlp_models as m
    ctx = [mx.cpu(i) for i in range(2)]
    net = m.initialized(m.classifier, ctx, units=64, heads=4, max_length=128)
    dp = gp.DataParallel(net, ctx, graph=True, cache_size=BUCKETS)
    dpl = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
    trainer = gp.Trainer(net.collect_params(), 'adam', {'learning_rate': 1e-3})
    steps, keys = lengths(mode, nlp)
    mx.nd.waitall()
    # Its own file: MXNet's profiler replaces the file it is given (a
    # character device such as /dev/null becomes a regular file).
    mx.profiler.set_config(profile_memory=True, aggregate_stats=True,
                           filename=os.path.join(tempfile.mkdtemp(), 'profile.json'))
    mx.profiler.set_state('run')
    reset_peak()
    before = status('VmRSS')
    for length, size in steps:
        b = m.Batch(size, length)
        with autograd.record():
            losses = dpl(dp(b.tokens, b.token_types, valid_length=b.valid_length), b.label)
        autograd.backward(losses)
        trainer.step(size)
    mx.nd.waitall()
    rss = status('VmHWM') - before
    mx.profiler.set_state('stop')
    assert dp.last_path == 'graph'
    print(storage_peak(mx.profiler.dumps()), rss, len({s[0] for s in steps}), max(keys))


def storage_peak(dump):
    """The devices' peak storage in use, in bytes: the sum of the "Max Use
    (kB)" column of the profiler's "Memory: cpu/N" rows (an upper bound of
    the peak of their sum)."""
    rows = [line.split() for line in dump.splitlines() if line.startswith('Memory: ')]
    return int(sum(float(r[4]) for r in rows) * 1024)


if __name__ == '__main__':
    main(sys.argv[1])
