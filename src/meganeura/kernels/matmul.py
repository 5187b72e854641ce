"""Batched matmul ``C[b] = A[b] @ B[b]`` (+ epilogue), operands read in place through strides.

Variants, chosen at compile time (``MatmulKernel.variant`` forces one):

* **tiled** — a workgroup of 16×16 invocations computes a 64×64 (``tiled64*``, 4×4 results per
  invocation) or 128×128 (``tiled128*``, 8×8) tile of C, stepping K by 16 with the A and B tiles
  staged through workgroup memory (8 or 16 KiB).  ``…v`` variants give each invocation
  contiguous rows/columns and read workgroup memory as vec4; the others interleave (rows
  ``ty + 16 i``).  The staging thread→element map follows each operand's contiguous axis, so a
  transposed operand is still read with neighbouring threads on neighbouring addresses.
  Bounds checks only where needed: interior tiles (a uniform branch) run unguarded loads and
  stores, and a K tail (K not a multiple of 16) is one guarded step after the main loop.
* **gemv** — when one of M, N is ≤ 4 (a matrix–vector product, M = 1 decoding, a 1-wide output
  layer): invocations split the long dimension *and* K, fold their share of K serially with
  four loads in flight, and a tree in workgroup memory adds the K partial sums.

The batch index comes from the (wrapped) workgroup id, so batches beyond 65,535 work; batch
broadcast is stride 0.  f16 operands are converted to f32 and accumulated in f32.  Measured on
the H200 (f32, GPU timestamps): 4096³ tiled128v 23.5 TFLOP/s on wgpu-native, 27.6 on Dawn;
gemv 1×8192×8192 2.3 TB/s (k-contiguous weights, wgpu).
"""

from __future__ import annotations

from ..dtypes import DType, f32
from .archetypes import kernel_family
from .common import (
    Bindings,
    CodegenError,
    bcast_strides,
    check_binding_size,
    check_bindings,
    check_dtypes,
    check_extent,
    check_invocations,
    check_workgroup_storage,
    emit_instrs,
    index_code,
    load,
    make_grid,
    make_target,
    module_header,
    module_source,
    pow2ceil,
    store_value,
    u,
)
from .ir import PRECISIONS, KernelSpec, MatmulKernel

THREADS = 16  # invocations per tile edge (16 x 16 = 256 per workgroup)
BK = 16  # K step
# variant -> (output tile edge, vectorized workgroup-memory reads).  64: 4x4 results per
# invocation, 128: 8x8.  "v": each invocation owns contiguous rows/columns of the tile and reads
# its operands from workgroup memory as vec4 (fewer shared-memory instructions); otherwise rows
# ty + 16 i and columns tx + 16 j (scalar reads, conflict-free).
TILES = {"tiled64": (64, False), "tiled128": (128, False), "tiled64v": (64, True),
         "tiled128v": (128, True)}
BIG_TILE_MIN_WORKGROUPS = 256  # use 128x128 tiles only when that still fills a big GPU
GEMV_MAX = 4  # M or N up to this use the gemv variant
# Tensor-core variants (precision "fast", Dawn's subgroup matrices, f16 x f16 -> f32 16x16x16,
# subgroups of 32): variant -> (tile rows, tile cols, subgroups along rows, along cols).  Each
# subgroup owns a (rows/sgm) x (cols/sgn) block of 16x16 accumulator fragments.
SGMAT = {"sgmat64": (64, 64, 2, 2), "sgmat128": (128, 128, 2, 4)}
SG_BK = 32  # K step of the tensor-core variants (two 16-deep fragments)
SG_PAD = 8  # f16 elements of padding per workgroup-memory row (keeps rows 16-byte aligned)
# the device's pseudo-feature for that (runtime.device derives it from Dawn's configs)
SG_FEATURE = "meganeura-subgroup-matrix-f16-16x16x16-sg32"
GEMV_THREADS = 256
GEMV_UNROLL = 4


def _norm(s, shape, what, name):
    if len(s.shape) == 2:  # allow rank-2 views for batch 1 / broadcast
        s = type(s)(s.dtype, (1,) + tuple(s.shape), (0,) + tuple(s.strides), s.offset, s.extent)
    if len(s.shape) != 3:
        raise CodegenError(f"kernel {name!r}: {what} must be a rank-3 view, got shape {s.shape}")
    return s, bcast_strides(s, shape, f"{name} {what}")


