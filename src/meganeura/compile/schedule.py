"""Scheduling: a primitive-op graph lowered to kernels in execution order.

Input: a Program whose graph holds only primitive ops (after ``passes``).  Output: a
``Schedule``, the list of ``LoweredKernel`` (a kernels-IR description plus the graph values it
reads and writes) that computes the program's roots, in graph order.  Where each value lives
(arena offsets, parameter groups, in-place updates) is decided afterwards by ``memory.py``;
kernel-list rewrites (post passes, merges of neighbours) are in ``rewrites.py``.

Fusion happens here, by grouping (``fusion.py`` decides which values are materialized):
pointwise producers are inlined into their consumer kernel (pointwise, reduce prologue, matmul
or archetype epilogue); views (reshape, permute, broadcast, slice, split, flip) are folded into
the strides of their reader.  A matmul with few output tiles and a long K is split along K
(``split_k``); values that exist only to be concatenated are computed straight into their slot
of the concat's buffer (``_Planner._alias_concat_inputs``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ..dtypes import f32
from ..errors import GraphBuildError
from ..graph import Graph, Node, TensorType, Value
from ..kernels import ir
from ..kernels.archetypes import archetype
from ..kernels.matmul import SMALL_M_SPLIT_CHUNK, small_m_sliced, small_m_split
from ..kernels.reduce import split_plan
from ..ops.lowering import Kernel, Matmul, Pointwise, Reduce, View
from ..ops.lowering import resolve as _pointwise_expr
from ..program import Program
from .fusion import materialized_values, takes_epilogue

_PROBE_LIMITS = {"max_storage_buffer_binding_size": 1 << 62, "max_buffer_size": 1 << 62}
ALIGN = 256  # bytes; >= minStorageBufferOffsetAlignment on every adapter we know
MAX_BINDINGS = 8  # storage buffers per stage that every WebGPU device supports


@dataclass(frozen=True)
class LoweredKernel:
    """One dispatch before placement: what it computes and which graph values it binds."""

    desc: object  # a kernels.ir kernel description
    ins: list[Value]  # bound inputs, in the kernel's binding order
    outs: list[Value]  # bound outputs, after the inputs
    label: str


@dataclass
class Schedule:
    """The kernels computing a program's roots, in execution order, and how values map to
    the buffers those kernels bind."""

    kernels: list[LoweredKernel]
    resolve: Callable[[Value], tuple[Value, ir.Strided]]  # value -> (bound base, view of it)
    slots: dict[int, tuple[Value, int]]  # value id -> (concat, element offset) it is computed in
    group_values: dict[str, Value]  # group name -> the planner value of the group's buffer
    needed: set[int]  # ids of the graph nodes the roots depend on
    # slot values written through a strided view (``PointwiseKernel.out_views``): value id ->
    # the concat whose whole range their kernel binds (their slot offset is 0)
    strided: dict[int, Value] = dataclasses.field(default_factory=dict)

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
            return base, broadcast_to(s, v.shape)
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


def _rebind(instrs, i_acc: int, remap: dict) -> tuple[ir.Instr, ...]:
    """A fused pointwise kernel's instructions as an epilogue: its input ``i_acc`` (the value
    the host kernel computes) becomes the accumulator, the others the host's extra inputs."""

    def arg(a):
        if a[0] != "in":
            return a
        return ("acc", 0) if a[1] == i_acc else remap[a[1]]

    return tuple(ir.Instr(i.expr, tuple(arg(a) for a in i.args), i.dtype, i.helpers)
                 for i in instrs)


def _broadcastable(src, dst) -> bool:
    if len(src) > len(dst):
        return False
    return all(a in (1, b) for a, b in zip(src[::-1], dst[::-1]))


def schedule(program: Program, roots: list[Value], fuse: bool, *, alias_ok: bool = True,
             align: int = ALIGN, groups: Mapping[str, tuple] = {},
             homes: Mapping[int, tuple[str, int]] = {}, no_kernel: Iterable[int] = (),
             contiguous: Iterable[Value] = ()) -> Schedule:
    """Kernels computing ``roots`` in graph order.

    ``groups``: name -> (dtype, elements, concat id) of buffers holding several persistent
    tensors (the concat value is the buffer itself); ``homes``: leaf value id -> (group name,
    element offset) for tensors read as views into their group; ``no_kernel``: values computed
    by no kernel (concats that are a range of a group); ``contiguous``: values (results,
    updates) that must end up contiguous, copied where their view is not.  ``alias_ok``:
    compute values that only feed a concat into their slot of it (slot offsets multiples of
    ``align`` bytes)."""
    pl = _Planner(program, roots, fuse, alias_ok, align)
    group_values = pl.bind_groups(groups, homes)
    pl.done.update(no_kernel)
    needed = program.graph.ancestors(roots)
    pl.lower_nodes(needed)
    pl.copy_strided(contiguous)
    return Schedule(pl.kernels, pl.views.resolve, pl.alias, group_values, needed, pl.strided)


