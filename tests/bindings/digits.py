"""scikit-learn's digits (1,797 8x8 images, shipped inside the package) and small models for training tests.

Every binding's training test uses these, so "equal to one process" always
means the same data, the same initial weights and the same batches: batch
``step`` is rows ``[step * batch, (step + 1) * batch)`` of the shuffled set
(wrapping around), and rank ``r`` of ``n`` trains on its ``np.array_split``
share of that batch.
"""

from __future__ import annotations

import functools

import numpy as np

FEATURES, CLASSES = 64, 10


@functools.lru_cache(maxsize=1)
def dataset() -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: float32 pixels scaled to [0, 1] and int64 labels, shuffled with a fixed seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    x = (digits.data[order] / 16.0).astype(np.float32)
    return x, digits.target[order].astype(np.int64)


def batch(step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``step``-th global batch of ``size`` rows (wrapping around the data set)."""
    x, y = dataset()
    rows = np.arange(step * size, (step + 1) * size) % len(y)
    return x[rows], y[rows]


def shard(step: int, size: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s share (``np.array_split``) of global batch ``step``."""
    x, y = batch(step, size)
    return np.array_split(x, world)[rank], np.array_split(y, world)[rank]


def torch_mlp(seed: int = 0, hidden: int = 32, batch_norm: bool = False):  # -> torch.nn.Module
    """A small MLP (64 -> hidden -> 10) with the same initial weights for the same seed."""
    import torch

    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(FEATURES, hidden)]
    if batch_norm:
        layers.append(torch.nn.BatchNorm1d(hidden))
    layers += [torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES)]
    return torch.nn.Sequential(*layers)


def accuracy(predict) -> float:  # predict: np.ndarray (n, 64) -> np.ndarray (n, 10) scores
    """Fraction of the whole data set ``predict`` labels correctly."""
    x, y = dataset()
    return float(np.mean(np.argmax(predict(x), axis=1) == y))
