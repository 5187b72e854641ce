"""Axis reductions (sum | max | min) with a pointwise prologue and epilogue.

A workgroup of ``TX × TY`` invocations owns ``TX`` neighbouring output elements; the ``TY``
invocations of one output each fold a strided share of the reduced elements (``r = y, y+TY, …``)
serially, then a tree in workgroup memory combines the ``TY`` partial results.  The order of
the arithmetic depends only on the shapes, never on timing: results are bit-for-bit
deterministic (no atomics).

* reduced dims contiguous in memory (a row reduction): ``TX = 1, TY ≤ 256`` — one workgroup per
  output, coalesced reads along the row;
* kept dims contiguous (a column reduction, e.g. over the batch): ``TX`` outputs side by side so
  a warp reads neighbouring addresses, ``TY`` lanes split the reduced extent;
* tiny reduced extents (≤ 16): ``TY = 1``, one invocation per output, a serial loop.

Reduced axes may be any subset (need not be last or contiguous); they are iterated through a
linear index decomposed over the (merged) reduced dims.  f16 and f32 accumulate in f32.
"""

from __future__ import annotations

from ..dtypes import DType, bool_
from .archetypes import kernel_family
from .common import (
    Bindings,
    CodegenError,
    acc_dtype,
    bcast_strides,
    check_binding_size,
    check_bindings,
    check_dtypes,
    check_extent,
    check_invocations,
    check_workgroup_storage,
    combine,
    convert,
    coords_code,
    emit_instrs,
    identity,
    index_code,
    load,
    make_grid,
    make_target,
    merge_dims,
    module_header,
    module_source,
    pow2ceil,
    prod,
    store_value,
    u,
)
from .ir import KernelSpec, ReduceKernel, Strided, contiguous_strides

SERIAL_MAX = 16  # reduced extents up to this are folded by one invocation per output
UNROLL = 4  # independent partial accumulators per invocation (memory-level parallelism)
MAX_THREADS = 256


def _extra_strides(s, shape, axes, out_shape, what):
    """Strides of an epilogue input over the output shape (it may be given with keepdims)."""
    if len(s.shape) == len(shape) and len(shape) != len(out_shape):
        st = bcast_strides(s, tuple(1 if d in axes else n for d, n in enumerate(shape)), what)
        return tuple(x for d, x in enumerate(st) if d not in axes)
    return bcast_strides(s, out_shape, what)


