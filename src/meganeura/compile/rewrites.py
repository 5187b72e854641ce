"""Rewrites of a scheduled kernel list: neighbouring kernels folded into one dispatch.

The scheduler (``schedule.py``) emits one kernel per materialized value, in graph order.  Two
rules then fuse neighbours whose combination it could not see node by node:
  * ``with_post_pass``: a reduction and the elementwise kernel reading its result broadcast
    back (a norm's x * rstd * w) run as one dispatch, the elementwise pass in the reduction's
    workgroups;
  * ``chained``: a reduction with a post pass and the next reduction over the same rows that
    reads the post pass's output (a LayerNorm's mean, then its variance) run as one dispatch
    holding the row in registers (``kernels/multi_reduce.py`` ``ChainReduceKernel``);
  * ``merged``: neighbouring elementwise kernels over one shape become one dispatch (training
    steps only; see ``rewrite_kernels``).
All only ever combine a kernel with the one right before it (``merge_adjacent``), so the
execution order of everything else is unchanged.
"""

from __future__ import annotations

import dataclasses
import math

from ..dtypes import f32
from ..graph import Value
from ..kernels import ir
from ..kernels.multi_reduce import CHAIN_MAX_REDUCED, ChainReduceKernel, chain_fits
from .schedule import MAX_BINDINGS, LoweredKernel, _contiguous


def rewrite_kernels(kernels: list[LoweredKernel], *, post_passes: bool, merges: bool,
                    updated: set[int], keep: set[int],
                    max_bindings: int = MAX_BINDINGS) -> list[LoweredKernel]:
    """``kernels`` with the post-pass rule (``post_passes``; never into a kernel writing an
    ``updated`` value, which the in-place rules look at alone), the chain rule (same flag; a
    ``keep`` value is always stored) and then the merge rule
    (``merges``; never for kernels writing a ``keep`` value: fetched results and updates).
    ``max_bindings`` (the device's storage buffers per stage) caps sibling-reduction groups
    only: the other rules keep WebGPU's 8 so that their kernels stay the same everywhere."""
    if post_passes:  # an elementwise pass reading a reduction broadcast back: in its workgroups
        kernels = merge_adjacent(kernels, lambda a, b: with_post_pass(a, b, updated))
        # ... and the next reduction over the same rows reading that pass: one dispatch
        read = _read_by(kernels)
        kernels = merge_adjacent(kernels, lambda a, b: chained(a, b, updated, keep, read))
    # neighbouring elementwise kernels over one shape: one dispatch.  (Training steps only:
    # in ResNet-50's inference plan the earlier-produced outputs raised the peak by 15%.)
    if merges:
        kernels = merge_adjacent(kernels, lambda a, b: merged(a, b, keep))
    if post_passes:  # sibling reductions (same shape and axes): one dispatch (siblings.py)
        from .siblings import group_sibling_reductions

        kernels = group_sibling_reductions(kernels, updated, max_bindings)
    return kernels
# Longest reduced extent whose elementwise pass runs in the reduction's workgroups: the pass
# has only the reduction's parallelism (one workgroup per row for a norm over the hidden
# size), fine for rows of a few thousand elements; batch norm's statistics over N·H·W are
# longer and keep their own full-width elementwise kernel.
POST_MAX_REDUCED = 4096


def _input_slot(bases: list, inputs: list, base: Value, st: ir.Strided) -> int:
    """Index of the input (``base`` read through ``st``) in a kernel being merged, added if
    new: a tensor read the same way by both kernels is bound once."""
    for j, (b2, s2) in enumerate(zip(bases, inputs, strict=True)):
        if b2 is base and s2 == st:
            return j
    bases.append(base)
    inputs.append(st)
    return len(inputs) - 1


def merge_adjacent(kernels: list, combine) -> list:
    """Fold each kernel into the one right before it whenever ``combine(prev, kernel)`` gives
    one kernel for both (None: keep them apart)."""
    out: list = []
    for k in kernels:
        m = combine(out[-1], k) if out else None
        if m is None:
            out.append(k)
        else:
            out[-1] = m
    return out


