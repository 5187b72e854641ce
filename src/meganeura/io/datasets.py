"""Small built-in datasets (no network) and a mini-batch iterator.

``load_digits`` is scikit-learn's embedded 8×8 handwritten digits (1,797 images, 10 classes),
scaled to [0, 1], with a fixed stratified train/test split so every run sees the same data.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["load_digits", "batches"]

_SPLITS = ("train", "test")


def load_digits(split: str = "train", test_fraction: float = 0.2,
                seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The ``split`` ("train" or "test") of scikit-learn's digits.

    Returns ``x`` float32 ``(N, 64)`` with pixel values scaled from 0..16 to [0, 1], and ``y``
    int32 ``(N,)`` labels 0..9.  The split is stratified by class and deterministic in ``seed``
    (sklearn's ``train_test_split``); train and test are disjoint and together the whole set.
    """
    if split not in _SPLITS:
        raise ValueError(f"load_digits: split must be one of {_SPLITS}, got {split!r}")
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)):
        raise ValueError(f"load_digits: test_fraction must be a number, got {test_fraction!r}")
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"load_digits: test_fraction must be in (0, 1), got {test_fraction}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"load_digits: seed must be an int, got {seed!r}")
    from sklearn.datasets import load_digits as _sk_digits
    from sklearn.model_selection import train_test_split

    data = _sk_digits()
    x = (np.asarray(data.data, dtype=np.float64) / 16.0).astype(np.float32)
    y = np.asarray(data.target, dtype=np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=float(test_fraction), random_state=int(seed), stratify=y, shuffle=True
    )
    if split == "train":
        return np.ascontiguousarray(x_tr), np.ascontiguousarray(y_tr)
    return np.ascontiguousarray(x_te), np.ascontiguousarray(y_te)


def batches(x: np.ndarray, y: np.ndarray | None, batch_size: int, shuffle: bool = True,
            seed: int = 0, drop_last: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Mini-batches ``(xb, yb)`` over the first axis of ``x`` and ``y`` (one pass, one epoch).

    ``shuffle`` permutes the examples with a generator seeded by ``seed`` (pass e.g. the epoch
    number to change the order from epoch to epoch); ``drop_last`` skips a final short batch,
    which keeps every batch the static shape a compiled graph needs.  ``y=None`` yields
    ``(xb, None)``.  Batches are contiguous copies.
    """
    x = np.asarray(x)
    if x.ndim < 1:
        raise ValueError("batches: x must have a leading example axis")
    n = x.shape[0]
    if y is not None:
        y = np.asarray(y)
        if y.ndim < 1 or y.shape[0] != n:
            raise ValueError(f"batches: x has {n} examples but y has shape {y.shape}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or batch_size <= 0:
        raise ValueError(f"batches: batch_size must be a positive int, got {batch_size!r}")
    batch_size = int(batch_size)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        xb = np.ascontiguousarray(x[idx])
        yb = np.ascontiguousarray(y[idx]) if y is not None else None
        yield xb, yb
