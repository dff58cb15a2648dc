"""Tiny GluonNLP 0.10 models, built by their constructors with random
initialisation (nothing downloaded), their batches, and the plain Gluon
reference the NLP tests compare DataParallel with: the same network on one
context with the whole batch.

gluonnlp builds from source with Cython (``pip install Cython && pip install
--no-build-isolation gluonnlp==0.10.0``, as ``.ci/run`` does); where it is
not importable the tests skip with that reason (under
GLUON_PARALLEL_REQUIRE_DAEMONS=1, CI: they fail).
"""
import os

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

import daemons

VOCAB = 40
UNITS = 16
HEADS = 2
LAYERS = 2
MAX_LENGTH = 64
NUM_MASKED = 3
INSTALL = 'pip install Cython && pip install --no-build-isolation gluonnlp==0.10.0'


def gluonnlp_problem():
    """Why gluonnlp 0.10 cannot be used here, or None (also when
    GLUON_PARALLEL_HIDE_PROGRAMS names it)."""
    if 'gluonnlp' in os.environ.get(daemons.HIDE_ENV, '').split(','):
        return f'gluonnlp is hidden ({daemons.HIDE_ENV}); install it: {INSTALL}'
    try:
        import gluonnlp
    except Exception as e:                      # noqa: BLE001 (a broken build raises anything)
        return f'gluonnlp is not importable ({type(e).__name__}: {e}); install it: {INSTALL}'
    if not gluonnlp.__version__.startswith('0.10'):
        return f'gluonnlp {gluonnlp.__version__} is installed; these tests need 0.10 ({INSTALL})'
    return None


def require_gluonnlp():
    """Skip the calling test (fail it under CI) without gluonnlp 0.10;
    returns the module."""
    problem = gluonnlp_problem()
    daemons.require(problem is None, problem)
    import gluonnlp
    return gluonnlp


def encoder(dropout=0.0, layers=LAYERS, units=UNITS, heads=HEADS, max_length=MAX_LENGTH):
    import gluonnlp as nlp
    return nlp.model.BERTEncoder(num_layers=layers, units=units, hidden_size=2 * units,
                                 max_length=max_length, num_heads=heads, dropout=dropout)


def bert_model(decoder=False, dropout=0.0, **sizes):
    """BERTModel: with `decoder`, the pretraining heads (next-sentence
    classifier and masked-LM decoder: four outputs), else the pooler only
    (two outputs)."""
    import gluonnlp as nlp
    enc = encoder(dropout, **sizes)
    return nlp.model.BERTModel(enc, vocab_size=VOCAB, token_type_vocab_size=2,
                               units=enc._units, embed_size=enc._units,
                               use_decoder=decoder, use_classifier=decoder)


def classifier(dropout=0.0, num_classes=3, **sizes):
    """BERTClassifier over a BERTModel without the pretraining heads."""
    import gluonnlp as nlp
    return nlp.model.BERTClassifier(bert_model(dropout=dropout, **sizes),
                                    num_classes=num_classes, dropout=dropout)


def initialized(make, ctx, seed=0, hybridize=True, like=None, **kwargs):
    """`make(**kwargs)` initialised on `ctx` (its deferred shapes inferred
    from one sample), with `like`'s parameter values when given, and
    hybridized if asked."""
    net = make(**kwargs)
    mx.random.seed(seed)
    net.initialize(mx.init.Normal(0.05), ctx=ctx)
    ctx0 = ctx[0] if isinstance(ctx, (list, tuple)) else ctx
    sample = Batch(1, NUM_MASKED + 1)
    args = [sample.tokens, sample.token_types, sample.valid_length]
    if getattr(net, '_use_decoder', False):
        args.append(sample.masked_positions)
    net(*[a.as_in_context(ctx0) for a in args])
    if like is not None:
        copy_params(like, net)
    if hybridize:
        net.hybridize()
    return net


def copy_params(src, dst):
    """Give `dst` the parameter values of `src` (the same architecture)."""
    theirs = src._collect_params_with_prefix()
    for name, p in dst._collect_params_with_prefix().items():
        p.set_data(theirs[name].data(theirs[name].list_ctx()[0]).copyto(mx.cpu()))


def twins(make, ctx, hybridize=True, **kwargs):
    """The reference on cpu(0) and the same network on `ctx`."""
    ref = initialized(make, mx.cpu(0), hybridize=hybridize, **kwargs)
    return ref, initialized(make, ctx, hybridize=hybridize, like=ref, **kwargs)


class Batch:
    """One BERT batch: tokens, token types, valid lengths, masked positions
    and labels (a class, the masked tokens and the next-sentence label)."""

    def __init__(self, batch, length, seed=0, num_classes=3):
        rng = np.random.RandomState(seed)
        self.size, self.length = batch, length
        self.tokens = nd.array(rng.randint(0, VOCAB, (batch, length)))
        self.token_types = nd.array(rng.randint(0, 2, (batch, length)))
        valid = rng.randint(max(NUM_MASKED + 1, length // 2), length + 1, batch)
        self.valid_length = nd.array(valid)
        self.masked_positions = nd.array([rng.choice(v, NUM_MASKED, replace=False)
                                          for v in valid])
        self.label = nd.array(rng.randint(0, num_classes, batch))
        self.masked_label = nd.array(rng.randint(0, VOCAB, (batch, NUM_MASKED)))
        self.ns_label = nd.array(rng.randint(0, 2, batch))


class PretrainingLoss(gluon.HybridBlock):
    """BERT's pretraining loss over BERTModel's four outputs (sequence,
    pooled, next-sentence scores, masked-LM scores): masked-LM cross-entropy
    plus next-sentence cross-entropy, per sample."""

    def __init__(self):
        super().__init__()
        self.ce = gluon.loss.SoftmaxCrossEntropyLoss()

    def hybrid_forward(self, F, seq, pooled, ns_scores, mlm_scores, mlm_label, ns_label):
        mlm = self.ce(mlm_scores, mlm_label)        # mean over the masked positions
        return mlm + self.ce(ns_scores, ns_label)


def flat(outputs):
    """A call's outputs (one per replica, each an NDArray or a tuple) as
    numpy arrays, concatenated along the batch axis: a list, one per
    output."""
    per = [o if isinstance(o, (list, tuple)) else (o,) for o in outputs]
    return [np.concatenate([p[k].asnumpy() for p in per]) for k in range(len(per[0]))]


def grads(net):
    """Every trained parameter's gradient summed over its contexts."""
    return {k: sum(g.asnumpy() for g in p.list_grad())
            for k, p in net._collect_params_with_prefix().items() if p.grad_req != 'null'}


def values(net):
    """Every parameter's value on its first context."""
    return {k: p.data(p.list_ctx()[0]).asnumpy()
            for k, p in net._collect_params_with_prefix().items()}


def reference_step(net, loss, trainer, inputs, kwargs, targets, batch):
    """One plain Gluon step on one context, the whole batch."""
    with autograd.record():
        out = net(*inputs, **kwargs)
        parts = out if isinstance(out, (list, tuple)) else (out,)
        losses = loss(*parts, *targets)
    losses.backward()
    trainer.step(batch)
    return out


def assert_close(got, want, what, rtol=1e-4, atol=1e-5):
    """Every entry of dict `want` in `got`, within tolerance."""
    assert set(got) == set(want), what
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=f'{what}: {k}')
