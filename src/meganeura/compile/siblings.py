"""Sibling reductions grouped into one dispatch (``kernels/multi_reduce.py``).

A norm's statistics and gradients reduce the same tensors over the same axes several times:
batch norm's backward computes ``sum(dy)`` and ``sum(dy * x̂)`` (and the weight and bias
gradients), each a separate, latency-bound dispatch (ResNet-50's training step: ~400
``reduce_sum`` kernels of 8–12 µs on the H200, 3.9 of 18.5 ms GPU time).  This rule, the last
kernel-list rewrite, folds each plain reduction into an earlier one of the same iteration
shape, axes and split when that is legal:

* every value it reads is produced before the earlier kernel (SSA values: moving a kernel
  earlier is then safe; a concat read through its buffer counts as produced by every kernel
  writing one of its inputs, which may write its slot);
* neither writes an updated persistent value (the in-place rules look at those kernels
  alone).  A reduction with a post pass (``rewrites.with_post_pass`` ran first) joins too:
  its post pass runs after the group's reduction, in the same workgroups, as it did alone;
* the group binds at most ``max_bindings`` storage buffers (shared inputs bound once).

A group of one stays the original ``ReduceKernel``: plans without sibling reductions are
unchanged.  Split reductions group twice: their partial kernels, then their final kernels.
"""

from __future__ import annotations

import dataclasses

from ..kernels import ir
from ..kernels.common import bcast_strides
from ..kernels.reduce import _extra_strides
from .schedule import MAX_BINDINGS, LoweredKernel

MAX_MEMBERS = 6  # keeps each invocation's accumulators (UNROLL per member) in registers


def _key(d: ir.ReduceKernel) -> tuple:
    """Iteration shape, reduced axes and split with size-1 dims squeezed (``squeezed``): a
    bias gradient over (1500, 384) and a LayerNorm one over (1, 1500, 384) are siblings."""
    d = squeezed(d)
    return tuple(d.shape), tuple(d.axes), d.split


def squeezed(d: ir.ReduceKernel) -> ir.ReduceKernel:
    """``d`` over its iteration shape without size-1 dims (the same elements in the same
    order; each operand's view re-expressed over the squeezed shape).  ``d`` itself when it
    has none, so that groups of same-shaped members are emitted as before."""
    shape = tuple(int(n) for n in d.shape)
    nd = len(shape)
    axes = sorted({a % nd for a in d.axes}) if nd else []
    if 1 not in shape:
        return d if list(d.axes) == axes else dataclasses.replace(d, axes=tuple(axes))
    keep = [i for i, n in enumerate(shape) if n != 1]
    out_shape = tuple(n for i, n in enumerate(shape) if i not in axes)
    keep_out = [i for i, n in enumerate(out_shape) if n != 1]

    def over(s: ir.Strided, strides, dims: list[int], of: tuple[int, ...]) -> ir.Strided:
        return ir.Strided(s.dtype, tuple(of[i] for i in dims), tuple(strides[i] for i in dims),
                          s.offset, s.extent)

    full = [over(s, bcast_strides(s, shape, f"{d.name} input"), keep, shape)
            for s in d.inputs + d.post_inputs]
    extra = tuple(over(s, _extra_strides(s, shape, axes, out_shape, f"{d.name} extra"),
                       keep_out, out_shape) for s in d.extra)
    return dataclasses.replace(
        d, shape=tuple(shape[i] for i in keep), axes=tuple(keep.index(a) for a in axes
                                                            if a in keep),
        inputs=tuple(full[:len(d.inputs)]), post_inputs=tuple(full[len(d.inputs):]),
        extra=extra)


def _candidate(k: LoweredKernel, updated: set[int]) -> bool:
    d = k.desc
    return (isinstance(d, ir.ReduceKernel) and len(k.outs) == 1 + len(d.post_outputs)
            and bool(d.prologue or d.inputs) and not any(v.id in updated for v in k.outs)
            and bool(squeezed(d).axes))


class _Group:
    """Reductions to be emitted as one kernel at the position of the first."""

    def __init__(self, first: LoweredKernel):
        self.members = [first]

    def bindings(self, extra: LoweredKernel | None = None) -> int:
        ks = self.members + ([extra] if extra is not None else [])
        ins, xs = set(), set()
        for k in ks:
            d = squeezed(k.desc)
            n_in, n_x = len(d.inputs), len(d.extra)
            ins |= {(b.id, s) for b, s in zip(k.ins, d.inputs, strict=False)}
            ins |= {(b.id, s) for b, s in zip(k.ins[n_in + n_x:], d.post_inputs, strict=True)}
            xs |= {(b.id, s) for b, s in zip(k.ins[n_in:n_in + n_x], d.extra, strict=True)}
        return len(ins) + len(xs) + sum(len(k.outs) for k in ks)

    def lowered(self) -> LoweredKernel:
        if len(self.members) == 1:
            return self.members[0]
        return _multi(self.members)


