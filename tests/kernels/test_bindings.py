"""Binding slots that share one buffer range (``emit(..., alias=…)``): the WGSL declares each
range once, and matches what runtime/session.py's former text rewrite (``_share_bindings``,
copied below as the oracle) produced from the unshared kernel; on the GPU the shared kernels
compute what numpy does."""

import dataclasses
import re

import numpy as np
import pytest

from meganeura import kernels
from meganeura.dtypes import f32, i32
from meganeura.kernels import (
    CodegenError,
    Instr,
    MatmulKernel,
    PointwiseKernel,
    ReduceKernel,
    Strided,
    binding_aliases,
)
from meganeura.kernels.attention import AttentionKernel
from meganeura.kernels.attention import emit as emit_attention
from meganeura.kernels.concat import ConcatKernel
from meganeura.kernels.conv import Conv2dKernel, ConvGeom
from meganeura.kernels.gather import DynamicUpdateSliceKernel, EmbeddingKernel
from meganeura.kernels.pool import AvgPoolKernel, PoolGeom

from ._util import assert_close


def _share_bindings(spec, binds):
    """The oracle: runtime/session.py's text rewrite, as it was."""
    first: dict = {}
    drop: dict[int, int] = {}
    for i, loc in enumerate(binds):
        if loc in first:
            drop[i] = first[loc]
        else:
            first[loc] = i
    if not drop:
        return spec, binds
    src = spec.wgsl
    for j, i in drop.items():
        src = re.sub(rf"^.*@binding\({j}\) var<storage, read_write> b{j}:.*\n", "", src,
                     flags=re.M)
        src = re.sub(rf"\bb{j}\[", f"b{i}[", src)
        src = re.sub(rf"&b{j}\b", f"&b{i}", src)
    keep = [i for i in range(len(binds)) if i not in drop]
    for new, old in enumerate(keep):  # binding numbers must stay dense: 0..n-1
        src = src.replace(f"@binding({old}) var", f"@binding(@{new}@) var")
    src = re.sub(r"@binding\(@(\d+)@\) var", r"@binding(\1) var", src)
    spec = dataclasses.replace(spec, wgsl=src, n_bindings=len(keep))
    return spec, [binds[i] for i in keep]


C = Strided.contiguous
MUL = "({0} * {1})"


def _pointwise(n=1000):
    return PointwiseKernel((n,), (C(f32, (n,)), C(f32, (n,))),
                           (Instr(MUL, (("in", 0), ("in", 1)), f32),), (0,))


def _reduce(shape=(6, 300)):
    return ReduceKernel(shape, (1,), "sum", (C(f32, shape), C(f32, shape)),
                        (Instr(MUL, (("in", 0), ("in", 1)), f32),))


def _matmul(n=48, variant=""):
    return MatmulKernel(1, n, n, n, C(f32, (1, n, n)), C(f32, (1, n, n)), variant=variant)


def _concat(n=37):
    return ConcatKernel((2 * n,), 0, (C(f32, (n,)), C(f32, (n,))), f32)


def _attention():
    q = C(f32, (1, 2, 5, 8))
    return AttentionKernel("fwd", q, q, q, None, None, None, None, True, 0.3, 0, 0)


def _conv():
    g = ConvGeom(2, 4, 6, 6, 4, 3, 3, 4, 4)
    x = C(f32, (2, 4, 6, 6))
    return Conv2dKernel(g, x, C(f32, (4, 4, 3, 3)), C(f32, (4,)), extra=(C(f32, (2, 4, 4, 4)),),
                        epilogue=(Instr("({0} + {1})", (("acc", 0), ("x", 0)), f32),))


CASES = {
    "pointwise": (_pointwise(), ["x", "x", "y"]),
    "reduce": (_reduce(), ["x", "x", "y"]),
    "matmul_tiled": (_matmul(), ["x", "x", "y"]),
    "matmul_gemv": (_matmul(4, "gemv"), ["x", "x", "y"]),
    "concat": (_concat(), ["x", "x", "y"]),
    "attention_qkv": (_attention(), ["q", "q", "q", "o", "l"]),
    "attention_kv": (_attention(), ["q", "k", "k", "o", "l"]),
    "conv_residual": (_conv(), ["x", "w", "b", "r", "r"]),
    "embedding": (EmbeddingKernel(C(i32, (5,)), C(f32, (7, 3))), ["t", "t", "o"]),
    "dynamic_update_slice": (
        DynamicUpdateSliceKernel(C(f32, (4, 6)), C(i32, (1,)), 1, 2, C(f32, (4, 2)),
                                 in_place=True), ["c", "u", "s", "c"]),
    "avg_pool": (AvgPoolKernel(PoolGeom(1, 2, 6, 6, 2, 2, 3, 3, (2, 2), (0, 0)),
                               C(f32, (1, 2, 6, 6)), True, f32), ["x", "x"]),
}


