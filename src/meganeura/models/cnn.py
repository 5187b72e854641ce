"""A small CNN for the 8×8 digits (``meganeura train --model cnn``): the flat 64-pixel input
is reshaped to a 1×8×8 image; conv 3×3 (8 channels) → ReLU → 2×2 max pool → conv 3×3 (16
channels) → ReLU gives 16×4×4 features, and a linear layer classifies them.  Small on purpose
(≈ 50 kFLOP per image forward): it trains on lavapipe (≈ 0.5 GFLOP/s) in seconds.  No batch
norm, so the same graph serves training and evaluation (only parameters move between them)."""

from __future__ import annotations

from .. import dtypes
from ..graph import Graph
from ..nn import Conv2d, GroupNorm, Linear
from ..ops import cross_entropy, max_pool2d
from .mlp import ClassifierGraph


def digits_cnn(batch: int, channels: tuple[int, int] = (8, 16), classes: int = 10,
               image: int = 8, groups: int = 4) -> ClassifierGraph:
    c1, c2 = channels
    g = Graph("digits_cnn")
    x = g.input("x", (batch, image * image))
    y = g.input("y", (batch,), dtype=dtypes.i32)
    h = x.reshape(batch, 1, image, image)
    h = Conv2d(1, c1, 3, padding=1, name="conv1")(g, h)
    h = GroupNorm(groups, c1, name="norm1")(g, h).relu()
    h = max_pool2d(h, 2)
    h = Conv2d(c1, c2, 3, padding=1, name="conv2")(g, h)
    h = GroupNorm(groups, c2, name="norm2")(g, h).relu()
    feat = c2 * (image // 2) ** 2
    logits = Linear(feat, classes, name="fc")(g, h.reshape(batch, feat))
    return ClassifierGraph(g, x, y, logits, cross_entropy(logits, y))
