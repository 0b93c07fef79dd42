"""The data the built-in tasks train on: small, bundled or already on disk, never downloaded.

``paratrain train`` must work on a machine with no network, so every data set
here comes from something the install already has: scikit-learn's copy of the
UCI handwritten digits (1797 8x8 images), random data with a fixed linear
teacher for the benchmarks, and the Python standard library's own source code
as text for the language model.

Everything is a function of its seed alone, so two workers (or a resumed run)
that build the same data set get the same bytes without talking to each other.
"""
import glob
import importlib.util
import os
import sysconfig

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset


def digits(test_fraction=0.2, seed=0):
    """(train, test) TensorDatasets of scikit-learn's digits: x (N, 1, 8, 8) float32 in [0, 1], y int64.

    The data ships inside scikit-learn (``sklearn.datasets.load_digits``; the
    test half of the UCI "Optical Recognition of Handwritten Digits" set), so
    nothing is fetched. Pixels are counts 0..16 of set pixels in 4x4 blocks of
    the original 32x32 bitmaps; dividing by 16 puts them in [0, 1]. The split
    is a numpy ``default_rng(seed)`` permutation: fixed by the seed, on every
    machine and numpy version that keeps the PCG64 stream (NEP 19).
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be between 0 and 1, got {test_fraction}")
    data = _digits_table()
    x = torch.from_numpy((data[:, :64] / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    y = torch.from_numpy(data[:, 64].astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def _digits_table():
    """The (1797, 65) table behind ``load_digits``: 64 pixels, then the label.

    Read from scikit-learn's bundled ``datasets/data/digits.csv.gz`` the way
    load_digits reads it (np.loadtxt), but without importing scikit-learn,
    which takes about a second: a second every worker and the front-end would
    otherwise pay before the first step. find_spec locates the package
    without running it; if the file is not where it was, ask load_digits.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            path = os.path.join(root, "datasets", "data", "digits.csv.gz")
            if os.path.exists(path):
                return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits
    d = load_digits()
    return np.concatenate([d.data, d.target[:, None]], axis=1)


def synthetic_classification(n, dim=784, classes=10, seed=0, latent=32, noise=0.5, teacher_seed=0):
    """n samples x float32 of size dim with int64 labels y from a fixed random linear teacher.

    Random labels would benchmark the same FLOPs but nothing would be learnt,
    so a loss curve could not show that a distributed run still trains. Here
    a latent z ~ N(0, I_latent) is mixed into dim coordinates, x = z M + noise,
    and labelled y = argmax(z W): like images, the inputs are high-dimensional
    but vary along few directions, so 8k samples are enough to generalise
    (isotropic inputs of as many dimensions overfit them). x has unit
    variance per coordinate.

    M and W come from ``teacher_seed`` and the samples from ``seed``, so a
    training and an evaluation set built with different seeds pose the same
    problem.
    """
    if n < 1 or dim < 1 or classes < 2 or latent < 1:
        raise ValueError(f"need n >= 1, dim >= 1, classes >= 2 and latent >= 1, got n={n}, dim={dim}, "
                         f"classes={classes}, latent={latent}")
    g = torch.Generator().manual_seed(teacher_seed)
    mix = torch.randn(latent, dim, generator=g) / latent ** 0.5
    teacher = torch.randn(latent, classes, generator=g)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, latent, generator=g)
    x = (z @ mix + noise * torch.randn(n, dim, generator=g)) / (1 + noise ** 2) ** 0.5
    return TensorDataset(x, (z @ teacher).argmax(dim=1))


def stdlib_text(max_bytes=2_000_000):
    """Up to max_bytes of the Python standard library's own source: its top-level ``*.py`` files,
    sorted by name and concatenated.

    Every Python install has these files, they are plain ASCII/UTF-8 code a
    small language model visibly learns (indentation, keywords, names), and
    sorting makes the text the same on every machine with the same Python.
    """
    where = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(where, "*.py")))
    if not files:
        raise FileNotFoundError(f"found no .py files of the standard library in {where} (is this a Python "
                                f"install without its sources?); the gpt task trains on them")
    parts, size = [], 0
    for path in files:
        if size >= max_bytes:
            break
        with open(path, "rb") as f:
            parts.append(f.read(max_bytes - size))
        size += len(parts[-1])
    return b"".join(parts)


class CharDataset(Dataset):
    """Windows of a byte string for next-byte prediction: item i is (x, y), y = x shifted by one.

    Tokens are bytes (vocabulary 256), so any file works with no tokenizer;
    for ASCII source that is exactly character-level, as in Karpathy's
    char-rnn / nanoGPT shakespeare_char. Window i starts at byte i * stride
    and needs block_size + 1 bytes (the last target is one byte past x), so
    there are (len - block_size - 1) // stride + 1 windows and none runs past
    the end. The default stride of block_size // 2 lets every byte be seen in
    two contexts while keeping neighbouring windows from being near-copies.
    """

    def __init__(self, data: bytes, block_size, stride=None):
        stride = max(1, block_size // 2) if stride is None else stride
        if block_size < 1 or stride < 1:
            raise ValueError(f"block_size and stride must be at least 1, got {block_size} and {stride}")
        self.data = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
        self.block_size, self.stride = block_size, stride

    def __len__(self):
        span = len(self.data) - self.block_size - 1
        return span // self.stride + 1 if span >= 0 else 0

    def __getitem__(self, i):
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        chunk = self.data[i * self.stride: i * self.stride + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def text_splits(block_size, max_bytes, val_fraction=0.1):
    """(train, val) CharDatasets over stdlib_text(max_bytes), split by position: the first
    1 - val_fraction of the bytes for training, the rest for validation.

    Splitting by position rather than by window keeps overlapping windows from
    landing on both sides, so validation text was never trained on.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    data = stdlib_text(max_bytes)
    cut = int(len(data) * (1 - val_fraction))
    return CharDataset(data[:cut], block_size), CharDataset(data[cut:], block_size)


class MaskedText(Dataset):
    """A CharDataset's windows for masked language modelling, as BERT is trained
    (Devlin et al., "BERT", arXiv 1810.04805, sec. 3.1): item i is (x, y), x the
    window with 15% of its positions chosen, y the original byte at those
    positions and -100 (cross-entropy's ignore_index) elsewhere. A chosen
    position holds ``mask_id`` 80% of the time, a random byte 10%, and is left
    as it is 10%.

    The choice is drawn from a generator seeded by i, so every worker, every
    epoch and a resumed run see the same masks for the same window.
    """

    FRACTION = 0.15

    def __init__(self, windows, mask_id=1, vocab=256):
        self.windows, self.mask_id, self.vocab = windows, mask_id, vocab

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        window = self.windows[i][0]
        n = len(window)
        gen = torch.Generator().manual_seed(int(i) % len(self))   # window -1 masked as window n - 1
        chosen = torch.randperm(n, generator=gen)[:max(1, round(self.FRACTION * n))]
        x, y = window.clone(), torch.full_like(window, -100)
        y[chosen] = window[chosen]
        draw = torch.rand(len(chosen), generator=gen)
        x[chosen[draw < 0.8]] = self.mask_id
        randomised = chosen[(draw >= 0.8) & (draw < 0.9)]
        x[randomised] = torch.randint(0, self.vocab, (len(randomised),), generator=gen)
        return x, y
