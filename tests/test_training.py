"""End to end: the training loop on 1, 2 and 4 devices is the computation of
plain Gluon on one device, short batches, frozen layers and gradient
accumulation included. Every reference is plain Gluon on one context with
``gluon.nn.BatchNorm``, never this library's own output.
"""

import numpy as np
import pytest
from mxnet import nd

from loops import SGD, ADAM, make_batches, reference, parallel, assert_same


# ---------------------------------------------------------------------------
# Same parameters on 1, 2 and 4 devices

@pytest.mark.parametrize('opt, batch, uok', [
    (SGD, 12, None), (SGD, 12, False), (SGD, 10, None), (ADAM, 12, None), (ADAM, 10, False)],
    ids=['sgd-12', 'sgd-12-local-update', 'sgd-10', 'adam-12', 'adam-10-local-update'])
def test_same_parameters_on_1_2_4_devices(init, opt, batch, uok):
    batches = make_batches([batch] * 5)
    ref = reference(init, batches, opt)
    for n in (1, 2, 4):
        got, _, _ = parallel(init, batches, n, opt, uok)
        assert_same(got, ref, what=f'{n:d} devices: ')


@pytest.mark.parametrize('uok', [None, False], ids=['kvstore-update', 'local-update'])
def test_short_batches_leave_idle_devices_consistent(init, uok):
    # The last batches of an epoch are smaller than the device count: the
    # idle device's gradient of the previous step must not be summed again.
    batches = make_batches([12, 12, 3, 3, 2])
    got, _, _ = parallel(init, batches, 4, SGD, uok)
    assert_same(got, reference(init, batches))


# ---------------------------------------------------------------------------
# Frozen parameters, gradient accumulation


def _freeze_first_conv(net):
    net[0].collect_params().setattr('grad_req', 'null')


def test_frozen_parameters_as_in_plain_gluon(init):
    batches = make_batches([12, 3, 10])
    got, net, _ = parallel(init, batches, 4, SGD, setup=_freeze_first_conv)
    ref = reference(init, batches, setup=_freeze_first_conv)
    assert_same(got, ref)
    init_values = nd.load(init)
    np.testing.assert_array_equal(got['0.weight'][0], init_values['0.weight'].asnumpy())


@pytest.mark.parametrize('uok', [None, False], ids=['kvstore-update', 'local-update'])
def test_gradient_accumulation_as_in_plain_gluon(init, uok):
    def accumulate(net):
        net.collect_params().setattr('grad_req', 'add')
    # Two batches per step. A short one leaves a device idle, whose
    # accumulated gradient of the step's first batch must still count; in
    # the third step a device stays idle throughout.
    batches = make_batches([8, 3, 12, 2, 3, 2, 5, 7])
    got, _, _ = parallel(init, batches, 4, SGD, uok, setup=accumulate, micro=2)
    assert_same(got, reference(init, batches, setup=accumulate, micro=2))
