"""How an op reaches the GPU, described as data (``OpDef.lowering``).  ``codegen/`` interprets
these; ops never emit WGSL themselves beyond a pointwise expression.

An ``OpDef.lowering`` is one of these objects, or a function ``(attrs, in_types, out_types) ->``
one of them when it depends on attributes (``cast``, ``gelu(approximate=…)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Pointwise:
    """One WGSL expression per element; ``{0}``, ``{1}``… are the (broadcast) operands in their
    register types (bool operands/results are WGSL ``bool``).  ``helpers`` are names of WGSL helper
    functions from ``codegen/wgsl_helpers.py`` that the expression calls."""

    expr: str
    helpers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reduce:
    """Reduce the ``axes`` attr (keepdims attr) with ``kind`` in "sum" | "max" | "min"."""

    kind: str


@dataclass(frozen=True)
class Matmul:
    """Batched matmul with broadcast batch dims (attrs ``transpose_a``/``transpose_b``)."""


@dataclass(frozen=True)
class View:
    """Pure re-indexing (reshape, permute, broadcast_to, slice…): folded into consumers' indexing
    where possible, else a copy kernel.  ``kind`` names the index map."""

    kind: str


@dataclass(frozen=True)
class Composite:
    """Expanded into simpler ops by a pass before codegen: ``expand(graph, node) -> outputs``."""

    expand: Callable


@dataclass(frozen=True)
class Kernel:
    """A dedicated kernel archetype (gather, scatter_add, softmax, cross_entropy…) with params.

    ``rewrite``, optional: ``(attrs, in_types, out_types) -> expand | None``.  Where it returns
    an ``expand`` function (same signature as ``Composite.expand``) the node is expanded into
    other ops by the pass that expands composites, because those run faster for these shapes
    (a 1×1 convolution as a matmul); elsewhere the node gets this archetype's kernel.  The
    decision depends on attributes and types only, so plans stay device-independent, and it
    is taken after autodiff (gradients are built from the op's own VJP either way)."""

    archetype: str
    params: tuple = ()
    rewrite: Callable | None = None


def resolve(node):
    """A node's lowering object: ``OpDef.lowering`` itself, or what its function returns for
    the node's attributes and types (``cast``, ``gelu``, ``full``)."""
    low = node.opdef.lowering
    if callable(low):
        low = low(node.attrs, [v.type for v in node.inputs], [o.type for o in node.outputs])
    return low
