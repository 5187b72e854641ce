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

One generator (``_Reduce``) serves both reduction families: a ``MultiReduceKernel``
(``kernels/multi_reduce.py``: sibling reductions sharing their loads) and a ``ReduceKernel``,
which is its one-member case with another binding order — so a change to the loop, the lane
tree or the post pass reaches both, and a member stores bit for bit what its own kernel would.
"""

from __future__ import annotations

from dataclasses import replace

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
from .ir import (
    KernelSpec,
    MultiReduceKernel,
    ReduceKernel,
    ReduceMember,
    Strided,
    contiguous_strides,
)

SERIAL_MAX = 16  # reduced extents up to this are folded by one invocation per output
# ... and, with contiguous outputs, up to these extents once there are this many outputs:
# (min outputs, max reduced extent).  H200, Dawn, a sum over the leading axis of (R, N)
# (bench/reduce_layout_bench.py, docs/data/h200-reduce-layout-2026-12-01.json): at N = 576,000
# R = 47 serial 97.5 µs vs lanes 209.6; at N = 65,536 serial wins to R = 47, lanes from 64; at
# N = 4,096 lanes win from R = 24 (too few invocations to hide latency serially).
SERIAL_WIDE = ((65536, 48), (262144, 128))
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
    wide = kept_contig and any(out_total >= n and red_total <= r for n, r in SERIAL_WIDE)
    if red_total <= SERIAL_MAX or wide:
        return min(max_threads, 64 if out_total >= 64 else pow2ceil(out_total)), 1
    if kept_contig and out_total > 1:
        tx = min(32, max_threads, pow2ceil(out_total))
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
    """One reduction dispatch being generated, for both families: a ``MultiReduceKernel`` as
    is, a ``ReduceKernel`` as its one-member view (``emit``).  One accumulator per member;
    each reduced element's coordinates are computed and every input loaded once.  The
    analysis (axes, dtypes, strides merged over the kept and the reduced dims, workgroup
    layout) is kept as attributes, the WGSL is written in steps.

    ``n_front``: how many inputs are bound before the extras (the rest follow them): the
    binding order of a ``ReduceKernel`` (inputs, extra, post inputs, out, post outputs) as
    data; a ``MultiReduceKernel`` binds all its inputs first."""

    def __init__(self, k: MultiReduceKernel, t, alias, n_front: int | None = None,
                 archetype: str = "multi_reduce"):
        self.k, self.t, self.name, self.archetype = k, t, k.name, archetype
        self.n_front = len(k.inputs) if n_front is None else n_front
        self._axes()
        self._members()
        self._operands(alias)
        self._merge()
        self._layout()

    def _who(self, j: int) -> str:
        """The subject of an error about member ``j`` (a ``ReduceKernel`` has no members)."""
        solo = self.archetype == "reduce"
        return f"kernel {self.name!r}" + ("" if solo else f" member {j}")

    def _label(self, i: int) -> str:
        """Input ``i`` as its description names it (a ``ReduceKernel``'s post inputs are
        appended to its inputs in the view)."""
        return f"input {i}" if i < self.n_front else f"post input {i - self.n_front}"

    def _reads(self, m) -> list[int]:
        """The inputs member ``m``'s prologue reads; without a prologue it reduces input 0."""
        if not m.prologue:
            return [0]
        return _used(m.prologue, "in", len(self.k.inputs), "prologue reads input", self.name)

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
        k = self.k
        if not k.members:
            raise CodegenError(f"kernel {self.name!r} has no members")
        self.val_t, self.acc_t, self.out_t = [], [], []
        self.post_dts = [[m.post[i].dtype for i in m.post_outputs] for m in k.members]
        self.has_post = any(self.post_dts)
        for j, m in enumerate(k.members):
            who = self._who(j)
            if m.kind not in ("sum", "max", "min"):
                raise CodegenError(f"{who}: unknown reduction {m.kind!r}")
            if not m.prologue and not k.inputs:
                raise CodegenError(f"{who} has neither inputs nor a prologue")
            if self.red_total == 0 and m.kind != "sum":
                raise CodegenError(f"{who}: {m.kind} over an empty axis")
            if self.split > 1 and (m.epilogue or k.extra):
                raise CodegenError(f"{who}: a split (partial) reduction has no epilogue")
            if (m.post_outputs or m.post) and (self.split > 1 or not m.post
                                               or not m.post_outputs):
                raise CodegenError(f"{who}: a post pass needs instrs, outputs and no split")
            val = m.prologue[-1].dtype if m.prologue else k.inputs[0].dtype
            acc = acc_dtype(val)
            out = acc if self.split > 1 else (
                m.out_dtype or (m.epilogue[-1].dtype if m.epilogue else val))
            self.val_t.append(val)
            self.acc_t.append(acc)
            self.out_t.append(out)

    def _operands(self, alias) -> None:
        k, name, t, shape = self.k, self.name, self.t, self.shape
        self.n_in, self.n_x, nf = len(k.inputs), len(k.extra), self.n_front
        ins = [s.dtype for s in k.inputs]
        bind_dtypes = ins[:nf] + [s.dtype for s in k.extra] + ins[nf:]
        self.in_b = [i if i < nf else i + self.n_x for i in range(self.n_in)]  # input bindings
        self.out_b = []  # binding of each member's output (its post outputs follow it)
        for j, dt in enumerate(self.out_t):
            self.out_b.append(len(bind_dtypes))
            bind_dtypes += [dt] + self.post_dts[j]
        instrs = [i for m in k.members for i in m.prologue + m.epilogue + m.post]
        self.uses_f16 = check_dtypes(name, bind_dtypes + [i.dtype for i in instrs], t)
        self.bd = Bindings(bind_dtypes, alias)
        check_bindings(name, self.bd.n, t)
        self.used = sorted({i for m in k.members for i in self._reads(m)})
        self.used_x = sorted({i for m in k.members
                              for i in _used(m.epilogue, "x", self.n_x,
                                             "epilogue reads extra input", name)})
        self.used_p = sorted({i for m in k.members
                              for i in _used(m.post, "in", self.n_in, "post pass reads input",
                                             name)})
        self.used_all = sorted(set(self.used) | set(self.used_p))
        self.full = {i: bcast_strides(k.inputs[i], shape, f"{name} {self._label(i)}")
                     for i in self.used_all}
        for i in self.used_all:
            check_extent(name, self._label(i), k.inputs[i], shape, self.full[i], t)
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

    def _kept_contig(self) -> bool:
        """Are the kept (output) dims the fast-moving ones in memory, for the first input the
        first member reads (a column reduction)?"""
        first = self._reads(self.k.members[0])
        main = first[0] if first else None
        kin, rin = self.kin, self.rin
        return bool(main is not None and self.kshape and kin[main] and kin[main][-1] == 1
                    and not (self.rshape and rin[main][-1] == 1))

    def _layout(self) -> None:
        """Workgroup shape, from the memory order of the first input (``_kept_contig``)."""
        t, name = self.t, self.name
        kept_contig = self._kept_contig()
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
        prologue (none: input 0) folded into that member's accumulator ``acc{j}{slot}``."""
        k, i3 = self.k, "            "
        rc = coords_code(r, self.rshape, f"rr{tag}", body, i3)
        names = {}
        for i in self.used:
            idx = _rel(f"base{i}", rc, self.rin[i])
            load_v = load(self.bd.name(self.in_b[i]), idx, k.inputs[i].dtype)
            body.append(f"{i3}let v{i}{tag} = {load_v};")
            names[i] = (f"v{i}{tag}", k.inputs[i].dtype)

        def parg(a):
            if a[0] != "in":
                raise CodegenError(f"kernel {self.name!r}: prologue operand {a!r} "
                                   "(use ('in', i))")
            return names[a[1]]

        for j, m in enumerate(k.members):
            if m.prologue:
                val, vdt = emit_instrs(m.prologue, parg, f"m{j}p{tag}_", body, i3,
                                       self.helpers)[-1]
            else:
                val, vdt = names[0]
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

    def _extras(self, L: list[str], i2: str) -> dict:
        """The extra inputs at this output, loaded once (where the first epilogue needs them)."""
        if self.xnames is None:
            k, self.xnames = self.k, {}
            kc2 = coords_code("o", self.kshape, "ko", L, i2)
            for i in self.used_x:
                e = load(self.bd.name(self.n_front + i),
                         index_code(kc2, self.kx[i], k.extra[i].offset), k.extra[i].dtype)
                L.append(f"{i2}let e{i} = {e};")
                self.xnames[i] = (f"e{i}", k.extra[i].dtype)
        return self.xnames

    def _store(self, L: list[str], i2: str) -> None:
        """Each member's epilogue (over its total and the extras at this output) and store."""
        oidx = f"cb * {u(self.out_total)} + o" if self.split > 1 else "o"
        results, self.xnames = [], None
        for j, m in enumerate(self.k.members):
            v, vdt = self._result(L, i2, j, m)
            results.append((v, vdt))
            store = f"{self.bd.name(self.out_b[j])}[{oidx}] = {store_value(v, vdt, self.out_t[j])};"
            L.append(f"{i2}if (y == 0u) {{ {store} }}" if self.has_post and self.ty > 1
                     else f"{i2}{store}")
        if self.has_post:
            self._post_pass(L, i2, results)

    def _result(self, L: list[str], i2: str, j: int, m) -> tuple[str, DType]:
        """The value member ``j`` stores: its epilogue over ``("acc", 0)`` (the total in the
        prologue's dtype) and the extras; without one the accumulator, unrounded."""
        val_t, acc_t = self.val_t[j], self.acc_t[j]
        if val_t is bool_:
            L.append(f"{i2}let accv{j}: bool = total{j} != 0u;")
        else:
            L.append(f"{i2}let accv{j}: {val_t.wgsl} = {convert(f'total{j}', acc_t, val_t)};")
        xnames = self._extras(L, i2) if self.used_x and any(
            kd == "x" for ins in m.epilogue for kd, _ in ins.args) else {}

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

    def _post_pass(self, L: list[str], ind: str, results) -> None:
        """Each invocation of an output walks its share of the reduced elements again: every
        post input loaded once, then each member's post instrs (``("r", 0)`` its stored
        result) and stores."""
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
        # the inputs the reduction loop did not read first (any order is equivalent; this one
        # is the order the single-reduction emitter always used)
        for i in sorted(self.used_p, key=lambda i: (i in self.used, i)):
            idx = _rel(f"qbase{i}", rc, self.rin[i])
            L.append(f"{i2}let z{i} = {load(bd.name(self.in_b[i]), idx, k.inputs[i].dtype)};")
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
                raise CodegenError(f"{self._who(j)}: post operand {a!r}")

            res = emit_instrs(m.post, arg, f"s{j}_", L, i2, self.helpers)
            for q, ins in enumerate(m.post_outputs):
                v, vdt = res[ins]
                L.append(f"{i2}{bd.name(self.out_b[j] + 1 + q)}[{oidx}] = "
                         f"{store_value(v, vdt, m.post[ins].dtype)};")
        L.append(f"{ind}}}")

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
        meta = {"archetype": self.archetype, "layout": (self.tx, self.ty),
                "workgroup_size": self.wg, "workgroup_storage": self.shared_bytes,
                "binding_dtypes": tuple(self.bd.dtypes), "reduced": self.red_total,
                "outputs": self.out_total, "split": self.split,
                "members": len(self.k.members),
                "post_members": sum(bool(m.post) for m in self.k.members)}
        return KernelSpec(name=self.name, wgsl=module_source(lines, self.helpers, self.wg, body),
                          n_bindings=self.bd.n, workgroups=self.grid.workgroups, meta=meta)