def with_post_pass(a: LoweredKernel, b: LoweredKernel, keep: set[int]) -> LoweredKernel | None:
    """A reduction followed by an elementwise kernel over the reduction's input shape that
    reads the result broadcast back over the reduced axes (x * rstd * w after an RMS): the
    elementwise pass runs in the reduction's workgroups, right after the reduction (one
    dispatch; ``ReduceKernel.post``).  None when that does not apply."""
    da, ins_a, outs_a, la = a.desc, a.ins, a.outs, a.label
    db, ins_b, outs_b, lb = b.desc, b.ins, b.outs, b.label
    if not (isinstance(da, ir.ReduceKernel) and isinstance(db, ir.PointwiseKernel)) or \
            da.split > 1 or da.post or tuple(db.shape) != tuple(da.shape) or \
            any(v.id in keep for v in outs_b) or len(outs_a) != 1 or outs_a[0].dtype != f32:
        return None
    r = outs_a[0]
    shape = tuple(da.shape)
    axes = {x % len(shape) for x in da.axes}
    if math.prod(shape[d] for d in axes) > POST_MAX_REDUCED:
        return None
    kept_strides = iter(_contiguous(tuple(n for d, n in enumerate(shape) if d not in axes)))
    want = [0 if d in axes else next(kept_strides) for d in range(len(shape))]
    post_inputs, bases, remap = [], [], {}
    for i, (base, st) in enumerate(zip(ins_b, db.inputs, strict=True)):
        if base is r:
            if st.offset or any(n > 1 and st.strides[d] != want[d]
                                for d, n in enumerate(shape)):
                return None  # reads the result at other positions
            remap[i] = ("r", 0)
            continue
        own = [j for j, (b2, s2) in enumerate(zip(ins_a, da.inputs)) if b2 is base and s2 == st
               and any(kind == "in" and x == j for ins in da.prologue for kind, x in ins.args)]
        if own:  # the reduction reads it already: same binding, same element
            remap[i] = ("ri", own[0])
            continue
        remap[i] = ("in", _input_slot(bases, post_inputs, base, st))
    if not any(v == ("r", 0) for v in remap.values()):
        return None
    n_bind = len(da.inputs) + len(da.extra) + len(post_inputs) + 1 + len(outs_b)
    if n_bind > MAX_BINDINGS:
        return None
    post = tuple(ir.Instr(ins.expr, tuple(remap[i] if kind == "in" else (kind, i)
                                          for kind, i in ins.args), ins.dtype, ins.helpers)
                 for ins in db.instrs)
    desc = dataclasses.replace(da, post_inputs=tuple(post_inputs), post=post,
                               post_outputs=tuple(db.outputs), name=f"{da.name}_post")
    label = f"{la} => {lb.split(' ', 1)[0]} {lb.rsplit(' ', 1)[-1]}"
    return LoweredKernel(desc, list(ins_a) + bases, list(outs_a) + list(outs_b), label)


def merged(a: LoweredKernel, b: LoweredKernel, keep: set[int]) -> LoweredKernel | None:
    """Two neighbouring elementwise kernels over one shape as one dispatch writing both
    kernels' outputs.  Where the second reads an output of the first at its own element, it
    takes the value from the register instead of memory (the output is still stored for its
    other readers).  Kernels producing fetched results or persistent updates stay alone (the
    in-place update rules look at them one by one)."""
    da, ins_a, outs_a, la = a.desc, a.ins, a.outs, a.label
    db, ins_b, outs_b, lb = b.desc, b.ins, b.outs, b.label
    if not (isinstance(da, ir.PointwiseKernel) and isinstance(db, ir.PointwiseKernel)) or \
            da.shape != db.shape or any(v.id in keep for v in outs_a + outs_b):
        return None
    produced = {v.id: da.outputs[i] for i, v in enumerate(outs_a)}  # value -> instr of a
    ident = _contiguous(da.shape)
    inputs, bases = list(da.inputs), list(ins_a)
    remap = {}
    for i, (base, st) in enumerate(zip(ins_b, db.inputs, strict=True)):
        if base.id in produced:
            if st.strides != ident or st.offset or st.shape != da.shape:
                return None  # reads other elements of a's output: needs a's kernel to finish
            remap[i] = ("t", produced[base.id])
            continue
        remap[i] = ("in", _input_slot(bases, inputs, base, st))
    if len(inputs) + len(outs_a) + len(outs_b) > MAX_BINDINGS:
        return None
    n = len(da.instrs)
    instrs = list(da.instrs)
    for ins in db.instrs:
        args = tuple(remap[i] if kind == "in" else ("t", i + n) for kind, i in ins.args)
        instrs.append(ir.Instr(ins.expr, args, ins.dtype, ins.helpers))
    views = ()
    if da.out_views or db.out_views:  # outputs written into strided concat slots stay so
        views = (tuple(da.out_views or (None,) * len(da.outputs))
                 + tuple(db.out_views or (None,) * len(db.outputs)))
    desc = ir.PointwiseKernel(da.shape, tuple(inputs), tuple(instrs),
                              da.outputs + tuple(o + n for o in db.outputs),
                              name=f"pw_{len(instrs)}", out_views=views)
    ops = f"{la.split(' ', 1)[0]}+{lb.split(' ', 1)[0]}"
    label = f"{ops} {da.shape} {la.rsplit(' ', 1)[-1]}|{lb.rsplit(' ', 1)[-1]}"
    return LoweredKernel(desc, bases, outs_a + outs_b, label)


def _read_by(kernels: list[LoweredKernel]) -> dict[int, set[int]]:
    """Value id -> ``id``s of the kernels reading its buffer (a concat's inputs, which may be
    computed straight into its slots, are read by the concat's readers)."""
    read: dict[int, set[int]] = {}

    def add(v, who: int) -> None:
        read.setdefault(v.id, set()).add(who)
        node = getattr(v, "node", None)
        if node is not None and node.op == "concat":
            for x in node.inputs:
                add(x, who)

    for k in kernels:
        for v in k.ins:
            add(v, id(k))
    return read


