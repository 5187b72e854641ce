"""The built-in digits dataset and the mini-batch iterator."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from meganeura.io.datasets import batches, load_digits

N_TOTAL = 1797


def test_sizes_dtypes_and_range():
    xtr, ytr = load_digits("train")
    xte, yte = load_digits("test")
    assert xtr.dtype == np.float32 and xte.dtype == np.float32
    assert ytr.dtype == np.int32 and yte.dtype == np.int32
    assert xtr.shape[1:] == (64,) and xte.shape[1:] == (64,)
    assert xtr.shape[0] == ytr.shape[0] and xte.shape[0] == yte.shape[0]
    assert xtr.shape[0] + xte.shape[0] == N_TOTAL
    assert xte.shape[0] == int(np.ceil(0.2 * N_TOTAL))
    for x in (xtr, xte):
        assert x.min() == 0.0 and x.max() == 1.0
        assert x.flags.c_contiguous
    assert set(np.unique(ytr)) == set(range(10)) == set(np.unique(yte))


def test_deterministic():
    a = load_digits("train")
    b = load_digits("train")
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    c = load_digits("train", seed=1)
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize("frac,seed", [(0.2, 0), (0.5, 3)])
def test_disjoint_split_covering_everything(frac, seed):
    from sklearn.datasets import load_digits as sk

    full = sk()
    xtr, ytr = load_digits("train", frac, seed)
    xte, yte = load_digits("test", frac, seed)

    # Identify rows by their bytes (the scaled pixels plus label).
    def rows(x, y):
        return [r.tobytes() + bytes([int(lbl)]) for r, lbl in zip(x, y, strict=True)]

    all_rows = rows((full.data / 16.0).astype(np.float32), full.target)
    tr, te = rows(xtr, ytr), rows(xte, yte)
    assert Counter(tr) + Counter(te) == Counter(all_rows)
    # disjoint as multisets: no example index used twice (duplicates in the data stay apart)
    assert len(tr) + len(te) == len(all_rows)


def test_stratified_class_coverage():
    for frac in (0.2, 0.5):
        _, ytr = load_digits("train", frac)
        _, yte = load_digits("test", frac)
        full = np.bincount(np.concatenate([ytr, yte]), minlength=10)
        te = np.bincount(yte, minlength=10)
        assert (te > 0).all() and (np.bincount(ytr, minlength=10) > 0).all()
        np.testing.assert_allclose(te / full, frac, atol=0.02)


@pytest.mark.parametrize("kw,msg", [
    (dict(split="val"), "split"),
    (dict(test_fraction=0.0), "test_fraction"),
    (dict(test_fraction=1.0), "test_fraction"),
    (dict(seed="0"), "seed"),
])
def test_bad_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg):
        load_digits(**kw)


def test_batches_cover_each_example_once():
    x = np.arange(23 * 2, dtype=np.float32).reshape(23, 2)
    y = np.arange(23, dtype=np.int32)
    got = list(batches(x, y, 5, shuffle=True, seed=4))
    assert [len(b[1]) for b in got] == [5, 5, 5, 5, 3]
    ys = np.concatenate([b[1] for b in got])
    assert sorted(ys.tolist()) == list(range(23))
    assert ys.tolist() != list(range(23))  # shuffled
    for xb, yb in got:
        np.testing.assert_array_equal(xb[:, 0], 2 * yb)  # x and y stay paired
        assert xb.dtype == np.float32 and yb.dtype == np.int32


def test_batches_drop_last_no_shuffle_and_determinism():
    x = np.arange(23, dtype=np.float32)[:, None]
    y = np.arange(23, dtype=np.int32)
    got = list(batches(x, y, 5, shuffle=False, drop_last=True))
    assert len(got) == 4 and all(b[0].shape == (5, 1) for b in got)
    np.testing.assert_array_equal(np.concatenate([b[1] for b in got]), np.arange(20))
    a = [b[1].tolist() for b in batches(x, y, 4, seed=7)]
    b = [b[1].tolist() for b in batches(x, y, 4, seed=7)]
    c = [b[1].tolist() for b in batches(x, y, 4, seed=8)]
    assert a == b and a != c
    assert list(batches(x, y, 50, drop_last=True)) == []


def test_batches_on_digits_and_without_labels():
    x, y = load_digits("test")
    n = sum(len(yb) for _, yb in batches(x, y, 32))
    assert n == len(y)
    xb, yb = next(batches(x, None, 8))
    assert xb.shape == (8, 64) and yb is None


@pytest.mark.parametrize("args,msg", [
    ((np.zeros((4, 2)), np.zeros(3), 2), "examples"),
    ((np.zeros((4, 2)), np.zeros(4), 0), "batch_size"),
    ((np.zeros((4, 2)), np.zeros(4), 2.0), "batch_size"),
])
def test_batches_bad_arguments(args, msg):
    with pytest.raises(ValueError, match=msg):
        list(batches(*args))
