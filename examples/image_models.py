"""Networks for examples/train_image_classification.py.

Every builder takes ``norm_layer`` (``gluon.nn.BatchNorm`` or
``gluon_parallel.nn.SyncBatchNorm``) so the same network trains with
per-device or whole-batch batch-norm statistics.
"""
from mxnet import gluon
from mxnet.gluon import nn

import gluon_parallel as gp

MODELS = ('small-cnn', 'resnet20', 'resnet18')


def _conv_bn_relu(channels, norm_layer, stride=1):
    out = nn.HybridSequential(prefix='')
    out.add(nn.Conv2D(channels, 3, strides=stride, padding=1, use_bias=False),
            norm_layer(),
            nn.Activation('relu'))
    return out


def small_cnn(classes, norm_layer):
    """Four 3x3 conv layers, one 2x2 max-pool, global average pooling.

    Sized for tiny images (8x8 digits): only one down-sampling step, so
    the spatial map never shrinks below 2x2 on 8x8 inputs.
    """
    net = nn.HybridSequential(prefix='smallcnn_')
    with net.name_scope():
        net.add(_conv_bn_relu(32, norm_layer),
                _conv_bn_relu(32, norm_layer),
                nn.MaxPool2D(2),
                _conv_bn_relu(64, norm_layer),
                _conv_bn_relu(64, norm_layer),
                nn.GlobalAvgPool2D(),
                nn.Dense(classes))
    return net


class ResidualBlock(gluon.HybridBlock):
    """Two 3x3 convolutions and an identity (or 1x1 projection) shortcut."""

    def __init__(self, channels, stride, norm_layer, **kwargs):
        super(ResidualBlock, self).__init__(**kwargs)
        with self.name_scope():
            self.body = nn.HybridSequential(prefix='')
            self.body.add(nn.Conv2D(channels, 3, strides=stride, padding=1, use_bias=False),
                          norm_layer(),
                          nn.Activation('relu'),
                          nn.Conv2D(channels, 3, padding=1, use_bias=False),
                          norm_layer())
            self.shortcut = None
            if stride != 1:
                # The channel count changes together with the stride.
                self.shortcut = nn.HybridSequential(prefix='')
                self.shortcut.add(nn.Conv2D(channels, 1, strides=stride, use_bias=False),
                                  norm_layer())

    def hybrid_forward(self, F, x):
        residual = x if self.shortcut is None else self.shortcut(x)
        return F.relu(self.body(x) + residual)


def resnet20(classes, norm_layer):
    """CIFAR-style ResNet-20 (He et al. 2016, section 4.2): a 3x3 stem,
    three stages of three residual blocks with 16, 32, 64 channels, the
    last two stages halving the resolution."""
    net = nn.HybridSequential(prefix='resnet20_')
    with net.name_scope():
        net.add(_conv_bn_relu(16, norm_layer))
        for stage, channels in enumerate((16, 32, 64)):
            for i in range(3):
                stride = 2 if stage > 0 and i == 0 else 1
                net.add(ResidualBlock(channels, stride, norm_layer))
        net.add(nn.GlobalAvgPool2D(), nn.Dense(classes))
    return net


def resnet18(classes, norm_layer, image_size):
    """Gluon model-zoo ResNet-18 v1, randomly initialised.

    Below 64x64 pixels it uses the model zoo's ``thumbnail`` stem (one 3x3
    convolution, no max-pool), which keeps small images from collapsing to
    1x1 before the last stage. The model zoo hard-codes ``nn.BatchNorm``,
    so SyncBatchNorm is swapped in afterwards.
    """
    net = gluon.model_zoo.vision.resnet18_v1(classes=classes, thumbnail=image_size < 64)
    if norm_layer is gp.nn.SyncBatchNorm:
        gp.nn.convert_sync_batchnorm(net)
    return net


def build_model(name, classes, image_size, syncbn=True):
    """Return the named network, not yet initialised.

    Parameters
    ----------
    name : {'small-cnn', 'resnet20', 'resnet18'}
    classes : int
    image_size : int
        Side of the (square) input images.
    syncbn : bool, default True
        Use SyncBatchNorm (whole-batch statistics) instead of BatchNorm.
    """
    norm_layer = gp.nn.SyncBatchNorm if syncbn else nn.BatchNorm
    if name == 'small-cnn':
        return small_cnn(classes, norm_layer)
    if name == 'resnet20':
        return resnet20(classes, norm_layer)
    if name == 'resnet18':
        return resnet18(classes, norm_layer, image_size)
    raise ValueError('unknown model %r, expected one of %s' % (name, ', '.join(MODELS)))
