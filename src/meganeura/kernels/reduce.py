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


def _post_pass(k: ReduceKernel, L: list[str], ind: str, kshape, kpost, rshape, rpost,
               used_p, result, start: str, step: int, red_total: int, out_b: int,
               helpers: set, kin, rin, bd) -> None:
    """Each invocation of an output walks its share of the reduced elements again, computing
    the post instrs (inputs at the full shape, ``("ri", i)`` the reduction's own input ``i``,
    ``("r", 0)`` the result) and storing them."""
    i2 = ind + "    "
    kc = coords_code("o", kshape, "kq", L, ind)
    pk = dict(zip(used_p, kpost, strict=False))
    ok_strides = kpost[len(used_p)]
    used_ri = sorted({i for ins in k.post for kind, i in ins.args if kind == "ri"})
    for i in used_ri:
        if i not in kin:
            raise CodegenError(f"kernel {k.name!r}: post pass reads reduction input {i}, "
                               "which the prologue does not read")
        L.append(f"{ind}let qbase{i} = {index_code(kc, kin[i], k.inputs[i].offset)};")
    for i in used_p:
        L.append(f"{ind}let pbase{i} = {index_code(kc, pk[i], k.post_inputs[i].offset)};")
    L.append(f"{ind}let obase = {index_code(kc, ok_strides, 0)};")
    L.append(f"{ind}for (var rp: u32 = {start}; rp < {u(red_total)}; rp = rp + {u(step)}) {{")
    rc = coords_code("rp", rshape, "rq", L, i2)
    pr = dict(zip(used_p, rpost, strict=False))
    names = {}
    for i in used_p:
        rel = index_code(rc, pr[i], 0)
        idx = f"pbase{i}" if rel == "0u" else f"pbase{i} + {rel}"
        binding = bd.name(len(k.inputs) + len(k.extra) + i)
        L.append(f"{i2}let w{i} = {load(binding, idx, k.post_inputs[i].dtype)};")
        names[i] = (f"w{i}", k.post_inputs[i].dtype)

    for i in used_ri:
        rel = index_code(rc, rin[i], 0)
        idx = f"qbase{i}" if rel == "0u" else f"qbase{i} + {rel}"
        L.append(f"{i2}let z{i} = {load(bd.name(i), idx, k.inputs[i].dtype)};")
        names[("ri", i)] = (f"z{i}", k.inputs[i].dtype)

    def arg(a):
        kind, i = a
        if kind == "in":
            return names[i]
        if kind == "ri":
            return names[("ri", i)]
        if kind == "r":
            return result
        raise CodegenError(f"kernel {k.name!r}: post operand {a!r}")

    res = emit_instrs(k.post, arg, "s", L, i2, helpers)
    rel = index_code(rc, rpost[len(used_p)], 0)
    oidx = "obase" if rel == "0u" else f"obase + {rel}"
    for j, ins in enumerate(k.post_outputs):
        v, vdt = res[ins]
        L.append(f"{i2}{bd.name(out_b + 1 + j)}[{oidx}] = "
                 f"{store_value(v, vdt, k.post[ins].dtype)};")
    L.append(f"{ind}}}")


