"""Expand composite ops (softmax, cross-entropy, mean, …) into the primitives codegen knows."""

from __future__ import annotations

from types import SimpleNamespace

from ...ops.lowering import Composite
from ...program import Program
from .rebuild import rebuild


def expand_composites(program: Program) -> Program:
    """Repeat until no composite remains (an expansion may use other composites)."""
    for _ in range(8):
        if not any(isinstance(n.opdef.lowering, Composite) for n in program.graph.nodes):
            return program

        def rewrite(g, node, ins):
            low = node.opdef.lowering
            if not isinstance(low, Composite):
                return None
            view = SimpleNamespace(op=node.op, inputs=ins, attrs=node.attrs, outputs=None)
            return list(low.expand(g, view))

        program = rebuild(program, rewrite)
    raise RuntimeError("composite expansion did not terminate")