@kernel_family("matmul", MatmulKernel)
def emit(k: MatmulKernel, limits=None, features=None, alias=None) -> KernelSpec:
    t = make_target(limits, features)
    name = k.name
    B, M, N, K = int(k.batch), int(k.m), int(k.n), int(k.k)
    a, sa = _norm(k.a, (B, M, K), "operand a", name)
    b, sb = _norm(k.b, (B, K, N), "operand b", name)
    if a.dtype is not b.dtype:
        raise CodegenError(f"kernel {name!r}: operand dtypes differ ({a.dtype}, {b.dtype})")
    op_dt: DType = a.dtype
    if not (op_dt.is_float or op_dt.is_int):
        raise CodegenError(f"kernel {name!r}: matmul of {op_dt.name} operands")
    acc_t = f32 if op_dt.is_float else op_dt
    check_extent(name, "operand a", a, (B, M, K), sa, t)
    check_extent(name, "operand b", b, (B, K, N), sb, t)
    xs = _extras(k, (B, M, N), t)
    res_dt = k.epilogue[-1].dtype if k.epilogue else op_dt
    out_dt: DType = k.out_dtype or res_dt
    check_binding_size(name, "output", B * M * N, out_dt, t)
    n_in = 2 + len(k.extra)
    n_bind = n_in + 1
    check_bindings(name, n_bind, t)
    dts = [op_dt, op_dt] + [s.dtype for s in k.extra] + [out_dt]
    uses_f16 = check_dtypes(name, dts + [i.dtype for i in k.epilogue], t)

    bd = Bindings(dts, alias)
    ctx = _Ctx(name, B, M, N, K, a, sa, b, sb, k, xs, op_dt, acc_t, out_dt, n_in, bd)
    variant = _variant(k, ctx, t)
    if variant == "gemv":
        body, shared, wg_size, grid, helpers, variant = _gemv(ctx, t)
    elif variant in SGMAT:
        uses_f16 = True
        body, shared, wg_size, grid, helpers, variant = _sgmat(ctx, t, *SGMAT[variant])
    else:
        tile, vec = TILES[variant]
        body, shared, wg_size, grid, helpers, variant = _tiled(ctx, t, tile, vec)
    check_invocations(name, wg_size, t)
    check_workgroup_storage(name, shared[1], t)

    lines = module_header(uses_f16)
    if variant in SGMAT:
        # per-subgroup fragment offsets (lid / 32) are not uniform across the workgroup
        lines[-1:-1] = ["enable chromium_experimental_subgroup_matrix;",
                        "diagnostic(off, chromium.subgroup_matrix_uniformity);"]
    lines += bd.decls()
    lines += shared[0]
    return KernelSpec(
        name=name,
        wgsl=module_source(lines, helpers, wg_size, body),
        n_bindings=bd.n,
        workgroups=grid.workgroups,
        meta={
            "archetype": "matmul",
            "variant": variant,
            "workgroup_size": wg_size,
            "workgroup_storage": shared[1],
            "binding_dtypes": tuple(dts),
            "flops": 2 * B * M * N * K,
        },
    )


def _extras(k: MatmulKernel, shape, t) -> dict[int, tuple[int, ...]]:
    """Strides over (batch, M, N) of the extra inputs the epilogue reads."""
    name, xs = k.name, {}
    for i in sorted({i for ins in k.epilogue for kind, i in ins.args if kind == "x"}):
        if i >= len(k.extra):
            raise CodegenError(f"kernel {name!r}: epilogue reads extra input {i} of {len(k.extra)}")
        s = k.extra[i]
        if len(s.shape) < 3:
            st = bcast_strides(s, shape, f"{name} extra {i}")
        else:
            _, st = _norm(s, shape, f"extra {i}", name)
        check_extent(name, f"extra input {i}", s, shape, st, t)
        xs[i] = st
    return xs


def _variant(k: MatmulKernel, c: _Ctx, t) -> str:
    """The variant for this kernel, precision and device (tensor cores only for "fast")."""
    name, op_dt = k.name, c.op_dt
    if k.precision not in PRECISIONS:
        raise CodegenError(f"kernel {name!r}: precision must be one of {PRECISIONS}, "
                           f"got {k.precision!r}")
    fast = k.precision == "fast" and op_dt.is_float and SG_FEATURE in t.features and t.has_f16
    variant = choose_variant(c.B, c.M, c.N, c.K, getattr(k, "variant", ""), name, fast)
    if variant in SGMAT and not (op_dt.is_float and SG_FEATURE in t.features):
        raise CodegenError(f"kernel {name!r}: variant {variant!r} needs f16 subgroup matrices "
                           f"(Dawn, feature {SG_FEATURE!r}) and float operands")
    return variant