class _Planner:
    """Lowers materialized values to kernels (``kernel_for``), recording them with ``emit``."""

    def __init__(self, program: Program, roots: list[Value], fuse: bool, alias_ok: bool = True,
                 align: int = ALIGN):
        self.fuse = fuse
        self.graph: Graph = program.graph
        self.materialized = materialized_values(self.graph, roots, fuse)
        self.views = _Views(self.materialized, self.copy_value)
        self.kernels: list = []
        self.done: set[int] = set()  # values whose kernel has been emitted
        self.alias: dict[int, tuple[Value, int]] = {}  # value id -> (concat value, elem offset)
        self.strided: dict[int, Value] = {}  # of those, written through strided views
        self.copies: dict[tuple, Value] = {}  # (value id, shape) -> its contiguous copy
        self.alias_ok = alias_ok  # values may be computed into their concat slot
        self.align = align  # binding offset alignment (bytes) of the device
        self.root_ids = {r.id for r in roots}
        self.consumers: dict[int, list[Node]] = {}
        for node in self.graph.nodes:
            for x in node.inputs:
                if node not in self.consumers.setdefault(x.id, []):
                    self.consumers[x.id].append(node)
        self.n_temps = 0  # planner-made values (ids -1, -2, ...)

    def bind_groups(self, groups: Mapping[str, tuple], homes: Mapping[int, tuple[str, int]]):
        """A planner value per group buffer (its concat needs no kernel: it is the buffer), and
        the tensors of ``homes`` read as views into their group.  Returns name -> value."""
        group_values = {}
        for gname, (dtype, n, concat_id) in groups.items():
            gv = self.temp_value((n,), dtype)
            group_values[gname] = gv
            self.views.cache.pop(gv.id, None)
            self.views.homes[concat_id] = (gv, 0)
            self.materialized.discard(concat_id)
            self.done.add(concat_id)  # the concat is the buffer itself: no kernel
        for vid, (gname, off) in homes.items():
            self.views.homes[vid] = (group_values[gname], off)
        return group_values

    def lower_nodes(self, needed: set[int]) -> None:
        """Kernels in graph order for every materialized non-leaf value of ``needed`` nodes."""
        for node in self.graph.nodes:
            if node.id not in needed or node.opdef.leaf:
                continue
            for v in node.outputs:
                if v.id in self.materialized and v.id not in self.done:
                    self.kernel_for(v)
                    self.done.add(v.id)

    def copy_strided(self, values: Iterable[Value]) -> None:
        """A copy kernel for each of ``values`` that is a non-contiguous view."""
        for v in values:
            res = self.views.resolve(v)
            if res[1].strides != _contiguous(v.shape) and v.size > 1 and v.id not in self.done:
                self.pointwise([v])
                self.materialized.add(v.id)
                self.views.cache[v.id] = (v, ir.Strided.contiguous(v.dtype, v.shape))
                self.done.add(v.id)

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
        if low.archetype in ("attention_fwd", "attention_combine") and \
                self._heads_last_reader(n.outputs[0]):
            # stored as (B, S, H, D): the output projection's (B, S, H·D) view needs no copy
            o = n.outputs[0]
            B, H, S, D = o.shape
            outs[0] = self.temp_value((B, S, H, D), o.dtype)
            self.views.cache[o.id] = (outs[0], ir.Strided(o.dtype, o.shape,
                                                          (S * H * D, D, H * D, 1), 0, o.size))
            desc = dataclasses.replace(desc, out_bshd=True)
            shapes += " [bshd]"
        if getattr(desc, "split_k", 1) > 1:
            self._split_k_archetype(desc, bases, outs[0], f"{low.archetype} {shapes}")
        else:
            self.emit(desc, bases, outs, f"{low.archetype} {shapes}")
        self.done.update(o.id for o in n.outputs)

    def _split_k_archetype(self, desc, bases, out: Value, label: str, epilogue=None) -> None:
        """A family description with ``split_k`` > 1 (a conv GEMM too small to fill the GPU):
        its partial sums go to an f32 temp (split_k, *out.shape), added in order by a reduction
        that also runs the pointwise ``epilogue`` ((instrs, extras, extra bases, ops))."""
        acc = f32 if out.dtype.is_float else out.dtype
        tmp = self.temp_value((desc.split_k,) + tuple(out.shape), acc)
        self.emit(dataclasses.replace(desc, out_dtype=acc), bases, [tmp],
                  f"{label} [split-K {desc.split_k}]")
        if epilogue is None:
            self._split_k_plain_sum(tmp, out, f"{label} [split-K sum]")
            return
        instrs, extras, ebases, ops = epilogue
        red = split_k_sum_reduce(tmp.shape, tmp.dtype, out.dtype, "splitk_sum_ep", instrs,
                                 tuple(extras))
        self.emit(red, [tmp] + list(ebases), [out], f"{label} [split-K sum] +{ops}")

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

        instrs = _rebind(kb.instrs, i_red, remap)
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

        instrs = _rebind(kb.instrs, i_src, remap)
        bases, views = self._archetype_inputs(n, arch)
        plain = arch.make(n.attrs, views, [src.type])
        if getattr(plain, "split_k", 1) > 1:  # the epilogue runs where the partials are added
            if len(extras) + 2 > MAX_BINDINGS:
                return False
            self._split_k_archetype(plain, bases, out, f"{low.archetype} {src.shape}",
                                    (instrs, extras, ebases, ops))
            return True
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
        operands = _matmul_epilogue_operands(kb, i_mm, mm.shape)
        if operands is None:
            return False
        extras, bases, remap = operands
        instrs = _rebind(kb.instrs, i_mm, remap)
        desc, mm_bases = self._matmul_desc(mm)
        if split_k(desc) > 1:
            # split-K: the epilogue runs in the kernel that sums the partial products
            if desc.batch != 1:
                return False
            tmp, label = self._split_k_partials(desc, mm_bases, mm)
            extra = tuple(ir.Strided(x.dtype, x.shape[1:], x.strides[1:], x.offset, x.extent)
                          for x in extras)
            red = split_k_sum_reduce(tmp.shape, tmp.dtype, out.dtype, "splitk_sum_ep", instrs,
                                     extra)
            self.emit(red, [tmp] + bases, [out], f"{label} [split-K sum] +{ops}")
            return True
        desc = ir.MatmulKernel(desc.batch, desc.m, desc.n, desc.k, desc.a, desc.b, tuple(extras),
                               instrs, out.dtype, name="matmul_ep",
                               tensor_cores=desc.tensor_cores)
        self.emit(desc, mm_bases + bases, [out],
                  f"matmul {desc.batch}x{desc.m}x{desc.n}x{desc.k} +{ops}")
        return True

    def matmul(self, v: Value) -> None:
        desc, bases = self._matmul_desc(v)
        label = f"matmul {desc.batch}x{desc.m}x{desc.n}x{desc.k}"
        split = split_k(desc)
        if split <= 1:
            self.emit(desc, bases, [v], label)
            return
        tmp, label = self._split_k_partials(desc, bases, v)
        self._split_k_plain_sum(tmp, v, f"{label} [split-K sum]")

    def _split_k_plain_sum(self, tmp: Value, out: Value, label: str) -> None:
        """Split-K partials ``tmp`` (split, *out.shape) added in order into ``out``
        (``split_k_sum_kernel``)."""
        desc, n_views = split_k_sum_kernel(tmp.shape, tmp.dtype, out.dtype)
        self.emit(desc, [tmp] * n_views, [out], label)

    def _split_k_partials(self, desc, bases, v: Value):
        """Few output tiles and a long K (weight gradients, small-M GEMMs): K split into
        ``split`` chunks computed as a batch of matmuls (strides only) into a temp of partial
        products, which the caller sums in order.  Returns (temp, label)."""
        split = split_k(desc)
        label = f"matmul {desc.batch}x{desc.m}x{desc.n}x{desc.k}"
        a, b, kc = desc.a, desc.b, desc.k // split
        a_s = ir.Strided(a.dtype, (split, desc.m, kc), (a.strides[2] * kc,) + a.strides[1:],
                         a.offset, a.extent)
        b_s = ir.Strided(b.dtype, (split, kc, desc.n), (b.strides[1] * kc,) + b.strides[1:],
                         b.offset, b.extent)
        acc = f32 if v.dtype.is_float else v.dtype
        tmp = self.temp_value((split, desc.m, desc.n), acc)
        self.emit(ir.MatmulKernel(split, desc.m, desc.n, kc, a_s, b_s, out_dtype=acc,
                                  name="matmul_splitk", tensor_cores=desc.tensor_cores,
                                  split_of=desc.k),
                  bases, [tmp],
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
        return ir.MatmulKernel(nb, M, N, K, ops[0], ops[1], out_dtype=v.dtype,
                               tensor_cores=not n.attrs.get("f32_only", False)), bases

    def _alias_concat_inputs(self, v: Value, concat: Node, starts: list[int]) -> set[int]:
        """Inputs of the concat ``v`` whose producer can write straight into the concat's
        buffer: a value that exists only to be concatenated (possibly split into several
        consecutive inputs, e.g. the weight gradient of a fused projection), read
        contiguously, at a binding-aligned slot.  Each input's slot must be one contiguous
        block: a 1-D concat, or one along an axis with only unit dimensions before it (the
        heads of a batch-1 attention gradient).  Returns the input indices placed."""
        ax = concat.attrs["axis"] % max(v.ndim, 1)
        if not (self.alias_ok and self.fuse) or v.id in self.root_ids:
            return set()
        if math.prod(v.shape[:ax]) != 1:
            return self._strided_concat_slots(v, concat, ax, starts) if STRIDED_SLOTS else set()
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

    def _strided_concat_slots(self, v: Value, concat: Node, ax: int,
                              starts: list[int]) -> set[int]:
        """Concat inputs whose slots are strided (a concat along an inner axis, e.g. the gate
        and up gradients of a fused projection side by side in each row), each produced by
        an elementwise kernel for this concat alone: that kernel writes it straight into the
        concat's buffer through a strided view (``PointwiseKernel.out_views``), binding the
        concat's whole range.  Returns the input indices placed."""
        vstr = _contiguous(v.shape)
        resolved = [self.views.resolve(x) for x in concat.inputs]
        uses: dict[int, int] = {}
        for base, _ in resolved:  # a base read by two slots stays where it is
            uses[base.id] = uses.get(base.id, 0) + 1
        placed = set()
        for i, x in enumerate(concat.inputs):
            base = resolved[i][0]
            j = self._pointwise_producer(base)
            # x itself (not a view of it) made by an elementwise kernel: no leaf, no temp
            if (j is None or base.id != x.id or uses[base.id] > 1
                    or base.dtype != v.dtype or base.id not in self.materialized
                    or base.id in self.root_ids or base.id in self.alias
                    or tuple(self.kernels[j].desc.shape) != tuple(x.shape)
                    or not self._only_feeds(base, concat)):
                continue
            view = ir.Strided(v.dtype, tuple(x.shape), vstr, starts[i] * vstr[ax], v.size)
            self._write_through(j, base, view)
            self.alias[base.id] = (v, 0)
            self.strided[base.id] = v
            placed.add(i)
        return placed

    def _pointwise_producer(self, base: Value) -> int | None:
        """Index in ``self.kernels`` of the elementwise kernel that writes ``base`` (None when
        another kind of kernel, or none, does)."""
        for j in range(len(self.kernels) - 1, -1, -1):
            if any(o.id == base.id for o in self.kernels[j].outs):
                ok = isinstance(self.kernels[j].desc, ir.PointwiseKernel)
                return j if ok else None
        return None

    def _write_through(self, j: int, base: Value, view: ir.Strided) -> None:
        """Kernel ``j`` writes its output ``base`` through ``view``."""
        k = self.kernels[j]
        views = list(k.desc.out_views or (None,) * len(k.desc.outputs))
        views[[o.id for o in k.outs].index(base.id)] = view
        self.kernels[j] = dataclasses.replace(
            k, desc=dataclasses.replace(k.desc, out_views=tuple(views)))

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
        self.n_temps += 1
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
        self.kernels.append(LoweredKernel(desc, list(in_values), list(out_values), label))


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
# Small-M GEMMs (transformer projections at 128 rows): fewer than SPLIT_K_SMALL_TILES 64x64
# tiles get K chunks of at least SPLIT_K_SMALL_CHUNK until there are SPLIT_K_TARGET
# workgroups.  H200, Dawn (bench/matmul_bench.py): 1x128x576x960 41 µs unsplit, 17 µs split
# 12 (13.5-17 µs in two runs); 1x128x576x1536 64-78 µs (12) vs 255; 1x128x1536x576 45 µs (8)
# vs 77.
SPLIT_K_SMALL_TILES = 64
SPLIT_K_SMALL_CHUNK = 64
SPLIT_K_TARGET = 264  # two workgroups per SM of a 132-SM GPU
SPLIT_K_SMALL_MAX = 12  # the most measured (best of 2..12 at 1x128x576x{960,1536,3072})
# Larger GEMMs (at least SPLIT_K_SMALL_TILES 64x64 tiles, fewer than SPLIT_K_MIN_TILES 128x128
# tiles) split until there are SPLIT_K_FILL 64x64 tiles: three workgroups per SM.  H200, Dawn,
# inside Whisper's steps (bench/whisper_gemm_variants.py, docs/benchmarks.md 2026-12-01), µs per
# step incl. the sums: 1500x384x1536 split 3 (432 workgroups of 64x64) 365 vs split 4 (288 of
# 128x64) 467, splits 2/6/8/12 375-424; 1536x384x1500 331 vs 357; 384x1536x1500 335 vs 359;
# 1500x384x1152 296 vs 306.  1152x384x1500 gets 4 (unmeasured; 3: 282, 5: 297, 6: 274).
SPLIT_K_FILL = 396


def split_k(desc: ir.MatmulKernel) -> int:
    """How many K chunks a single-batch matmul with few output tiles should be split into
    (1 = no split).  A divisor of K, so every chunk has the same length.  The target counts
    64x64 tiles, the tile ``choose_config`` falls back to when a split leaves too few 128x64
    workgroups, so the split and the tile choice together fill the GPU."""
    if desc.batch != 1 or desc.m <= 4 or desc.n <= 4:
        return 1
    if small_m_sliced(desc.batch, desc.m, desc.n, desc.k):  # one K-sliced dispatch instead
        return 1
    if small_m_split(desc.batch, desc.m, desc.n, desc.k):
        return _divisor_at_most(desc.k, max(2, round(desc.k / SMALL_M_SPLIT_CHUNK)))
    small = -(-desc.m // 64) * -(-desc.n // 64)
    if small < SPLIT_K_SMALL_TILES and desc.k >= 4 * SPLIT_K_SMALL_CHUNK:
        want = min(desc.k // SPLIT_K_SMALL_CHUNK, -(-SPLIT_K_TARGET // small), SPLIT_K_SMALL_MAX)
    else:
        tiles = -(-desc.m // 128) * -(-desc.n // 128)
        if tiles >= SPLIT_K_MIN_TILES or desc.k < 4 * SPLIT_K_MIN_CHUNK:
            return 1
        want = min(desc.k // SPLIT_K_MIN_CHUNK, -(-SPLIT_K_FILL // small), 64)
    return _divisor_at_most(desc.k, want)


def _divisor_at_most(k: int, want: int) -> int:
    """The largest divisor of ``k`` from 2 to ``want`` (1 when there is none)."""
    for s in range(want, 1, -1):
        if k % s == 0:
            return s
    return 1


SPLIT_SUM_POINTWISE = True  # plain split-K sums as vec4 pointwise kernels (bench/splitk_sum_bench)
# inputs of inner-axis concats written through strided views (``_strided_concat_slots``; off:
# copied by a concat kernel, for A/B: ``bench/plan_memory.py --no-strided-slots``)
STRIDED_SLOTS = True


def split_k_sum_pointwise(dtype, tmp_shape) -> ir.PointwiseKernel:
    """Partials of ``tmp_shape`` (split, *shape) summed over the first axis in split order, as
    a pointwise kernel whose input ``j`` is partial ``j`` (a view at element offset j·size)."""
    split, shape = tmp_shape[0], tuple(tmp_shape[1:])
    size = int(np.prod(shape, dtype=np.int64))
    strides = ir.contiguous_strides(shape)
    views = tuple(ir.Strided(dtype, shape, strides, j * size, split * size)
                  for j in range(split))
    instrs = [ir.Instr("{0}", (("in", 0),), dtype)]
    instrs += [ir.Instr("({0} + {1})", (("t", j - 1), ("in", j)), dtype) for j in range(1, split)]
    return ir.PointwiseKernel(shape, views, tuple(instrs), (split - 1,), name="splitk_sum")


def split_k_sum_kernel(tmp_shape, dtype, out_dtype, epilogue=(), extra=()) -> tuple:
    """The kernel adding split-K partials of ``tmp_shape`` (split, *out) in order, and how many
    inputs read the partials: the vec4 pointwise sum over their ``split`` views where the sum
    is plain, f32 and ``SPLIT_SUM_POINTWISE``, else the reduction over the split axis (one
    input; it also runs a pointwise ``epilogue`` over ``extra`` inputs)."""
    if SPLIT_SUM_POINTWISE and not epilogue and dtype == out_dtype == f32:
        return split_k_sum_pointwise(dtype, tmp_shape), tmp_shape[0]
    name = "splitk_sum_ep" if epilogue else "splitk_sum"
    return split_k_sum_reduce(tmp_shape, dtype, out_dtype, name, epilogue, extra), 1


def split_k_sum_reduce(tmp_shape, dtype, out_dtype, name: str, epilogue=(),
                       extra=()) -> ir.ReduceKernel:
    """The reduction summing split-K partial products of ``tmp_shape`` (split, m, n) in order,
    with an optional pointwise ``epilogue`` over ``extra`` inputs."""
    shape = tuple(tmp_shape)
    return ir.ReduceKernel(shape, (0,), "sum", (ir.Strided.contiguous(dtype, shape),),
                           (ir.Instr("{0}", (("in", 0),), dtype),), tuple(epilogue),
                           tuple(extra), out_dtype=out_dtype, name=name)


def _matmul_epilogue_operands(kb: _KernelBuilder, i_mm: int, mm_shape):
    """The inputs of ``kb`` other than the matmul (its input ``i_mm``) as (batch, m, n) views:
    (extra views, their bases, input index -> ("x", extra index)), or None when a view cannot
    be laid over the matmul's output that way."""
    batch = mm_shape[:-2]
    extras, bases, remap = [], [], {}
    for j, (b, s) in enumerate(zip(kb.bases, kb.inputs)):
        if j == i_mm:
            continue
        if s.shape != mm_shape:  # the epilogue reads the matmul through a reshape
            s = reshape_strided(s, mm_shape)
            if s is None:
                return None
        try:
            bst = _merge_batch(tuple(batch), s.strides[:-2]) if batch else 0
        except _Unmergeable:
            return None
        nb = int(np.prod(batch, dtype=np.int64)) if batch else 1
        remap[j] = ("x", len(extras))
        extras.append(ir.Strided(s.dtype, (nb,) + s.shape[-2:], (bst,) + s.strides[-2:],
                                 s.offset, s.extent))
        bases.append(b)
    return extras, bases, remap


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


# Column reductions (outputs side by side, TX = 32, TY = 8) over a medium extent: Whisper's
# layer-norm and bias gradients (1500, 384) -> 384 ran as 12 workgroups whose invocations each
# walk 1500 / 8 = 188 rows in 47 dependent rounds of 4 loads: ~30 µs on the H200 for 4.6 MB
# (under 1 µs at 4.8 TB/s).  Chunks of 256 rows give 5 x 12 = 60 workgroups of 10 rounds plus
# a tiny final pass (5 partials per output): two dispatches of ~8 µs each.
COLUMN_MIN_CHUNK = 256


@functools.lru_cache(maxsize=4096)
def _split_plan(desc):
    """``split_plan`` for the planner, cached: identical layers ask about identical kernels.
    Column reductions split from ``COLUMN_MIN_CHUNK`` rows on."""
    plan = split_plan(desc, limits=_PROBE_LIMITS)
    if plan is None and desc.split == 1 and not desc.post:
        tx, ty = _probe_spec(desc).meta["layout"]
        if tx > 1 and ty > 1:
            plan = split_plan(desc, limits=_PROBE_LIMITS, min_chunk=COLUMN_MIN_CHUNK)
    return plan


def _probe_spec(desc) -> ir.KernelSpec:
    """The planner's probe emission of ``desc`` (grid and layout, no device)."""
    from ..kernels.reduce import emit

    return emit(desc, _PROBE_LIMITS)