def choose_layout(rshape, kept_contig: bool, red_total: int, out_total: int, max_threads: int):
    """(TX, TY): outputs per workgroup and invocations per output."""
    if red_total <= SERIAL_MAX:
        return min(max_threads, 64 if out_total >= 64 else pow2ceil(out_total)), 1
    if kept_contig and out_total > 1:
        tx = min(32, pow2ceil(out_total))
        ty = max(1, min(max_threads // tx, pow2ceil(red_total)))
        return tx, ty
    return 1, min(max_threads, pow2ceil(red_total))


def _rel(base: str, coords, strides) -> str:
    """``base`` plus the offset of ``coords`` along ``strides``."""
    rel = index_code(coords, strides, 0)
    return base if rel == "0u" else f"{base} + {rel}"


def _used(instrs, kind: str, n: int, what: str, name: str) -> list[int]:
    """Indices of the ``kind`` operands ``instrs`` read (each < ``n``)."""
    used = sorted({i for ins in instrs for kd, i in ins.args if kd == kind})
    for i in used:
        if i >= n:
            raise CodegenError(f"kernel {name!r}: {what} {i} of {n}")
    return used


class _Reduce:
    """One reduction being generated: the analysis (axes, dtypes, operand strides merged over
    the kept and the reduced dims, workgroup layout) as attributes, the WGSL in steps."""

    def __init__(self, k: ReduceKernel, t, alias):
        self.k, self.t, self.name = k, t, k.name
        self._axes()
        self._dtypes(alias)
        self._operands()
        self._merge()
        self._layout()

    def _axes(self) -> None:
        k, name = self.k, self.name
        shape = self.shape = tuple(int(n) for n in k.shape)
        nd = len(shape)
        if any(not -nd <= a < nd for a in k.axes):
            raise CodegenError(f"kernel {name!r}: axes {k.axes} out of range for shape {shape}")
        axes = self.axes = tuple(sorted({a % nd for a in k.axes}))
        if len(axes) != len(k.axes):
            raise CodegenError(f"kernel {name!r}: repeated axes {k.axes}")
        if k.kind not in ("sum", "max", "min"):
            raise CodegenError(f"kernel {name!r}: unknown reduction {k.kind!r}")
        self.kept = [d for d in range(nd) if d not in axes]
        self.out_shape = tuple(shape[d] for d in self.kept)
        self.rshape_full = tuple(shape[d] for d in axes)
        self.out_total = prod(self.out_shape)
        self.red_total = prod(self.rshape_full)
        if self.red_total == 0 and k.kind != "sum":
            raise CodegenError(f"kernel {name!r}: {k.kind} over an empty axis")

    def _dtypes(self, alias) -> None:
        k, name = self.k, self.name
        if not k.prologue and not k.inputs:
            raise CodegenError(f"kernel {name!r} has neither inputs nor a prologue")
        # the value reduced
        self.val_dtype = k.prologue[-1].dtype if k.prologue else k.inputs[0].dtype
        self.acc_t = acc_dtype(self.val_dtype)
        res_dtype = k.epilogue[-1].dtype if k.epilogue else self.val_dtype
        self.out_dtype: DType = k.out_dtype or res_dtype
        self.split = max(1, int(getattr(k, "split", 1) or 1))
        if self.split > 1:
            self.out_dtype = self.acc_t  # partial results stay in the accumulator type
        self.n_in, self.n_x = len(k.inputs), len(k.extra)
        self.n_po = len(k.post_outputs)
        if self.n_po and (self.split > 1 or not k.post):
            raise CodegenError(f"kernel {name!r}: a post pass needs instrs and no split")
        self.post_dts = [k.post[i].dtype for i in k.post_outputs]
        bind_dtypes = ([s.dtype for s in k.inputs] + [s.dtype for s in k.extra]
                       + [s.dtype for s in k.post_inputs] + [self.out_dtype] + self.post_dts)
        check_bindings(name, len(bind_dtypes), self.t)
        all_dtypes = bind_dtypes + [i.dtype for i in k.prologue + k.epilogue + k.post]
        self.uses_f16 = check_dtypes(name, all_dtypes, self.t)
        self.bd = Bindings(bind_dtypes, alias)
        self.out_b = self.n_in + self.n_x + len(k.post_inputs)  # binding of the reduced output

    def _operands(self) -> None:
        k, name, t, shape = self.k, self.name, self.t, self.shape
        used = self.used = (_used(k.prologue, "in", self.n_in, "prologue reads input", name)
                            if k.prologue else [0])
        used_x = self.used_x = _used(k.epilogue, "x", self.n_x, "epilogue reads extra input",
                                     name)
        self.full = {i: bcast_strides(k.inputs[i], shape, f"{name} input {i}") for i in used}
        for i in used:
            check_extent(name, f"input {i}", k.inputs[i], shape, self.full[i], t)
        self.xst = {i: _extra_strides(k.extra[i], shape, self.axes, self.out_shape,
                                      f"{name} extra {i}") for i in used_x}
        for i in used_x:
            check_extent(name, f"extra input {i}", k.extra[i], self.out_shape, self.xst[i], t)
        check_binding_size(name, "output", self.out_total * self.split, self.out_dtype, t)
        used_p = self.used_p = _used(k.post, "in", len(k.post_inputs), "post pass reads input",
                                     name)
        self.pfull = {i: bcast_strides(k.post_inputs[i], shape, f"{name} post input {i}")
                      for i in used_p}
        for i in used_p:
            check_extent(name, f"post input {i}", k.post_inputs[i], shape, self.pfull[i], t)
        for dt in self.post_dts:
            check_binding_size(name, "post output", prod(shape), dt, t)

    def _merge(self) -> None:
        """Kept dims merged over inputs (kept part), extras, post operands and the contiguous
        output; reduced dims over inputs and post operands."""
        used, used_x, used_p, kept, axes = self.used, self.used_x, self.used_p, self.kept, self.axes
        full, pfull = self.full, self.pfull
        full_out = contiguous_strides(self.shape)  # the post outputs' layout
        post_out = [full_out] if self.n_po else []
        self.kshape, kstr = merge_dims(
            self.out_shape,
            [contiguous_strides(self.out_shape)]
            + [tuple(full[i][d] for d in kept) for i in used]
            + [self.xst[i] for i in used_x]
            + [tuple(s[d] for d in kept) for s in [pfull[i] for i in used_p] + post_out],
        )
        nu, nx = len(used), len(used_x)
        self.kin = dict(zip(used, kstr[1 : 1 + nu], strict=False))
        self.kx = dict(zip(used_x, kstr[1 + nu : 1 + nu + nx], strict=False))
        self.kpost = kstr[1 + nu + nx:]
        self.rshape, rstr = merge_dims(
            self.rshape_full,
            [tuple(s[d] for d in axes) for s in [full[i] for i in used]
             + [pfull[i] for i in used_p] + post_out],
        )
        self.rin = dict(zip(used, rstr, strict=False))
        self.rpost = rstr[nu:]

    def _layout(self) -> None:
        """Workgroup shape: are the kept (output) dims the fast-moving ones in memory?"""
        k, t, name = self.k, self.t, self.name
        main = self.used[0] if self.used else None
        kin, rin = self.kin, self.rin
        kept_contig = bool(main is not None and self.kshape and kin[main] and kin[main][-1] == 1
                           and not (self.rshape and rin[main][-1] == 1))
        max_threads = min(MAX_THREADS, t.lim("max_compute_invocations_per_workgroup"))
        if self.split > 1:
            if k.epilogue or k.extra:
                raise CodegenError(f"kernel {name!r}: a split (partial) reduction has no "
                                   "epilogue")
            self.split = min(self.split, max(self.red_total, 1))
        self.chunk = -(-self.red_total // self.split)
        self.tx, self.ty = choose_layout(self.rshape, kept_contig, self.chunk, self.out_total,
                                         max_threads)
        self.wg = self.tx * self.ty
        check_invocations(name, self.wg, t)
        self.shared_bytes = self.wg * 4 if self.ty > 1 else 0
        check_workgroup_storage(name, self.shared_bytes, t)
        self.owgs = -(-max(self.out_total, 1) // self.tx)
        self.grid = make_grid(name, self.owgs * self.split, t)

    # -- WGSL ----------------------------------------------------------------------------------
    def _head(self, body: list[str], ind: str) -> tuple[str, str]:
        """Which outputs and which share of the reduced range this invocation owns, the
        accumulator and the inputs' bases; returns the (start, end) of its range."""
        tx, ty, split, k = self.tx, self.ty, self.split, self.k
        body.append(f"{ind}let wg = {self.grid.wg_expr};")
        if split > 1:
            body.append(f"{ind}let cb = wg / {u(self.owgs)};")
            body.append(f"{ind}let wo = wg % {u(self.owgs)};")
        else:
            body.append(f"{ind}let wo = wg;")
        if tx > 1:
            body += [f"{ind}let x = lid % {u(tx)};", f"{ind}let y = lid / {u(tx)};",
                     f"{ind}let o = wo * {u(tx)} + x;"]
        else:
            body += [f"{ind}let x = 0u;", f"{ind}let y = lid;", f"{ind}let o = wo;"]
        live = f"o < {u(self.out_total)}" + (f" && cb < {u(split)}" if split > 1 else "")
        body.append(f"{ind}let valid = {live};")
        body.append(f"{ind}var acc: {self.acc_t.wgsl} = {identity(k.kind, self.acc_t)};")
        body.append(f"{ind}if (valid) {{")
        i2 = ind * 2
        kc = coords_code("o", self.kshape, "k", body, i2)
        for i in self.used:
            body.append(f"{i2}let base{i} = {index_code(kc, self.kin[i], k.inputs[i].offset)};")
        if split > 1:
            body.append(f"{i2}let r0 = cb * {u(self.chunk)};")
            body.append(f"{i2}let r1 = min(r0 + {u(self.chunk)}, {u(self.red_total)});")
            return ("r0 + y" if ty > 1 else "r0"), "r1"
        return ("y" if ty > 1 else "0u"), u(self.red_total)

    def _fold(self, body: list[str], r: str, tag: str, target: str) -> None:
        """The loads + prologue of reduced element ``r`` folded into ``target``."""
        k, i3, acc_t = self.k, "            ", self.acc_t
        rc = coords_code(r, self.rshape, f"rr{tag}", body, i3)
        names = {}
        for i in self.used:
            idx = _rel(f"base{i}", rc, self.rin[i])
            body.append(f"{i3}let v{i}{tag} = {load(self.bd.name(i), idx, k.inputs[i].dtype)};")
            names[i] = (f"v{i}{tag}", k.inputs[i].dtype)

        def parg(a):
            kind, i = a
            if kind != "in":
                raise CodegenError(f"kernel {self.name!r}: prologue operand {a!r} "
                                   "(use ('in', i))")
            return names[i]

        if k.prologue:
            val, vdt = emit_instrs(k.prologue, parg, f"p{tag}_", body, i3, self.helpers)[-1]
        else:
            val, vdt = names[0]
        if vdt is bool_:
            v = f"select(0u, 1u, {val})"
        else:
            v = convert(val, vdt, acc_t) if vdt is not acc_t else val
        body.append(f"{i3}{target} = {combine(k.kind, target, v)};")

    def _accumulate(self, body: list[str], start: str, end: str) -> None:
        """The serial loop: ``UNROLL`` independent accumulators while whole groups remain,
        then one at a time; the partial accumulators are combined in a fixed tree."""
        i2, i3, ty, kind = "        ", "            ", self.ty, self.k.kind
        per_thread = -(-self.chunk // ty)
        unroll = UNROLL if per_thread >= 2 * UNROLL else 1
        body.append(f"{i2}var r: u32 = {start};")
        if unroll > 1:
            for j in range(1, unroll):
                body.append(f"{i2}var acc{j}: {self.acc_t.wgsl} = {identity(kind, self.acc_t)};")
            last = f"r + {u((unroll - 1) * ty)}" if ty > 1 else f"r + {u(unroll - 1)}"
            body.append(f"{i2}for (; {last} < {end}; r = r + {u(unroll * ty)}) {{")
            for j in range(unroll):
                rj = "r" if j == 0 else f"(r + {u(j * ty)})"
                body.append(f"{i3}let ru{j} = {rj};")
                self._fold(body, f"ru{j}", f"u{j}", "acc" if j == 0 else f"acc{j}")
            body.append(f"{i2}}}")
        body.append(f"{i2}for (; r < {end}; r = r + {u(ty)}) {{")
        self._fold(body, "r", "", "acc")
        body.append(f"{i2}}}")
        if unroll > 1:
            parts = ["acc"] + [f"acc{j}" for j in range(1, unroll)]
            while len(parts) > 1:  # fixed pairwise tree: deterministic
                parts = [combine(kind, parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
            body.append(f"{i2}acc = {parts[0]};")
        body.append("    }")

    def _lanes(self, body: list[str], ind: str) -> list[str]:
        """Combine the ``TY`` lanes of each output in workgroup memory (a fixed tree); returns
        the first line of the store block (the total)."""
        tx, ty, kind, i2 = self.tx, self.ty, self.k.kind, ind * 2
        if ty == 1:
            body.append(f"{ind}if (valid) {{")
            return [f"{i2}let total = acc;"]
        body.append(f"{ind}red[lid] = acc;")
        body.append(f"{ind}workgroupBarrier();")
        s = ty // 2
        while s >= 1:
            body.append(f"{ind}if (y < {u(s)}) {{")
            body.append(f"{i2}red[lid] = {combine(kind, 'red[lid]', f'red[lid + {u(s * tx)}]')};")
            body.append(f"{ind}}}")
            body.append(f"{ind}workgroupBarrier();")
            s //= 2
        # every lane of an output reads the total when a post pass follows (after the last
        # barrier nothing writes ``red``); otherwise only lane 0, which stores it
        body.append(f"{ind}if ({'valid' if self.n_po else 'y == 0u && valid'}) {{")
        return [f"{i2}let total = red[x];"]

    def _epilogue(self, L: list[str], i2: str) -> tuple[str, DType]:
        """The value stored: the epilogue over ``("acc", 0)`` (the reduced value in the
        prologue's dtype) and the extra inputs at this output."""
        k, val_dtype = self.k, self.val_dtype
        if val_dtype is bool_:
            L.append(f"{i2}let accv: bool = total != 0u;")
        else:
            L.append(f"{i2}let accv: {val_dtype.wgsl} = {convert('total', self.acc_t, val_dtype)};")
        xnames = {}
        if self.used_x:
            kc2 = coords_code("o", self.kshape, "ko", L, i2)
            for i in self.used_x:
                idx = index_code(kc2, self.kx[i], k.extra[i].offset)
                e = load(self.bd.name(self.n_in + i), idx, k.extra[i].dtype)
                L.append(f"{i2}let e{i} = {e};")
                xnames[i] = (f"e{i}", k.extra[i].dtype)

        def earg(a):
            kind, i = a
            if kind == "acc":
                return "accv", val_dtype
            if kind == "x":
                return xnames[i]
            raise CodegenError(f"kernel {self.name!r}: epilogue operand {a!r}")

        if k.epilogue:
            return emit_instrs(k.epilogue, earg, "q", L, i2, self.helpers)[-1]
        if val_dtype is not bool_ or self.split > 1:
            return "total", self.acc_t  # no epilogue: store from the accumulator, unrounded
        return "accv", val_dtype

    def _store(self, L: list[str], i2: str) -> None:
        out_v, out_vdt = self._epilogue(L, i2)
        oidx = f"cb * {u(self.out_total)} + o" if self.split > 1 else "o"
        store = (f"{self.bd.name(self.out_b)}[{oidx}] = "
                 f"{store_value(out_v, out_vdt, self.out_dtype)};")
        if self.n_po and self.ty > 1:
            L.append(f"{i2}if (y == 0u) {{ {store} }}")
        else:
            L.append(f"{i2}{store}")
        if self.n_po:
            self._post_pass(L, i2, (out_v, out_vdt), "y" if self.ty > 1 else "0u")

    def _post_pass(self, L: list[str], ind: str, result, start: str) -> None:
        """Each invocation of an output walks its share of the reduced elements again,
        computing the post instrs (inputs at the full shape, ``("ri", i)`` the reduction's own
        input ``i``, ``("r", 0)`` the result) and storing them."""
        k, bd, i2 = self.k, self.bd, ind + "    "
        kc = coords_code("o", self.kshape, "kq", L, ind)
        used_p = self.used_p
        used_ri = sorted({i for ins in k.post for kind, i in ins.args if kind == "ri"})
        for i in used_ri:
            if i not in self.kin:
                raise CodegenError(f"kernel {k.name!r}: post pass reads reduction input {i}, "
                                   "which the prologue does not read")
            L.append(f"{ind}let qbase{i} = {index_code(kc, self.kin[i], k.inputs[i].offset)};")
        for i, st in zip(used_p, self.kpost, strict=False):
            L.append(f"{ind}let pbase{i} = {index_code(kc, st, k.post_inputs[i].offset)};")
        L.append(f"{ind}let obase = {index_code(kc, self.kpost[len(used_p)], 0)};")
        L.append(f"{ind}for (var rp: u32 = {start}; rp < {u(self.red_total)}; "
                 f"rp = rp + {u(self.ty)}) {{")
        rc = coords_code("rp", self.rshape, "rq", L, i2)
        names = {}
        for i, st in zip(used_p, self.rpost, strict=False):
            binding = bd.name(self.n_in + self.n_x + i)
            L.append(f"{i2}let w{i} = "
                     f"{load(binding, _rel(f'pbase{i}', rc, st), k.post_inputs[i].dtype)};")
            names[("in", i)] = (f"w{i}", k.post_inputs[i].dtype)
        for i in used_ri:
            idx = _rel(f"qbase{i}", rc, self.rin[i])
            L.append(f"{i2}let z{i} = {load(bd.name(i), idx, k.inputs[i].dtype)};")
            names[("ri", i)] = (f"z{i}", k.inputs[i].dtype)

        def arg(a):
            if a[0] == "r":
                return result
            if a in names:
                return names[a]
            raise CodegenError(f"kernel {k.name!r}: post operand {a!r}")

        res = emit_instrs(k.post, arg, "s", L, i2, self.helpers)
        oidx = _rel("obase", rc, self.rpost[len(used_p)])
        for j, ins in enumerate(k.post_outputs):
            v, vdt = res[ins]
            L.append(f"{i2}{bd.name(self.out_b + 1 + j)}[{oidx}] = "
                     f"{store_value(v, vdt, k.post[ins].dtype)};")
        L.append(f"{ind}}}")

    def spec(self) -> KernelSpec:
        ind = "    "
        self.helpers: set[str] = set()
        if self.acc_t.is_float and self.k.kind != "sum":
            self.helpers.add("mn_inf")  # the identity of max/min
        body: list[str] = []
        start, end = self._head(body, ind)
        self._accumulate(body, start, end)
        store_lines = self._lanes(body, ind)
        self._store(store_lines, ind * 2)
        body += store_lines + [f"{ind}}}"]
        lines = module_header(self.uses_f16) + self.bd.decls()
        if self.ty > 1:
            lines.append(f"var<workgroup> red: array<{self.acc_t.wgsl}, {self.wg}>;")
        meta = {"archetype": "reduce", "layout": (self.tx, self.ty), "workgroup_size": self.wg,
                "workgroup_storage": self.shared_bytes, "binding_dtypes": tuple(self.bd.dtypes),
                "reduced": self.red_total, "outputs": self.out_total, "split": self.split}
        return KernelSpec(name=self.name, wgsl=module_source(lines, self.helpers, self.wg, body),
                          n_bindings=self.bd.n, workgroups=self.grid.workgroups, meta=meta)


@kernel_family("reduce", ReduceKernel)
def emit(k: ReduceKernel, limits=None, features=None, alias=None) -> KernelSpec:
    return _Reduce(k, make_target(limits, features), alias).spec()


def split_plan(k: ReduceKernel, limits=None, features=None, target_workgroups: int = 256,
               min_chunk: int = 1024):
    """Two kernels for a reduction with few outputs and a huge reduced extent (a full sum, a
    bias gradient over N·H·W rows), which one dispatch could only spread over a handful of
    workgroups: ``partial`` (the prologue, each of ``split`` contiguous chunks of the reduced
    range reduced separately, written as ``(split, *out_shape)`` partials in the accumulator
    type) and ``final`` (reduces those partials and applies the epilogue).  Returns
    ``(partial, final, temp)`` with ``temp = (shape, dtype)`` of the partials buffer the
    planner must allocate — bindings: partial = inputs…, temp; final = temp, extra…, out — or
    None when one dispatch is enough.  Results stay deterministic (fixed chunking and order)."""
    from dataclasses import replace

    t = make_target(limits, features)
    shape = tuple(int(n) for n in k.shape)
    nd = len(shape)
    axes = {a % nd for a in k.axes} if nd else set()
    out_shape = tuple(n for d, n in enumerate(shape) if d not in axes)
    red_total = prod(n for d, n in enumerate(shape) if d in axes)
    val_dtype = k.prologue[-1].dtype if k.prologue else k.inputs[0].dtype
    acc_t = acc_dtype(val_dtype)
    if acc_t is not val_dtype or getattr(k, "split", 1) > 1:
        return None  # the epilogue would see another dtype (f16/bool): keep one kernel
    spec = emit(k, t.limits, t.features)
    wgs = spec.workgroups[0] * spec.workgroups[1] * spec.workgroups[2]
    if wgs >= target_workgroups // 2 or red_total < 2 * min_chunk:
        return None
    split = min(red_total // min_chunk, -(-target_workgroups // wgs))
    if split < 2:
        return None
    partial = replace(k, epilogue=(), extra=(), out_dtype=None, split=split,
                      name=f"{k.name}_partial")
    tshape = (split,) + out_shape
    final = ReduceKernel(
        tshape, (0,), k.kind, (Strided.contiguous(acc_t, tshape),), (),
        k.epilogue, k.extra, k.out_dtype, name=f"{k.name}_final",
    )
    return partial, final, (tshape, acc_t)