def choose_layout(rshape, kept_contig: bool, red_total: int, out_total: int, max_threads: int):
    """(TX, TY): outputs per workgroup and invocations per output."""
    if red_total <= SERIAL_MAX:
        return min(max_threads, 64 if out_total >= 64 else pow2ceil(out_total)), 1
    if kept_contig and out_total > 1:
        tx = min(32, pow2ceil(out_total))
        ty = max(1, min(max_threads // tx, pow2ceil(red_total)))
        return tx, ty
    return 1, min(max_threads, pow2ceil(red_total))


@kernel_family("reduce", ReduceKernel)
def emit(k: ReduceKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    shape = tuple(int(n) for n in k.shape)
    nd = len(shape)
    if any(not -nd <= a < nd for a in k.axes):
        raise CodegenError(f"kernel {name!r}: axes {k.axes} out of range for shape {shape}")
    axes = tuple(sorted({a % nd for a in k.axes}))
    if len(axes) != len(k.axes):
        raise CodegenError(f"kernel {name!r}: repeated axes {k.axes}")
    if k.kind not in ("sum", "max", "min"):
        raise CodegenError(f"kernel {name!r}: unknown reduction {k.kind!r}")
    kept = [d for d in range(nd) if d not in axes]
    out_shape = tuple(shape[d] for d in kept)
    rshape_full = tuple(shape[d] for d in axes)
    out_total = prod(out_shape)
    red_total = prod(rshape_full)
    if red_total == 0 and k.kind != "sum":
        raise CodegenError(f"kernel {name!r}: {k.kind} over an empty axis")

    # the value reduced
    if k.prologue:
        val_dtype = k.prologue[-1].dtype
    else:
        if not k.inputs:
            raise CodegenError(f"kernel {name!r} has neither inputs nor a prologue")
        val_dtype = k.inputs[0].dtype
    acc_t = acc_dtype(val_dtype)
    if k.epilogue:
        res_dtype = k.epilogue[-1].dtype
    else:
        res_dtype = val_dtype
    out_dtype: DType = k.out_dtype or res_dtype
    split = max(1, int(getattr(k, "split", 1) or 1))
    if split > 1:
        out_dtype = acc_t  # partial results stay in the accumulator type

    n_in, n_x = len(k.inputs), len(k.extra)
    n_p, n_po = len(k.post_inputs), len(k.post_outputs)
    if n_po and (split > 1 or not k.post):
        raise CodegenError(f"kernel {name!r}: a post pass needs instrs and no split")
    post_dts = [k.post[i].dtype for i in k.post_outputs]
    n_bind = n_in + n_x + n_p + 1 + n_po
    check_bindings(name, n_bind, t)
    bind_dtypes = ([s.dtype for s in k.inputs] + [s.dtype for s in k.extra]
                   + [s.dtype for s in k.post_inputs] + [out_dtype] + post_dts)
    all_dtypes = bind_dtypes + [i.dtype for i in k.prologue] + [i.dtype for i in k.epilogue]
    all_dtypes += [i.dtype for i in k.post]
    uses_f16 = check_dtypes(name, all_dtypes, t)
    bd = Bindings(bind_dtypes, alias)
    out_b = n_in + n_x + n_p  # binding of the reduced output

    used = sorted({i for ins in k.prologue for kind, i in ins.args if kind == "in"})
    if not k.prologue:
        used = [0]
    used_x = sorted({i for ins in k.epilogue for kind, i in ins.args if kind == "x"})
    for i in used:
        if i >= n_in:
            raise CodegenError(f"kernel {name!r}: prologue reads input {i} of {n_in}")
    for i in used_x:
        if i >= n_x:
            raise CodegenError(f"kernel {name!r}: epilogue reads extra input {i} of {n_x}")
    full = {i: bcast_strides(k.inputs[i], shape, f"{name} input {i}") for i in used}
    for i in used:
        check_extent(name, f"input {i}", k.inputs[i], shape, full[i], t)
    xst = {i: _extra_strides(k.extra[i], shape, axes, out_shape, f"{name} extra {i}")
           for i in used_x}
    for i in used_x:
        check_extent(name, f"extra input {i}", k.extra[i], out_shape, xst[i], t)
    check_binding_size(name, "output", out_total * split, out_dtype, t)
    used_p = sorted({i for ins in k.post for kind, i in ins.args if kind == "in"})
    for i in used_p:
        if i >= n_p:
            raise CodegenError(f"kernel {name!r}: post pass reads input {i} of {n_p}")
    pfull = {i: bcast_strides(k.post_inputs[i], shape, f"{name} post input {i}")
             for i in used_p}
    for i in used_p:
        check_extent(name, f"post input {i}", k.post_inputs[i], shape, pfull[i], t)
    for dt in post_dts:
        check_binding_size(name, "post output", prod(shape), dt, t)
    full_out = contiguous_strides(shape)  # the post outputs' layout

    # kept dims: merged over inputs (kept part), extras and the contiguous output
    contig = contiguous_strides(out_shape)
    post_lists = ([tuple(pfull[i][d] for d in kept) for i in used_p]
                  + ([tuple(full_out[d] for d in kept)] if n_po else []))
    kshape, kstr = merge_dims(
        out_shape,
        [contig]
        + [tuple(full[i][d] for d in kept) for i in used]
        + [xst[i] for i in used_x]
        + post_lists,
    )
    kin = dict(zip(used, kstr[1 : 1 + len(used)], strict=False))
    kx = dict(zip(used_x, kstr[1 + len(used) : 1 + len(used) + len(used_x)], strict=False))
    kpost = kstr[1 + len(used) + len(used_x):]
    rshape, rstr = merge_dims(
        rshape_full,
        [tuple(full[i][d] for d in axes) for i in used]
        + [tuple(pfull[i][d] for d in axes) for i in used_p]
        + ([tuple(full_out[d] for d in axes)] if n_po else []),
    )
    rin = dict(zip(used, rstr, strict=False))
    rpost = rstr[len(used):]

    # layout: are the kept (output) dims the fast-moving ones in memory?
    main = used[0] if used else None
    kept_contig = bool(main is not None and kshape and kin[main] and kin[main][-1] == 1
                       and not (rshape and rin[main][-1] == 1))
    max_threads = min(MAX_THREADS, t.lim("max_compute_invocations_per_workgroup"))
    if split > 1:
        if k.epilogue or k.extra:
            raise CodegenError(f"kernel {name!r}: a split (partial) reduction has no epilogue")
        split = min(split, max(red_total, 1))
    chunk = -(-red_total // split)
    tx, ty = choose_layout(rshape, kept_contig, chunk, out_total, max_threads)
    wg = tx * ty
    check_invocations(name, wg, t)
    shared_bytes = wg * 4 if ty > 1 else 0
    check_workgroup_storage(name, shared_bytes, t)
    owgs = -(-max(out_total, 1) // tx)
    grid = make_grid(name, owgs * split, t)

    ind = "    "
    body: list[str] = []
    body.append(f"{ind}let wg = {grid.wg_expr};")
    if split > 1:
        body.append(f"{ind}let cb = wg / {u(owgs)};")
        body.append(f"{ind}let wo = wg % {u(owgs)};")
    else:
        body.append(f"{ind}let wo = wg;")
    if tx > 1:
        body.append(f"{ind}let x = lid % {u(tx)};")
        body.append(f"{ind}let y = lid / {u(tx)};")
        body.append(f"{ind}let o = wo * {u(tx)} + x;")
    else:
        body.append(f"{ind}let x = 0u;")
        body.append(f"{ind}let y = lid;")
        body.append(f"{ind}let o = wo;")
    live = f"o < {u(out_total)}" + (f" && cb < {u(split)}" if split > 1 else "")
    body.append(f"{ind}let valid = {live};")
    body.append(f"{ind}var acc: {acc_t.wgsl} = {identity(k.kind, acc_t)};")
    body.append(f"{ind}if (valid) {{")
    i2 = ind * 2
    kc = coords_code("o", kshape, "k", body, i2)
    for i in used:
        base = index_code(kc, kin[i], k.inputs[i].offset)
        body.append(f"{i2}let base{i} = {base};")
    if split > 1:
        body.append(f"{i2}let r0 = cb * {u(chunk)};")
        body.append(f"{i2}let r1 = min(r0 + {u(chunk)}, {u(red_total)});")
        start, end = "r0 + y" if ty > 1 else "r0", "r1"
    else:
        start, end = ("y" if ty > 1 else "0u"), u(red_total)
    i3 = ind * 3
    helpers: set[str] = set()
    if acc_t.is_float and k.kind != "sum":
        helpers.add("mn_inf")  # the identity of max/min

    def fold(r: str, tag: str, target: str) -> None:
        """Emit the loads + prologue of reduced element ``r`` folded into ``target``."""
        rc = coords_code(r, rshape, f"rr{tag}", body, i3)
        names = {}
        for i in used:
            rel = index_code(rc, rin[i], 0)
            idx = f"base{i}" if rel == "0u" else f"base{i} + {rel}"
            body.append(f"{i3}let v{i}{tag} = {load(bd.name(i), idx, k.inputs[i].dtype)};")
            names[i] = (f"v{i}{tag}", k.inputs[i].dtype)

        def parg(a):
            kind, i = a
            if kind != "in":
                raise CodegenError(f"kernel {name!r}: prologue operand {a!r} (use ('in', i))")
            return names[i]

        if k.prologue:
            res = emit_instrs(k.prologue, parg, f"p{tag}_", body, i3, helpers)
            val, vdt = res[-1]
        else:
            val, vdt = names[0]
        if vdt is bool_:
            v = f"select(0u, 1u, {val})"
        else:
            v = convert(val, vdt, acc_t) if vdt is not acc_t else val
        body.append(f"{i3}{target} = {combine(k.kind, target, v)};")

    per_thread = -(-chunk // ty)
    unroll = UNROLL if per_thread >= 2 * UNROLL else 1
    body.append(f"{i2}var r: u32 = {start};")
    if unroll > 1:
        for j in range(1, unroll):
            body.append(f"{i2}var acc{j}: {acc_t.wgsl} = {identity(k.kind, acc_t)};")
        last = f"r + {u((unroll - 1) * ty)}" if ty > 1 else f"r + {u(unroll - 1)}"
        body.append(f"{i2}for (; {last} < {end}; r = r + {u(unroll * ty)}) {{")
        for j in range(unroll):
            rj = "r" if j == 0 else f"(r + {u(j * ty)})"
            body.append(f"{i3}let ru{j} = {rj};")
            fold(f"ru{j}", f"u{j}", "acc" if j == 0 else f"acc{j}")
        body.append(f"{i2}}}")
    body.append(f"{i2}for (; r < {end}; r = r + {u(ty)}) {{")
    fold("r", "", "acc")
    body.append(f"{i2}}}")
    if unroll > 1:
        parts = ["acc"] + [f"acc{j}" for j in range(1, unroll)]
        while len(parts) > 1:  # fixed pairwise tree: deterministic
            parts = [combine(k.kind, parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
        body.append(f"{i2}acc = {parts[0]};")
    body.append(f"{ind}}}")

    store_lines: list[str] = []
    if ty > 1:
        body.append(f"{ind}red[lid] = acc;")
        body.append(f"{ind}workgroupBarrier();")
        s = ty // 2
        while s >= 1:
            body.append(f"{ind}if (y < {u(s)}) {{")
            body.append(f"{i2}red[lid] = {combine(k.kind, 'red[lid]', f'red[lid + {u(s * tx)}]')};")
            body.append(f"{ind}}}")
            body.append(f"{ind}workgroupBarrier();")
            s //= 2
        # every lane of an output reads the total when a post pass follows (after the last
        # barrier nothing writes ``red``); otherwise only lane 0, which stores it
        body.append(f"{ind}if ({'valid' if n_po else 'y == 0u && valid'}) {{")
        store_lines.append(f"{i2}let total = red[x];")
    else:
        body.append(f"{ind}if (valid) {{")
        store_lines.append(f"{i2}let total = acc;")

    # epilogue: ("acc", 0) is the reduced value in the prologue's dtype
    if val_dtype is bool_:
        store_lines.append(f"{i2}let accv: bool = total != 0u;")
    else:
        conv = convert("total", acc_t, val_dtype)
        store_lines.append(f"{i2}let accv: {val_dtype.wgsl} = {conv};")
    xnames = {}
    if used_x:
        kc2 = coords_code("o", kshape, "ko", store_lines, i2)
        for i in used_x:
            idx = index_code(kc2, kx[i], k.extra[i].offset)
            store_lines.append(f"{i2}let e{i} = {load(bd.name(n_in + i), idx, k.extra[i].dtype)};")
            xnames[i] = (f"e{i}", k.extra[i].dtype)

    def earg(a):
        kind, i = a
        if kind == "acc":
            return "accv", val_dtype
        if kind == "x":
            return xnames[i]
        raise CodegenError(f"kernel {name!r}: epilogue operand {a!r}")

    if k.epilogue:
        res = emit_instrs(k.epilogue, earg, "q", store_lines, i2, helpers)
        out_v, out_vdt = res[-1]
    elif val_dtype is not bool_ or split > 1:
        out_v, out_vdt = "total", acc_t  # no epilogue: store from the accumulator, unrounded
    else:
        out_v, out_vdt = "accv", val_dtype
    oidx = f"cb * {u(out_total)} + o" if split > 1 else "o"
    store = f"{bd.name(out_b)}[{oidx}] = {store_value(out_v, out_vdt, out_dtype)};"
    if n_po and ty > 1:
        store_lines.append(f"{i2}if (y == 0u) {{ {store} }}")
    else:
        store_lines.append(f"{i2}{store}")
    if n_po:
        _post_pass(k, store_lines, i2, kshape, kpost, rshape, rpost, used_p, (out_v, out_vdt),
                   "y" if ty > 1 else "0u", ty, red_total, out_b, helpers, kin, rin, bd)
    body += store_lines
    body.append(f"{ind}}}")

    lines = module_header(uses_f16)
    lines += bd.decls()
    if ty > 1:
        lines.append(f"var<workgroup> red: array<{acc_t.wgsl}, {wg}>;")
    return KernelSpec(
        name=name,
        wgsl=module_source(lines, helpers, wg, body),
        n_bindings=bd.n,
        workgroups=grid.workgroups,
        meta={
            "archetype": "reduce",
            "layout": (tx, ty),
            "workgroup_size": wg,
            "workgroup_storage": shared_bytes,
            "binding_dtypes": tuple(bind_dtypes),
            "reduced": red_total,
            "outputs": out_total,
            "split": split,
        },
    )


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
