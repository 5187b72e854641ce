"""Expand composite ops (softmax, cross-entropy, mean, …) into the primitives codegen knows,
and kernel ops whose ``Kernel.rewrite`` prefers other ops for their shapes (1×1 convolutions as
matmuls)."""

from __future__ import annotations

from types import SimpleNamespace

from ...ops.lowering import Composite, Kernel
from ...program import Program
from .rebuild import rebuild


def _expander(node):
    """The function expanding ``node`` into other ops, or None when it stays as it is."""
    low = node.opdef.lowering
    if isinstance(low, Composite):
        return low.expand
    if isinstance(low, Kernel) and low.rewrite is not None:
        return low.rewrite(node.attrs, [v.type for v in node.inputs],
                           [o.type for o in node.outputs])
    return None


def expand_composites(program: Program) -> Program:
    """Repeat until no composite remains (an expansion may use other composites)."""
    for _ in range(8):
        if not any(_expander(n) is not None for n in program.graph.nodes):
            return program

        def rewrite(g, node, ins):
            expand = _expander(node)
            if expand is None:
                return None
            view = SimpleNamespace(op=node.op, inputs=ins, attrs=node.attrs, outputs=None)
            return list(expand(g, view))

        program = rebuild(program, rewrite)
    raise RuntimeError("composite expansion did not terminate")
