"""Rewrites of a scheduled kernel list: neighbouring kernels folded into one dispatch.

The scheduler (``schedule.py``) emits one kernel per materialized value, in graph order.  Two
rules then fuse neighbours whose combination it could not see node by node:
  * ``with_post_pass``: a reduction and the elementwise kernel reading its result broadcast
    back (a norm's x * rstd * w) run as one dispatch, the elementwise pass in the reduction's
    workgroups;
  * ``merged``: neighbouring elementwise kernels over one shape become one dispatch (training
    steps only; see ``rewrite_kernels``).
Both only ever combine a kernel with the one right before it (``merge_adjacent``), so the
execution order of everything else is unchanged.
"""

from __future__ import annotations

import dataclasses
import math

from ..dtypes import f32
from ..graph import Value
from ..kernels import ir
from .schedule import MAX_BINDINGS, LoweredKernel, _contiguous


def rewrite_kernels(kernels: list[LoweredKernel], *, post_passes: bool, merges: bool,
                    updated: set[int], keep: set[int],
                    max_bindings: int = MAX_BINDINGS) -> list[LoweredKernel]:
    """``kernels`` with the post-pass rule (``post_passes``; never into a kernel writing an
    ``updated`` value, which the in-place rules look at alone) and then the merge rule
    (``merges``; never for kernels writing a ``keep`` value: fetched results and updates).
    ``max_bindings`` (the device's storage buffers per stage) caps sibling-reduction groups
    only: the other rules keep WebGPU's 8 so that their kernels stay the same everywhere."""
    if post_passes:  # an elementwise pass reading a reduction broadcast back: in its workgroups
        kernels = merge_adjacent(kernels, lambda a, b: with_post_pass(a, b, updated))
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
    desc = ir.PointwiseKernel(da.shape, tuple(inputs), tuple(instrs),
                              da.outputs + tuple(o + n for o in db.outputs),
                              name=f"pw_{len(instrs)}")
    ops = f"{la.split(' ', 1)[0]}+{lb.split(' ', 1)[0]}"
    label = f"{ops} {da.shape} {la.rsplit(' ', 1)[-1]}|{lb.rsplit(' ', 1)[-1]}"
    return LoweredKernel(desc, bases, outs_a + outs_b, label)
