"""The vec4 variant of the pointwise emitter (four elements per invocation): when it is chosen,
when it falls back to one element per invocation, and that it computes what numpy (float64)
and the scalar variant compute — bit for bit, since each lane runs the scalar instructions."""

import numpy as np
import pytest

from meganeura import kernels as codegen
from meganeura.dtypes import bool_, f16, f32, i32, u32
from meganeura.kernels import CodegenError, Instr, PointwiseKernel, Strided
from meganeura.kernels import pointwise as pw

from ._util import assert_close, view_of

C = Strided.contiguous
SCALAR, X4 = (1,), (4,)
# w - lr * g (SGD), and an AdamW-like update: 4 inputs (w, g, m, v), 3 outputs (w, m, v)
SGD = [Instr("({0} * 0.01)", (("in", 1),), f32), Instr("({0} - {1})", (("in", 0), ("t", 0)), f32)]
ADAMW = [
    Instr("(0.9 * {0} + 0.1 * {1})", (("in", 2), ("in", 1)), f32),  # t0 m
    Instr("(0.999 * {0} + 0.001 * {1} * {1})", (("in", 3), ("in", 1)), f32),  # t1 v
    Instr("({0} / (sqrt({1}) + 1e-8))", (("t", 0), ("t", 1)), f32),  # t2
    Instr("({0} - 0.001 * ({1} + 0.01 * {0}))", (("in", 0), ("t", 2)), f32),  # t3 w
]


def _pk(shape, inputs, instrs, outputs=None, config=()):
    return PointwiseKernel(tuple(shape), tuple(inputs), tuple(instrs),
                           tuple(outputs if outputs is not None else (len(instrs) - 1,)),
                           "pw", config)


def _variant(spec) -> str:
    return spec.meta.get("variant", "pointwise")


def _sgd_ref(w, g):
    return w.astype(np.float64) - np.float64(np.float32(0.01)) * g


@pytest.mark.parametrize("n", [4, 8, 1024, 4 * 257])
def test_multiples_of_four_run_vec4(run, rng, n):
    w, g = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    (y,) = run(_pk((n,), [C(f32, (n,))] * 2, SGD), [w, g], [((n,), f32)])
    assert _variant(run.last_spec) == "pointwise_x4"
    assert "array<vec4<f32>>" in run.last_spec.wgsl
    assert_close(y, _sgd_ref(w, g), 1e-6, 1e-7, what=f"sgd n={n}")


@pytest.mark.parametrize("n", [5, 6, 7, 4 * 33 + 1, 4 * 33 + 3])
def test_other_sizes_fall_back_to_scalar(run, rng, n):
    w, g = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    (y,) = run(_pk((n,), [C(f32, (n,))] * 2, SGD), [w, g], [((n,), f32)])
    assert _variant(run.last_spec) == "pointwise" and "vec4" not in run.last_spec.wgsl.split(
        "fn main")[0]
    assert_close(y, _sgd_ref(w, g), 1e-6, 1e-7, what=f"sgd n={n}")


@pytest.mark.parametrize("off", [1, 2, 3, 4])
def test_input_offsets(run, rng, off):
    """x[off:off+16]: an offset that is not a multiple of 4 elements cannot be a vec4 index
    (16-byte alignment), so the kernel runs scalar; offset 4 stays vectorized."""
    base = rng.standard_normal(24).astype(np.float32)
    k = _pk((16,), [view_of(base, base[off:off + 16])], [Instr("({0} * 2.0)", (("in", 0),), f32)])
    (y,) = run(k, [base], [((16,), f32)])
    assert _variant(run.last_spec) == ("pointwise_x4" if off % 4 == 0 else "pointwise")
    np.testing.assert_array_equal(y, base[off:off + 16] * 2)
    if off % 4:
        with pytest.raises(CodegenError, match="asks for vec4"):
            codegen.emit(_pk((16,), k.inputs, k.instrs, config=X4))


