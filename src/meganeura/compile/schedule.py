"""The plan: kernel list, buffer liveness and aliasing — everything the runtime needs, nothing
it has to decide.

Input: a Program whose graph holds only primitive ops (after ``passes``).  Output: a ``Plan``
with
  * kernels in execution order, each a codegen IR description plus the tensor ranges it binds,
  * copies (parameter/state updates, contiguous views of results) done at the end of a step,
  * a temp arena whose offsets come from liveness (values whose lifetimes do not overlap share
    memory), and pinned tensors (inputs, parameters, states, constants, fetched results).

Fusion happens here, by grouping (``passes/fuse.py`` decides which values are materialized):
pointwise producers are inlined into their consumer kernel (pointwise, reduce prologue, matmul
epilogue); views (reshape, permute, broadcast, slice, split) become strides of their reader.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from ..dtypes import f32
from ..errors import GraphBuildError
from ..graph import Graph, Node, TensorType, Value
from ..kernels import ir
from ..kernels.archetypes import archetype, archetype_of
from ..kernels.reduce import split_plan
from ..ops.lowering import Kernel, Matmul, Pointwise, Reduce, View
from ..ops.lowering import resolve as _pointwise_expr
from ..program import Program
from .executable import Loc
from .fusion import materialized_values, takes_epilogue

_PROBE_LIMITS = {"max_storage_buffer_binding_size": 1 << 62, "max_buffer_size": 1 << 62}
ALIGN = 256  # bytes; >= minStorageBufferOffsetAlignment on every adapter we know
MAX_BINDINGS = 8  # storage buffers per stage that every WebGPU device supports


@dataclass
class PlannedKernel:
    desc: object  # a codegen.ir kernel description
    binds: list[Loc]  # inputs then outputs, in the kernel's binding order
    label: str = ""


@dataclass
class PlannedCopy:
    src: Loc
    dst: Loc


@dataclass
class Plan:
    kernels: list = field(default_factory=list)  # PlannedKernel | PlannedCopy, in order
    arena_bytes: int = 0
    pinned: dict[str, tuple[str, TensorType]] = field(default_factory=dict)  # name -> (kind, t)
    fetch: dict[str, tuple[Loc, TensorType]] = field(default_factory=dict)
    naive_bytes: int = 0
    dispatches_unfused: int = 0
    aliased: int = 0  # values computed straight into their concat slot

    @property
    def dispatch_count(self) -> int:
        return sum(isinstance(k, PlannedKernel) for k in self.kernels)


def _nbytes(t: TensorType) -> int:
    return max(t.size, 1) * t.dtype.gpu_itemsize


def _align(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


_contiguous = ir.contiguous_strides


class _Views:
    """Resolve a value to (materialized base value, Strided view over the value's own shape)."""

    def __init__(self, materialized: set[int], copier):
        self.materialized = materialized
        self.copier = copier  # (value, shape) -> contiguous copy of it (a planner kernel)
        self.cache: dict[int, tuple[Value, ir.Strided]] = {}
        self.homes: dict[int, tuple[Value, int]] = {}  # value id -> (group value, elem offset)

    def resolve(self, v: Value) -> tuple[Value, ir.Strided]:
        if v.id in self.cache:
            return self.cache[v.id]
        res = self._resolve(v)
        self.cache[v.id] = res
        return res

    def _resolve(self, v: Value):
        n = v.node
        if v.id in self.homes:  # a grouped leaf, or the group's concat: part of one buffer
            gv, off = self.homes[v.id]
            s = ir.Strided.contiguous(v.dtype, v.shape)
            return gv, ir.Strided(v.dtype, v.shape, s.strides, off, gv.size)
        if v.id in self.materialized or not isinstance(n.opdef.lowering, View):
            return v, ir.Strided.contiguous(v.dtype, v.shape)
        kind = n.opdef.lowering.kind
        if kind not in ("reshape", "permute", "broadcast", "slice", "split", "flip"):
            return v, ir.Strided.contiguous(v.dtype, v.shape)  # concat, pad_slice: kernels
        base, s = self.resolve(n.inputs[0])
        if kind == "reshape":
            r = reshape_strided(s, v.shape)
            if r is None:  # strides cannot express it: copy to contiguous first
                src = n.inputs[0]
                base = self.copier(src, src.shape)
                c = ir.Strided.contiguous(src.dtype, src.shape)
                return base, ir.Strided(v.dtype, v.shape, _contiguous(v.shape), 0, c.extent)
            return base, ir.Strided(v.dtype, v.shape, r.strides, r.offset, r.extent)
        if kind == "permute":
            perm = n.attrs["perm"]
            return base, ir.Strided(v.dtype, v.shape, tuple(s.strides[p] for p in perm),
                                    s.offset, s.extent)
        if kind == "broadcast":
            lead = len(v.shape) - len(s.shape)
            strides = (0,) * lead + tuple(
                0 if (d == 1 and v.shape[lead + i] != 1) else st
                for i, (d, st) in enumerate(zip(s.shape, s.strides)))
            return base, ir.Strided(v.dtype, v.shape, strides, s.offset, s.extent)
        if kind == "flip":  # a negative stride, starting at the far end
            axes = n.attrs["axes"]
            off = s.offset + sum((s.shape[a] - 1) * s.strides[a] for a in axes)
            strides = tuple(-st if i in axes else st for i, st in enumerate(s.strides))
            return base, ir.Strided(v.dtype, v.shape, strides, off, s.extent)
        if kind == "slice":
            off = s.offset + sum(st * a for st, a in zip(s.strides, n.attrs["starts"]))
            strides = tuple(st * k for st, k in zip(s.strides, n.attrs["steps"]))
            return base, ir.Strided(v.dtype, v.shape, strides, off, s.extent)
        # split output v.index: a slice along the split axis
        ax = n.attrs["axis"]
        start = sum(n.attrs["sizes"][: v.index])
        return base, ir.Strided(v.dtype, v.shape, s.strides, s.offset + start * s.strides[ax],
                                s.extent)


def broadcast_to(s: ir.Strided, shape) -> ir.Strided:
    lead = len(shape) - len(s.shape)
    strides = (0,) * lead + tuple(
        0 if (d == 1 and shape[lead + i] != 1) else st
        for i, (d, st) in enumerate(zip(s.shape, s.strides)))
    return ir.Strided(s.dtype, tuple(shape), strides, s.offset, s.extent)




def is_pointwise(node: Node) -> bool:
    return isinstance(_pointwise_expr(node), Pointwise) if not node.opdef.leaf else False


class _KernelBuilder:
    """Collects the inputs (dedup by base and view) and instructions of one fused kernel."""

    def __init__(self, planner: _Planner, shape):
        self.p = planner
        self.shape = tuple(shape)
        self.inputs: list[ir.Strided] = []
        self.bases: list[Value] = []
        self.instrs: list[ir.Instr] = []
        self.memo: dict[int, tuple[str, int]] = {}
        self.ops: list[str] = []  # op names fused in (for labels and profiles)
        self.epilogue_of: Value | None = None  # a matmul this kernel computes as its prologue

    def read(self, v: Value, shape=None) -> tuple[str, int]:
        base, s = self.p.views.resolve(v)
        if base.id not in self.p.materialized and (
                isinstance(base.node.opdef.lowering, (Matmul, Reduce))
                or takes_epilogue(base.node)):
            reshaped = (base is not v and isinstance(base.node.opdef.lowering, Matmul)
                        and v.size == base.size and s.offset == 0
                        and s.strides == _contiguous(v.shape))
            if ((base is not v and not reshaped) or shape is not None or v.shape != self.shape
                    or self.epilogue_of is not None):
                self.p.materialize(base)  # not fusable here after all: compute it first
            else:
                self.epilogue_of = base
        s = broadcast_to(s, shape or self.shape)
        for i, (b, t) in enumerate(zip(self.bases, self.inputs)):
            if b is base and t == s:
                return ("in", i)
        self.bases.append(base)
        self.inputs.append(s)
        return ("in", len(self.inputs) - 1)

    def value(self, v: Value) -> tuple[str, int]:
        """Operand for ``v``: inline its pointwise producer unless ``v`` is materialized."""
        if v.id in self.memo:
            return self.memo[v.id]
        n = v.node
        if (v.id not in self.p.materialized and is_pointwise(n)
                and _broadcastable(v.shape, self.shape)):
            args = tuple(self.value(a) for a in n.inputs)
            low = _pointwise_expr(n)
            self.instrs.append(ir.Instr(low.expr, args, v.dtype, low.helpers))
            self.ops.append(n.op)
            ref = ("t", len(self.instrs) - 1)
        else:
            ref = self.read(v)
        self.memo[v.id] = ref
        return ref


def _broadcastable(src, dst) -> bool:
    if len(src) > len(dst):
        return False
    return all(a in (1, b) for a, b in zip(src[::-1], dst[::-1]))


class _Planner:
    def __init__(self, program: Program, roots: list[Value], fuse: bool):
        self.program = program
        self.fuse = fuse
        self.graph: Graph = program.graph
        self.roots = roots
        self.materialized = materialized_values(self.graph, roots, fuse)
        self.views = _Views(self.materialized, self.copy_value)
        self.kernels: list = []
        self.done: set[int] = set()  # values whose kernel has been emitted
        self.alias: dict[int, tuple[Value, int]] = {}  # value id -> (concat value, elem offset)
        self.copies: dict[tuple, Value] = {}  # (value id, shape) -> its contiguous copy
        self.alias_ok = True
        self.align = ALIGN  # binding offset alignment (bytes); _make_plan sets the device's
        self.root_ids = {r.id for r in roots}
        self.consumers: dict[int, list[Node]] = {}
        for node in self.graph.nodes:
            for x in node.inputs:
                if node not in self.consumers.setdefault(x.id, []):
                    self.consumers[x.id].append(node)
        # value id -> Loc for materialized values once placed
        self.loc: dict[int, Loc] = {}
        self.temp_values: list[Value] = []

    # -- kernels per node kind ------------------------------------------------------------
    def kernel_for(self, v: Value) -> None:
        n = v.node
        low = _pointwise_expr(n)
        if isinstance(low, Pointwise):
            self.pointwise([v])
        elif isinstance(low, Reduce):
            self.reduce(v, low.kind)
        elif isinstance(low, Matmul):
            self.matmul(v)
        elif isinstance(low, View):
            self.view_kernel(v, low.kind)
        elif isinstance(low, Kernel):
            self.archetype_kernel(n, low)
        else:
            raise GraphBuildError(f"op {n.op!r} has no GPU lowering ({low!r}); it must be "
                                  "expanded by a pass before planning")

    def archetype_kernel(self, n: Node, low: Kernel) -> None:
        """A dedicated kernel from the archetype registry, computing all outputs of ``n``."""
        arch = archetype(low.archetype)
        bases, views = self._archetype_inputs(n, arch)
        desc = arch.make(n.attrs, views, [o.type for o in n.outputs])
        shapes = ",".join(str(o.shape) for o in n.outputs)
        outs = list(n.outputs)
        if low.archetype == "attention_fwd" and self._heads_last_reader(n.outputs[0]):
            # stored as (B, S, H, D): the output projection's (B, S, H·D) view needs no copy
            o = n.outputs[0]
            B, H, S, D = o.shape
            outs[0] = self.temp_value((B, S, H, D), o.dtype)
            self.views.cache[o.id] = (outs[0], ir.Strided(o.dtype, o.shape,
                                                          (S * H * D, D, H * D, 1), 0, o.size))
            desc = dataclasses.replace(desc, out_bshd=True)
            shapes += " [bshd]"
        self.emit(desc, bases, outs, f"{low.archetype} {shapes}")
        self.done.update(o.id for o in n.outputs)

    def _heads_last_reader(self, v: Value) -> bool:
        """Some reader swaps heads and positions of ``v`` (B, H, S, D) and nothing fetches
        ``v`` itself."""
        return v.id not in self.root_ids and any(
            c.op == "permute" and tuple(c.attrs["perm"]) == (0, 2, 1, 3)
            for c in self.consumers.get(v.id, []))

    def pointwise(self, outs: list[Value]) -> None:
        kb = _KernelBuilder(self, outs[0].shape)
        res = []
        for v in outs:
            if is_pointwise(v.node):
                n = v.node
                args = tuple(kb.value(a) for a in n.inputs)
                low = _pointwise_expr(n)
                kb.instrs.append(ir.Instr(low.expr, args, v.dtype, low.helpers))
                kb.ops.append(n.op)
                res.append(len(kb.instrs) - 1)
            else:  # materializing copy of a view
                ref = kb.read(v)
                kb.instrs.append(ir.Instr("{0}", (ref,), v.dtype))
                res.append(len(kb.instrs) - 1)
        if len(kb.inputs) + len(outs) > MAX_BINDINGS and self._split_wide(outs):
            return self.pointwise(outs)  # operands now have their own kernels: fewer bindings
        ops = ",".join([o for o in kb.ops if o != "full"] or ["copy"])
        ops = ops if len(ops) < 48 else ops[:45] + "..."
        if kb.epilogue_of is not None and len(outs) == 1:
            low = kb.epilogue_of.node.opdef.lowering
            if isinstance(low, Reduce):
                if self.reduce_with_epilogue(kb, outs[0], ops):
                    return
            elif isinstance(low, Kernel):
                if self.kernel_with_epilogue(kb, outs[0], ops):
                    return
            elif self.matmul_with_epilogue(kb, outs[0], ops):
                return
            self.materialize(kb.epilogue_of)
            return self.pointwise(outs)
        desc = ir.PointwiseKernel(kb.shape, tuple(kb.inputs), tuple(kb.instrs), tuple(res),
                                  name=f"pw_{len(kb.instrs)}")
        self.emit(desc, kb.bases, outs, f"pointwise[{len(kb.instrs)}] {kb.shape} {ops}")

    def _split_wide(self, outs: list[Value]) -> bool:
        """Materialize the inlined operands of ``outs`` (a fused kernel that would bind more
        storage buffers than every device allows); False if there was nothing to split."""
        changed = False
        for v in outs:
            for a in v.node.inputs if is_pointwise(v.node) else ():
                if a.id not in self.materialized and is_pointwise(a.node) and a.node.op != "full":
                    self.materialize(a)
                    changed = True
        return changed

    def reduce(self, v: Value, kind: str, epilogue=None) -> None:
        """``v`` = reduction of its input (pointwise producers inlined as the prologue).
        ``epilogue``: (instrs, extra views, extra bases, out value, ops) of a pointwise
        consumer computed on the reduced values in the same kernel."""
        n = v.node
        x = n.inputs[0]
        kb = _KernelBuilder(self, x.shape)
        ref = kb.value(x)
        if kb.epilogue_of is not None:  # reduce kernels take no matmul prologue
            self.materialize(kb.epilogue_of)
            return self.reduce(v, kind, epilogue)
        n_extra = len(epilogue[1]) if epilogue else 0
        if len(kb.inputs) + n_extra + 1 > MAX_BINDINGS and is_pointwise(x.node) and \
                x.id not in self.materialized:
            self.materialize(x)
            return self.reduce(v, kind, epilogue)
        if ref[0] == "in" or not kb.instrs:
            kb.instrs.append(ir.Instr("{0}", (ref,), x.dtype))
        out, epi, extra, ebases, eops = v, (), (), [], ""
        if epilogue is not None:
            epi, extra, ebases, out, eops = epilogue
        desc = ir.ReduceKernel(x.shape, n.attrs["axes"], kind, tuple(kb.inputs), tuple(kb.instrs),
                               tuple(epi), tuple(extra), out_dtype=out.dtype,
                               name=f"reduce_{kind}")
        pro = ",".join(o for o in kb.ops if o != "full")
        label = f"reduce_{kind} {x.shape}->{v.shape}" + (f" <{pro}>" if pro else "") + \
            (f" +{eops}" if eops else "")
        # (the planner only asks for the grid here: binding sizes are checked against the real
        # device when the runtime emits the kernel)
        split = _split_plan(desc) if self.fuse else None
        if split is None:
            self.emit(desc, kb.bases + list(ebases), [out], label)
            return
        # few outputs, long reduced extent: partial sums over chunks, then a final pass
        partial, final, (tshape, tdtype) = split
        tmp = self.temp_value(tshape, tdtype)
        self.emit(partial, kb.bases, [tmp], label + " [partial]")
        self.emit(final, [tmp] + list(ebases), [out], label + " [final]")

    def reduce_with_epilogue(self, kb: _KernelBuilder, out: Value, ops: str) -> bool:
        """The pointwise kernel ``kb`` (same shape as the reduced value) as the epilogue of
        the reduction it reads; False if its other inputs cannot be laid over the output."""
        red = kb.epilogue_of
        i_red = kb.bases.index(red)
        axes = red.node.attrs["axes"]
        x = red.node.inputs[0]
        flat = tuple(d for i, d in enumerate(x.shape) if i not in axes)  # the output's data
        extras, ebases, remap = [], [], {}
        for j, (b, s) in enumerate(zip(kb.bases, kb.inputs)):
            if j == i_red:
                continue
            r = reshape_strided(s, flat) if s.shape != flat else s
            if r is None:
                return False
            remap[j] = ("x", len(extras))
            extras.append(r)
            ebases.append(b)

        def arg(a):
            if a[0] != "in":
                return a
            return ("acc", 0) if a[1] == i_red else remap[a[1]]

        instrs = [ir.Instr(i.expr, tuple(arg(a) for a in i.args), i.dtype, i.helpers)
                  for i in kb.instrs]
        self.reduce(red, red.node.opdef.lowering.kind, (instrs, extras, ebases, out, ops))
        return True

    def materialize(self, v: Value) -> None:
        self.materialized.add(v.id)
        self.views.cache.pop(v.id, None)
        self.kernel_for(v)

    def _archetype_inputs(self, n: Node, arch) -> tuple[list[Value], list[ir.Strided]]:
        """The node's inputs as (bases, strided views); copies where the archetype needs
        contiguous inputs."""
        bases, views = [], []
        for x in n.inputs:
            base, s = self.views.resolve(x)
            if (arch.contiguous_inputs and (s.strides != _contiguous(x.shape) or s.offset)) \
                    or any(st < 0 for st in s.strides):
                base = self.copy_value(x, x.shape)
                s = ir.Strided.contiguous(x.dtype, x.shape)
            bases.append(base)
            views.append(s)
        return bases, views

    def kernel_with_epilogue(self, kb: _KernelBuilder, out: Value, ops: str) -> bool:
        """The pointwise kernel ``kb`` as the epilogue of the archetype kernel it reads."""
        src = kb.epilogue_of
        n = src.node
        low = n.opdef.lowering
        arch = archetype(low.archetype)
        i_src = kb.bases.index(src)
        extras, ebases, remap = [], [], {}
        for j, (b, s) in enumerate(zip(kb.bases, kb.inputs)):
            if j != i_src:  # already broadcast to the kernel's output shape
                remap[j] = ("x", len(extras))
                extras.append(s)
                ebases.append(b)

        def arg(a):
            if a[0] != "in":
                return a
            return ("acc", 0) if a[1] == i_src else remap[a[1]]

        instrs = tuple(ir.Instr(i.expr, tuple(arg(a) for a in i.args), i.dtype, i.helpers)
                       for i in kb.instrs)
        bases, views = self._archetype_inputs(n, arch)
        if len(bases) + len(extras) + 1 > MAX_BINDINGS:
            return False
        desc = arch.epilogue(arch.make(n.attrs, views, [src.type]), tuple(extras), instrs,
                             out.dtype)
        if desc is None:
            return False
        self.emit(desc, bases + ebases, [out], f"{low.archetype} {src.shape} +{ops}")
        return True

    def matmul_with_epilogue(self, kb: _KernelBuilder, out: Value, ops: str) -> bool:
        """The pointwise kernel ``kb`` as the epilogue of the matmul it reads; False if its
        other inputs cannot be addressed as (batch, m, n)."""
        mm = kb.epilogue_of
        if len(kb.inputs) + 2 > MAX_BINDINGS:
            return False
        i_mm = kb.bases.index(mm)
        batch = mm.shape[:-2]
        extras, bases, remap = [], [], {}
        for j, (b, s) in enumerate(zip(kb.bases, kb.inputs)):
            if j == i_mm:
                continue
            if s.shape != mm.shape:  # the epilogue reads the matmul through a reshape
                s = reshape_strided(s, mm.shape)
                if s is None:
                    return False
            lead, lead_st = s.shape[:-2], s.strides[:-2]
            try:
                bst = _merge_batch(tuple(batch), lead_st) if batch else 0
            except _Unmergeable:
                return False
            nb = int(np.prod(batch, dtype=np.int64)) if batch else 1
            del lead
            remap[j] = ("x", len(extras))
            extras.append(ir.Strided(s.dtype, (nb,) + s.shape[-2:], (bst,) + s.strides[-2:],
                                     s.offset, s.extent))
            bases.append(b)

        def arg(a):
            if a[0] != "in":
                return a
            return ("acc", 0) if a[1] == i_mm else remap[a[1]]

        instrs = tuple(ir.Instr(i.expr, tuple(arg(a) for a in i.args), i.dtype, i.helpers)
                       for i in kb.instrs)
        desc, mm_bases = self._matmul_desc(mm)
        if _split_k(desc) > 1:
            # split-K: the epilogue runs in the kernel that sums the partial products
            if desc.batch != 1:
                return False
            tmp, label = self._split_k_partials(desc, mm_bases, mm)
            extra = tuple(ir.Strided(x.dtype, x.shape[1:], x.strides[1:], x.offset, x.extent)
                          for x in extras)
            red = ir.ReduceKernel(tmp.shape, (0,), "sum",
                                  (ir.Strided.contiguous(tmp.dtype, tmp.shape),),
                                  (ir.Instr("{0}", (("in", 0),), tmp.dtype),), instrs, extra,
                                  out_dtype=out.dtype, name="splitk_sum_ep")
            self.emit(red, [tmp] + bases, [out], f"{label} [split-K sum] +{ops}")
            return True
        desc = ir.MatmulKernel(desc.batch, desc.m, desc.n, desc.k, desc.a, desc.b, tuple(extras),
                               instrs, out.dtype, name="matmul_ep")
        self.emit(desc, mm_bases + bases, [out],
                  f"matmul {desc.batch}x{desc.m}x{desc.n}x{desc.k} +{ops}")
        return True

    def matmul(self, v: Value) -> None:
        desc, bases = self._matmul_desc(v)
        label = f"matmul {desc.batch}x{desc.m}x{desc.n}x{desc.k}"
        split = _split_k(desc)
        if split <= 1:
            self.emit(desc, bases, [v], label)
            return
        tmp, label = self._split_k_partials(desc, bases, v)
        acc = tmp.dtype
        red = ir.ReduceKernel(tmp.shape, (0,), "sum", (ir.Strided.contiguous(acc, tmp.shape),),
                              (ir.Instr("{0}", (("in", 0),), acc),), out_dtype=v.dtype,
                              name="splitk_sum")
        self.emit(red, [tmp], [v], f"{label} [split-K sum]")

    def _split_k_partials(self, desc, bases, v: Value):
        """Few output tiles and a long K (weight gradients, small-M GEMMs): K split into
        ``split`` chunks computed as a batch of matmuls (strides only) into a temp of partial
        products, which the caller sums in order.  Returns (temp, label)."""
        split = _split_k(desc)
        label = f"matmul {desc.batch}x{desc.m}x{desc.n}x{desc.k}"
        a, b, kc = desc.a, desc.b, desc.k // split
        a_s = ir.Strided(a.dtype, (split, desc.m, kc), (a.strides[2] * kc,) + a.strides[1:],
                         a.offset, a.extent)
        b_s = ir.Strided(b.dtype, (split, kc, desc.n), (b.strides[1] * kc,) + b.strides[1:],
                         b.offset, b.extent)
        acc = f32 if v.dtype.is_float else v.dtype
        tmp = self.temp_value((split, desc.m, desc.n), acc)
        self.emit(ir.MatmulKernel(split, desc.m, desc.n, kc, a_s, b_s, out_dtype=acc,
                                  name="matmul_splitk"), bases, [tmp],
                  f"{label} [split-K {split}]")
        return tmp, label

    def _matmul_desc(self, v: Value):
        n = v.node
        a, b = n.inputs
        ta, tb = n.attrs["transpose_a"], n.attrs["transpose_b"]
        batch = v.shape[:-2]
        M, N = v.shape[-2:]
        K = a.shape[-1] if not ta else a.shape[-2]
        ops = []
        bases = []
        for val, t in ((a, ta), (b, tb)):
            base, s = self.views.resolve(val)
            if any(st < 0 for st in s.strides):  # flipped views: tiled kernels read forward
                base = self.copy_value(val, val.shape)
                s = ir.Strided.contiguous(val.dtype, val.shape)
            try:
                s = _as_batched(s, batch, t)
            except _Unmergeable:
                # batch dims that no single stride can walk: copy to a contiguous broadcast
                base = self.copy_value(val, tuple(batch) + val.shape[-2:])
                s = _as_batched(ir.Strided.contiguous(val.dtype, base.shape), batch, t)
            ops.append(s)
            bases.append(base)
        nb = int(np.prod(batch, dtype=np.int64)) if batch else 1
        return ir.MatmulKernel(nb, M, N, K, ops[0], ops[1], out_dtype=v.dtype), bases

    def _alias_concat_inputs(self, v: Value, concat: Node, starts: list[int]) -> set[int]:
        """Inputs of the concat ``v`` whose producer can write straight into the concat's
        buffer: a value that exists only to be concatenated (possibly split into several
        consecutive inputs, e.g. the weight gradient of a fused projection), read
        contiguously, at a binding-aligned slot.  Each input's slot must be one contiguous
        block: a 1-D concat, or one along an axis with only unit dimensions before it (the
        heads of a batch-1 attention gradient).  Returns the input indices placed."""
        ax = concat.attrs["axis"] % max(v.ndim, 1)
        if not (self.alias_ok and self.fuse) or v.id in self.root_ids or \
                math.prod(v.shape[:ax]) != 1:
            return set()
        inner = math.prod(v.shape[ax + 1:])
        starts = [st * inner for st in starts]  # element offsets of the slots
        by_base: dict[int, list] = {}
        for i, x in enumerate(concat.inputs):
            base, s = self.views.resolve(x)
            by_base.setdefault(base.id, []).append((i, base, s, x))
        placed = set()
        for parts in by_base.values():
            base = parts[0][1]
            shift = {starts[i] - s.offset for i, _, s, _ in parts}
            if (self.graph.leaf_of(base) is not None or base.id < 0 or base.dtype != v.dtype
                    or base.id not in self.materialized or base.id in self.root_ids
                    or len(shift) != 1 or sum(x.size for *_, x in parts) != base.size
                    or any(s.strides != _contiguous(x.shape) for _, _, s, x in parts)):
                continue
            (at,) = shift
            if at < 0 or at + base.size > v.size or (at * v.dtype.gpu_itemsize) % self.align:
                continue
            if not self._only_feeds(base, concat):
                continue
            self.alias[base.id] = (v, at)
            placed.update(i for i, *_ in parts)
        return placed

    def _only_feeds(self, value: Value, concat: Node) -> bool:
        """Every use of ``value`` is (through views) an input of ``concat``."""
        for c in self.consumers.get(value.id, []):
            if c is concat:
                continue
            if not isinstance(c.opdef.lowering, View) or c.op == "concat":
                return False
            if not all(self._only_feeds(o, concat) for o in c.outputs):
                return False
        return True

    def temp_value(self, shape, dtype, src: Value | None = None) -> Value:
        """A planner-made intermediate (no graph node): copies, partial reductions."""
        self.n_temps = getattr(self, "n_temps", 0) + 1
        node = Node(-self.n_temps, "copy", (src,) if src is not None else (), {})
        v = Value(self.graph, -self.n_temps, TensorType(tuple(shape), dtype), node, 0)
        node.outputs = (v,)
        self.materialized.add(v.id)
        self.views.cache[v.id] = (v, ir.Strided.contiguous(dtype, v.shape))
        return v

    def copy_value(self, src: Value, shape) -> Value:
        """``src`` broadcast to ``shape`` in its own contiguous buffer (made once, then shared
        by every kernel that needs it)."""
        key = (src.id, tuple(shape))
        if key in self.copies:
            return self.copies[key]
        v = self.temp_value(shape, src.dtype, src)
        self.copies[key] = v
        kb = _KernelBuilder(self, shape)
        kb.instrs.append(ir.Instr("{0}", (kb.read(src),), src.dtype))
        self.emit(ir.PointwiseKernel(kb.shape, tuple(kb.inputs), tuple(kb.instrs), (0,),
                                     name="copy"), kb.bases, [v], f"copy {src.shape}->{shape}")
        return v

    def view_kernel(self, v: Value, kind: str) -> None:
        from ..kernels.concat import ConcatKernel, PadSliceKernel

        n = v.node
        if kind == "concat":
            ax = n.attrs["axis"]
            starts, pos = [], 0
            for x in n.inputs:
                starts.append(pos)
                pos += x.shape[ax]
            # inputs produced only for this concat are computed straight into their slot
            placed = self._alias_concat_inputs(v, n, starts)
            copy = [i for i in range(len(n.inputs)) if i not in placed]
            # the rest in runs of consecutive inputs, each within WebGPU's guaranteed 8
            # storage bindings per stage
            runs: list[list[int]] = []
            for i in copy:
                if runs and runs[-1][-1] == i - 1 and len(runs[-1]) < MAX_BINDINGS - 1:
                    runs[-1].append(i)
                else:
                    runs.append([i])
            for run in runs:
                part = [n.inputs[i] for i in run]
                srcs = [self.views.resolve(x) for x in part]
                shape = list(v.shape)
                shape[ax] = sum(x.shape[ax] for x in part)
                desc = ConcatKernel(tuple(shape), ax, tuple(s for _, s in srcs), v.dtype,
                                    v.shape, starts[run[0]])
                self.emit(desc, [b for b, _ in srcs], [v], f"concat {tuple(shape)}->{v.shape}")
        elif kind == "pad_slice":
            base, s = self.views.resolve(n.inputs[0])
            desc = PadSliceKernel(v.shape, n.attrs["starts"], n.attrs["steps"], s, v.dtype)
            self.emit(desc, [base], [v], f"pad_slice {v.shape}")
        else:
            raise GraphBuildError(f"no GPU lowering for view kind {kind!r} (op {n.op!r})")

    def emit(self, desc, in_values: list[Value], out_values: list[Value], label: str) -> None:
        self.kernels.append((desc, list(in_values), list(out_values), label))


def _as_batched(s: ir.Strided, batch, transposed: bool) -> ir.Strided:
    """Rank-3 (batch, rows, cols) view of a matmul operand, with the transpose applied."""
    s = broadcast_to(s, tuple(batch) + s.shape[-2:]) if len(s.shape) < len(batch) + 2 else \
        ir.Strided(s.dtype, s.shape, s.strides, s.offset, s.extent)
    lead_shape, lead_strides = s.shape[:-2], s.strides[:-2]
    # broadcast lead dims of the operand to the output batch
    lb = len(batch) - len(lead_shape)
    lead_shape = (1,) * lb + tuple(lead_shape)
    lead_strides = (0,) * lb + tuple(lead_strides)
    lead_strides = tuple(0 if d == 1 else st for d, st in zip(lead_shape, lead_strides))
    bstride = _merge_batch(tuple(batch), lead_strides)
    r, c = s.shape[-2:]
    rs, cs = s.strides[-2:]
    if transposed:
        r, c, rs, cs = c, r, cs, rs
    nb = int(np.prod(batch, dtype=np.int64)) if batch else 1
    return ir.Strided(s.dtype, (nb, r, c), (bstride, rs, cs), s.offset, s.extent)


SPLIT_K_MIN_TILES = 64  # fewer 128x128 output tiles than this leaves a big GPU mostly idle
SPLIT_K_MIN_CHUNK = 256


def _split_k(desc: ir.MatmulKernel) -> int:
    """How many K chunks a single-batch matmul with few output tiles should be split into
    (1 = no split).  A divisor of K, so every chunk has the same length."""
    if desc.batch != 1 or desc.m <= 4 or desc.n <= 4 or desc.k < 4 * SPLIT_K_MIN_CHUNK:
        return 1
    tiles = -(-desc.m // 128) * -(-desc.n // 128)
    if tiles >= SPLIT_K_MIN_TILES:
        return 1
    want = min(desc.k // SPLIT_K_MIN_CHUNK, -(-2 * SPLIT_K_MIN_TILES // tiles), 64)
    for s in range(want, 1, -1):
        if desc.k % s == 0:
            return s
    return 1


@dataclass(frozen=True)
class LeafGroups:
    """Persistent tensors stored back to back in one buffer, because the program concatenates
    them as flat vectors (the optimizer's per-group parameter vector): the concat is then the
    buffer itself, and an update of the whole vector can be written in place."""

    home: dict  # leaf name -> (group name, element offset)
    groups: dict  # group name -> (dtype, elements, id of the concat value)

    def loc(self, name: str, nbytes: int) -> Loc | None:
        if name not in self.home:
            return None
        gname, off = self.home[name]
        return Loc("group", gname, off * self.groups[gname][0].gpu_itemsize, nbytes)


NO_GROUPS = LeafGroups({}, {})


def find_leaf_groups(graph: Graph) -> LeafGroups:
    home, groups = {}, {}
    for node in graph.nodes:
        if node.op != "concat" or node.attrs["axis"] != 0 or node.out.ndim != 1:
            continue
        members, off = [], 0
        for x in node.inputs:
            leaf_v = x.node.inputs[0] if x.node.op == "reshape" else x
            lf = graph.leaf_of(leaf_v)
            if lf is None or lf.kind not in ("param", "state") or lf.name in home or \
                    lf.value.dtype != node.out.dtype or lf.value.dtype.gpu_itemsize != 4 or \
                    lf.name in (m for m, _ in members):
                members = None
                break
            members.append((lf.name, off))
            off += lf.value.size
        if not members:
            continue
        gname = f"group{len(groups)}:{members[0][0]}"
        groups[gname] = (node.out.dtype, off, node.out.id)
        for name, o in members:
            home[name] = (gname, o)
    return LeafGroups(home, groups)


def _in_place_updates(kernels, updates, graph, fetched_leaves) -> dict[str, int]:
    """Updates a pointwise kernel can write into the persistent tensor's own buffer: the kernel
    produces exactly that value, reads the old tensor (if at all) only at each thread's own
    element, and no later kernel (nor a fetched output) reads the old tensor.  The two
    bindings of that buffer are then merged into one by the runtime (read, then write, per
    element)."""
    producer = {}
    readers: dict[int, list[int]] = {}
    for i, (_desc, ins, outs, _label) in enumerate(kernels):
        for o in outs:
            producer[o.id] = i
        for x in ins:
            readers.setdefault(x.id, []).append(i)
    chosen: dict[str, int] = {}
    for name, v in updates.items():
        leaf = graph.leaves[name]
        k = producer.get(v.id)
        if k is None or name in fetched_leaves:
            continue
        desc, ins, outs, label = kernels[k]
        if len(outs) != 1 or outs[0] is not v:
            continue
        old = leaf.value
        if any(r > k for r in readers.get(old.id, [])):
            continue
        ident = ir.Strided.contiguous(old.dtype, old.shape)
        arch = archetype_of(desc)
        if arch is not None and arch.in_place is not None:
            # e.g. a KV cache: input 0 is the cache itself (the hook checks its layout)
            variant = arch.in_place(desc) if ins and ins[0] is old else None
            if variant is not None and all(x is not old for x in ins[1:]):
                kernels[k] = (variant, ins, outs, label + " [in place]")
                chosen[name] = k
            continue
        if not isinstance(desc, ir.PointwiseKernel):
            continue
        if all(s.shape == ident.shape and s.strides == ident.strides and s.offset == 0
               for x, s in zip(ins, desc.inputs) if x is old) and desc.shape == old.shape:
            chosen[name] = k
    return chosen


def reshape_strided(s: ir.Strided, shape) -> ir.Strided | None:
    """The same elements (row-major order) viewed with ``shape`` without copying, when strides
    can express it: dims may be split or merged where the merged run is itself walkable by one
    stride (numpy's no-copy reshape).  None when a copy is needed."""
    shape = tuple(int(d) for d in shape)
    if int(np.prod(shape, dtype=np.int64)) != int(np.prod(s.shape, dtype=np.int64)):
        return None
    if 0 in shape:
        return ir.Strided(s.dtype, shape, _contiguous(shape), s.offset, s.extent)
    old = [(d, st) for d, st in zip(s.shape, s.strides) if d != 1]
    new = [(i, d) for i, d in enumerate(shape) if d != 1]
    strides = [0] * len(shape)
    oi = ni = 0
    while oi < len(old) and ni < len(new):
        oj, nj = oi + 1, ni + 1
        op, np_ = old[oi][0], new[ni][1]
        while op != np_:
            if np_ < op:
                np_ *= new[nj][1]
                nj += 1
            else:
                op *= old[oj][0]
                oj += 1
        for k in range(oi, oj - 1):  # the old run must be walkable by one stride
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        st = old[oj - 1][1]
        for k in range(nj - 1, ni - 1, -1):
            strides[new[k][0]] = st
            st *= new[k][1]
        oi, ni = oj, nj
    # size-1 dims: any stride walks them; give the row-major one so contiguous stays contiguous
    nxt = 1
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == 1:
            strides[i] = nxt
        else:
            nxt = strides[i] * shape[i]
    return ir.Strided(s.dtype, shape, tuple(strides), s.offset, s.extent)


def _in_place_groups(kernels, updates, fetch_bases, groups: LeafGroups, group_values, graph,
                     ranges=None):
    """A group whose members are all updated from one new flat vector, laid out like the group
    and computed by a pointwise kernel that reads the group only element-wise and is its last
    reader: that vector is computed straight into the group's buffer."""
    producer, readers = {}, {}
    for i, (_desc, ins, outs, _label) in enumerate(kernels):
        for o in outs:
            producer[o.id] = i
        for x in ins:
            readers.setdefault(x.id, []).append(i)
    chosen = {}
    for gname, gv in group_values.items():
        members = [n for n, (g, _) in groups.home.items() if g == gname]
        bases = {fetch_bases[n][0].id: fetch_bases[n][0] for n in members if n in updates}
        if len(bases) != 1 or len(members) != sum(1 for n in members if n in updates):
            continue
        (b,) = bases.values()
        if b.shape != gv.shape or any(fetch_bases[n][1].offset != groups.home[n][1]
                                      for n in members):
            continue
        k = producer.get(b.id)
        if k is None:
            continue
        desc, ins, outs, _ = kernels[k]
        if not isinstance(desc, ir.PointwiseKernel) or len(outs) != 1 or outs[0] is not b:
            continue
        member_ids = [graph.leaves[n].value.id for n in members] + (ranges or {}).get(gname, [])
        if any(r > k for x in [gv.id, *member_ids] for r in readers.get(x, [])):
            continue
        ident = ir.Strided.contiguous(gv.dtype, gv.shape)
        if all(s.strides == ident.strides and s.offset == 0 and s.shape == gv.shape
               for x, s in zip(ins, desc.inputs) if x is gv):
            chosen[gname] = b
    return chosen


class _Unmergeable(Exception):
    pass


def _merge_batch(batch, strides) -> int:
    """One stride for the flattened batch, when the batch dims are mergeable."""
    dims = [(d, st) for d, st in zip(batch, strides) if d != 1]
    if not dims:
        return 0
    if all(st == 0 for _, st in dims):
        return 0
    for (_, s1), (d2, s2) in zip(dims, dims[1:]):
        if s1 != d2 * s2:
            raise _Unmergeable()
    return dims[-1][1]


def make_plan(program: Program, inference: bool, fuse: bool = True,
              plan_memory: bool = True, groups: LeafGroups = NO_GROUPS,
              align: int = ALIGN) -> Plan:
    """Schedule, fuse and place every tensor of ``program`` (training step or inference run).
    ``groups``: persistent tensors stored together (``find_leaf_groups``), shared by every plan
    of a session.  ``align``: the device's storage-buffer offset alignment in bytes (every
    binding starts at a multiple of it; the default suits every adapter).

    Computing values straight into their concat slot saves the copy but keeps the whole
    concat buffer alive from the first such value on; when that raises the peak (gradients
    produced while activations are still live), the plan without it is kept.

    Parameters of a group are bound as their own range of the group's buffer where their
    offset allows (``align``), so kernels reading them carry no parameter offset and identical
    layers share one pipeline (SmolLM2's training step: 51 distinct pipelines instead of 298).
    A kernel that would bind a parameter and its whole group at once (overlapping writable
    ranges, which WebGPU forbids) makes the plan fall back to views into the group."""
    for own_ranges in (True, False):
        try:
            plan = _make_plan(program, inference, fuse, plan_memory, groups, alias=True,
                              own_ranges=own_ranges, align=align)
            if plan.aliased:
                other = _make_plan(program, inference, fuse, plan_memory, groups, alias=False,
                                   own_ranges=own_ranges, align=align)
                if other.arena_bytes < plan.arena_bytes:
                    plan = other
            return plan
        except _OverlappingBindings:
            continue
    raise AssertionError("unreachable: views into groups never overlap")  # pragma: no cover


class _OverlappingBindings(Exception):
    pass


def _place(todo, fit, align: int = ALIGN) -> tuple[dict[int, int], int]:
    """Arena offsets for values ``(id, bytes, first use, last use)`` (by first use) with the
    gap policy ``fit``, and the arena size."""
    live: list[tuple[int, int]] = []  # (offset, size) of blocks still live, by offset
    expiry: list[tuple[int, int, int]] = []  # heap of (last use, offset, size)
    offsets, cursor = {}, 0
    for vid, nbytes, start, end in todo:
        while expiry and expiry[0][0] < start:  # uses are in order: gone for good
            _, o, sz = heapq.heappop(expiry)
            live.pop(bisect.bisect_left(live, (o, sz)))
        size = _align(nbytes, align)
        off = fit(live, size)
        bisect.insort(live, (off, size))
        heapq.heappush(expiry, (end, off, size))
        offsets[vid] = off
        cursor = max(cursor, off + size)
    return offsets, cursor


def _first_fit(live: list[tuple[int, int]], size: int) -> int:
    """The lowest offset where ``size`` bytes fit between the live blocks (sorted)."""
    off = 0
    for o, s in live:
        if off + size <= o:
            break
        off = max(off, o + s)
    return off


@functools.lru_cache(maxsize=4096)
def _split_plan(desc):
    """``split_plan`` for the planner, cached: identical layers ask about identical kernels."""
    return split_plan(desc, limits=_PROBE_LIMITS)


def _best_fit(live: list[tuple[int, int]], size: int) -> int:
    """Offset for a block of ``size`` bytes among the live blocks ``(offset, size)`` (sorted):
    the smallest gap it fits in, else the end.  Less sensitive to placement order than first
    fit (fewer small holes left in front of big blocks)."""
    best, best_gap, end = None, None, 0
    for o, s in live:
        gap = o - end
        if gap >= size and (best_gap is None or gap < best_gap):
            best, best_gap = end, gap
        end = max(end, o + s)
    return end if best is None else best


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


def _merge_adjacent(kernels: list, merged) -> list:
    """Fold each kernel into the one right before it whenever ``merged(prev, kernel)`` gives
    one kernel for both (None: keep them apart)."""
    out: list = []
    for k in kernels:
        m = merged(out[-1], k) if out else None
        if m is None:
            out.append(k)
        else:
            out[-1] = m
    return out


def _with_post_pass(a, b, keep: set[int]):
    """A reduction followed by an elementwise kernel over the reduction's input shape that
    reads the result broadcast back over the reduced axes (x * rstd * w after an RMS): the
    elementwise pass runs in the reduction's workgroups, right after the reduction (one
    dispatch; ``ReduceKernel.post``).  None when that does not apply."""
    da, ins_a, outs_a, la = a
    db, ins_b, outs_b, lb = b
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
    return desc, list(ins_a) + bases, list(outs_a) + list(outs_b), label


def _merged(a, b, keep: set[int]):
    """Two neighbouring elementwise kernels over one shape as one dispatch writing both
    kernels' outputs.  Where the second reads an output of the first at its own element, it
    takes the value from the register instead of memory (the output is still stored for its
    other readers).  Kernels producing fetched results or persistent updates stay alone (the
    in-place update rules look at them one by one)."""
    da, ins_a, outs_a, la = a
    db, ins_b, outs_b, lb = b
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
    return desc, bases, outs_a + outs_b, label


def _concat_ranges(graph: Graph, groups: LeafGroups, align: int = ALIGN) -> dict:
    """Concats along axis 0 of parameters stored consecutively, in order, in one group, starting
    at an aligned offset: value id -> (group, element offset, value)."""
    out = {}
    concat_ids = {cid for _, _, cid in groups.groups.values()}
    for node in graph.nodes:
        if node.op != "concat" or node.attrs["axis"] != 0 or node.outputs[0].id in concat_ids:
            continue
        span = []
        for x in node.inputs:
            lf = graph.leaf_of(x)
            if lf is None or lf.name not in groups.home or lf.value is not x:
                break
            span.append((*groups.home[lf.name], x.size))
        else:
            (g0, start, _), v = span[0], node.outputs[0]
            pos, ok = start, True
            for g, off, n in span:
                ok = ok and g == g0 and off == pos
                pos = off + n
            if ok and v.dtype == groups.groups[g0][0] and \
                    (start * v.dtype.gpu_itemsize) % align == 0:
                out[v.id] = (g0, start, v)
    return out


def _check_no_overlap(plan: Plan) -> None:
    """Distinct bindings of one kernel must not share bytes of a buffer (identical ranges are
    merged by the runtime)."""
    for k in plan.kernels:
        if not isinstance(k, PlannedKernel):
            continue
        locs = sorted({(b.pool, b.name, b.offset, b.nbytes) for b in k.binds
                       if b.pool == "group"})
        for (p1, n1, o1, s1), (p2, n2, o2, _) in zip(locs, locs[1:], strict=False):
            if (p1, n1) == (p2, n2) and o2 < o1 + s1:
                raise _OverlappingBindings(k.label)


def _make_plan(program: Program, inference: bool, fuse: bool, plan_memory: bool,
               groups: LeafGroups, alias: bool, own_ranges: bool = False,
               align: int = ALIGN) -> Plan:
    graph = program.graph
    roots = program.roots(inference)
    updates = {} if inference else dict(graph.updates)
    fetch_values: dict[str, Value] = dict(program.outputs)
    if not inference and program.loss is not None:
        fetch_values["__loss__"] = program.loss

    pl = _Planner(program, roots, fuse)
    pl.align = align
    pl.alias_ok = plan_memory and alias
    group_values = {}
    for gname, (dtype, n, concat_id) in groups.groups.items():
        gv = pl.temp_value((n,), dtype)
        group_values[gname] = gv
        pl.views.cache.pop(gv.id, None)
        pl.views.homes[concat_id] = (gv, 0)
        pl.materialized.discard(concat_id)
        pl.done.add(concat_id)  # the concat is the buffer itself: no kernel
    for name, (gname, off) in groups.home.items():
        if own_ranges and (off * groups.groups[gname][0].gpu_itemsize) % align == 0:
            continue  # the parameter is its own base, bound at its range of the group buffer
        pl.views.homes[graph.leaves[name].value.id] = (group_values[gname], off)
    # concats of parameters that lie back to back in a group (fused q/k/v or gate/up weights):
    # the concat is that range of the group buffer; no kernel
    concat_ranges = _concat_ranges(graph, groups, align) if own_ranges else {}
    pl.done.update(concat_ranges)
    needed = graph.ancestors(roots)
    # 1) kernels in graph order for every materialized non-leaf value
    done = pl.done
    for node in graph.nodes:
        if node.id not in needed or node.opdef.leaf:
            continue
        for v in node.outputs:
            if v.id in pl.materialized and v.id not in done:
                pl.kernel_for(v)
                done.add(v.id)
    # Roots that are non-contiguous views need a copy kernel.
    for v in list(fetch_values.values()) + list(updates.values()):
        res = pl.views.resolve(v)
        if res[1].strides != _contiguous(v.shape) and v.size > 1:
            if v.id not in done:
                pl.pointwise([v])
                pl.materialized.add(v.id)
                pl.views.cache[v.id] = (v, ir.Strided.contiguous(v.dtype, v.shape))
                done.add(v.id)

    plan = Plan()
    plan.naive_bytes = sum(_nbytes(v.type) for n in graph.nodes if not n.opdef.leaf
                           and n.id in needed for v in n.outputs)
    # 2) pinned tensors
    for name, lf in graph.leaves.items():
        if lf.kind in ("param", "state", "input", "constant"):
            plan.pinned[name] = (lf.kind, lf.value.type)

    def leaf_loc(v: Value) -> Loc | None:
        lf = graph.leaf_of(v)
        if lf is None:
            return None
        return groups.loc(lf.name, _nbytes(v.type)) or Loc(lf.kind, lf.name, 0, _nbytes(v.type))

    if fuse:  # an elementwise pass reading a reduction broadcast back: in its workgroups
        updated = {pl.views.resolve(v)[0].id for v in updates.values()}  # in-place rules
        pl.kernels[:] = _merge_adjacent(pl.kernels,
                                        lambda a, b: _with_post_pass(a, b, updated))
    # neighbouring elementwise kernels over one shape: one dispatch.  (Training steps only:
    # in ResNet-50's inference plan the earlier-produced outputs raised the peak by 15%.)
    if fuse and not inference:
        keep = {pl.views.resolve(v)[0].id
                for v in list(fetch_values.values()) + list(updates.values())}
        pl.kernels[:] = _merge_adjacent(pl.kernels, lambda a, b: _merged(a, b, keep))
    # 3) liveness over kernel indices for temp values
    kernels = pl.kernels
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    values: dict[int, Value] = {}
    for i, (_desc, ins, outs, _label) in enumerate(kernels):
        for v in outs:
            first.setdefault(v.id, i)
            last[v.id] = max(last.get(v.id, i), i)
            values[v.id] = v
        for v in ins:
            last[v.id] = max(last.get(v.id, i), i)
            values[v.id] = v
    end = len(kernels)
    # a value computed into its slot of a concat makes the concat's buffer live from then on
    # a slot may itself lie in an outer concat's slot: follow to the outermost buffer
    def outermost(vid: int) -> tuple[Value, int]:
        cv, off = pl.alias[vid]
        while cv.id in pl.alias:
            outer, more = pl.alias[cv.id]
            cv, off = outer, off + more
        return cv, off

    slots = {vid: outermost(vid) for vid in pl.alias}
    for vid in pl.alias:
        cv = slots[vid][0]
        if vid in first:
            first[cv.id] = min(first.get(cv.id, first[vid]), first[vid])
            last[cv.id] = max(last.get(cv.id, first[vid]), last.get(vid, first[vid]))
            values[cv.id] = cv
    fetch_bases = {}
    for name, v in list(fetch_values.items()) + list(updates.items()):
        base, s = pl.views.resolve(v)
        fetch_bases[name] = (base, s)
        if graph.leaf_of(base) is None:
            last[base.id] = end  # alive until the step's end (updates copy, outputs read back)

    # 4) placement: fetched results get pinned "out" buffers; the rest share the arena
    out_values = {fetch_bases[n][0].id for n in fetch_values}
    placed: dict[int, Loc] = {}
    for gname, gv in group_values.items():
        placed[gv.id] = Loc("group", gname, 0, _nbytes(gv.type))
    for cid, (gname, off, v) in concat_ranges.items():
        placed[cid] = Loc("group", gname, off * v.dtype.gpu_itemsize, _nbytes(v.type))
    if plan_memory:
        ranges = {}  # concats that are a range of a group read that group too
        for cid, (gname, _, _) in concat_ranges.items():
            ranges.setdefault(gname, []).append(cid)
        for gname, b in _in_place_groups(kernels, updates, fetch_bases, groups, group_values,
                                         graph, ranges).items():
            placed[b.id] = Loc("group", gname, 0, _nbytes(b.type))
    if plan_memory:  # updates computed straight into their tensor's buffer (no temp, no copy)
        fetched_leaves = {lf.name for n in fetch_values
                          if (lf := graph.leaf_of(fetch_bases[n][0])) is not None}
        for name in _in_place_updates(kernels, updates, graph, fetched_leaves):
            if name in groups.home:
                continue
            v = updates[name]
            placed[v.id] = Loc(graph.leaves[name].kind, name, 0, _nbytes(v.type))
    todo = []  # arena values in order of first use: (id, bytes, first, last)
    for vid in sorted(first, key=lambda vid: first[vid]):
        v = values[vid]
        if graph.leaf_of(v) is not None or vid in placed or vid in pl.alias:
            continue
        if vid in out_values:
            placed[vid] = Loc("out", f"%{vid}", 0, _nbytes(v.type))
            continue
        todo.append((vid, _nbytes(v.type), first[vid], last[vid]))
    if plan_memory:  # both placements are cheap; keep the smaller arena
        offsets, cursor = min((_place(todo, fit, align) for fit in (_first_fit, _best_fit)),
                              key=lambda r: r[1])
    else:
        offsets, cursor = {}, 0
        for vid, nbytes, _, _ in todo:
            offsets[vid] = cursor
            cursor += _align(nbytes, align)
    for vid, nbytes, _, _ in todo:
        placed[vid] = Loc("temp", "", offsets[vid], nbytes)
    plan.arena_bytes = cursor
    plan.aliased = len(pl.alias)
    for vid, (cv, off) in slots.items():
        if vid in values:
            c = placed[cv.id]
            placed[vid] = Loc(c.pool, c.name, c.offset + off * cv.dtype.gpu_itemsize,
                              _nbytes(values[vid].type))

    def loc_of(v: Value) -> Loc:
        return leaf_loc(v) or placed[v.id]

    for desc, ins, outs, label in kernels:
        plan.kernels.append(PlannedKernel(desc, [loc_of(v) for v in ins + outs], label))
    if own_ranges:
        _check_no_overlap(plan)
    for name, v in fetch_values.items():
        base, s = fetch_bases[name]
        bl = loc_of(base)
        plan.fetch[name] = (Loc(bl.pool, bl.name, bl.offset + s.offset * v.dtype.gpu_itemsize,
                                _nbytes(v.type)), v.type)
    for name, v in updates.items():
        base, s = fetch_bases[name]
        bl = loc_of(base)
        src = Loc(bl.pool, bl.name, bl.offset + s.offset * v.dtype.gpu_itemsize, _nbytes(v.type))
        dst = groups.loc(name, _nbytes(v.type)) or Loc(graph.leaves[name].kind, name, 0,
                                                        _nbytes(v.type))
        if src != dst:
            plan.kernels.append(PlannedCopy(src, dst))
    plan.dispatches_unfused = sum(1 for n in graph.nodes if n.id in needed and not n.opdef.leaf
                                  and not isinstance(n.opdef.lowering, View) and n.op != "full")
    return plan
