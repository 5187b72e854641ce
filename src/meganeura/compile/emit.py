"""Last compile stage: a Plan's kernel descriptions → WGSL programs (one ``Stream``).

Each description is emitted for the target device (its limits and features); precision is
applied here, once: under ``precision="fast"`` matmul and attention descriptions ask for the
tensor-core variant (the emitters fall back to f32 kernels where the device has none)."""

from __future__ import annotations

import dataclasses
import os

from .. import kernels
from ..kernels.common import Target
from .executable import Copy, Dispatch, Fetch, Stream, round4
from .memory import CopyOp, Plan

_DEBUG = set(filter(None, os.environ.get("MEGANEURA_DEBUG", "").split(",")))


def emit_kernel(desc, binds, target: Target, precision: str = "strict",
                label: str = "") -> Dispatch:
    """One kernel description with its bindings → a ``Dispatch``."""
    if precision != "strict" and "precision" in {f.name for f in dataclasses.fields(desc)}:
        desc = dataclasses.replace(desc, precision=precision)  # matmul, attention
    # several views of one tensor (RoPE halves, q/k/v of a fused projection) bind the same
    # range: WebGPU forbids that for writable storage bindings (Dawn validates it), so the
    # kernel is emitted with one binding per distinct range
    alias = kernels.binding_aliases(binds)
    spec = kernels.emit(desc, target.limits, target.features, alias=alias)
    binds = [b for i, b in enumerate(binds) if alias[i] == i]
    if "wgsl" in _DEBUG:
        print(f"// ---- {label}\n{spec.wgsl}")
    return Dispatch(label, spec, tuple(binds))


def emit_stream(plan: Plan, target: Target, precision: str, tag: str) -> Stream:
    """Every kernel of ``plan`` emitted, copies kept in order, result buffers and the
    readback layout of fetched values laid out."""
    ops: list[Dispatch | Copy] = []
    for k in plan.kernels:
        if isinstance(k, CopyOp):
            ops.append(Copy(k.src, k.dst, round4(k.src.nbytes)))
        else:
            ops.append(emit_kernel(k.desc, k.binds, target, precision, k.label))
    if "plan" in _DEBUG:
        for k in plan.kernels:
            print(getattr(k, "label", k))
    return Stream(tag, tuple(ops), plan.arena_bytes, _out_buffers(ops, plan),
                  _fetch_layout(plan), plan.naive_bytes, plan.dispatches_unfused)


def _out_buffers(ops, plan: Plan) -> dict[str, int]:
    """Sizes of the result buffers ("out" pool), first use first (a fetched view may need its
    offset too)."""
    outs: dict[str, int] = {}
    for op in ops:
        for loc in (op.binds if isinstance(op, Dispatch) else (op.src, op.dst)):
            if loc.pool == "out" and loc.name not in outs:
                outs[loc.name] = round4(loc.nbytes)
    for loc, _t in plan.fetch.values():
        if loc.pool == "out" and loc.name not in outs:
            outs[loc.name] = round4(loc.offset + loc.nbytes)
    return outs


def _fetch_layout(plan: Plan) -> tuple[Fetch, ...]:
    out, offset = [], 0
    for name, (loc, t) in plan.fetch.items():
        n = round4(loc.nbytes)
        out.append(Fetch(name, loc, t, offset, n))
        offset += n
    return tuple(out)
