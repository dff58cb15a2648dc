"""GluonNLP's BERT fine-tuning step through DataParallel (issue 55).

BERT-small (GluonNLP 0.10's BERTClassifier built by its constructor,
random initialisation: 4 layers, 128 units, 4 heads, 512 hidden, a
30522-word vocabulary), sequence length 64, global batch 32, Adam, 4 CPU
contexts, synthetic tokens. One step = forward, softmax cross-entropy,
backward and the Trainer's step, then ``nd.waitall()``. Every contender runs
in its own process, timed in interleaved rounds:

  ours-kw        DataParallel (graph='auto') + DataParallelLoss + gp.Trainer,
                 called as GluonNLP's scripts call the model:
                 ``dp(tokens, token_types, valid_length=vl)``
  ours-pos       the same with valid_length positional
  ours-replicas  the keyword call with graph=False (replica by replica)
  loop           the plain Gluon loop of GluonNLP's scripts:
                 ``gluon.utils.split_and_load`` of every input, the
                 hybridized network per device, ``gluon.Trainer``
  single         one context, the whole batch
  ours-kw-var, loop-var
                 ours-kw and loop on a new sequence length every step
                 (32, 40, 48, 56, 64 in turn: bucketed batches)

Targets (issue 55): ours-kw <= 1.03 x ours-pos; ours-kw <= 0.70 x loop;
ours-replicas <= 1.00 x loop (time per step).
"""
import argparse
import itertools
import os
import sys

from harness.machine import load_avg, load_str
from harness.options import add_common_args
from harness.tables import Targets, finish, fmt_ratio, mib, table
from harness.timing import TimedContender, interleave, median, setup_all, time_iters
from harness.workers import Skip, Worker, close_workers, worker_main

CONTENDERS = ('ours-kw', 'ours-pos', 'ours-replicas', 'loop', 'single', 'ours-kw-var',
              'loop-var')
VAR_LENGTHS = (32, 40, 48, 56, 64)
CLASSES = 2
ADAM = {'learning_rate': 1e-4}


def bert_small(nlp, vocab, max_length):
    """GluonNLP's BERTClassifier over a 4-layer, 128-unit BERT."""
    encoder = nlp.model.BERTEncoder(num_layers=4, units=128, hidden_size=512,
                                    max_length=max_length, num_heads=4, dropout=0.1)
    bert = nlp.model.BERTModel(encoder, vocab_size=vocab, token_type_vocab_size=2, units=128,
                               embed_size=128, use_decoder=False, use_classifier=False)
    return nlp.model.BERTClassifier(bert, num_classes=CLASSES, dropout=0.1)


