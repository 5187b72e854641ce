"""Sibling reductions in one dispatch (``MultiReduceKernel``): several reductions of one
iteration shape over the same axes, each with its own prologue, epilogue and output.

Why: a norm's statistics and gradients reduce the same tensors over the same axes several
times (batch norm's backward: ``sum(dy)``, ``sum(dy * x̂)``, …).  Each is a small,
latency-bound dispatch on a big GPU (ResNet-50's 8–12 µs ``reduce_sum`` kernels move under a
megabyte); one dispatch for all of them pays the launch and the index arithmetic once and
loads each shared input once.

The layout, loop and lane tree are those of ``kernels/reduce.py`` (one accumulator per member
instead of one): ``TX`` outputs per workgroup, ``TY`` invocations per output, each folding a
strided share of the reduced range with ``UNROLL`` independent accumulators, then a fixed
tree in workgroup memory.  The order of the arithmetic of each member is the one its own
``ReduceKernel`` would use with the same layout: results are deterministic (no atomics).
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
    prod,
    store_value,
    u,
)
from .ir import KernelSpec, MultiReduceKernel, contiguous_strides
from .reduce import MAX_THREADS, UNROLL, _extra_strides, _rel, _used, choose_layout


class _Multi:
    """One multi-reduction being generated: the shared analysis (axes, merged strides,
    layout) as attributes, the WGSL in steps."""

    def __init__(self, k: MultiReduceKernel, t, alias):
        self.k, self.t, self.name = k, t, k.name
        self._axes()
        self._members()
        self._operands(alias)
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
        self.kept = [d for d in range(nd) if d not in axes]
        self.out_shape = tuple(shape[d] for d in self.kept)
        self.out_total = prod(self.out_shape)
        self.red_total = prod(shape[d] for d in axes)
        self.split = max(1, int(k.split or 1))

    def _members(self) -> None:
        """Per member: the reduced value's dtype, its accumulator and stored dtypes."""
        k, name = self.k, self.name
        if not k.members:
            raise CodegenError(f"kernel {name!r} has no members")
        self.val_t, self.acc_t, self.out_t = [], [], []
        self.post_dts = [[m.post[i].dtype for i in m.post_outputs] for m in k.members]
        self.has_post = any(self.post_dts)
        for j, m in enumerate(k.members):
            if m.kind not in ("sum", "max", "min"):
                raise CodegenError(f"kernel {name!r} member {j}: unknown reduction {m.kind!r}")
            if not m.prologue:
                raise CodegenError(f"kernel {name!r} member {j} has no prologue")
            if self.red_total == 0 and m.kind != "sum":
                raise CodegenError(f"kernel {name!r} member {j}: {m.kind} over an empty axis")
            if self.split > 1 and m.epilogue:
                raise CodegenError(f"kernel {name!r} member {j}: a split (partial) "
                                   "reduction has no epilogue")
            if (m.post_outputs or m.post) and (self.split > 1 or not m.post
                                               or not m.post_outputs):
                raise CodegenError(f"kernel {name!r} member {j}: a post pass needs instrs, "
                                   "outputs and no split")
            val = m.prologue[-1].dtype
            acc = acc_dtype(val)
            out = acc if self.split > 1 else (
                m.out_dtype or (m.epilogue[-1].dtype if m.epilogue else val))
            self.val_t.append(val)
            self.acc_t.append(acc)
            self.out_t.append(out)

    def _operands(self, alias) -> None:
        k, name, t, shape = self.k, self.name, self.t, self.shape
        self.n_in, self.n_x = len(k.inputs), len(k.extra)
        if self.split > 1 and k.extra:
            raise CodegenError(f"kernel {name!r}: a split (partial) reduction has no extras")
        bind_dtypes = [s.dtype for s in k.inputs] + [s.dtype for s in k.extra]
        self.out_b = []  # binding of each member's output (its post outputs follow it)
        for j, dt in enumerate(self.out_t):
            self.out_b.append(len(bind_dtypes))
            bind_dtypes += [dt] + self.post_dts[j]
        check_bindings(name, len(bind_dtypes), t)
        instrs = [i for m in k.members for i in m.prologue + m.epilogue + m.post]
        self.uses_f16 = check_dtypes(name, bind_dtypes + [i.dtype for i in instrs], t)
        self.bd = Bindings(bind_dtypes, alias)
        self.used = sorted({i for m in k.members
                            for i in _used(m.prologue, "in", self.n_in, "prologue reads input",
                                           name)})
        self.used_x = sorted({i for m in k.members
                              for i in _used(m.epilogue, "x", self.n_x,
                                             "epilogue reads extra input", name)})
        self.used_p = sorted({i for m in k.members
                              for i in _used(m.post, "in", self.n_in, "post pass reads input",
                                             name)})
        self.used_all = sorted(set(self.used) | set(self.used_p))
        self.full = {i: bcast_strides(k.inputs[i], shape, f"{name} input {i}")
                     for i in self.used_all}
        for i in self.used_all:
            check_extent(name, f"input {i}", k.inputs[i], shape, self.full[i], t)
        self.xst = {i: _extra_strides(k.extra[i], shape, self.axes, self.out_shape,
                                      f"{name} extra {i}") for i in self.used_x}
        for i in self.used_x:
            check_extent(name, f"extra input {i}", k.extra[i], self.out_shape, self.xst[i], t)
        for dt in self.out_t:
            check_binding_size(name, "output", self.out_total * self.split, dt, t)
        for dt in (d for dts in self.post_dts for d in dts):
            check_binding_size(name, "post output", prod(shape), dt, t)

    def _merge(self) -> None:
        """Kept dims merged over the inputs' kept part, the extras, the outputs and the post
        outputs (contiguous over ``shape``); reduced dims over the inputs and post outputs."""
        used, kept, axes, full = self.used_all, self.kept, self.axes, self.full
        post_out = [contiguous_strides(self.shape)] if self.has_post else []
        self.kshape, kstr = merge_dims(
            self.out_shape,
            [contiguous_strides(self.out_shape)]
            + [tuple(s[d] for d in kept) for s in [full[i] for i in used] + post_out]
            + [self.xst[i] for i in self.used_x])
        nu, npo = len(used), len(post_out)
        self.kin = dict(zip(used, kstr[1:1 + nu], strict=True))
        self.kpost = kstr[1 + nu] if npo else None
        self.kx = dict(zip(self.used_x, kstr[1 + nu + npo:], strict=True))
        self.rshape, rstr = merge_dims(tuple(self.shape[d] for d in axes),
                                       [tuple(s[d] for d in axes)
                                        for s in [full[i] for i in used] + post_out])
        self.rin = dict(zip(used, rstr[:nu], strict=True))
        self.rpost = rstr[nu] if npo else None

    def _layout(self) -> None:
        """Workgroup shape from the first member's first input (as ``reduce`` chooses it)."""
        t, name = self.t, self.name
        first = _used(self.k.members[0].prologue, "in", self.n_in, "prologue reads input", name)
        main = first[0] if first else None
        kin, rin = self.kin, self.rin
        kept_contig = bool(main is not None and self.kshape and kin[main] and kin[main][-1] == 1
                           and not (self.rshape and rin[main][-1] == 1))
        max_threads = min(MAX_THREADS, t.lim("max_compute_invocations_per_workgroup"))
        self.split = min(self.split, max(self.red_total, 1))
        self.chunk = -(-self.red_total // self.split)
        self.tx, self.ty = choose_layout(self.rshape, kept_contig, self.chunk, self.out_total,
                                         max_threads)
        self.wg = self.tx * self.ty
        check_invocations(name, self.wg, t)
        self.shared_bytes = self.wg * 4 * len(self.k.members) if self.ty > 1 else 0
        check_workgroup_storage(name, self.shared_bytes, t)
        self.owgs = -(-max(self.out_total, 1) // self.tx)
        self.grid = make_grid(name, self.owgs * self.split, t)

    # -- WGSL ----------------------------------------------------------------------------------
    def _head(self, body: list[str], ind: str) -> tuple[str, str]:
        """Outputs and share of the reduced range of this invocation, one accumulator per
        member, the inputs' bases; returns the (start, end) of its range."""
        tx, ty, split = self.tx, self.ty, self.split
        body.append(f"{ind}let wg = {self.grid.wg_expr};")
        if split > 1:
            body += [f"{ind}let cb = wg / {u(self.owgs)};", f"{ind}let wo = wg % {u(self.owgs)};"]
        else:
            body.append(f"{ind}let wo = wg;")
        if tx > 1:
            body += [f"{ind}let x = lid % {u(tx)};", f"{ind}let y = lid / {u(tx)};",
                     f"{ind}let o = wo * {u(tx)} + x;"]
        else:
            body += [f"{ind}let x = 0u;", f"{ind}let y = lid;", f"{ind}let o = wo;"]
        live = f"o < {u(self.out_total)}" + (f" && cb < {u(split)}" if split > 1 else "")
        body.append(f"{ind}let valid = {live};")
        for j, m in enumerate(self.k.members):
            a = self.acc_t[j]
            body.append(f"{ind}var acc{j}: {a.wgsl} = {identity(m.kind, a)};")
        body.append(f"{ind}if (valid) {{")
        i2 = ind * 2
        kc = coords_code("o", self.kshape, "k", body, i2)
        for i in self.used:
            base = index_code(kc, self.kin[i], self.k.inputs[i].offset)
            body.append(f"{i2}let base{i} = {base};")
        if split > 1:
            body.append(f"{i2}let r0 = cb * {u(self.chunk)};")
            body.append(f"{i2}let r1 = min(r0 + {u(self.chunk)}, {u(self.red_total)});")
            return ("r0 + y" if ty > 1 else "r0"), "r1"
        return ("y" if ty > 1 else "0u"), u(self.red_total)

    def _fold(self, body: list[str], r: str, tag: str, slot: str) -> None:
        """Reduced element ``r``: its coordinates and each input once, then every member's
        prologue folded into that member's accumulator ``acc{j}{slot}``."""
        k, i3 = self.k, "            "
        rc = coords_code(r, self.rshape, f"rr{tag}", body, i3)
        names = {}
        for i in self.used:
            idx = _rel(f"base{i}", rc, self.rin[i])
            body.append(f"{i3}let v{i}{tag} = {load(self.bd.name(i), idx, k.inputs[i].dtype)};")
            names[i] = (f"v{i}{tag}", k.inputs[i].dtype)

        def parg(a):
            if a[0] != "in":
                raise CodegenError(f"kernel {self.name!r}: prologue operand {a!r} "
                                   "(use ('in', i))")
            return names[a[1]]

        for j, m in enumerate(k.members):
            val, vdt = emit_instrs(m.prologue, parg, f"m{j}p{tag}_", body, i3, self.helpers)[-1]
            acc_t = self.acc_t[j]
            if vdt is bool_:
                v = f"select(0u, 1u, {val})"
            else:
                v = convert(val, vdt, acc_t) if vdt is not acc_t else val
            target = f"acc{j}{slot}"
            body.append(f"{i3}{target} = {combine(m.kind, target, v)};")

    def _accumulate(self, body: list[str], start: str, end: str) -> None:
        """The serial loop (``UNROLL`` independent accumulators per member while whole groups
        remain, then one at a time) and each member's fixed pairwise tree over them."""
        i2, ty, members = "        ", self.ty, self.k.members
        per_thread = -(-self.chunk // ty)
        unroll = UNROLL if per_thread >= 2 * UNROLL else 1
        body.append(f"{i2}var r: u32 = {start};")
        if unroll > 1:
            for j, m in enumerate(members):
                a = self.acc_t[j]
                for s in range(1, unroll):
                    body.append(f"{i2}var acc{j}_{s}: {a.wgsl} = {identity(m.kind, a)};")
            last = f"r + {u((unroll - 1) * ty)}" if ty > 1 else f"r + {u(unroll - 1)}"
            body.append(f"{i2}for (; {last} < {end}; r = r + {u(unroll * ty)}) {{")
            for s in range(unroll):
                rs = "r" if s == 0 else f"(r + {u(s * ty)})"
                body.append(f"            let ru{s} = {rs};")
                self._fold(body, f"ru{s}", f"u{s}", "" if s == 0 else f"_{s}")
            body.append(f"{i2}}}")
        body.append(f"{i2}for (; r < {end}; r = r + {u(ty)}) {{")
        self._fold(body, "r", "", "")
        body.append(f"{i2}}}")
        if unroll > 1:
            for j, m in enumerate(members):
                parts = [f"acc{j}"] + [f"acc{j}_{s}" for s in range(1, unroll)]
                while len(parts) > 1:  # fixed pairwise tree: deterministic
                    parts = [combine(m.kind, parts[i], parts[i + 1])
                             for i in range(0, len(parts), 2)]
                body.append(f"{i2}acc{j} = {parts[0]};")
        body.append("    }")

    def _lanes(self, body: list[str], ind: str) -> list[str]:
        """Each member's ``TY`` lanes combined in its own workgroup array, all members in the
        same tree steps (one barrier per step); returns the store block's first lines."""
        tx, ty, i2, members = self.tx, self.ty, ind * 2, self.k.members
        if ty == 1:
            body.append(f"{ind}if (valid) {{")
            return [f"{i2}let total{j} = acc{j};" for j in range(len(members))]
        for j in range(len(members)):
            body.append(f"{ind}red{j}[lid] = acc{j};")
        body.append(f"{ind}workgroupBarrier();")
        s = ty // 2
        while s >= 1:
            body.append(f"{ind}if (y < {u(s)}) {{")
            for j, m in enumerate(members):
                body.append(f"{i2}red{j}[lid] = "
                            f"{combine(m.kind, f'red{j}[lid]', f'red{j}[lid + {u(s * tx)}]')};")
            body.append(f"{ind}}}")
            body.append(f"{ind}workgroupBarrier();")
            s //= 2
        # every lane of an output reads the totals when a post pass follows (after the last
        # barrier nothing writes ``red``); otherwise only lane 0, which stores them
        body.append(f"{ind}if ({'valid' if self.has_post else 'y == 0u && valid'}) {{")
        return [f"{i2}let total{j} = red{j}[x];" for j in range(len(members))]

    def _store(self, L: list[str], i2: str) -> None:
        """Each member's epilogue (over its total and the extras at this output) and store."""
        k = self.k
        xnames = {}
        if self.used_x:
            kc2 = coords_code("o", self.kshape, "ko", L, i2)
            for i in self.used_x:
                e = load(self.bd.name(self.n_in + i),
                         index_code(kc2, self.kx[i], k.extra[i].offset), k.extra[i].dtype)
                L.append(f"{i2}let e{i} = {e};")
                xnames[i] = (f"e{i}", k.extra[i].dtype)
        oidx = f"cb * {u(self.out_total)} + o" if self.split > 1 else "o"
        results = []
        for j, m in enumerate(k.members):
            v, vdt = self._result(L, i2, j, m, xnames)
            results.append((v, vdt))
            store = f"{self.bd.name(self.out_b[j])}[{oidx}] = {store_value(v, vdt, self.out_t[j])};"
            L.append(f"{i2}if (y == 0u) {{ {store} }}" if self.has_post and self.ty > 1
                     else f"{i2}{store}")
        if self.has_post:
            self._post_pass(L, i2, results)

    def _post_pass(self, L: list[str], ind: str, results) -> None:
        """Each invocation of an output walks its share of the reduced elements again: every
        post input loaded once, then each member's post instrs (``("r", 0)`` its stored
        result) and stores (``ReduceKernel``'s post pass, all members in one loop)."""
        k, bd, i2 = self.k, self.bd, ind + "    "
        kc = coords_code("o", self.kshape, "kq", L, ind)
        for i in self.used_p:
            L.append(f"{ind}let qbase{i} = {index_code(kc, self.kin[i], k.inputs[i].offset)};")
        L.append(f"{ind}let obase = {index_code(kc, self.kpost, 0)};")
        start = "y" if self.ty > 1 else "0u"
        L.append(f"{ind}for (var rp: u32 = {start}; rp < {u(self.red_total)}; "
                 f"rp = rp + {u(self.ty)}) {{")
        rc = coords_code("rp", self.rshape, "rq", L, i2)
        names = {}
        for i in self.used_p:
            idx = _rel(f"qbase{i}", rc, self.rin[i])
            L.append(f"{i2}let z{i} = {load(bd.name(i), idx, k.inputs[i].dtype)};")
            names[("in", i)] = (f"z{i}", k.inputs[i].dtype)
        oidx = _rel("obase", rc, self.rpost)
        for j, m in enumerate(k.members):
            if not m.post:
                continue

            def arg(a, j=j):
                if a == ("r", 0):
                    return results[j]
                if a in names:
                    return names[a]
                raise CodegenError(f"kernel {self.name!r} member {j}: post operand {a!r}")

            res = emit_instrs(m.post, arg, f"s{j}_", L, i2, self.helpers)
            for q, ins in enumerate(m.post_outputs):
                v, vdt = res[ins]
                L.append(f"{i2}{bd.name(self.out_b[j] + 1 + q)}[{oidx}] = "
                         f"{store_value(v, vdt, m.post[ins].dtype)};")
        L.append(f"{ind}}}")

    def _result(self, L: list[str], i2: str, j: int, m, xnames) -> tuple[str, DType]:
        """The value member ``j`` stores (``reduce``'s rules: unrounded accumulator without
        an epilogue)."""
        val_t, acc_t = self.val_t[j], self.acc_t[j]
        if val_t is bool_:
            L.append(f"{i2}let accv{j}: bool = total{j} != 0u;")
        else:
            L.append(f"{i2}let accv{j}: {val_t.wgsl} = {convert(f'total{j}', acc_t, val_t)};")

        def earg(a):
            if a[0] == "acc":
                return f"accv{j}", val_t
            if a[0] == "x":
                return xnames[a[1]]
            raise CodegenError(f"kernel {self.name!r}: epilogue operand {a!r}")

        if m.epilogue:
            return emit_instrs(m.epilogue, earg, f"q{j}_", L, i2, self.helpers)[-1]
        if val_t is not bool_ or self.split > 1:
            return f"total{j}", acc_t
        return f"accv{j}", val_t

    def spec(self) -> KernelSpec:
        ind = "    "
        self.helpers: set[str] = set()
        if any(a.is_float and m.kind != "sum" for a, m in zip(self.acc_t, self.k.members,
                                                               strict=True)):
            self.helpers.add("mn_inf")  # the identity of max/min
        body: list[str] = []
        start, end = self._head(body, ind)
        self._accumulate(body, start, end)
        store_lines = self._lanes(body, ind)
        self._store(store_lines, ind * 2)
        body += store_lines + [f"{ind}}}"]
        lines = module_header(self.uses_f16) + self.bd.decls()
        if self.ty > 1:
            lines += [f"var<workgroup> red{j}: array<{a.wgsl}, {self.wg}>;"
                      for j, a in enumerate(self.acc_t)]
        meta = {"archetype": "multi_reduce", "layout": (self.tx, self.ty),
                "workgroup_size": self.wg, "workgroup_storage": self.shared_bytes,
                "binding_dtypes": tuple(self.bd.dtypes), "reduced": self.red_total,
                "outputs": self.out_total, "split": self.split,
                "members": len(self.k.members),
                "post_members": sum(bool(m.post) for m in self.k.members)}
        return KernelSpec(name=self.name, wgsl=module_source(lines, self.helpers, self.wg, body),
                          n_bindings=self.bd.n, workgroups=self.grid.workgroups, meta=meta)


@kernel_family("multi_reduce", MultiReduceKernel)
def emit(k: MultiReduceKernel, limits=None, features=None, alias=None) -> KernelSpec:
    return _Multi(k, make_target(limits, features), alias).spec()
