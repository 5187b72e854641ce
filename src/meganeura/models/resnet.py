"""ResNet (He et al. 2016) in torchvision's layout: ResNet-50 (bottleneck blocks 3/4/6/3, stride
on the 3×3 convolution — "v1.5") and ResNet-18 (basic blocks 2/2/2/2), configurable in width,
depth, image size and classes for tiny CI configurations.

Parameter and state names are torchvision's (``conv1.weight``, ``bn1.running_mean``,
``layer1.0.conv2.weight``, ``layer2.0.downsample.0.weight``, ``layer2.0.downsample.1.bias``,
``fc.weight`` …), so a torchvision ``state_dict`` (minus ``num_batches_tracked``) loads as is.

Graphs are built in one batch-norm mode: ``training=True`` (batch statistics, running-stat
updates after each step) or ``training=False`` (running statistics).  ``fold_bn=True`` builds the
inference graph with every batch norm folded into its convolution (which gains a bias);
:func:`fold_params` maps trained parameters + states to that graph's parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .. import dtypes, ops
from ..graph import Graph, Value
from ..init import kaiming_normal
from ..nn import BatchNorm2d, Conv2d, Linear, fold_conv_bn_params

__all__ = ["ResNetConfig", "ResNetGraph", "resnet", "fold_params", "conv_bn_pairs", "PRESETS"]


@dataclass(frozen=True)
class ResNetConfig:
    block: str = "bottleneck"  # "bottleneck" (expansion 4) or "basic" (expansion 1)
    layers: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64  # channels of the stem and of the first stage's 3x3 convolutions
    num_classes: int = 1000
    image_size: int = 224
    in_channels: int = 3
    bn_eps: float = 1e-5
    bn_momentum: float = 0.1

    @property
    def expansion(self) -> int:
        return 4 if self.block == "bottleneck" else 1


PRESETS = {
    "resnet50": ResNetConfig(),
    "resnet18": ResNetConfig(block="basic", layers=(2, 2, 2, 2)),
    # tiny CI configurations (same structure: stem, 4 stages with downsampling, head)
    "resnet50-tiny": ResNetConfig(layers=(1, 1, 1, 1), width=4, num_classes=10, image_size=64),
    "resnet18-tiny": ResNetConfig(block="basic", layers=(1, 1, 1, 1), width=4, num_classes=10,
                                  image_size=64),
}


@dataclass
class ResNetGraph:
    graph: Graph
    x: Value  # (batch, in_channels, image, image)
    y: Value  # (batch,) i32 labels
    logits: Value
    loss: Value  # mean cross-entropy
    config: ResNetConfig


def _conv_init():
    # torchvision: kaiming_normal_(mode="fan_out", nonlinearity="relu")
    return kaiming_normal(mode="fan_out")


class _Builder:
    def __init__(self, g: Graph, cfg: ResNetConfig, training: bool, fold_bn: bool):
        self.g, self.cfg, self.training, self.fold_bn = g, cfg, training, fold_bn

    def conv_bn(self, x: Value, cin: int, cout: int, k: int, stride: int, conv: str,
                bn: str) -> Value:
        g = self.g
        if self.fold_bn:
            return Conv2d(cin, cout, k, stride, k // 2, bias=True, name=conv,
                          init=_conv_init())(g, x)
        y = Conv2d(cin, cout, k, stride, k // 2, bias=False, name=conv, init=_conv_init())(g, x)
        return BatchNorm2d(cout, self.cfg.bn_eps, self.cfg.bn_momentum, training=self.training,
                           name=bn)(g, y)

    def block(self, x: Value, cin: int, planes: int, stride: int, name: str) -> Value:
        cfg = self.cfg
        cout = planes * cfg.expansion
        if cfg.block == "bottleneck":
            h = self.conv_bn(x, cin, planes, 1, 1, f"{name}.conv1", f"{name}.bn1").relu()
            h = self.conv_bn(h, planes, planes, 3, stride, f"{name}.conv2", f"{name}.bn2").relu()
            h = self.conv_bn(h, planes, cout, 1, 1, f"{name}.conv3", f"{name}.bn3")
        else:
            h = self.conv_bn(x, cin, planes, 3, stride, f"{name}.conv1", f"{name}.bn1").relu()
            h = self.conv_bn(h, planes, planes, 3, 1, f"{name}.conv2", f"{name}.bn2")
        if stride != 1 or cin != cout:
            x = self.conv_bn(x, cin, cout, 1, stride, f"{name}.downsample.0",
                             f"{name}.downsample.1")
        return (h + x).relu()


def resnet(cfg: ResNetConfig | str, batch: int, training: bool = True,
           fold_bn: bool = False) -> ResNetGraph:
    """The classifier graph: input ``x`` (batch, C, H, W), labels ``y``, logits and mean
    cross-entropy.  ``fold_bn`` (inference only) folds every batch norm into its conv."""
    if isinstance(cfg, str):
        cfg = PRESETS[cfg]
    if fold_bn and training:
        raise ValueError("fold_bn builds an inference graph: pass training=False")
    if cfg.block not in ("bottleneck", "basic"):
        raise ValueError(f"block must be 'bottleneck' or 'basic', got {cfg.block!r}")
    g = Graph(f"resnet-{cfg.block}")
    x = g.input("x", (batch, cfg.in_channels, cfg.image_size, cfg.image_size))
    y = g.input("y", (batch,), dtype=dtypes.i32)
    b = _Builder(g, cfg, training, fold_bn)
    h = b.conv_bn(x, cfg.in_channels, cfg.width, 7, 2, "conv1", "bn1").relu()
    h = ops.max_pool2d(h, 3, 2, 1)
    cin = cfg.width
    for i, n_blocks in enumerate(cfg.layers):
        planes = cfg.width * 2**i
        for j in range(n_blocks):
            stride = 2 if (i > 0 and j == 0) else 1
            h = b.block(h, cin, planes, stride, f"layer{i + 1}.{j}")
            cin = planes * cfg.expansion
    h = ops.mean(h, (2, 3))  # global average pooling
    logits = Linear(cin, cfg.num_classes, name="fc")(g, h)
    return ResNetGraph(g, x, y, logits, ops.cross_entropy(logits, y), cfg)


def conv_bn_pairs(cfg: ResNetConfig) -> list[tuple[str, str]]:
    """(conv name, batch-norm name) of every convolution followed by a batch norm."""
    pairs = [("conv1", "bn1")]
    cin = cfg.width
    for i, n_blocks in enumerate(cfg.layers):
        planes = cfg.width * 2**i
        for j in range(n_blocks):
            name = f"layer{i + 1}.{j}"
            n_conv = 3 if cfg.block == "bottleneck" else 2
            pairs += [(f"{name}.conv{c}", f"{name}.bn{c}") for c in range(1, n_conv + 1)]
            stride = 2 if (i > 0 and j == 0) else 1
            if stride != 1 or cin != planes * cfg.expansion:
                pairs.append((f"{name}.downsample.0", f"{name}.downsample.1"))
            cin = planes * cfg.expansion
    return pairs


def fold_params(cfg: ResNetConfig | str, params: Mapping[str, np.ndarray]) -> dict:
    """Parameters for ``resnet(cfg, …, training=False, fold_bn=True)`` from the parameters and
    batch-norm states of the unfolded model."""
    if isinstance(cfg, str):
        cfg = PRESETS[cfg]
    out = {"fc.weight": params["fc.weight"], "fc.bias": params["fc.bias"]}
    for conv, bn in conv_bn_pairs(cfg):
        out.update(fold_conv_bn_params(params, conv, bn, cfg.bn_eps))
    return out


