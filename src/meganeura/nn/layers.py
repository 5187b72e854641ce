"""Basic layers.  A layer holds hyperparameters; calling it with (graph, x) declares its
parameters in the graph (names prefixed by the layer's ``name``) and returns the output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..graph import Graph, Value
from ..init import fan_in_uniform, kaiming_uniform
from ..ops import matmul


@dataclass
class Linear:
    """y = x @ W.T + b with W of shape (out, in) (PyTorch layout and default init)."""

    in_features: int
    out_features: int
    bias: bool = True
    name: str = "linear"

    def __call__(self, g: Graph, x: Value) -> Value:
        w = g.param(f"{self.name}.weight", (self.out_features, self.in_features),
                    init=kaiming_uniform())
        y = matmul(x, w, transpose_b=True)
        if self.bias:
            b = g.param(f"{self.name}.bias", (self.out_features,),
                        init=fan_in_uniform(self.in_features))
            y = y + b
        return y


@dataclass
class MLP:
    """Linear layers with an activation between them (none after the last)."""

    sizes: Sequence[int]
    activation: str = "relu"
    name: str = "mlp"

    def __call__(self, g: Graph, x: Value) -> Value:
        n = len(self.sizes) - 1
        for i in range(n):
            x = Linear(self.sizes[i], self.sizes[i + 1], name=f"{self.name}.{i}")(g, x)
            if i < n - 1:
                x = getattr(x, self.activation)()
        return x
