"""Vision layers (NCHW) built from ops: Conv2d, Conv1d, BatchNorm2d, GroupNorm, pooling and
nearest upsampling, and batch-norm folding for inference.

Parameter names are PyTorch's (``{name}.weight``, ``{name}.bias``, ``{name}.running_mean``,
``{name}.running_var``; ``num_batches_tracked`` is omitted), so ``state_dict``s map one to one.
The norms are compositions of primitive ops: autodiff gives their exact gradients.

Batch norm follows ``torch.nn.BatchNorm2d``: in training mode it normalizes with the batch
statistics (biased variance) and registers running-statistic updates (``graph.state`` +
``graph.set_update``, applied after each step) with PyTorch's momentum semantics
(``running = (1 - momentum)·running + momentum·batch``, the running variance taking the
*unbiased* batch variance); in eval mode it uses the running statistics.  A static graph is
built in one mode: build a second graph (same names) for evaluation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .. import ops
from ..errors import GraphBuildError, ShapeError
from ..graph import Graph, Value
from ..init import Initializer, fan_in_uniform, kaiming_uniform, ones, zeros
from ..ops.conv import avg_pool2d, max_pool2d  # noqa: F401  (re-exported)

__all__ = [
    "Conv2d", "Conv1d", "BatchNorm2d", "GroupNorm", "max_pool2d", "avg_pool2d",
    "global_avg_pool2d", "upsample_nearest2d", "fold_batchnorm", "fold_conv_bn_params",
]


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, (int, np.integer)) else tuple(int(a) for a in v)


@dataclass
class Conv2d:
    """``torch.nn.Conv2d``: weight ``(out, in/groups, kh, kw)``, optional bias, PyTorch's
    default init (U(±1/√fan_in) for both) unless ``init`` is given."""

    in_channels: int
    out_channels: int
    kernel_size: int | tuple[int, int]
    stride: int | tuple[int, int] = 1
    padding: object = 0
    dilation: int | tuple[int, int] = 1
    groups: int = 1
    bias: bool = True
    name: str = "conv"
    init: Initializer | None = None

    def __call__(self, g: Graph, x: Value) -> Value:
        kh, kw = _pair(self.kernel_size)
        if self.in_channels % self.groups or self.out_channels % self.groups:
            raise GraphBuildError(f"{self.name}: groups={self.groups} must divide in_channels="
                                  f"{self.in_channels} and out_channels={self.out_channels}")
        cg = self.in_channels // self.groups
        w = g.param(f"{self.name}.weight", (self.out_channels, cg, kh, kw),
                    init=self.init or kaiming_uniform())
        b = None
        if self.bias:
            b = g.param(f"{self.name}.bias", (self.out_channels,),
                        init=fan_in_uniform(cg * kh * kw))
        return ops.conv2d(x, w, b, stride=self.stride, padding=self.padding,
                          dilation=self.dilation, groups=self.groups)


@dataclass
class Conv1d:
    """``torch.nn.Conv1d``: (N, C, L) input, weight ``(out, in/groups, k)``."""

    in_channels: int
    out_channels: int
    kernel_size: int
    stride: int = 1
    padding: object = 0
    dilation: int = 1
    groups: int = 1
    bias: bool = True
    name: str = "conv"
    init: Initializer | None = None

    def __call__(self, g: Graph, x: Value) -> Value:
        cg = self.in_channels // self.groups
        w = g.param(f"{self.name}.weight", (self.out_channels, cg, self.kernel_size),
                    init=self.init or kaiming_uniform())
        b = None
        if self.bias:
            b = g.param(f"{self.name}.bias", (self.out_channels,),
                        init=fan_in_uniform(cg * self.kernel_size))
        return ops.conv1d(x, w, b, self.stride, self.padding, self.dilation, self.groups)


def _channel(v: Value, ndim: int) -> Value:
    """A (C,) vector shaped to broadcast over axis 1 of a rank-``ndim`` tensor."""
    return v.reshape((1, v.shape[0]) + (1,) * (ndim - 2))


@dataclass
class BatchNorm2d:
    """``torch.nn.BatchNorm2d`` (works for any (N, C, …) input).  ``training`` selects batch
    statistics + running-stat updates, or the running statistics (eval)."""

    num_features: int
    eps: float = 1e-5
    momentum: float = 0.1
    affine: bool = True
    track_running_stats: bool = True
    training: bool = True
    name: str = "bn"

    def __call__(self, g: Graph, x: Value) -> Value:
        C = self.num_features
        if x.ndim < 2 or x.shape[1] != C:
            raise ShapeError(f"{self.name}: expected (N, {C}, ...) input, got {x.shape}")
        if self.momentum is None or not 0.0 <= float(self.momentum) <= 1.0:
            raise GraphBuildError(f"{self.name}: momentum must be a number in [0, 1] "
                                  "(cumulative averaging, momentum=None, is not supported)")
        axes = (0,) + tuple(range(2, x.ndim))
        rm = rv = None
        if self.track_running_stats:
            rm = g.state(f"{self.name}.running_mean", (C,), init=zeros())
            rv = g.state(f"{self.name}.running_var", (C,), init=ones())
        if self.training or not self.track_running_stats:
            mean = ops.mean(x, axes, keepdims=True)
            xc = x - mean
            var = ops.mean(xc * xc, axes, keepdims=True)
            y = xc * ops.rsqrt(var + self.eps)
            if self.training and self.track_running_stats:
                n = x.size // C
                m = float(self.momentum)
                bm = ops.stop_gradient(mean.reshape(C))
                bv = ops.stop_gradient(var.reshape(C))
                g.set_update(f"{self.name}.running_mean", rm * (1.0 - m) + bm * m)
                g.set_update(f"{self.name}.running_var",
                             rv * (1.0 - m) + bv * (m * n / max(n - 1, 1)))
        else:
            y = (x - _channel(rm, x.ndim)) * _channel(ops.rsqrt(rv + self.eps), x.ndim)
        if self.affine:
            w = g.param(f"{self.name}.weight", (C,), init=ones())
            b = g.param(f"{self.name}.bias", (C,), init=zeros())
            y = y * _channel(w, x.ndim) + _channel(b, x.ndim)
        return y


@dataclass
class GroupNorm:
    """``torch.nn.GroupNorm``: statistics over (C/groups, *spatial) per sample and group."""

    num_groups: int
    num_channels: int
    eps: float = 1e-5
    affine: bool = True
    name: str = "norm"

    def __call__(self, g: Graph, x: Value) -> Value:
        G, C = self.num_groups, self.num_channels
        if C % G:
            raise GraphBuildError(f"{self.name}: num_groups={G} must divide num_channels={C}")
        if x.ndim < 2 or x.shape[1] != C:
            raise ShapeError(f"{self.name}: expected (N, {C}, ...) input, got {x.shape}")
        n = x.shape[0]
        h = x.reshape(n, G, -1)
        mean = ops.mean(h, -1, keepdims=True)
        hc = h - mean
        var = ops.mean(hc * hc, -1, keepdims=True)
        y = (hc * ops.rsqrt(var + self.eps)).reshape(x.shape)
        if self.affine:
            w = g.param(f"{self.name}.weight", (C,), init=ones())
            b = g.param(f"{self.name}.bias", (C,), init=zeros())
            y = y * _channel(w, x.ndim) + _channel(b, x.ndim)
        return y


def global_avg_pool2d(x: Value) -> Value:
    """(N, C, H, W) -> (N, C): the mean over the spatial axes."""
    return ops.mean(x, (2, 3))


def upsample_nearest2d(x: Value, scale: int = 2) -> Value:
    """Nearest-neighbour upsampling by an integer factor (``F.interpolate(mode='nearest')``):
    reshape + broadcast + reshape, so its gradient is a reshape + sum."""
    n, c, h, w = x.shape
    s = int(scale)
    y = ops.broadcast_to(x.reshape(n, c, h, 1, w, 1), (n, c, h, s, w, s))
    return y.reshape(n, c, h * s, w * s)


# ------------------------------------------------------------------------------ BN folding


def fold_batchnorm(weight: np.ndarray, bias: np.ndarray | None, bn_weight: np.ndarray,
                   bn_bias: np.ndarray, running_mean: np.ndarray, running_var: np.ndarray,
                   eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
    """Conv weight and bias that compute ``bn_eval(conv(x))`` in one convolution:
    ``w' = w·γ/√(σ²+ε)`` (per output channel), ``b' = (b − μ)·γ/√(σ²+ε) + β``.
    Works for any conv rank (the output channel is axis 0 of ``weight``)."""
    w = np.asarray(weight, dtype=np.float64)
    scale = np.asarray(bn_weight, np.float64) / np.sqrt(np.asarray(running_var, np.float64) + eps)
    b = np.zeros(w.shape[0]) if bias is None else np.asarray(bias, np.float64)
    w2 = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
    b2 = (b - np.asarray(running_mean, np.float64)) * scale + np.asarray(bn_bias, np.float64)
    dt = np.asarray(weight).dtype
    return w2.astype(dt), b2.astype(dt)


def fold_conv_bn_params(params: Mapping[str, np.ndarray], conv: str, bn: str,
                        eps: float = 1e-5) -> dict[str, np.ndarray]:
    """From a parameter/state dict holding ``{conv}.weight`` (+ ``{conv}.bias``) and the
    batch norm ``{bn}.*``: the folded ``{conv}.weight`` and ``{conv}.bias``."""
    w, b = fold_batchnorm(params[f"{conv}.weight"], params.get(f"{conv}.bias"),
                          params[f"{bn}.weight"], params[f"{bn}.bias"],
                          params[f"{bn}.running_mean"], params[f"{bn}.running_var"], eps)
    return {f"{conv}.weight": w, f"{conv}.bias": b}
