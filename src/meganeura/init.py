"""Parameter initializers.  Deterministic: ``init_params(seed)`` seeds each tensor from the seed
and the tensor's name, so adding a parameter never changes the others' initial values.

Fan convention (PyTorch's): a weight is laid out ``(out, in, *kernel)``; fan_in = in·∏kernel,
fan_out = out·∏kernel; 1-D tensors use their length for both.
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


def fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    rf = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
    return shape[1] * rf, shape[0] * rf


def rng_for(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(name.encode())])


class Initializer(ABC):
    @abstractmethod
    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray: ...

    def __call__(self, rng, shape, dtype) -> np.ndarray:
        return np.asarray(self.sample(rng, tuple(shape)), dtype=np.float64).astype(dtype.np)


@dataclass(frozen=True)
class constant(Initializer):
    value: float = 0.0

    def sample(self, rng, shape):
        return np.full(shape, self.value)


def zeros() -> constant:
    return constant(0.0)


def ones() -> constant:
    return constant(1.0)


@dataclass(frozen=True)
class normal(Initializer):
    std: float = 1.0
    mean: float = 0.0

    def sample(self, rng, shape):
        return rng.normal(self.mean, self.std, shape)


@dataclass(frozen=True)
class uniform(Initializer):
    low: float = -1.0
    high: float = 1.0

    def sample(self, rng, shape):
        return rng.uniform(self.low, self.high, shape)


@dataclass(frozen=True)
class xavier_uniform(Initializer):
    gain: float = 1.0

    def sample(self, rng, shape):
        fi, fo = fans(shape)
        b = self.gain * math.sqrt(6.0 / (fi + fo))
        return rng.uniform(-b, b, shape)


@dataclass(frozen=True)
class xavier_normal(Initializer):
    gain: float = 1.0

    def sample(self, rng, shape):
        fi, fo = fans(shape)
        return rng.normal(0.0, self.gain * math.sqrt(2.0 / (fi + fo)), shape)


def _gain(nonlinearity: str, a: float) -> float:
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        return math.sqrt(2.0 / (1 + a * a))
    if nonlinearity in ("linear", "sigmoid"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    raise ValueError(f"unknown nonlinearity {nonlinearity!r}")


@dataclass(frozen=True)
class kaiming_uniform(Initializer):
    """Default ``a=sqrt(5)`` with leaky_relu gives PyTorch's nn.Linear/Conv default:
    U(±1/√fan_in)."""

    a: float = math.sqrt(5.0)
    mode: str = "fan_in"
    nonlinearity: str = "leaky_relu"

    def sample(self, rng, shape):
        fi, fo = fans(shape)
        fan = fi if self.mode == "fan_in" else fo
        b = _gain(self.nonlinearity, self.a) * math.sqrt(3.0 / fan)
        return rng.uniform(-b, b, shape)


@dataclass(frozen=True)
class kaiming_normal(Initializer):
    a: float = 0.0
    mode: str = "fan_in"
    nonlinearity: str = "relu"

    def sample(self, rng, shape):
        fi, fo = fans(shape)
        fan = fi if self.mode == "fan_in" else fo
        return rng.normal(0.0, _gain(self.nonlinearity, self.a) / math.sqrt(fan), shape)


@dataclass(frozen=True)
class fan_in_uniform(Initializer):
    """U(±1/√fan_in) with fan_in taken from another tensor's shape (PyTorch's bias default)."""

    fan_in: int = 1

    def sample(self, rng, shape):
        b = 1.0 / math.sqrt(self.fan_in) if self.fan_in > 0 else 0.0
        return rng.uniform(-b, b, shape)


def init_leaves(graph, seed: int = 0, kinds=("param", "state"),
                names=None) -> dict[str, np.ndarray]:
    """Initial values of the graph's parameters and states (only ``names``, when given),
    deterministic in ``seed``; each leaf's values depend on its name, not on which others
    are initialised with it."""
    out = {}
    for name in graph.leaves if names is None else names:
        lf = graph.leaves[name]
        if lf.kind in kinds:
            out[name] = lf.init(rng_for(seed, name), lf.value.shape, lf.value.dtype)
    return out