def _emit(desc, alias=None):
    if isinstance(desc, AttentionKernel) and type(desc) is AttentionKernel:
        return emit_attention(desc, None, None, alias)
    return kernels.emit(desc, alias=alias)


def _decl_types(wgsl: str) -> dict[int, str]:
    """Slot index -> declared array element type (``b3: array<vec4<f32>>`` -> 3: vec4<f32>)."""
    import re

    return {int(m[1]): m[2] for m in re.finditer(r"> b(\d+): array<(.+)>;", wgsl)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_alias_matches_text_rewrite(case):
    desc, binds = CASES[case]
    plain = _emit(desc)
    alias = binding_aliases(binds)
    types = _decl_types(plain.wgsl)
    if isinstance(desc, MatmulKernel) and any(
            types.get(i, "").startswith("vec") or types.get(a, "").startswith("vec")
            for i, a in enumerate(alias) if a != i):
        # vec4 loads on a shared range: the matmul emitter falls back to scalar reads for
        # shared slots (their layouts may differ), which the text rewrite did not do;
        # correctness is checked on the GPU below
        got = _emit(desc, alias)
        assert got.n_bindings == len(set(alias)) and "vec4<f32>>;" not in got.wgsl.split(
            "var<workgroup>")[0]
        return
    want, kept = _share_bindings(plain, binds)
    got = _emit(desc, alias)
    assert got.wgsl == want.wgsl
    assert got.n_bindings == want.n_bindings == len(kept)
    assert got.workgroups == want.workgroups


def test_identity_alias_is_no_sharing():
    desc = _reduce()
    assert _emit(desc, (0, 1, 2)) == _emit(desc)


def test_binding_aliases():
    assert binding_aliases(["a", "b", "a", "c", "b"]) == (0, 1, 0, 3, 1)
    assert binding_aliases([]) == ()


@pytest.mark.parametrize("alias", [(0, 0), (1, 1, 2), (0, 2, 2), (0, 0, 1)])
def test_bad_alias(alias):
    """Wrong length, a slot pointing past itself, or at a slot that is itself aliased."""
    with pytest.raises(CodegenError, match="alias"):
        _emit(_reduce(), alias)


# ------------------------------------------------------------------------------ on the GPU


def test_pointwise_reads_one_buffer_twice(run, rng):
    x = rng.standard_normal(1000).astype(np.float32)
    (y,) = run(_pointwise(), [x, x], [((1000,), f32)], alias=(0, 0, 2))
    assert_close(y, x * x, 1e-6)


def test_reduce_reads_one_buffer_twice(run, rng):
    x = rng.standard_normal((6, 300)).astype(np.float32)
    (y,) = run(_reduce(), [x, x], [((6,), f32)], alias=(0, 0, 2))
    assert_close(y, (x.astype(np.float64) ** 2).sum(1), 1e-5)


@pytest.mark.parametrize("n,variant", [(48, ""), (4, "gemv")])
def test_matmul_a_and_b_one_buffer(run, rng, n, variant):
    x = rng.standard_normal((1, n, n)).astype(np.float32)
    (y,) = run(_matmul(n, variant), [x, x], [((1, n, n), f32)], alias=(0, 0, 2))
    assert_close(y, x.astype(np.float64) @ x, 1e-5, 1e-5)


def test_concat_of_one_buffer_twice(run, rng):
    x = rng.standard_normal(37).astype(np.float32)
    (y,) = run(_concat(), [x, x], [((74,), f32)], alias=(0, 0, 2))
    np.testing.assert_array_equal(y, np.concatenate([x, x]))


def test_limit_counts_shared_ranges_once(run, rng):
    """The storage-buffer limit counts declared bindings, not slots: the split-K sum of 16
    partials reads 16 views of one temp (17 slots, 2 ranges), which must emit under WebGPU's
    default of 8 (Dawn on the H200 allows 16: counting slots failed Whisper's 16-way sum) and
    sum the partials in order; unshared, the same slots exceed the limit."""
    from meganeura.compile.schedule import split_k_sum_pointwise
    from meganeura.errors import LimitError

    desc = split_k_sum_pointwise(f32, (16, 3, 8))
    alias = (0,) * 16 + (16,)
    assert _emit(desc, alias).n_bindings == 2
    with pytest.raises(LimitError, match="17 storage buffers"):
        _emit(desc)
    tmp = rng.standard_normal((16, 3, 8)).astype(np.float32)
    (y,) = run(desc, [tmp] * 16, [((3, 8), f32)], alias=alias)
    want = tmp[0].copy()
    for j in range(1, 16):
        want = want + tmp[j]  # f32, in split order
    np.testing.assert_array_equal(y, want)
