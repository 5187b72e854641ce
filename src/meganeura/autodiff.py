"""Reverse-mode automatic differentiation as a graph → graph transform.

``grad`` copies the graph and appends the backward pass built from each op's VJP (itself written
with ordinary ops, so gradients can be compiled, fused and even differentiated again)."""

from __future__ import annotations

from collections.abc import Iterable

from .errors import AutodiffError
from .graph import Graph, Value


def _targets(graph: Graph, wrt) -> list[str]:
    params = graph.params
    if wrt is None:
        return list(params)
    out = []
    for w in (wrt if isinstance(wrt, (list, tuple)) else [wrt]):
        if isinstance(w, Value):
            leaf = w.graph.leaf_of(w)
            if leaf is None or leaf.kind != "param":
                article = "an" if leaf and leaf.kind[0] in "aeiou" else "a"
                what = (f"{article} {leaf.kind} ({leaf.name!r})" if leaf
                        else f"the result of {w.node.op} (at {w.node.loc})")
                raise AutodiffError(f"grad: can only differentiate with respect to parameters; "
                                    f"{w!r} is {what}")
            w = leaf.name
        if w not in params:
            kind = graph.leaves[w].kind if w in graph.leaves else "unknown name"
            raise AutodiffError(f"grad: {w!r} is not a parameter of the graph ({kind})")
        out.append(w)
    return out


def grad(graph: Graph, loss: Value, wrt: Iterable | None = None) -> tuple[Graph, dict[str, Value]]:
    """Gradients of the scalar ``loss`` with respect to parameters ``wrt`` (default: all).

    Returns a new graph (a copy of ``graph`` with the backward pass appended) and a dict mapping
    each parameter name to its gradient value in that new graph.  A parameter the loss does not
    depend on gets exact zeros of its own shape.
    """
    if not isinstance(loss, Value):
        raise AutodiffError(f"grad: loss must be a graph Value, got {type(loss).__name__}")
    if loss.graph is not graph:
        raise AutodiffError("grad: loss belongs to a different graph")
    if loss.shape != ():
        raise AutodiffError(f"grad: loss must be a scalar, got {loss.type}; reduce it "
                            "(e.g. .mean()) first")
    if not loss.dtype.is_float:
        raise AutodiffError(f"grad: loss must be floating point, got {loss.dtype.name}")
    names = _targets(graph, wrt)

    g = graph.copy()
    loss = g[loss]
    target_ids = {g.params[n].id for n in names}

    # Forward sweep: which values depend (differentiably) on a target?
    depends: set[int] = set()
    for node in g.nodes[: loss.node.id + 1]:
        if node.op == "stop_gradient":  # cuts the dependence: nothing past it needs a VJP
            continue
        if any(o.id in target_ids for o in node.outputs) or any(
            v.id in depends for v in node.inputs if v.dtype.is_float
        ):
            depends.update(o.id for o in node.outputs if o.dtype.is_float)

    cot: dict[int, Value] = {loss.id: g.full((), 1.0, loss.dtype)}
    for node in reversed(g.nodes[: loss.node.id + 1]):
        cts = [cot.get(o.id) for o in node.outputs]
        if all(c is None for c in cts) or not any(v.id in depends for v in node.inputs):
            continue
        opdef = node.opdef
        if opdef.vjp is None:
            raise AutodiffError(f"grad: op {node.op!r} (at {node.loc}) has no gradient rule, but "
                                "the loss depends on a parameter through it")
        in_cts = opdef.vjp(node, cts)
        for v, c in zip(node.inputs, in_cts, strict=True):
            if c is None or v.id not in depends:
                continue
            if c.shape != v.shape or c.dtype != v.dtype:
                raise AutodiffError(f"internal: VJP of {node.op} gave {c.type} for input {v.type}")
            prev = cot.get(v.id)
            cot[v.id] = c if prev is None else prev + c
    grads = {}
    for n in names:
        p = g.params[n]
        c = cot.get(p.id)
        grads[n] = c if c is not None else g.full(p.shape, 0.0, p.dtype)
    return g, grads