def _stage(d: ir.ReduceKernel, ins: list, shared: tuple, reg: dict) -> ir.ReduceMember | None:
    """``d`` as a chain stage over the ``shared`` (input bases, input views, extra bases,
    extra views) lists, its own operands added where new; a value in ``reg`` is read from the
    registers as ``("c", q)``.  None when it reads such a value at other elements."""
    bases, inputs, xbases, extras = shared
    n_in, n_x = len(d.inputs), len(d.extra)
    ident = _contiguous(tuple(d.shape))

    def slot(base, st):
        if base.id not in reg:
            return ("in", _input_slot(bases, inputs, base, st))
        if tuple(st.shape) != tuple(d.shape) or st.offset or any(
                n > 1 and st.strides[i] != ident[i] for i, n in enumerate(d.shape)):
            return None  # another element of the earlier stage's output
        return ("c", reg[base.id])

    own = [slot(b, st) for b, st in zip(ins[:n_in], d.inputs, strict=True)]
    post_in = [slot(b, st) for b, st in zip(ins[n_in + n_x:], d.post_inputs, strict=True)]
    if None in own or None in post_in or any(b.id in reg for b in ins[n_in:n_in + n_x]):
        return None
    xs = [("x", _input_slot(xbases, extras, b, st))
          for b, st in zip(ins[n_in:n_in + n_x], d.extra, strict=True)]
    pro = d.prologue or (ir.Instr("{0}", (("in", 0),), d.inputs[0].dtype),)
    return ir.ReduceMember(d.kind, _remap(pro, {"in": own}), _remap(d.epilogue, {"x": xs}),
                           d.out_dtype, _remap(d.post, {"in": post_in, "ri": own}),
                           tuple(d.post_outputs))


def _remap(instrs, remap: dict) -> tuple[ir.Instr, ...]:
    return tuple(ir.Instr(i.expr, tuple(remap[kd][j] if kd in remap else (kd, j)
                                        for kd, j in i.args), i.dtype, i.helpers)
                 for i in instrs)


def chained(a: LoweredKernel, b: LoweredKernel, updated: set[int], keep: set[int],
            read: dict[int, set[int]]) -> LoweredKernel | None:
    """A reduction with a post pass followed by a reduction over the same shape and axes that
    reads the post pass's output at its own elements (a LayerNorm: ``x - mean``, then the
    variance of that): one ``ChainReduceKernel`` keeping the row in registers, for rows of at
    most ``CHAIN_MAX_REDUCED`` elements.  An output is still stored when another kernel reads
    it (``read``: value id -> reading kernels) or it is a ``keep`` value (fetched, updated);
    the others live in registers only.  None when that does not apply."""
    da, db = a.desc, b.desc
    if not (isinstance(da, ir.ReduceKernel) and isinstance(db, ir.ReduceKernel)) or \
            not da.post or da.split > 1 or db.split > 1 or \
            tuple(da.shape) != tuple(db.shape) or any(v.id in updated for v in a.outs + b.outs):
        return None
    shape, nd = tuple(da.shape), len(da.shape)
    axes = tuple(sorted({x % nd for x in da.axes}))
    if axes != tuple(sorted({x % nd for x in db.axes})) or \
            not 1 <= math.prod(shape[d] for d in axes) <= CHAIN_MAX_REDUCED:
        return None
    if a.outs[0].id in {v.id for v in b.ins}:
        return None  # reads the first reduction's result broadcast: not a register
    reg = {v.id: q for q, v in enumerate(a.outs[1:])}
    shared = ([], [], [], [])  # input bases and views, extra bases and views
    first = _stage(da, a.ins, shared, {})
    second = _stage(db, b.ins, shared, reg)
    if first is None or second is None or \
            not any(kd == "c" for i in second.prologue + second.post for kd, _ in i.args):
        return None
    pair = {id(a), id(b)}
    stored = [tuple(v.id in keep or bool(read.get(v.id, set()) - pair) for v in k.outs)
              for k in (a, b)]
    outs = [v for k, flags in zip((a, b), stored, strict=True)
            for v, f in zip(k.outs, flags, strict=True) if f]
    bases, inputs, xbases, extras = shared
    if not outs or len(inputs) + len(extras) + len(outs) > MAX_BINDINGS:
        return None
    desc = ChainReduceKernel(shape, axes, tuple(inputs), (first, second), tuple(stored),
                             tuple(extras), name="chain_reduce_2")
    if not chain_fits(desc):
        return None  # e.g. a long column reduction: its rows do not fit the registers
    return LoweredKernel(desc, bases + xbases, outs, _chain_label(a.label, b.label))


def _chain_label(la: str, lb: str) -> str:
    """``chain_reduce[2] <shape>-><out> {first's tail; second's tail}`` (each stage's label
    after the shared head), so profiles still say what the dispatch computes."""
    head = la.split(" <")[0].split(" =>")[0].split(" +")[0]
    kind_shape = head.split(" ", 1)
    tails = [lbl[len(head):].strip() if lbl.startswith(head) else lbl for lbl in (la, lb)]
    return f"chain_reduce[2] {kind_shape[-1]} {{{'; '.join(tails)}}}"
