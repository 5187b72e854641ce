"""A classifier MLP (the default model of ``meganeura train``: digits, 64 → 128 → 10)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import dtypes
from ..graph import Graph, Value
from ..nn import MLP
from ..ops import cross_entropy


@dataclass
class ClassifierGraph:
    graph: Graph
    x: Value
    y: Value
    logits: Value
    loss: Value


def mlp_classifier(batch: int, in_dim: int = 64, hidden: tuple[int, ...] = (128,),
                   classes: int = 10, activation: str = "relu") -> ClassifierGraph:
    g = Graph("mlp")
    x = g.input("x", (batch, in_dim))
    y = g.input("y", (batch,), dtype=dtypes.i32)
    logits = MLP((in_dim, *hidden, classes), activation=activation, name="mlp")(g, x)
    loss = cross_entropy(logits, y)
    return ClassifierGraph(g, x, y, logits, loss)