class Contender(TimedContender):
    def __init__(self, name, options):
        import mxnet as mx
        self.mx = mx
        self.name = name

    def setup(self, config):
        mx = self.mx
        from mxnet import nd
        try:
            import gluonnlp as nlp
        except ImportError as e:
            raise Skip(f'gluonnlp is not installed ({e}): pip install Cython && '
                       'pip install --no-build-isolation gluonnlp==0.10.0') from e
        n = 1 if self.name == 'single' else config['n']
        ctx = [mx.cpu(i) for i in range(n)]
        batch, length = config['batch'], config['length']
        mx.random.seed(0)
        net = bert_small(nlp, config['vocab'], max(VAR_LENGTHS + (length,)))
        net.initialize(mx.init.Normal(0.02), ctx=ctx)
        net.hybridize(static_alloc=True)
        lengths = itertools.cycle(VAR_LENGTHS if self.name.endswith('-var') else (length,))
        batches = {}

        def batch_of():
            s = next(lengths)
            if s not in batches:
                rng = nd.random
                batches[s] = (rng.randint(0, config['vocab'], (batch, s)).astype('float32'),
                              nd.zeros((batch, s)),
                              rng.randint(s // 2, s + 1, (batch,)).astype('float32'),
                              nd.array([i % CLASSES for i in range(batch)]))
            return batches[s]
        make = self._ours if self.name.startswith('ours') else self._loop
        self.step = make(net, ctx, batch_of, batch)
        time_iters(self.step, config.get('warmup', 2), nd.waitall)
        return {'path': getattr(self, 'path', '-')}

    def _ours(self, net, ctx, batch_of, batch):
        from mxnet import autograd, gluon
        import gluon_parallel as gp
        dp = gp.DataParallel(net, ctx, graph=self.name != 'ours-replicas')
        dpl = gp.DataParallelLoss(gluon.loss.SoftmaxCrossEntropyLoss())
        trainer = gp.Trainer(net.collect_params(), 'adam', ADAM)
        keyword = self.name != 'ours-pos'

        def step():
            x, t, vl, y = batch_of()
            with autograd.record():
                out = dp(x, t, valid_length=vl) if keyword else dp(x, t, vl)
                losses = dpl(out, y)
            autograd.backward(losses)
            trainer.step(batch)
            self.path = dp.last_path
        return step

    def _loop(self, net, ctx, batch_of, batch):
        from mxnet import autograd, gluon
        loss = gluon.loss.SoftmaxCrossEntropyLoss()
        trainer = gluon.Trainer(net.collect_params(), 'adam', ADAM,
                                kvstore='device' if len(ctx) > 1 else None)
        split = gluon.utils.split_and_load

        def step():
            parts = [split(a, ctx, even_split=False) for a in batch_of()]
            with autograd.record():
                losses = [loss(net(x, t, vl), y) for x, t, vl, y in zip(*parts)]
            autograd.backward(losses)
            trainer.step(batch)
        return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--n', type=int, default=4, help='CPU contexts (default %(default)s)')
    p.add_argument('--batch', type=int, default=32, help='global batch (default %(default)s)')
    p.add_argument('--length', type=int, default=64,
                   help='sequence length (default %(default)s)')
    p.add_argument('--vocab', type=int, default=30522,
                   help='vocabulary size (default %(default)s, BERT\'s)')
    p.add_argument('--rounds', type=int, default=6,
                   help='interleaved rounds (default %(default)s)')
    p.add_argument('--iters', type=int, default=5, help='steps per round (default %(default)s)')
    p.add_argument('--warmup', type=int, default=3,
                   help='untimed steps (default %(default)s; the -var contenders bind '
                        'a graph per length on their first cycle)')
    add_common_args(p, CONTENDERS, 600, 'smoke run: 2 rounds of 2 steps, vocabulary 1000')
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(Contender)
    if args.quick:
        args.rounds, args.iters, args.warmup, args.vocab = 2, 2, len(VAR_LENGTHS), 1000
    names = args.contenders.split(',')
    load_before = load_avg()
    print(f'bench_nlp: BERT-small classifier (4 layers, 128 units, 4 heads), global batch '
          f'{args.batch}, sequence {args.length}, {args.n} CPU contexts, Adam; '
          f'{args.rounds} rounds x {args.iters} steps; {load_str(load_before)}')
    workers = [Worker(os.path.abspath(__file__), name) for name in names]
    config = {'n': args.n, 'batch': args.batch, 'length': args.length, 'vocab': args.vocab,
              'warmup': args.warmup}
    status = setup_all(workers, config, args.timeout)
    for name, why in status.items():
        print(f'  {name}: {why}')
    paths = {w.name: getattr(w, 'info', {}).get('path', '-') for w in workers}
    live = [w for w in workers if not w.dead and w.name not in status]
    times = interleave(live, args.rounds, args.iters, args.timeout)
    rss = close_workers(workers, status)
    ms = {k: median(times[k]) * 1e3 if times.get(k) else None for k in names}

    def ratio(a, b):
        return ms[a] / ms[b] if ms.get(a) and ms.get(b) else None
    rows = [[k, paths.get(k, '-'), '-' if ms[k] is None else f'{ms[k]:.0f}', mib(rss.get(k)),
             fmt_ratio(ratio(k, 'loop')), fmt_ratio(ratio(k, 'single'))] for k in names]
    tbl = table(['contender', 'path', 'ms/step', 'peak MiB', 'x loop', 'x single'], rows)
    targets = Targets()
    targets.check('ours-kw / ours-pos', ratio('ours-kw', 'ours-pos'), 1.03)
    targets.check('ours-kw / loop', ratio('ours-kw', 'loop'), 0.70)
    targets.check('ours-replicas / loop', ratio('ours-replicas', 'loop'), 1.00)
    var = ratio('ours-kw-var', 'loop-var')
    targets.note('varying lengths: ours-kw-var / loop-var (no target)', 'INFO',
                 '-' if var is None else f'{var:.2f}')
    finish('nlp', args.json, tbl, targets, load_before, ms=ms, status=status, rss=rss,
           paths=paths)
    return 0


if __name__ == '__main__':
    sys.exit(main())