def choose_variant(B: int, M: int, N: int, K: int, forced: str = "", name: str = "",
                   tensor_cores: bool = False) -> str:
    """``gemv`` when M or N ≤ 4; ``tiled128v`` (8×8 per invocation), or ``sgmat128`` with
    ``tensor_cores``, when there are enough 128×128 tiles to fill a large GPU; else
    ``tiled64v`` / ``sgmat64``.  ``forced`` overrides."""
    if forced:
        if forced != "gemv" and forced not in TILES and forced not in SGMAT:
            raise CodegenError(
                f"kernel {name!r}: unknown matmul variant {forced!r}; expected gemv, "
                f"{', '.join(TILES)}, {', '.join(SGMAT)}"
            )
        if forced == "gemv" and min(M, N) > 2 * GEMV_MAX:
            raise CodegenError(
                f"kernel {name!r}: the gemv variant needs M or N ≤ {2 * GEMV_MAX}, got {M}×{N}"
            )
        return forced
    if min(M, N) <= GEMV_MAX:
        return "gemv"
    # H200 (f32, 4096³): tiled128v 23.5 / 27.6 TFLOP/s (wgpu / Dawn), tiled128 21.5 / 26.2,
    # tiled64v 19.2 / 21.8, tiled64 13.3 / 19.0.
    big = B * -(-M // 128) * -(-N // 128) >= BIG_TILE_MIN_WORKGROUPS
    if tensor_cores:
        return "sgmat128" if big else "sgmat64"
    return "tiled128v" if big else "tiled64v"


class _Ctx:
    def __init__(self, name, B, M, N, K, a, sa, b, sb, k, xs, op_dt, acc_t, out_dt, n_in, bd):
        self.name, self.B, self.M, self.N, self.K = name, B, M, N, K
        self.a, self.sa, self.b, self.sb = a, sa, b, sb
        self.k, self.xs, self.op_dt, self.acc_t, self.out_dt = k, xs, op_dt, acc_t, out_dt
        self.n_in, self.bd = n_in, bd

    def read(self, which: str, idx: str) -> str:
        """Operand element converted to the accumulator type."""
        binding = self.bd.name(0 if which == "a" else 1)
        v = load(binding, idx, self.op_dt)
        return v if self.op_dt is self.acc_t else f"{self.acc_t.wgsl}({v})"

    def store(self, lines, ind, bi: str, row: str, col: str, acc: str, helpers: set) -> None:
        """Epilogue and store of one result ``acc`` at (bi, row, col) (bounds checked by the
        caller)."""
        k = self.k
        lines.append(f"{ind}{{")
        i2 = ind + "    "
        conv = acc if self.acc_t is self.op_dt else f"{self.op_dt.wgsl}({acc})"
        lines.append(f"{i2}let accv: {self.op_dt.wgsl} = {conv};")
        names = {}
        for i, st in self.xs.items():
            s = k.extra[i]
            idx = index_code([bi, row, col], st, s.offset)
            lines.append(f"{i2}let e{i} = {load(self.bd.name(2 + i), idx, s.dtype)};")
            names[i] = (f"e{i}", s.dtype)

        def arg(a):
            kind, i = a
            if kind == "acc":
                return "accv", self.op_dt
            if kind == "x":
                return names[i]
            raise CodegenError(f"kernel {self.name!r}: epilogue operand {a!r}")

        if k.epilogue:
            res = emit_instrs(k.epilogue, arg, "q", lines, i2, helpers)
            v, vdt = res[-1]
        else:
            v, vdt = acc, self.acc_t  # no epilogue: store from the accumulator, unrounded
        oidx = index_code([bi, row, col], (self.M * self.N, self.N, 1))
        lines.append(f"{i2}{self.bd.name(self.n_in)}[{oidx}] = {store_value(v, vdt, self.out_dt)};")
        lines.append(f"{ind}}}")


def _fma(acc_t, x, y, c):
    return f"fma({x}, {y}, {c})" if acc_t is f32 else f"{c} + {x} * {y}"


def _tile_start(c: _Ctx, t, TM: int, TN: int, L: list[str], ind: str):
    """Lines mapping the workgroup to (batch ``bi``, tile origin ``row0``/``col0``) of a TM x TN
    tile grid, the uniform ``interior`` test (whole tile inside C, so loads and stores need no
    bounds checks) and the operands' batch bases.  Returns (grid, live_check, full_m, full_n)."""
    B, M, N = c.B, c.M, c.N
    mt, nt = -(-M // TM), -(-N // TN)
    grid = make_grid(c.name, mt * nt * B, t)
    L += [f"{ind}let wg = {grid.wg_expr};", f"{ind}let tn = wg % {u(nt)};",
          f"{ind}let tq = wg / {u(nt)};", f"{ind}let tm = tq % {u(mt)};",
          f"{ind}let bi = tq / {u(mt)};", f"{ind}let row0 = tm * {u(TM)};",
          f"{ind}let col0 = tn * {u(TN)};"]
    live_check = not grid.exact
    if live_check:
        L.append(f"{ind}let live = bi < {u(B)};")
    full_m, full_n = M % TM == 0, N % TN == 0
    conds = ([] if full_m else [f"row0 + {u(TM)} <= {u(M)}"])
    conds += ([] if full_n else [f"col0 + {u(TN)} <= {u(N)}"])
    conds += (["live"] if live_check else [])
    if conds:
        L.append(f"{ind}let interior = {' && '.join(conds)};")
    L.append(f"{ind}let abase = {index_code(['bi'], [c.sa[0]], c.a.offset)};")
    L.append(f"{ind}let bbase = {index_code(['bi'], [c.sb[0]], c.b.offset)};")
    return grid, live_check, full_m, full_n


def _k_steps(c: _Ctx, L: list[str], ind: str, bk: int, edges: bool, stage, compute) -> None:
    """The K loop: whole ``bk`` steps, then one guarded tail step when K is not a multiple.
    Each step stages the A and B tiles (``stage(out, ii, check_mn, check_k)``; interior tiles
    unguarded), waits, runs ``compute(out, ii)`` on them and waits again."""
    i2 = ind + "    "

    def step(ii: str, check_k: bool) -> None:
        if edges:
            L.append(f"{ii}if (interior) {{")
            stage(L, ii + "    ", False, check_k)
            L.append(f"{ii}}} else {{")
            stage(L, ii + "    ", True, check_k)
            L.append(f"{ii}}}")
        else:
            stage(L, ii, False, check_k)
        L.append(f"{ii}workgroupBarrier();")
        compute(L, ii)
        L.append(f"{ii}workgroupBarrier();")

    kf = c.K - c.K % bk  # K covered by whole steps
    if kf:
        L.append(f"{ind}for (var k0: u32 = 0u; k0 < {u(kf)}; k0 = k0 + {u(bk)}) {{")
        step(i2, False)
        L.append(f"{ind}}}")
    if kf != c.K:
        L.append(f"{ind}{{")
        L.append(f"{i2}let k0 = {u(kf)};")
        step(i2, True)
        L.append(f"{ind}}}")


def _tiled_compute(c: _Ctx, out: list[str], ii: str, TILE: int, vec: bool) -> None:
    """c_ij += A·B over the staged BK slice: PER x PER results per invocation, rows
    ty·PER + i (vec: read as vec4) or ty + 16 i."""
    PER, T4, jj = TILE // THREADS, TILE // 4, ii + "    "
    out.append(f"{ii}for (var kk: u32 = 0u; kk < {u(BK)}; kk = kk + 1u) {{")
    if vec:
        for q in range(PER // 4):
            out.append(f"{jj}let a4{q} = As[kk * {u(T4)} + ty * {u(PER // 4)} + {u(q)}];")
            out.append(f"{jj}let b4{q} = Bs[kk * {u(T4)} + tx * {u(PER // 4)} + {u(q)}];")
        for i in range(PER):
            out.append(f"{jj}let a{i} = a4{i // 4}.{'xyzw'[i % 4]};")
        for j in range(PER):
            out.append(f"{jj}let b{j} = b4{j // 4}.{'xyzw'[j % 4]};")
    else:
        for i in range(PER):
            out.append(f"{jj}let a{i} = As[kk * {u(TILE)} + ty + {u(THREADS * i)}];")
        for j in range(PER):
            out.append(f"{jj}let b{j} = Bs[kk * {u(TILE)} + tx + {u(THREADS * j)}];")
    for i in range(PER):
        for j in range(PER):
            out.append(f"{jj}c{i}{j} = {_fma(c.acc_t, f'a{i}', f'b{j}', f'c{i}{j}')};")
    out.append(f"{ii}}}")


def _tiled_stores(c: _Ctx, out: list[str], ii: str, PER: int, checks, helpers) -> None:
    """Epilogue and store of every result; ``checks`` (row and column bounds) guard them."""
    for i in range(PER):
        for j in range(PER):
            conds = [x for x, ok in ((f"r{i} < {u(c.M)}", checks[0]),
                                     (f"n{j} < {u(c.N)}", checks[1])) if ok]
            if conds:
                out.append(f"{ii}if ({' && '.join(conds)}) {{")
                c.store(out, ii + "    ", "bi", f"r{i}", f"n{j}", f"c{i}{j}", helpers)
                out.append(f"{ii}}}")
            else:
                c.store(out, ii, "bi", f"r{i}", f"n{j}", f"c{i}{j}", helpers)


def _tiled(c: _Ctx, t, TILE: int, vec: bool = False):
    PER = TILE // THREADS
    T4 = TILE // 4
    acc = c.acc_t.wgsl
    ind, i2 = "    ", "        "
    L: list[str] = [f"{ind}let tx = lid % {u(THREADS)};", f"{ind}let ty = lid / {u(THREADS)};"]
    grid, live_check, full_m, full_n = _tile_start(c, t, TILE, TILE, L, ind)
    edges = not (full_m and full_n) or live_check

    def sh(arr: str, k: str, x: str) -> str:
        """Workgroup-memory element (k, x) of a BK x TILE operand tile."""
        if vec:
            return f"{arr}[{k} * {u(T4)} + {x} / 4u][{x} % 4u]"
        return f"{arr}[{k} * {u(TILE)} + {x}]"

    for i in range(PER):
        for j in range(PER):
            L.append(f"{ind}var c{i}{j}: {acc} = {acc}(0);")
    nthreads = THREADS * THREADS

    def stage(out: list[str], ii: str, check_mn: bool, check_k: bool) -> None:
        _stage(c, out, ii, check_mn, check_k, TILE, TILE, BK, nthreads, live_check, sh,
               lambda v: v)

    _k_steps(c, L, ind, BK, edges, stage,
             lambda out, ii: _tiled_compute(c, out, ii, TILE, vec))
    helpers: set[str] = set()
    for i in range(PER):
        r = f"ty * {u(PER)} + {u(i)}" if vec else f"ty + {u(THREADS * i)}"
        L.append(f"{ind}let r{i} = row0 + {r};")
    for j in range(PER):
        n = f"tx * {u(PER)} + {u(j)}" if vec else f"tx + {u(THREADS * j)}"
        L.append(f"{ind}let n{j} = col0 + {n};")
    if edges:
        L.append(f"{ind}if (interior) {{")
        _tiled_stores(c, L, i2, PER, (False, False), helpers)
        L.append(f"{ind}}} else if ({'live' if live_check else 'true'}) {{")
        _tiled_stores(c, L, i2, PER, (not full_m, not full_n), helpers)
        L.append(f"{ind}}}")
    else:
        _tiled_stores(c, L, ind, PER, (False, False), helpers)
    nbytes = 2 * BK * TILE * 4
    et, n = (f"vec4<{acc}>", BK * T4) if vec else (acc, BK * TILE)
    shared = (
        [f"var<workgroup> As: array<{et}, {n}>;", f"var<workgroup> Bs: array<{et}, {n}>;"],
        nbytes,
    )
    return L, shared, nthreads, grid, helpers, f"tiled{TILE}{'v' if vec else ''}"


def _sgmat(c: _Ctx, t, TM: int, TN: int, SGM: int, SGN: int):
    """Tensor-core tile: operands rounded to f16 while staged through workgroup memory, 16x16x16
    subgroup-matrix multiply-accumulate into f32 fragments, then each fragment goes through
    workgroup memory so every invocation applies the epilogue to its share of elements with
    ordinary bounds checks (any shape, stride and epilogue works)."""
    M, N = c.M, c.N
    nsg = SGM * SGN
    nthreads = 32 * nsg
    FM, FN = TM // SGM // 16, TN // SGN // 16  # fragments per subgroup
    astr, bstr = SG_BK + SG_PAD, TN + SG_PAD  # workgroup-memory row strides (f16 elements)
    ind = "    "
    L: list[str] = [
        f"{ind}let sid = lid / 32u;",
        f"{ind}let lane = lid % 32u;",
        f"{ind}let fr = sid / {u(SGN)} * {u(FM * 16)};",  # subgroup's first row in the tile
        f"{ind}let fc = sid % {u(SGN)} * {u(FN * 16)};",
    ]
    grid, live_check, full_m, full_n = _tile_start(c, t, TM, TN, L, ind)
    frag = "subgroup_matrix_result<f32, 16, 16>"
    for i in range(FM):
        for j in range(FN):
            L.append(f"{ind}var c{i}_{j} = {frag}();")

    def sh(arr, kx, x):
        return f"As[{x} * {u(astr)} + {kx}]" if arr == "As" else f"Bs[{kx} * {u(bstr)} + {x}]"

    def conv(v):  # staged values come in the accumulator type (f32), also for f16 operands
        return f"f16({v})"

    def stage(out, ii, check_mn, check_k):
        _stage(c, out, ii, check_mn, check_k, TM, TN, SG_BK, nthreads, live_check, sh, conv)

    def compute(out: list[str], ii: str) -> None:
        for kk in range(0, SG_BK, 16):
            for i in range(FM):
                out.append(f"{ii}let a{i}_{kk} = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, "
                           f"16>>(&As, (fr + {u(16 * i)}) * {u(astr)} + {u(kk)}, false, "
                           f"{u(astr)});")
            for j in range(FN):
                out.append(f"{ii}let b{j}_{kk} = subgroupMatrixLoad<subgroup_matrix_right<f16, "
                           f"16, 16>>(&Bs, {u(kk * bstr)} + fc + {u(16 * j)}, false, "
                           f"{u(bstr)});")
            for i in range(FM):
                for j in range(FN):
                    out.append(f"{ii}c{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}_{kk}, "
                               f"b{j}_{kk}, c{i}_{j});")

    _k_steps(c, L, ind, SG_BK, not (full_m and full_n) or live_check, stage, compute)

    # epilogue: fragment -> this subgroup's 16x16 f32 scratch -> 8 elements per invocation
    helpers: set[str] = set()
    guard = []
    if not full_m:
        guard.append(f"r < {u(M)}")
    if not full_n:
        guard.append(f"n < {u(N)}")
    if live_check:
        guard.append("live")
    _sgmat_stores(c, L, FM, FN, guard, helpers)
    nbytes = 2 * (TM * astr + SG_BK * bstr) + 4 * 256 * nsg
    shared = ([f"var<workgroup> As: array<f16, {TM * astr}>;",
               f"var<workgroup> Bs: array<f16, {SG_BK * bstr}>;",
               f"var<workgroup> Cs: array<f32, {256 * nsg}>;"], nbytes)
    return L, shared, nthreads, grid, helpers, f"sgmat{TM}"


def _sgmat_stores(c: _Ctx, L: list[str], FM: int, FN: int, guard: list[str], helpers) -> None:
    """Each fragment through this subgroup's 16x16 f32 scratch in workgroup memory, then 8
    elements per invocation through the ordinary (bounds-checked) epilogue and store."""
    ind, i2, i3 = "    ", "        ", "            "
    for i in range(FM):
        for j in range(FN):
            L.append(f"{ind}subgroupMatrixStore(&Cs, sid * 256u, c{i}_{j}, false, 16u);")
            L.append(f"{ind}workgroupBarrier();")
            L.append(f"{ind}for (var q: u32 = 0u; q < 8u; q = q + 1u) {{")
            L.append(f"{i2}let e = lane + q * 32u;")
            L.append(f"{i2}let r = row0 + fr + {u(16 * i)} + e / 16u;")
            L.append(f"{i2}let n = col0 + fc + {u(16 * j)} + e % 16u;")
            L.append(f"{i2}let v = Cs[sid * 256u + e];")
            if guard:
                L.append(f"{i2}if ({' && '.join(guard)}) {{")
                c.store(L, i3, "bi", "r", "n", "v", helpers)
                L.append(f"{i2}}}")
            else:
                c.store(L, i2, "bi", "r", "n", "v", helpers)
            L.append(f"{ind}}}")
            L.append(f"{ind}workgroupBarrier();")


def _stage(c: _Ctx, out: list[str], ii: str, check_mn: bool, check_k: bool, TM: int, TN: int,
           bk: int, nthreads: int, live_check: bool, sh, conv) -> None:
    """Copy step ``k0``'s A (TM x bk) and B (bk x TN) tiles into workgroup memory, zero-filled
    outside the matrices.  Neighbouring threads walk each operand's contiguous axis, so a
    transposed operand is still read coalesced.  ``sh(arr, k, x)`` is the workgroup-memory
    element, ``conv(value)`` converts the accumulator-typed value to its stored type."""
    M, N, K = c.M, c.N, c.K
    full_m, full_n = M % TM == 0, N % TN == 0
    _, sam, sak = c.sa
    _, sbk, sbn = c.sb
    a_k_fast = not (sam == 1 and sak != 1)  # neighbouring threads walk k unless A is m-major
    b_n_fast = not (sbk == 1 and sbn != 1)  # neighbouring threads walk n unless B is k-major
    acc = c.acc_t.wgsl
    for arr, tile, rows_fast in (("As", TM, not a_k_fast), ("Bs", TN, b_n_fast)):
        for l in range(tile * bk // nthreads):
            e = f"(lid + {u(l * nthreads)})"
            x, kx = (f"ar{l}", f"ak{l}") if arr == "As" else (f"bn{l}", f"bk{l}")
            if rows_fast:
                out.append(f"{ii}let {x} = {e} % {u(tile)};")
                out.append(f"{ii}let {kx} = {e} / {u(tile)};")
            else:
                out.append(f"{ii}let {kx} = {e} % {u(bk)};")
                out.append(f"{ii}let {x} = {e} / {u(bk)};")
            if arr == "As":
                v, idx = f"av{l}", "abase + " + index_code([f"(row0 + {x})", f"(k0 + {kx})"],
                                                           [sam, sak])
                conds = [f"row0 + {x} < {u(M)}"] if check_mn and not full_m else []
            else:
                v, idx = f"bv{l}", "bbase + " + index_code([f"(k0 + {kx})", f"(col0 + {x})"],
                                                           [sbk, sbn])
                conds = [f"col0 + {x} < {u(N)}"] if check_mn and not full_n else []
            conds += [f"k0 + {kx} < {u(K)}"] if check_k else []
            if check_mn and live_check:
                conds.append("live")
            val = c.read("a" if arr == "As" else "b", idx)
            if conds:
                out.append(f"{ii}var {v}: {acc} = {acc}(0);")
                out.append(f"{ii}if ({' && '.join(conds)}) {{")
                out.append(f"{ii}    {v} = {val};")
                out.append(f"{ii}}}")
                out.append(f"{ii}{sh(arr, kx, x)} = {conv(v)};")
            else:
                out.append(f"{ii}{sh(arr, kx, x)} = {conv(val)};")


def _gemv_layout(c: _Ctx):
    """Which operand is the vector (S ≤ 4 rows or columns), the matrix's strides along the
    long dim P and K, and the invocations along P (tp) and K (tk)."""
    M, N, K = c.M, c.N, c.K
    _, sam, sak = c.sa
    _, sbk, sbn = c.sb
    if M <= N:
        # vector = rows of A (s = m), matrix = B indexed (p = n, k)
        lay = dict(S=M, P=N, vec="a", vst_s=sam, vst_k=sak, mat="b", mst_p=sbn, mst_k=sbk)
    else:
        lay = dict(S=N, P=M, vec="b", vst_s=sbn, vst_k=sbk, mat="a", mst_p=sam, mst_k=sak)
    k_fast = lay["mst_k"] == 1 and lay["mst_p"] != 1  # the matrix is contiguous along k
    if k_fast:
        tk = min(32, pow2ceil(K))
        tp = GEMV_THREADS // tk
    else:
        tp = min(32, pow2ceil(lay["P"]))
        tk = GEMV_THREADS // tp
    lay.update(k_fast=k_fast, tp=tp, tk=max(1, min(tk, pow2ceil(K))))
    return lay


def _gemv_loop(c: _Ctx, L: list[str], lay) -> None:
    """Each invocation folds its share of K (every tk-th element), GEMV_UNROLL matrix loads
    in flight while whole groups remain (same summation order)."""
    i2, i3 = "        ", "            "
    S, tk, K, mst_k = lay["S"], lay["tk"], c.K, lay["mst_k"]

    def step(kk: str, tag: str) -> tuple[list[str], list[str]]:
        midx = "mbase" + ("" if mst_k == 0 else " + " + index_code([kk], [mst_k]))
        ld = [f"{i3}let mv{tag} = {c.read(lay['mat'], midx)};"]
        fm = []
        for s in range(S):
            vidx = "vbase + " + index_code([u(s), kk], [lay["vst_s"], lay["vst_k"]])
            if vidx.endswith("+ 0u"):
                vidx = "vbase"
            fm.append(f"{i3}s{s} = "
                      f"{_fma(c.acc_t, c.read(lay['vec'], vidx), f'mv{tag}', f's{s}')};")
        return ld, fm

    L.append(f"{i2}var kk: u32 = kl;")
    if -(-K // tk) >= 2 * GEMV_UNROLL:
        L.append(f"{i2}for (; kk + {u((GEMV_UNROLL - 1) * tk)} < {u(K)}; "
                 f"kk = kk + {u(GEMV_UNROLL * tk)}) {{")
        loads, fmas = [], []
        for j in range(GEMV_UNROLL):
            ld, fm = step("kk" if j == 0 else f"(kk + {u(j * tk)})", str(j))
            loads += ld
            fmas += fm
        L += loads + fmas
        L.append(f"{i2}}}")
    L.append(f"{i2}for (; kk < {u(K)}; kk = kk + {u(tk)}) {{")
    ld, fm = step("kk", "")
    L += ld + fm
    L.append(f"{i2}}}")


def _gemv_tree(L: list[str], S: int, wg_size: int, tk: int, kstep: int) -> None:
    """Add the tk partial sums of each output in workgroup memory (a fixed tree)."""
    ind, i2 = "    ", "        "
    for s in range(S):
        L.append(f"{ind}red[{u(s * wg_size)} + lid] = s{s};")
    L.append(f"{ind}workgroupBarrier();")
    h = tk // 2
    while h >= 1:
        L.append(f"{ind}if (kl < {u(h)}) {{")
        for s in range(S):
            o = s * wg_size
            L.append(f"{i2}red[{u(o)} + lid] = red[{u(o)} + lid] + "
                     f"red[{u(o)} + lid + {u(h * kstep)}];")
        L.append(f"{ind}}}")
        L.append(f"{ind}workgroupBarrier();")
        h //= 2
    for s in range(S):
        L.append(f"{ind}s{s} = red[{u(s * wg_size)} + lid];")


def _gemv(c: _Ctx, t):
    """One of M, N is small (S ≤ 4): parallel over the long dim P and over K."""
    lay = _gemv_layout(c)
    S, P, vec, tp, tk = lay["S"], lay["P"], lay["vec"], lay["tp"], lay["tk"]
    wg_size = tp * tk
    pt = -(-P // tp)
    grid = make_grid(c.name, pt * c.B, t)
    acc = c.acc_t.wgsl
    ind, i2 = "    ", "        "
    L: list[str] = [f"{ind}let wg = {grid.wg_expr};", f"{ind}let tpi = wg % {u(pt)};",
                    f"{ind}let bi = wg / {u(pt)};"]
    if lay["k_fast"]:
        L += [f"{ind}let kl = lid % {u(tk)};", f"{ind}let pl = lid / {u(tk)};"]
        kstep = 1
    else:
        L += [f"{ind}let pl = lid % {u(tp)};", f"{ind}let kl = lid / {u(tp)};"]
        kstep = tp
    L.append(f"{ind}let p = tpi * {u(tp)} + pl;")
    L.append(f"{ind}let valid = p < {u(P)} && bi < {u(c.B)};")
    for s in range(S):
        L.append(f"{ind}var s{s}: {acc} = {acc}(0);")
    ops = {"a": (c.a, c.sa[0]), "b": (c.b, c.sb[0])}  # view, batch stride
    (vb, vsb), (mb, msb) = ops[vec], ops[lay["mat"]]
    L.append(f"{ind}if (valid) {{")
    L.append(f"{i2}let mbase = {index_code(['bi', 'p'], [msb, lay['mst_p']], mb.offset)};")
    L.append(f"{i2}let vbase = {index_code(['bi'], [vsb], vb.offset)};")
    _gemv_loop(c, L, lay)
    L.append(f"{ind}}}")
    if tk > 1:
        _gemv_tree(L, S, wg_size, tk, kstep)
    helpers: set[str] = set()
    L.append(f"{ind}if (valid && kl == 0u) {{")
    for s in range(S):
        row, col = (u(s), "p") if vec == "a" else ("p", u(s))
        c.store(L, i2, "bi", row, col, f"s{s}", helpers)
    L.append(f"{ind}}}")
    nbytes = S * wg_size * 4 if tk > 1 else 0
    shared = ([f"var<workgroup> red: array<{acc}, {S * wg_size}>;"] if tk > 1 else [], nbytes)
    return L, shared, wg_size, grid, helpers, f"gemv{'_t' if vec == 'b' else ''}"