def _as_member(k: ReduceKernel) -> MultiReduceKernel:
    """``k`` as a one-member multi-reduction: its post inputs appended to its inputs (the
    post pass's ``("in", i)`` renumbered after them, ``("ri", i)`` read as ``("in", i)``)."""
    n_in = len(k.inputs)
    _used(k.post, "in", len(k.post_inputs), "post pass reads input", k.name)
    _used(k.post, "ri", n_in, "post pass reads reduction input", k.name)
    shift = {"in": n_in, "ri": 0}
    post = tuple(replace(ins, args=tuple(("in", i + shift[kd]) if kd in shift else (kd, i)
                                         for kd, i in ins.args)) for ins in k.post)
    member = ReduceMember(k.kind, k.prologue, k.epilogue, k.out_dtype, post, k.post_outputs)
    return MultiReduceKernel(k.shape, k.axes, k.inputs + k.post_inputs, (member,), k.extra,
                             k.split, k.name)


@kernel_family("reduce", ReduceKernel)
def emit(k: ReduceKernel, limits=None, features=None, alias=None) -> KernelSpec:
    """A ``ReduceKernel`` is generated as its one-member view, bound in its own order."""
    return _Reduce(_as_member(k), make_target(limits, features), alias,
                   n_front=len(k.inputs), archetype="reduce").spec()


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
