"""BERT fine-tuning under MXNet's AMP (bfloat16 on CPU contexts) for
tests/test_nlp.py: ``python nlp_amp.py OUT.npz N`` runs three SGD steps of
a tiny BERTClassifier on one context with the whole batch (plain Gluon) and
through DataParallel on N contexts (the keyword call, gp.Trainer), both
under AMP, and saves both runs' parameters after every step, the path the
calls took and the outputs' dtype. ``amp.init()`` patches MXNet for the
whole process, hence a process of its own."""
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

STEPS = 3
SGD = ('sgd', {'learning_rate': 0.1, 'momentum': 0.9})
# GluonNLP's self-attention: MXNet 1.9.1 computes these in float32 only on
# CPU ("Only FP32 is supported on CPU at the moment"): AMP keeps them so.
FP32_OPS = ['_contrib_interleaved_matmul_selfatt_qk', '_contrib_interleaved_matmul_selfatt_valatt']


def run(num_ctx):
    from mxnet.contrib import amp
    amp.init(target_dtype='bfloat16', fp32_ops=FP32_OPS)
    import gluon_parallel as gp
    import nlp_models as m
    ctx = [mx.cpu(i) for i in range(num_ctx)]
    ref, net = m.twins(m.classifier, ctx)
    ce = gluon.loss.SoftmaxCrossEntropyLoss()
    ref_trainer = gluon.Trainer(ref.collect_params(), *SGD)
    trainer = gp.Trainer(net.collect_params(), *SGD)
    amp.init_trainer(ref_trainer)
    amp.init_trainer(trainer)
    dp, dpl = gp.DataParallel(net, ctx), gp.DataParallelLoss(ce)
    saved = {}
    for step in range(STEPS):
        b = m.Batch(8, 16, seed=step)
        with autograd.record():
            loss = ce(ref(b.tokens, b.token_types, valid_length=b.valid_length), b.label)
            with amp.scale_loss(loss, ref_trainer) as scaled:
                autograd.backward(scaled)
        ref_trainer.step(b.size)
        with autograd.record():
            out = dp(b.tokens, b.token_types, valid_length=b.valid_length)
            losses = dpl(out, b.label)
            with amp.scale_loss(losses, trainer) as scaled:
                autograd.backward(scaled)
        trainer.step(b.size)
        saved['path'] = dp.last_path
        saved['dtype'] = str(out[0].dtype)
        for who, model in (('single', ref), ('dp', net)):
            for k, v in m.values(model).items():
                saved[f'{who}/{step}/{k}'] = v.astype(np.float32)
    dp.close()
    return saved


if __name__ == '__main__':
    np.savez(sys.argv[1], **run(int(sys.argv[2])))
