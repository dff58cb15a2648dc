"""Networks for examples/train_image_classification.py.

Every builder takes ``norm_layer`` (``gluon.nn.BatchNorm`` or
``gluon_parallel.nn.SyncBatchNorm``) so the same network trains with
per-device or whole-batch batch-norm statistics. Besides the three small
networks here, every image-classification network of GluonCV's model zoo
(``cifar_resnet20_v1``, ``resnet18_v1b``, ``mobilenetv2_0.25``, ...) is
built by name, with ``norm_layer``/``norm_kwargs`` as GluonCV's own
scripts pass them.
"""
from mxnet import gluon
from mxnet.gluon import nn

import gluon_parallel as gp

MODELS = ('small-cnn', 'resnet20', 'resnet18')

# GluonCV model-zoo modules that hold image classifiers (the zoo also has
# detection, segmentation, pose, video and quantised models).
_CLASSIFIER_MODULES = {
    'alexnet', 'cifarresnet', 'cifarresnext', 'cifarwideresnet', 'densenet', 'dla',
    'googlenet', 'hrnet', 'inception', 'mobilenet', 'mobilenetv3', 'nasnet',
    'residual_attentionnet', 'resnest', 'resnet', 'resnetv1b', 'resnext', 'senet',
    'shufflenet', 'squeezenet', 'vgg', 'xception', 'yolo.darknet'}


def gluoncv_classifiers():
    """Names of GluonCV's image-classification networks (empty without GluonCV)."""
    try:
        from gluoncv.model_zoo import model_zoo
    except ImportError:
        return ()
    prefix = 'gluoncv.model_zoo.'
    return tuple(sorted(name for name, fn in model_zoo._models.items()
                        if getattr(fn, '__module__', '')[len(prefix):] in _CLASSIFIER_MODULES))


def gluoncv_model(name, classes, norm_layer):
    """A GluonCV model-zoo classifier, randomly initialised, built with
    ``norm_layer``. With SyncBatchNorm, BatchNorms that the network creates
    without asking ``norm_layer`` (or all of them, when its constructor takes
    none) are converted too."""
    from gluoncv.model_zoo import get_model
    try:
        net = get_model(name, classes=classes, pretrained=False, norm_layer=norm_layer,
                        norm_kwargs={})
    except TypeError as e:
        if 'norm_' not in str(e):
            raise
        net = get_model(name, classes=classes, pretrained=False)
    return gp.nn.convert_sync_batchnorm(net) if norm_layer is gp.nn.SyncBatchNorm else net


def _conv_bn_relu(channels, norm_layer, stride=1):
    out = nn.HybridSequential(prefix='')
    out.add(nn.Conv2D(channels, 3, strides=stride, padding=1, use_bias=False),
            norm_layer(),
            nn.Activation('relu'))
    return out


def small_cnn(classes, norm_layer, image_size=8):
    """Four 3x3 conv layers with 2x2 max-pools, global average pooling.

    One down-sampling step after the second convolution; images larger
    than 8x8 (MNIST's 28x28) get another after the first, which keeps the
    cost per image small. On 8x8 digits the map never shrinks below 2x2.
    """
    net = nn.HybridSequential(prefix='smallcnn_')
    with net.name_scope():
        net.add(_conv_bn_relu(32, norm_layer))
        if image_size > 8:
            net.add(nn.MaxPool2D(2))
        net.add(_conv_bn_relu(32, norm_layer),
                nn.MaxPool2D(2),
                _conv_bn_relu(64, norm_layer),
                _conv_bn_relu(64, norm_layer),
                nn.GlobalAvgPool2D(),
                nn.Dense(classes))
    return net


class ResidualBlock(gluon.HybridBlock):
    """Two 3x3 convolutions and an identity (or 1x1 projection) shortcut."""

    def __init__(self, channels, stride, norm_layer, **kwargs):
        super().__init__(**kwargs)
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
    name : str
        One of MODELS, or a GluonCV classifier (see gluoncv_classifiers).
    classes : int
    image_size : int
        Side of the (square) input images.
    syncbn : bool, default True
        Use SyncBatchNorm (whole-batch statistics) instead of BatchNorm.
    """
    norm_layer = gp.nn.SyncBatchNorm if syncbn else nn.BatchNorm
    if name == 'small-cnn':
        return small_cnn(classes, norm_layer, image_size)
    if name == 'resnet20':
        return resnet20(classes, norm_layer)
    if name == 'resnet18':
        return resnet18(classes, norm_layer, image_size)
    if name in gluoncv_classifiers():
        return gluoncv_model(name, classes, norm_layer)
    raise ValueError(f"unknown model {name!r}, expected one of {', '.join(MODELS)} or a GluonCV "
                     'classifier')
