"""Last compile stage: a Plan's kernel descriptions → WGSL programs (one ``Stream``).

Each description is emitted for the target device (its limits and features); precision is
applied here, once: under ``precision="fast"`` matmul descriptions ask for the tensor-core
variant (the emitter falls back to f32 kernels where the device has none), and so do attention
forwards over long key loops (``attention_fast.pays``: H200, Whisper's (1, 6, 1500, 64) in the
model 118.2 µs against 203.0 strict); short ones, whose tensor-core kernel is slower, and the
attention backward stay strict."""

from __future__ import annotations

import dataclasses
import math
import os

from .. import kernels
from ..kernels import attention_fast
from ..kernels.attention import AttentionKernel
from ..kernels.common import Target
from .executable import Copy, Dispatch, Fetch, Stream, round4
from .memory import CopyOp, Plan


def fast_pays(desc) -> bool:
    """Whether description ``desc`` asks for its tensor-core variant under precision "fast":
    matmuls unless marked to stay f32, attention forwards where ``attention_fast.pays``."""
    if isinstance(desc, kernels.MatmulKernel):
        return desc.tensor_cores
    return isinstance(desc, AttentionKernel) and attention_fast.pays(desc)


_DEBUG = set(filter(None, os.environ.get("MEGANEURA_DEBUG", "").split(",")))


def emit_kernel(desc, binds, target: Target, precision: str = "strict",
                label: str = "", memo: dict | None = None,
                n_in: int | None = None) -> Dispatch:
    """One kernel description with its bindings → a ``Dispatch``.  ``memo``: specs already
    emitted for this target, by (description, aliasing); the layers of a model repeat the same
    few kernels (SmolLM2's 1,015 training dispatches are 51 distinct programs), and emitting
    WGSL is most of this stage's time."""
    if precision != "strict" and fast_pays(desc):
        desc = dataclasses.replace(desc, precision=precision)
    # several views of one tensor (RoPE halves, q/k/v of a fused projection) bind the same
    # range: WebGPU forbids that for writable storage bindings (Dawn validates it), so the
    # kernel is emitted with one binding per distinct range
    alias = kernels.binding_aliases(binds)
    key = (desc, tuple(alias))
    spec = memo.get(key) if memo is not None else None
    if spec is None:
        spec = kernels.emit(desc, target.limits, target.features, alias=alias)
        if memo is not None:
            memo[key] = spec
    kept = [i for i in range(len(binds)) if alias[i] == i]
    if "wgsl" in _DEBUG:
        print(f"// ---- {label}\n{spec.wgsl}")
    return Dispatch(label, spec, tuple(binds[i] for i in kept),
                    inplace_slots(alias, kept, n_in), written_through_views(desc, alias, kept))


def written_through_views(desc, alias, kept: list[int]) -> tuple[tuple[int, int], ...]:
    """(position in ``kept``, bytes) of each range that only outputs written through strided
    views bind (``PointwiseKernel.out_views``): the kernel writes its slots of the range, not
    the whole of it, so the roofline counts those bytes."""
    views = getattr(desc, "out_views", ())
    if not views:
        return ()
    n_in = len(desc.inputs)
    by_range: dict[int, int | None] = {}
    for slot, r in enumerate(alias):
        v = views[slot - n_in] if slot >= n_in else None
        if v is None:
            by_range[r] = None  # read, or written contiguously: the whole range moves
        elif by_range.get(r, 0) is not None:
            by_range[r] = by_range.get(r, 0) + math.prod(v.shape) * v.dtype.gpu_itemsize
    return tuple((j, by_range[i]) for j, i in enumerate(kept) if by_range.get(i) is not None)


def inplace_slots(alias, kept: list[int], n_in: int | None) -> tuple[int, ...]:
    """Slots (positions in ``kept``) bound by an input and an output at once: the range is
    read and then written, so the roofline counts its bytes twice.  Two inputs sharing a range
    (q/k/v views of one projection) are one read, not an in-place update."""
    if n_in is None:
        return ()
    read = {alias[i] for i in range(n_in)}
    written = {alias[i] for i in range(n_in, len(alias))}
    return tuple(j for j, i in enumerate(kept) if i in read and i in written)


def emit_stream(plan: Plan, target: Target, precision: str, tag: str) -> Stream:
    """Every kernel of ``plan`` emitted, copies kept in order, result buffers and the
    readback layout of fetched values laid out."""
    ops: list[Dispatch | Copy] = []
    memo: dict = {}
    for k in plan.kernels:
        if isinstance(k, CopyOp):
            ops.append(Copy(k.src, k.dst, round4(k.src.nbytes)))
        else:
            ops.append(emit_kernel(k.desc, k.binds, target, precision, k.label, memo,
                                   k.n_in))
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
