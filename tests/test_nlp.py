"""GluonNLP 0.10's BERT as a client (issue 55): fine-tuning with
``valid_length=`` and pretraining with ``masked_positions=`` as keywords,
bucketed sequence lengths, clipping, accumulation, AMP, dropout, bad input.

Every model is built by its constructor with random initialisation
(tests/nlp_models.py) and compared with the same network on one context
with the whole batch in plain Gluon.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import gluon_parallel as gp
import nlp_models as m

pytestmark = pytest.mark.usefixtures('gluonnlp')

CE = gluon.loss.SoftmaxCrossEntropyLoss()
ADAM = ('adam', {'learning_rate': 0.01})
BERTADAM = ('bertadam', {'learning_rate': 0.01, 'wd': 0.01})
LENGTHS = (12, 16, 20, 12)


@pytest.fixture
def gluonnlp():
    return m.require_gluonnlp()


def contexts(n):
    return [mx.cpu(i) for i in range(n)]


def _fine_tune(n, hybridize, optimizer, keyword=True):
    """Fine-tuning steps at LENGTHS, ours and the reference: their outputs,
    gradients and parameters after every step, and the paths taken."""
    ctx = contexts(n)
    ref, net = m.twins(m.classifier, ctx, hybridize=hybridize)
    ref_trainer = gluon.Trainer(ref.collect_params(), *optimizer)
    trainer = gp.Trainer(net.collect_params(), *optimizer)
    dp, dpl = gp.DataParallel(net, ctx), gp.DataParallelLoss(CE)
    paths = []
    for step, length in enumerate(LENGTHS):
        b = m.Batch(8, length, seed=step)
        want = m.reference_step(ref, CE, ref_trainer, (b.tokens, b.token_types),
                                {'valid_length': b.valid_length}, (b.label,), b.size)
        with autograd.record():
            if keyword:
                out = dp(b.tokens, b.token_types, valid_length=b.valid_length)
            else:
                out = dp(b.tokens, b.token_types, b.valid_length)
            losses = dpl(out, b.label)
        paths.append(dp.last_path)
        autograd.backward(losses)
        got_grads = m.grads(net)
        trainer.step(b.size)
        what = f'step {step} (length {length})'
        np.testing.assert_allclose(m.flat(out)[0], want.asnumpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f'outputs, {what}')
        m.assert_close(got_grads, m.grads(ref), f'gradients, {what}')
        m.assert_close(m.values(net), m.values(ref), f'parameters, {what}')
    dp.close()
    return paths


@pytest.mark.parametrize('n, hybridize, optimizer', [
    (2, True, ADAM), (4, True, BERTADAM), (4, False, ADAM), (2, False, BERTADAM)],
    ids=['2-graph-adam', '4-graph-bertadam', '4-eager-adam', '2-eager-bertadam'])
def test_fine_tuning_with_valid_length_as_a_keyword_equals_one_device(n, hybridize, optimizer):
    paths = _fine_tune(n, hybridize, optimizer)
    assert paths == ['graph' if hybridize else 'replicas'] * len(LENGTHS)


def test_fine_tuning_with_valid_length_positional_equals_one_device():
    """The same steps, valid_length passed positionally (the path that
    worked before keyword calls did)."""
    assert _fine_tune(2, True, ADAM, keyword=False) == ['graph'] * len(LENGTHS)


@pytest.mark.parametrize('n', [2, 4])
def test_pretraining_masked_lm_and_next_sentence_equals_one_device(n):
    """BERTModel with the decoder and the classifier: four outputs, one
    loss over them (and two targets) through DataParallelLoss, with
    valid_length and masked_positions as keywords."""
    ctx = contexts(n)
    ref, net = m.twins(m.bert_model, ctx, decoder=True)
    loss = m.PretrainingLoss()
    ref_trainer = gluon.Trainer(ref.collect_params(), *BERTADAM)
    trainer = gp.Trainer(net.collect_params(), *BERTADAM)
    dp, dpl = gp.DataParallel(net, ctx), gp.DataParallelLoss(loss)
    for step, length in enumerate(LENGTHS[:3]):
        b = m.Batch(8, length, seed=step)
        kwargs = {'valid_length': b.valid_length, 'masked_positions': b.masked_positions}
        targets = (b.masked_label, b.ns_label)
        want = m.reference_step(ref, loss, ref_trainer, (b.tokens, b.token_types), kwargs,
                                targets, b.size)
        with autograd.record():
            out = dp(b.tokens, b.token_types, **kwargs)
            losses = dpl(out, *targets)
        assert dp.last_path == 'graph'
        autograd.backward(losses)
        got_grads = m.grads(net)
        trainer.step(b.size)
        got = m.flat(out)
        assert len(got) == 4
        for k, (g, w) in enumerate(zip(got, want)):
            # (after an Adam step: float32 rounding, amplified near zero)
            np.testing.assert_allclose(g, w.asnumpy(), rtol=1e-4, atol=1e-4,
                                       err_msg=f'output {k}, step {step}')
        # Adam moves a parameter whose gradient is rounding noise by up to
        # its learning rate: 1e-4 is 1% of a step; later steps' gradients
        # start from parameters that differ that much.
        m.assert_close(got_grads, m.grads(ref), f'gradients, step {step}',
                       atol=1e-5 if step == 0 else 1e-4)
        m.assert_close(m.values(net), m.values(ref), f'parameters, step {step}', atol=1e-4)
    dp.close()


def test_clipping_across_devices_equals_one_device():
    """GluonNLP's clipping between gp.Trainer's allreduce_grads and update:
    the global norm of the whole batch's gradient, on every device."""
    ctx = contexts(4)
    ref, net = m.twins(m.classifier, ctx)
    ref_trainer = gluon.Trainer(ref.collect_params(), *ADAM)
    trainer = gp.Trainer(net.collect_params(), *ADAM)
    dp, dpl = gp.DataParallel(net, ctx), gp.DataParallelLoss(CE)
    max_norm = 0.05
    for step, length in enumerate(LENGTHS[:3]):
        b = m.Batch(8, length, seed=step)
        with autograd.record():
            CE(ref(b.tokens, b.token_types, valid_length=b.valid_length), b.label).backward()
        ref_trainer.allreduce_grads()
        want = nlp_clip(ref, max_norm)
        ref_trainer.update(b.size)
        with autograd.record():
            losses = dpl(dp(b.tokens, b.token_types, valid_length=b.valid_length), b.label)
        autograd.backward(losses)
        trainer.allreduce_grads()
        got = nlp_clip(net, max_norm)
        trainer.update(b.size)
        assert want > max_norm                          # the clipping did something
        assert got == pytest.approx(want, rel=1e-5)
        m.assert_close(m.values(net), m.values(ref), f'parameters, step {step}')
    dp.close()


