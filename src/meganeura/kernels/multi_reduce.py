"""Reductions sharing one dispatch: siblings (``MultiReduceKernel``) and chains
(``ChainReduceKernel``).

Siblings: several reductions of one iteration shape over the same axes, each with its own
prologue, epilogue and output.  Why: a norm's statistics and gradients reduce the same
tensors over the same axes several times (batch norm's backward: ``sum(dy)``,
``sum(dy * x̂)``, …).  Each is a small, latency-bound dispatch on a big GPU (ResNet-50's
8–12 µs ``reduce_sum`` kernels move under a megabyte); one dispatch for all of them pays the
launch and the index arithmetic once and loads each shared input once.  The generator is the
one of ``kernels/reduce.py`` (a ``ReduceKernel`` is its one-member case): ``TX`` outputs per
workgroup, ``TY`` invocations per output, each folding a strided share of the reduced range
with ``UNROLL`` independent accumulators, then a fixed tree in workgroup memory.  The order of
the arithmetic of each member is the one its own ``ReduceKernel`` would use with the same
layout: results are deterministic (no atomics).

Chains: reductions that run one after another over the same rows, each stage reading what
the stage before computed at every element (a LayerNorm: the mean, then the variance of
``x - mean``, then the normalisation).  As separate dispatches each stage re-reads the row from
memory and the centered row is written and read back once more; on the H200 a LayerNorm over
(1500, 384) took two ~10 µs latency-bound dispatches.  Here the row stays in registers: each
invocation holds at most ``CHAIN_PER_LANE`` of a row's elements, so rows of up to
``CHAIN_MAX_REDUCED`` elements (256 invocations) fit one workgroup.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import bool_
from ..errors import LimitError
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
    combine,
    convert,
    coords_code,
    emit_instrs,
    identity,
    index_code,
    load,
    make_grid,
    make_target,
    module_header,
    module_source,
    pow2ceil,
    prod,
    reg_type,
    store_value,
    u,
)
from .ir import KernelSpec, MultiReduceKernel, ReduceMember, Strided
from .reduce import MAX_THREADS, SERIAL_MAX, _extra_strides, _Reduce, _rel, _used

CHAIN_PER_LANE = 16  # a row's elements one invocation keeps in registers
CHAIN_MAX_REDUCED = CHAIN_PER_LANE * MAX_THREADS  # 4096: the longest row one workgroup holds


@kernel_family("multi_reduce", MultiReduceKernel)
def emit(k: MultiReduceKernel, limits=None, features=None, alias=None) -> KernelSpec:
    return _Reduce(k, make_target(limits, features), alias).spec()


@dataclass(frozen=True)
class ChainReduceKernel:
    """Reductions of one iteration ``shape`` over the same ``axes``, one after another, in one
    dispatch.  ``stages[j]`` is a ``ReduceMember`` whose prologue and post pass read
    ``("in", i)`` (the shared ``inputs``, Strided over ``shape``) and ``("c", q)``: post output
    ``q`` of the earlier stages (numbered across them in order) at the same element, kept in
    registers; its post pass also reads ``("r", 0)``, the stage's own result (after its
    epilogue, which reads ``("acc", 0)`` and the shared ``extra`` inputs ``("x", i)``, Strided
    over the output shape).  Every stage but the last has a post pass.  ``stored[j]``: one
    flag for the stage's result, then one per post output: which are written (contiguous over
    the output shape, resp. over ``shape``); the others live in registers only.  Bindings:
    inputs, extra, then per stage its stored outputs in order."""

    shape: tuple[int, ...]
    axes: tuple[int, ...]
    inputs: tuple[Strided, ...]
    stages: tuple[ReduceMember, ...]
    stored: tuple[tuple[bool, ...], ...]
    extra: tuple[Strided, ...] = ()
    name: str = "chain_reduce"


@kernel_family("chain_reduce", ChainReduceKernel)
def emit_chain(k: ChainReduceKernel, limits=None, features=None, alias=None) -> KernelSpec:
    return _Chain(k, make_target(limits, features), alias).spec()


def chain_fits(k: ChainReduceKernel) -> bool:
    """Whether ``k`` can be emitted for WebGPU's guaranteed limits (its rows fit one
    workgroup's registers in its layout; bindings, binding sizes, f16 without the feature):
    the rewrite that builds chains asks this before replacing two kernels by one, so a chain
    never fails where the two kernels would have run."""
    try:
        _Chain(k, make_target(None, None), None)
    except (CodegenError, LimitError):
        return False
    return True


class _Chain(_Reduce):
    """The generator of a ``ChainReduceKernel``: the analysis of ``_Reduce`` (axes, dtypes,
    merged strides) over its stages as members, its own bindings, layout and WGSL.  Each
    invocation loads its ``per`` elements of the row once (element ``y + s·TY``: coalesced),
    then per stage: the prologue at each element, a fixed pairwise tree over its registers,
    the fixed lane tree in workgroup memory (every lane reads the total), the epilogue, and
    the post pass at each element into registers.  The summation order depends only on the
    shapes: deterministic."""

    def __init__(self, k: ChainReduceKernel, t, alias):
        view = MultiReduceKernel(k.shape, k.axes, k.inputs, k.stages, k.extra, 1, k.name)
        self.chain = k
        self.k, self.t, self.name, self.archetype = view, t, k.name, "chain_reduce"
        self.n_front = len(k.inputs)
        self._axes()
        self._members()
        self._check_stages()
        self._operands(alias)
        self._merge()
        self._layout()

    def _check_stages(self) -> None:
        k, name = self.chain, self.name
        if len(k.stages) < 2:
            raise CodegenError(f"kernel {name!r}: a chain needs at least two stages")
        if len(k.stored) != len(k.stages) or any(
                len(f) != 1 + len(m.post_outputs) for f, m in zip(k.stored, k.stages)):
            raise CodegenError(f"kernel {name!r}: stored flags {k.stored} do not match the "
                               "stages' outputs")
        if any(not m.post for m in k.stages[:-1]):
            raise CodegenError(f"kernel {name!r}: every stage but the last needs a post pass")
        if self.red_total > CHAIN_MAX_REDUCED:
            raise CodegenError(f"kernel {name!r}: reduced extent {self.red_total} > "
                               f"{CHAIN_MAX_REDUCED}, a row does not fit one workgroup")
        self.c_base, n_c = [], 0  # first ("c", q) number of each stage's post outputs
        for j, m in enumerate(k.stages):
            self.c_base.append(n_c)
            for kd, q in _args(m.prologue + m.post):
                if kd == "c" and not 0 <= q < n_c:
                    raise CodegenError(f"kernel {name!r} stage {j} reads ('c', {q}); the "
                                       f"earlier stages have {n_c} post outputs")
            for kd, q in _args(m.epilogue):
                if kd not in ("acc", "t", "x"):
                    raise CodegenError(f"kernel {name!r} stage {j}: epilogue operand "
                                       f"{(kd, q)!r} (('acc', 0) or ('x', i))")
            n_c += len(m.post_outputs)

    def _operands(self, alias) -> None:
        k, name, t, shape = self.k, self.name, self.t, self.shape
        self.n_in, self.n_x = len(k.inputs), len(k.extra)
        bind = [s.dtype for s in k.inputs + k.extra]
        self.in_b = list(range(self.n_in))
        self.slots = []  # per stage: binding of the result, then of each post output (or None)
        for j, flags in enumerate(self.chain.stored):
            slots = []
            for f, dt in zip(flags, [self.out_t[j]] + self.post_dts[j], strict=True):
                slots.append(len(bind) if f else None)
                bind += [dt] if f else []
            self.slots.append(slots)
        instrs = [i for m in k.members for i in m.prologue + m.epilogue + m.post]
        self.uses_f16 = check_dtypes(name, bind + [i.dtype for i in instrs], t)
        self.bd = Bindings(bind, alias)
        check_bindings(name, self.bd.n, t)
        self.used = sorted({i for m in k.members for i in _used(m.prologue, "in", self.n_in,
                                                                "prologue reads input", name)})
        self.used_p = sorted({i for m in k.members
                              for i in _used(m.post, "in", self.n_in, "post reads input", name)})
        self.used_all = sorted(set(self.used) | set(self.used_p))
        self.used = self.used_all  # every input is loaded once, before the first stage
        self.used_x = sorted({i for m in k.members for i in _used(
            m.epilogue, "x", self.n_x, "epilogue reads extra input", name)})
        self.xst = {i: _extra_strides(k.extra[i], shape, self.axes, self.out_shape,
                                      f"{name} extra {i}") for i in self.used_x}
        for i in self.used_x:
            check_extent(name, f"extra input {i}", k.extra[i], self.out_shape, self.xst[i], t)
        self.full = {i: bcast_strides(k.inputs[i], shape, f"{name} input {i}")
                     for i in self.used_all}
        for i in self.used_all:
            check_extent(name, f"input {i}", k.inputs[i], shape, self.full[i], t)
        for slots in self.slots:
            for q, s in enumerate(slots):
                if s is not None:
                    n = self.out_total if q == 0 else prod(shape)
                    check_binding_size(name, "output", n, bind[s], t)

    def _layout(self) -> None:
        """One invocation per row for rows of ≤ ``SERIAL_MAX`` elements (``TX`` rows per
        workgroup); else ``TY`` lanes per row, each holding ``per`` elements: one row per
        workgroup, or 32 neighbouring rows when the kept dims are contiguous in memory (a
        column reduction: neighbouring lanes read neighbouring addresses), which holds rows
        of at most ``CHAIN_PER_LANE * MAX_THREADS / 32`` elements."""
        t, name, red = self.t, self.name, self.red_total
        max_threads = min(MAX_THREADS, t.lim("max_compute_invocations_per_workgroup"))
        if red <= SERIAL_MAX:
            self.tx = min(max_threads, 64 if self.out_total >= 64 else pow2ceil(self.out_total))
            self.ty = 1
        elif self._kept_contig() and self.out_total > 1:
            self.tx = min(32, max_threads, pow2ceil(self.out_total))
            self.ty = max(1, min(max_threads // self.tx, pow2ceil(red)))
        else:
            self.tx, self.ty = 1, min(max_threads, pow2ceil(red))
        self.per = -(-red // self.ty)
        if self.per > CHAIN_PER_LANE:
            raise CodegenError(f"kernel {name!r}: {self.per} elements per invocation "
                               f"> {CHAIN_PER_LANE} (reduced extent {red})")
        self.chunk, self.split = red, 1
        self.wg = self.tx * self.ty
        check_invocations(name, self.wg, t)
        self.shared_bytes = self.wg * 4 * len(self.k.members) if self.ty > 1 else 0
        check_workgroup_storage(name, self.shared_bytes, t)
        self.owgs = -(-max(self.out_total, 1) // self.tx)
        self.grid = make_grid(name, self.owgs, t)

    # -- WGSL ----------------------------------------------------------------------------------
    def _load_row(self, body: list[str], ind: str) -> None:
        """This invocation's output ``o`` and elements ``r{s}`` (``ok{s}``: it exists), every
        input read once into registers ``v{i}_{s}`` (zero where the element does not)."""
        k, tx, ty, red = self.k, self.tx, self.ty, self.red_total
        body.append(f"{ind}let wg = {self.grid.wg_expr};")
        if tx > 1:
            body += [f"{ind}let x = lid % {u(tx)};", f"{ind}let y = lid / {u(tx)};",
                     f"{ind}let o = wg * {u(tx)} + x;"]
        else:
            body += [f"{ind}let x = 0u;", f"{ind}let y = lid;", f"{ind}let o = wg;"]
        body.append(f"{ind}let valid = o < {u(self.out_total)};")
        kc = coords_code("o", self.kshape, "k", body, ind)
        for i in self.used:
            body.append(f"{ind}let base{i} = {index_code(kc, self.kin[i], k.inputs[i].offset)};")
        body.append(f"{ind}let obase = {index_code(kc, self.kpost, 0)};")
        self.oidx = []
        for s in range(self.per):
            body.append(f"{ind}let r{s} = {f'y + {u(s * ty)}' if ty > 1 else u(s)};")
            every = (s + 1) * ty <= red  # element s exists in every lane
            body.append(f"{ind}let ok{s} = {'valid' if every else f'valid && r{s} < {u(red)}'};")
            rc = coords_code(f"r{s}", self.rshape, f"rr{s}_", body, ind)
            for i in self.used:
                dt = k.inputs[i].dtype
                v = load(self.bd.name(self.in_b[i]), _rel(f"base{i}", rc, self.rin[i]), dt)
                body += [f"{ind}var v{i}_{s}: {reg_type(dt)};",
                         f"{ind}if (ok{s}) {{ v{i}_{s} = {v}; }}"]
            self.oidx.append(_rel("obase", rc, self.rpost))

    def _extras(self, L: list[str], ind: str) -> dict:
        """The extra inputs at this output, loaded once where the first epilogue needs them
        (zero in invocations past the last output: every lane runs every line)."""
        if self.xnames is None:
            k, self.xnames = self.k, {}
            kc = coords_code("o", self.kshape, "ko", L, ind)
            for i in self.used_x:
                dt = k.extra[i].dtype
                e = load(self.bd.name(self.n_front + i),
                         index_code(kc, self.kx[i], k.extra[i].offset), dt)
                L += [f"{ind}var e{i}: {reg_type(dt)};", f"{ind}if (valid) {{ e{i} = {e}; }}"]
                self.xnames[i] = (f"e{i}", dt)
        return self.xnames

    def _operand(self, a, s: int, regs: list, result=None):
        """A stage operand at element ``s``: an input, an earlier post output, the result."""
        if a[0] == "in":
            return f"v{a[1]}_{s}", self.k.inputs[a[1]].dtype
        if a[0] == "c":
            return regs[a[1]][s]
        if a == ("r", 0) and result is not None:
            return result
        raise CodegenError(f"kernel {self.name!r}: operand {a!r}")

    def _reduce_stage(self, body: list[str], ind: str, j: int, m, regs: list) -> None:
        """Stage ``j``'s prologue at each element, a fixed pairwise tree over the
        invocation's elements, then the lanes' tree; ``total{j}`` in every lane."""
        acc_t, parts = self.acc_t[j], []
        if not m.prologue:
            raise CodegenError(f"kernel {self.name!r} stage {j} needs a prologue")
        for s in range(self.per):
            val, vdt = emit_instrs(m.prologue, lambda a, s=s: self._operand(a, s, regs),
                                   f"p{j}_{s}_", body, ind, self.helpers)[-1]
            v = f"select(0u, 1u, {val})" if vdt is bool_ else convert(val, vdt, acc_t)
            body.append(f"{ind}let a{j}_{s} = select({identity(m.kind, acc_t)}, {v}, ok{s});")
            parts.append(f"a{j}_{s}")
        while len(parts) > 1:  # fixed pairwise tree: deterministic
            pairs = [combine(m.kind, parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
            parts = pairs + parts[len(pairs) * 2:]
        if self.ty == 1:
            body.append(f"{ind}let total{j} = {parts[0]};")
            return
        body += [f"{ind}red{j}[lid] = {parts[0]};", f"{ind}workgroupBarrier();"]
        h = self.ty // 2
        while h >= 1:
            other = f"red{j}[lid + {u(h * self.tx)}]"
            body += [f"{ind}if (y < {u(h)}) {{ red{j}[lid] = "
                     f"{combine(m.kind, f'red{j}[lid]', other)}; }}",
                     f"{ind}workgroupBarrier();"]
            h //= 2
        body.append(f"{ind}let total{j} = red{j}[x];")

    def _finish_stage(self, body: list[str], ind: str, j: int, m, regs: list) -> None:
        """Stage ``j``'s epilogue and stored result, then its post pass at each element
        (outputs kept in registers as ``("c", q)`` for later stages, stored where flagged)."""
        result = self._result(body, ind, j, m)
        slots = self.slots[j]
        if slots[0] is not None:
            st = store_value(result[0], result[1], self.out_t[j])
            body.append(f"{ind}if (valid && y == 0u) {{ {self.bd.name(slots[0])}[o] = {st}; }}")
        if not m.post:
            return
        outs = [[] for _ in m.post_outputs]
        for s in range(self.per):
            res = emit_instrs(m.post, lambda a, s=s: self._operand(a, s, regs, result),
                              f"s{j}_{s}_", body, ind, self.helpers)
            for q, ins in enumerate(m.post_outputs):
                outs[q].append(res[ins])
                if slots[1 + q] is not None:
                    st = store_value(*res[ins], m.post[ins].dtype)
                    body.append(f"{ind}if (ok{s}) {{ {self.bd.name(slots[1 + q])}"
                                f"[{self.oidx[s]}] = {st}; }}")
        regs += outs

    def spec(self) -> KernelSpec:
        ind, body, regs = "    ", [], []
        self.helpers: set[str] = set()
        if any(a.is_float and m.kind != "sum" for a, m in zip(self.acc_t, self.k.members,
                                                               strict=True)):
            self.helpers.add("mn_inf")  # the identity of max/min
        self.xnames = None
        self._load_row(body, ind)
        for j, m in enumerate(self.chain.stages):
            self._reduce_stage(body, ind, j, m, regs)
            self._finish_stage(body, ind, j, m, regs)
        lines = module_header(self.uses_f16) + self.bd.decls()
        if self.ty > 1:
            lines += [f"var<workgroup> red{j}: array<{a.wgsl}, {self.wg}>;"
                      for j, a in enumerate(self.acc_t)]
        meta = {"archetype": self.archetype, "layout": (self.tx, self.ty),
                "workgroup_size": self.wg, "workgroup_storage": self.shared_bytes,
                "binding_dtypes": tuple(self.bd.dtypes), "reduced": self.red_total,
                "outputs": self.out_total, "split": 1, "stages": len(self.k.members),
                "per_lane": self.per}
        return KernelSpec(name=self.name, wgsl=module_source(lines, self.helpers, self.wg, body),
                          n_bindings=self.bd.n, workgroups=self.grid.workgroups, meta=meta)


def _args(instrs) -> list[tuple[str, int]]:
    return [a for ins in instrs for a in ins.args]