def _multi(ks: list[LoweredKernel]) -> LoweredKernel:
    """One ``MultiReduceKernel`` for ``ks``: inputs and extras deduplicated (by value and
    view), each member's operands renumbered (post inputs join the shared inputs)."""
    ins, ins_b, xs, xs_b, members = [], [], [], [], []

    def slot(bases, views, b, s):
        for j, (b2, s2) in enumerate(zip(bases, views, strict=True)):
            if b2 is b and s2 == s:
                return j
        bases.append(b)
        views.append(s)
        return len(views) - 1

    for k in ks:
        d = squeezed(k.desc)
        n_in = len(d.inputs)
        imap = {i: slot(ins_b, ins, k.ins[i], d.inputs[i]) for i in range(n_in)}
        n_x = len(d.extra)
        xmap = {i: slot(xs_b, xs, k.ins[n_in + i], d.extra[i]) for i in range(n_x)}
        remap = {"in": imap, "x": xmap}
        # the post pass reads its own inputs and the reduction's (``ri``): all shared inputs
        pmap = {i: slot(ins_b, ins, k.ins[n_in + n_x + i], s)
                for i, s in enumerate(d.post_inputs)}
        post = tuple(ir.Instr(i.expr, tuple(("in", imap[j]) if kd == "ri" else
                                            ("in", pmap[j]) if kd == "in" else (kd, j)
                                            for kd, j in i.args), i.dtype, i.helpers)
                     for i in d.post)
        # no prologue: the value reduced is input 0 (a split reduction's final pass)
        pro = d.prologue or (ir.Instr("{0}", (("in", 0),), d.inputs[0].dtype),)
        members.append(ir.ReduceMember(d.kind, _renumber(pro, remap),
                                       _renumber(d.epilogue, remap), d.out_dtype, post,
                                       tuple(d.post_outputs)))
    d0 = squeezed(ks[0].desc)
    desc = ir.MultiReduceKernel(tuple(d0.shape), tuple(d0.axes), tuple(ins), tuple(members),
                                tuple(xs), d0.split, name=f"multi_reduce_{len(ks)}")
    return LoweredKernel(desc, ins_b + xs_b, [v for k in ks for v in k.outs], _label(ks))


def _renumber(instrs, remap) -> tuple[ir.Instr, ...]:
    return tuple(ir.Instr(i.expr, tuple((kd, remap[kd][j]) if kd in remap else (kd, j)
                                        for kd, j in i.args), i.dtype, i.helpers)
                 for i in instrs)


def _label(ks: list[LoweredKernel]) -> str:
    """``multi_reduce[n] <shape>-><out> {member suffixes}`` (the members' own labels, minus
    the shared head), so profiles still say which reductions a dispatch computes."""
    head = ks[0].label.split(" <")[0].split(" +")[0].split(" [")[0]
    tails = [k.label[len(head):].strip() if k.label.startswith(head) else k.label
             for k in ks]
    kind_shape = head.split(" ", 1)
    shape = kind_shape[1] if len(kind_shape) > 1 else head
    return f"multi_reduce[{len(ks)}] {shape} {{{'; '.join(t or 'plain' for t in tails)}}}"


def group_sibling_reductions(kernels: list[LoweredKernel], updated: set[int],
                             max_bindings: int = MAX_BINDINGS) -> list[LoweredKernel]:
    """``kernels`` with each plain reduction folded into the latest earlier reduction of the
    same shape, axes and split that it may join (see the module docstring)."""
    out: list = []  # LoweredKernel or _Group, in execution order
    made_at: dict[int, int] = {}  # value id -> index in ``out`` of the kernel producing it
    open_: dict[tuple, list[int]] = {}  # key -> indices of groups in ``out``
    for k in kernels:
        pos = _join_position(k, out, made_at, open_, updated, max_bindings)
        if pos is None:
            pos = len(out)
            if _candidate(k, updated):
                out.append(_Group(k))
                open_.setdefault(_key(k.desc), []).append(pos)
            else:
                out.append(k)
        else:
            out[pos].members.append(k)
        for v in k.outs:
            made_at[v.id] = pos
    return [g.lowered() if isinstance(g, _Group) else g for g in out]


def _join_position(k, out, made_at, open_, updated, max_bindings) -> int | None:
    """Index of the group ``k`` joins, or None."""
    if not _candidate(k, updated):
        return None
    ready = max((_made(b, made_at) for b in k.ins), default=-1)  # inputs exist after this
    for pos in reversed(open_.get(_key(k.desc), [])):
        if pos <= ready:
            break
        g = out[pos]
        if len(g.members) < MAX_MEMBERS and g.bindings(k) <= max_bindings:
            return pos
    return None


def _made(b, made_at: dict[int, int]) -> int:
    """Last kernel index writing (part of) value ``b``'s buffer: its own kernel, and for a
    concat the kernels of its inputs (computed straight into their slots)."""
    at = made_at.get(b.id, -1)
    node = getattr(b, "node", None)
    if node is not None and node.op == "concat":
        at = max([at] + [made_at.get(x.id, -1) for x in node.inputs])
    return at