def test_broadcast_operands_row_splat_and_scalar(run, rng):
    """A bias over rows (``row``: vec4 at its own index), a per-row value (``splat``: one
    scalar for four lanes), a rank-0 scalar and a full tensor, in one kernel."""
    m, n = 6, 12
    x = rng.standard_normal((m, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal((m, 1)).astype(np.float32)
    s = np.array(1.5, np.float32)
    k = _pk((m, n), [C(f32, (m, n)), C(f32, (n,)), C(f32, (m, 1)), C(f32, ())],
            [Instr("(({0} + {1}) * {2} - {3})", (("in", 0), ("in", 1), ("in", 2), ("in", 3)),
                   f32)])
    (y,) = run(k, [x, b, r, s], [((m, n), f32)])
    assert _variant(run.last_spec) == "pointwise_x4"
    assert run.last_spec.wgsl.count("array<vec4<f32>>") == 3  # x, b and the output
    assert_close(y, (x.astype(np.float64) + b) * r - s, 1e-6, 1e-6, what="row/splat")


@pytest.mark.parametrize("inner", [6, 10])
def test_inner_extent_not_multiple_of_four_falls_back(run, rng, inner):
    x = rng.standard_normal((4, inner)).astype(np.float32)
    b = rng.standard_normal(inner).astype(np.float32)
    k = _pk((4, inner), [C(f32, (4, inner)), C(f32, (inner,))],
            [Instr("({0} + {1})", (("in", 0), ("in", 1)), f32)])
    (y,) = run(k, [x, b], [((4, inner), f32)])
    assert _variant(run.last_spec) == "pointwise"  # 24 / 40 elements, but rows of 6 / 10
    np.testing.assert_array_equal(y, x + b)


def test_transposed_input_falls_back(run, rng):
    base = rng.standard_normal((8, 4)).astype(np.float32)
    k = _pk((4, 8), [view_of(base, base.T)], [Instr("({0} + 1.0)", (("in", 0),), f32)])
    (y,) = run(k, [base], [((4, 8), f32)])
    assert _variant(run.last_spec) == "pointwise"
    np.testing.assert_array_equal(y, base.T + 1)


def test_several_outputs_and_integer_dtypes(run, rng):
    """bool in and out (stored as u32 vectors), i32 and u32 arithmetic, an f32 output."""
    n = 64
    a = rng.standard_normal(n).astype(np.float32) * 10
    m = rng.integers(0, 2, n).astype(bool)
    j = rng.integers(-50, 50, n).astype(np.int32)
    q = rng.integers(0, 1000, n).astype(np.uint32)
    instrs = [Instr("({0} > 0.0)", (("in", 0),), bool_),  # t0
              Instr("({0} != {1})", (("t", 0), ("in", 1)), bool_),  # t1 xor
              Instr("select(-{0}, {0} * 3, {1})", (("in", 2), ("t", 1)), i32),  # t2
              Instr("({0} % 7u)", (("in", 3),), u32),  # t3
              Instr("select(0.0, {0}, {1})", (("in", 0), ("t", 1)), f32)]  # t4
    k = _pk((n,), [C(f32, (n,)), C(bool_, (n,)), C(i32, (n,)), C(u32, (n,))], instrs,
            outputs=(1, 2, 3, 4))
    outs = run(k, [a, m, j, q], [((n,), bool_), ((n,), i32), ((n,), u32), ((n,), f32)])
    assert _variant(run.last_spec) == "pointwise_x4"
    t1 = (a > 0) != m
    np.testing.assert_array_equal(outs[0], t1)
    np.testing.assert_array_equal(outs[1], np.where(t1, j * 3, -j))
    np.testing.assert_array_equal(outs[2], q % 7)
    np.testing.assert_array_equal(outs[3], np.where(t1, a, 0).astype(np.float32))


def test_f16_vectors(run, dev, rng):
    if not dev.has_f16:
        pytest.skip("device has no shader-f16")
    n = 32
    a = rng.standard_normal(n).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float32)
    k = _pk((n,), [C(f16, (n,)), C(f32, (n,))],
            [Instr("({0} * 2.0h)", (("in", 0),), f16), Instr("f32({0})", (("t", 0),), f32),
             Instr("({0} + {1})", (("t", 1), ("in", 1)), f32)], outputs=(0, 2))
    h, s = run(k, [a, b], [((n,), f16), ((n,), f32)])
    assert _variant(run.last_spec) == "pointwise_x4" and "array<vec4<f16>>" in run.last_spec.wgsl
    np.testing.assert_array_equal(h, a * np.float16(2))
    assert_close(s, (a * np.float16(2)).astype(np.float64) + b, 1e-6, what="f16 -> f32")


def test_bit_identical_to_scalar(run, rng):
    """The AdamW-like update (4 inputs, 3 outputs) and a tanh-GELU chain (helpers) against
    the scalar variant: the same bits (each lane runs the scalar instructions), and close to
    float64.  n leaves a partial last workgroup."""
    n = 4 * 700
    w, g, m = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    v = rng.random(n).astype(np.float32)
    ins = [C(f32, (n,))] * 4
    shapes = [((n,), f32)] * 3
    scalar = run(_pk((n,), ins, ADAMW, outputs=(3, 0, 1), config=SCALAR), [w, g, m, v], shapes)
    vec = run(_pk((n,), ins, ADAMW, outputs=(3, 0, 1), config=X4), [w, g, m, v], shapes)
    assert run.last_spec.meta["config"] == X4
    for a, b in zip(scalar, vec, strict=True):
        np.testing.assert_array_equal(a, b)
    m1 = 0.9 * m.astype(np.float64) + 0.1 * g
    v1 = 0.999 * v.astype(np.float64) + 0.001 * g * g
    assert_close(vec[1], m1, 1e-6, 1e-7, what="m")
    assert_close(vec[2], v1, 1e-6, 1e-7, what="v")
    gelu = [Instr("(0.5 * {0} * (1.0 + mn_tanh(0.7978846 * ({0} + 0.044715 * {0} * {0} * {0}))))",
                  (("in", 0),), f32, ("mn_tanh",))]
    (gs,) = run(_pk((n,), ins[:1], gelu, config=SCALAR), [w], shapes[:1])
    (gv,) = run(_pk((n,), ins[:1], gelu, config=X4), [w], shapes[:1])
    np.testing.assert_array_equal(gs, gv)


def test_in_place_update_shares_the_vector_binding(dev, rng):
    """An in-place update binds input 0 and the output to one range (one vec4 array)."""
    n = 40
    w, g = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    spec = codegen.emit(_pk((n,), [C(f32, (n,))] * 2, SGD), dev.limits, dev.features,
                        alias=(0, 1, 0))
    assert spec.n_bindings == 2 and _variant(spec) == "pointwise_x4"
    wb = dev.upload(w)
    dev.dispatch(spec, [wb, dev.upload(g)])
    assert_close(dev.read_array(wb, (n,), f32), _sgd_ref(w, g), 1e-6, 1e-7, what="in place")


def test_range_bound_as_vectors_and_as_splat_falls_back(run, rng):
    """One buffer read as a full tensor (vec4) and as a per-row scalar (splat) cannot be one
    declaration of each kind: the scalar variant runs."""
    x = rng.standard_normal((4, 4)).astype(np.float32)
    col = Strided(f32, (4, 4), (4, 0), 0, 16)  # x[:, :1] broadcast along rows
    k = _pk((4, 4), [C(f32, (4, 4)), col], [Instr("({0} - {1})", (("in", 0), ("in", 1)), f32)])
    (y,) = run(k, [x, x], [((4, 4), f32)], alias=(0, 0, 2))
    assert _variant(run.last_spec) == "pointwise"
    np.testing.assert_array_equal(y, x - x[:, :1])


def test_grid_wraps_2d_and_3d(run, dev, rng):
    """5,120 vec4s = 20 workgroups of 256 invocations."""
    n = 20480
    a = rng.standard_normal(n).astype(np.float32)
    k = _pk((n,), [C(f32, (n,))], [Instr("({0} * 3.0 + 1.0)", (("in", 0),), f32)])
    for maxdim, expect in ((5, (5, 4, 1)), (3, (3, 3, 3)), (65535, (20, 1, 1))):
        limits = dict(dev.limits, max_compute_workgroups_per_dimension=maxdim)
        (y,) = run(k, [a], [((n,), f32)], limits=limits)
        assert run.last_spec.workgroups == expect, maxdim
        assert_close(y, a.astype(np.float64) * 3.0 + 1.0, 1e-6, 1e-6, what=f"grid {expect}")


def test_bad_configs_are_refused_by_name():
    k = _pk((8,), [C(f32, (8,))], [Instr("({0} + 1.0)", (("in", 0),), f32)])
    for bad in ((2,), (8,), (4, 1), (1, 1)):
        with pytest.raises(CodegenError, match="config"):
            codegen.emit(_pk((8,), k.inputs, k.instrs, config=bad))
    odd = _pk((7,), [C(f32, (7,))], k.instrs, config=X4)
    with pytest.raises(CodegenError, match="asks for vec4"):
        codegen.emit(odd)


def test_heuristic_picks_vec4_only_when_legal():
    assert pw.choose_config({0: "vec", 1: "splat"}, 32) == X4
    assert pw.choose_config(None, 32) == SCALAR