def nlp_clip(net, max_norm):
    """The global norm (a float) of `net`'s gradients, which are clipped."""
    import gluonnlp
    norm = gluonnlp.utils.clip_grad_global_norm(net.collect_params().values(), max_norm)
    return float(norm.asscalar() if hasattr(norm, 'asscalar') else norm)


def test_gradient_accumulation_over_batches_equals_one_device():
    """grad_req='add': three batches' gradients summed, then one update of
    the three batches' size, then zeroed."""
    ctx = contexts(2)
    ref, net = m.twins(m.classifier, ctx)
    for model in (ref, net):
        model.collect_params().setattr('grad_req', 'add')
    ref_trainer = gluon.Trainer(ref.collect_params(), *ADAM)
    trainer = gp.Trainer(net.collect_params(), *ADAM)
    dp, dpl = gp.DataParallel(net, ctx), gp.DataParallelLoss(CE)
    for update in range(2):
        batches = [m.Batch(6, length, seed=10 * update + k) for k, length in enumerate(LENGTHS[:3])]
        for b in batches:
            with autograd.record():
                CE(ref(b.tokens, b.token_types, valid_length=b.valid_length), b.label).backward()
            with autograd.record():
                losses = dpl(dp(b.tokens, b.token_types, valid_length=b.valid_length), b.label)
            autograd.backward(losses)
        m.assert_close(m.grads(net), m.grads(ref), f'accumulated gradients, update {update}')
        total = sum(b.size for b in batches)
        ref_trainer.step(total)
        trainer.step(total)
        for model in (ref, net):
            model.collect_params().zero_grad()
        m.assert_close(m.values(net), m.values(ref), f'parameters, update {update}')
    dp.close()


def test_a_transformer_with_dropout_trains():
    """Dropout in every layer (random: not compared exactly): the loss of a
    learnable task goes down over a few dozen steps."""
    ctx = contexts(2)
    net = m.initialized(m.classifier, ctx, dropout=0.1)
    trainer = gp.Trainer(net.collect_params(), 'adam', {'learning_rate': 3e-3})
    dp, dpl = gp.DataParallel(net, ctx), gp.DataParallelLoss(CE)
    b = m.Batch(16, 12, seed=3)
    label = b.tokens[:, 0] % 3                       # the first token tells the class
    seen = []
    for _ in range(40):
        with autograd.record():
            losses = dpl(dp(b.tokens, b.token_types, valid_length=b.valid_length), label)
        autograd.backward(losses)
        trainer.step(b.size)
        seen.append(float(sum(x.sum().asscalar() for x in losses)) / b.size)
    assert dp.last_path == 'graph'
    first, last = np.mean(seen[:5]), np.mean(seen[-5:])
    assert last < 0.5 * first, f'loss {first:.3f} -> {last:.3f}'
    dp.close()
