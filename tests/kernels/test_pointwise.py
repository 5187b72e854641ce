"""Pointwise emitter on the device vs numpy: broadcasting, views (transposes, slices with
offsets, negative steps), multiple outputs, dtypes, wrapped grids, limits."""

import dataclasses

import numpy as np
import pytest

from meganeura import kernels as codegen
from meganeura.dtypes import bool_, f16, f32, i32, u32
from meganeura.errors import DeviceError, LimitError
from meganeura.kernels import CodegenError, Instr, PointwiseKernel, Strided

from ._util import assert_close, view_of

ADD = "({0} + {1})"


def _pk(shape, inputs, instrs, outputs=None, name="pw", config=()):
    return PointwiseKernel(tuple(shape), tuple(inputs), tuple(instrs),
                           tuple(outputs if outputs is not None else (len(instrs) - 1,)), name,
                           config)


def test_contiguous_same_shape(run, rng):
    a = rng.standard_normal(1001).astype(np.float32)
    b = rng.standard_normal(1001).astype(np.float32)
    k = _pk((1001,), [Strided.contiguous(f32, (1001,))] * 2,
            [Instr(ADD, (("in", 0), ("in", 1)), f32),
             Instr("({0} * {1})", (("t", 0), ("in", 0)), f32)])
    (y,) = run(k, [a, b], [((1001,), f32)])
    assert_close(y, (a + b) * a, 1e-6, what="(a+b)*a")
    assert "i % " not in run.last_spec.wgsl  # contiguous: no index arithmetic


@pytest.mark.parametrize(
    "sa,sb",
    [((4, 1, 6), (5, 1)), ((1,), (3, 7)), ((2, 3, 1, 5), (3, 4, 1)), ((), (9,)), ((7, 1), (1, 8))],
)
def test_broadcasting(run, rng, sa, sb):
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    out = np.broadcast_shapes(sa, sb)
    k = _pk(out, [Strided.contiguous(f32, sa), Strided.contiguous(f32, sb)],
            [Instr("({0} - {1} * 2.0)", (("in", 0), ("in", 1)), f32)])
    (y,) = run(k, [a, b], [(out, f32)])
    assert_close(y, a - b * 2.0, 1e-6, what=f"{sa} - {sb}")


def test_views_transpose_slice_offset_negative_step(run, rng):
    base = rng.standard_normal((9, 12)).astype(np.float32)
    other = rng.standard_normal((40,)).astype(np.float32)
    views = [
        base.T[2:8, 1:6],  # transposed and sliced: offset and swapped strides
        base[1:6, 11:0:-2],  # negative step along the last axis
        base[::-2, 3:9][:5],  # negative step along the first axis
    ]
    for v in views:
        ov = other[5 : 5 + v.size].reshape(v.shape)  # offset into a flat buffer
        k = _pk(v.shape, [view_of(base, v), view_of(other, ov)],
                [Instr("max({0}, {1})", (("in", 0), ("in", 1)), f32),
                 Instr("({0} * {1})", (("t", 0), ("in", 0)), f32)])
        (y,) = run(k, [base, other], [(v.shape, f32)])
        assert_close(y, np.maximum(v, ov) * v, 1e-6, what=f"view strides {v.strides}")


def test_broadcast_view_with_stride_zero(run, rng):
    base = rng.standard_normal((3, 4)).astype(np.float32)
    v = np.broadcast_to(base[:, 1:2], (2, 3, 5))  # numpy gives stride 0 itself
    k = _pk((2, 3, 5), [view_of(base, v)], [Instr("exp({0})", (("in", 0),), f32)])
    (y,) = run(k, [base], [((2, 3, 5), f32)])
    assert_close(y, np.exp(v.astype(np.float64)), 1e-5, what="exp of broadcast column")


def test_rank0_and_rank5(run, rng):
    a = np.array(2.5, np.float32)
    k = _pk((), [Strided.contiguous(f32, ())], [Instr("({0} * {0})", (("in", 0),), f32)])
    (y,) = run(k, [a], [((), f32)])
    assert y.shape == () and y == 6.25
    s = (2, 3, 1, 4, 5)
    b = rng.standard_normal(s).astype(np.float32)
    c = rng.standard_normal((3, 1, 1, 5)).astype(np.float32)
    k = _pk(s, [Strided.contiguous(f32, s), Strided.contiguous(f32, (3, 1, 1, 5))],
            [Instr("({0} / {1})", (("in", 0), ("in", 1)), f32)])
    (y,) = run(k, [b, c], [(s, f32)])
    assert_close(y, b / c, 1e-6, what="rank 5")


def test_multiple_outputs_and_dtypes(run, rng):
    """One kernel: compare (bool out), where, cast to i32, integer arithmetic, bool ops."""
    n = 300
    a = rng.standard_normal(n).astype(np.float32) * 10
    b = rng.standard_normal(n).astype(np.float32) * 10
    m = rng.integers(0, 2, n).astype(bool)
    j = rng.integers(-50, 50, n).astype(np.int32)
    instrs = [
        Instr("({0} > {1})", (("in", 0), ("in", 1)), bool_),  # t0
        Instr("({0} && {1})", (("t", 0), ("in", 2)), bool_),  # t1
        Instr("select({2}, {1}, {0})", (("t", 1), ("in", 0), ("in", 1)), f32),  # t2 where
        Instr("i32({0})", (("t", 2),), i32),  # t3 cast (truncates)
        Instr("({0} * {1} - 3)", (("t", 3), ("in", 3)), i32),  # t4
        Instr("(!{0})", (("t", 1),), bool_),  # t5
        Instr("f32({0})", (("t", 5),), f32),  # t6 bool -> float
        Instr("abs({0})", (("in", 3),), i32),  # t7
    ]
    k = _pk((n,), [Strided.contiguous(f32, (n,)), Strided.contiguous(f32, (n,)),
                   Strided.contiguous(bool_, (n,)), Strided.contiguous(i32, (n,))],
            instrs, outputs=(1, 2, 4, 6, 7))
    outs = run(k, [a, b, m, j], [((n,), bool_), ((n,), f32), ((n,), i32), ((n,), f32), ((n,), i32)])
    t1 = (a > b) & m
    t2 = np.where(t1, a, b)
    np.testing.assert_array_equal(outs[0], t1)
    np.testing.assert_array_equal(outs[1], t2)
    np.testing.assert_array_equal(outs[2], np.trunc(t2).astype(np.int32) * j - 3)
    np.testing.assert_array_equal(outs[3], (~t1).astype(np.float32))
    np.testing.assert_array_equal(outs[4], np.abs(j))


def test_u32_and_constants(run):
    n = 10
    x = np.arange(n, dtype=np.uint32) * 3
    k = _pk((n,), [Strided.contiguous(u32, (n,))],
            [Instr("u32(7)", (), u32), Instr("({0} % {1})", (("in", 0), ("t", 0)), u32),
             Instr("f32(-inf)", (), f32), Instr("f32({0})", (("t", 1),), f32),
             Instr("max({0}, {1})", (("t", 2), ("t", 3)), f32)],
            outputs=(1, 2, 4))
    o1, o2, o3 = run(k, [x], [((n,), u32), ((n,), f32), ((n,), f32)])
    np.testing.assert_array_equal(o1, x % 7)
    assert np.all(np.isneginf(o2))
    np.testing.assert_array_equal(o3, (x % 7).astype(np.float32))


def test_no_inputs_full(run):
    k = _pk((5, 3), [], [Instr("f32(1.5)", (), f32)])
    (y,) = run(k, [], [((5, 3), f32)])
    np.testing.assert_array_equal(y, np.full((5, 3), 1.5, np.float32))


def test_grid_wraps_2d_and_3d(run, dev, rng):
    """The scalar variant (test_pointwise_vec4.py wraps the vector one)."""
    n = 5000  # 20 workgroups of 256
    a = rng.standard_normal(n).astype(np.float32)
    k = _pk((n,), [Strided.contiguous(f32, (n,))],
            [Instr("({0} * 3.0 + 1.0)", (("in", 0),), f32)], config=(1,))
    for maxdim, expect in ((5, (5, 4, 1)), (4, (4, 4, 2)), (3, (3, 3, 3)), (65535, (20, 1, 1))):
        limits = dict(dev.limits, max_compute_workgroups_per_dimension=maxdim)
        (y,) = run(k, [a], [((n,), f32)], limits=limits)
        assert run.last_spec.workgroups == expect
        # (GPUs may fuse into an fma: compare with float64 and an absolute floor)
        assert_close(y, a.astype(np.float64) * 3.0 + 1.0, 1e-6, 1e-6, what=f"grid {expect}")


def test_f16(run, dev, rng):
    if not dev.has_f16:
        pytest.skip("device has no shader-f16")
    n = 257
    a = rng.standard_normal(n).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float32)
    k = _pk((n,), [Strided.contiguous(f16, (n,)), Strided.contiguous(f32, (n,))],
            [Instr("mn_sigmoid({0})", (("in", 0),), f16, ("mn_sigmoid",)),
             Instr("f32({0})", (("t", 0),), f32),
             Instr("({0} + {1})", (("t", 1), ("in", 1)), f32)],
            outputs=(0, 2))
    h, s = run(k, [a, b], [((n,), f16), ((n,), f32)])
    ref = 1 / (1 + np.exp(-a.astype(np.float64)))
    assert_close(h, ref, 1e-3, what="f16 sigmoid")
    # the f16 value may round either way (one f16 ulp is 4.9e-4 below 1), and drivers may
    # keep an f16 register at higher precision (seen on NVIDIA): compare with tolerances
    assert_close(s, ref + b, 0, 1e-3, what="f16 -> f32")
    assert "enable f16;" in run.last_spec.wgsl
    with pytest.raises(DeviceError, match="shader-f16"):
        codegen.emit(k, dev.limits, features=())


def test_limit_errors(dev):
    ins = [Strided.contiguous(f32, (4,))] * 3
    k = _pk((4,), ins, [Instr("({0} + {1} + {2})", (("in", 0), ("in", 1), ("in", 2)), f32)])
    with pytest.raises(LimitError, match="storage buffers"):
        codegen.emit(k, {"max_storage_buffers_per_shader_stage": 3})
    codegen.emit(k, {"max_storage_buffers_per_shader_stage": 4})
    with pytest.raises(LimitError, match="max_storage_buffer_binding_size"):
        codegen.emit(k, {"max_storage_buffer_binding_size": 8})
    big = _pk((70000 * 256,), [], [Instr("f32(0.0)", (), f32)])
    with pytest.raises(LimitError, match="workgroups"):
        codegen.emit(big, {"max_compute_workgroups_per_dimension": 16})
    # WebGPU defaults when no limits are given: still fine for small kernels
    assert codegen.emit(k).workgroups == (1, 1, 1)


def test_description_errors():
    s = Strided(f32, (4,), (1,), 2, 5)  # reads elements 2..5 of a 5-element range
    k = _pk((4,), [s], [Instr("{0}", (("in", 0),), f32)])
    with pytest.raises(CodegenError, match="binding holds 5"):
        codegen.emit(k)
    k = _pk((4,), [Strided.contiguous(f32, (3,))], [Instr("{0}", (("in", 0),), f32)])
    with pytest.raises(CodegenError, match="does not broadcast"):
        codegen.emit(k)
    k = _pk((4,), [Strided.contiguous(f32, (4,))], [Instr("({0} + {1})", (("in", 0),), f32)])
    with pytest.raises(CodegenError, match="operand"):
        codegen.emit(k)
    with pytest.raises(CodegenError, match="no WGSL emitter"):
        codegen.emit(object())


def test_deterministic_source(dev):
    k = _pk((3, 4), [Strided.contiguous(f32, (3, 4)), Strided.contiguous(f32, (4,))],
            [Instr("mn_tanh({0} + {1})", (("in", 0), ("in", 1)), f32, ("mn_tanh",))])
    a, b = codegen.emit(k, dev), codegen.emit(k, dev)
    assert a == b and a.wgsl == b.wgsl
    assert dev.pipeline(a) is dev.pipeline(b)  # cached by source


def test_out_of_range_outputs_and_inputs_are_refused_by_name():
    """A description naming an instr or input that does not exist is a CodegenError that says
    which, never an IndexError (or, for index -1, silently the last instr)."""
    one = [Strided.contiguous(f32, (4,))]
    neg = [Instr("{0}", (("in", 0),), f32), Instr("({0} * 2.0)", (("t", 0),), f32)]
    for outputs in ((-1,), (2,)):
        with pytest.raises(CodegenError, match=f"output refers to instr {outputs[0]} of 2"):
            codegen.emit(_pk((4,), one, neg, outputs=outputs))
    k = _pk((4,), one, [Instr("({0} + {1})", (("in", 0), ("in", 1)), f32)])
    with pytest.raises(CodegenError, match="reads input 1 of 1"):
        codegen.emit(k)


def test_output_larger_than_a_binding_is_refused():
    """The output's binding is checked too: a broadcast input of 4 bytes fits a limit of 8,
    the 16-byte output does not."""
    k = _pk((4,), [Strided.contiguous(f32, (1,))], [Instr("{0}", (("in", 0),), f32)])
    with pytest.raises(LimitError, match="output 0"):
        codegen.emit(k, {"max_storage_buffer_binding_size": 8})


def test_contiguous_input_at_an_offset(run, rng):
    """An input walking like the output but starting at element 1 (x[1:]): indexed by the
    thread id plus its offset."""
    base = rng.standard_normal(9).astype(np.float32)
    k = _pk((8,), [view_of(base, base[1:])], [Instr("({0} * 2.0)", (("in", 0),), f32)])
    (y,) = run(k, [base], [((8,), f32)])
    np.testing.assert_array_equal(y, base[1:] * 2)


@pytest.mark.parametrize("cols,config", [(8, (4,)), (8, (1,)), (6, ())])
def test_outputs_written_into_strided_slots(run, rng, cols, config):
    """``out_views``: two outputs side by side in every row of one buffer (a concat's slots:
    the gate and up gradients of a fused projection), bound once; vec4 where the rows allow."""
    rows = 5
    a = rng.standard_normal((1, rows, cols)).astype(np.float32)
    b = rng.standard_normal((1, rows, cols)).astype(np.float32)
    shape = (1, rows, cols)
    views = tuple(Strided(f32, shape, (rows * 2 * cols, 2 * cols, 1), off, rows * 2 * cols)
                  for off in (0, cols))
    k = PointwiseKernel(shape, (Strided.contiguous(f32, shape),) * 2,
                        (Instr("({0} * {1})", (("in", 0), ("in", 1)), f32),
                         Instr(ADD, (("in", 0), ("in", 1)), f32)), (0, 1), "slots", config,
                        out_views=views)
    out = ((1, rows, 2 * cols), f32)
    y, _ = run(k, [a, b], [out, out], alias=(0, 1, 2, 2))
    assert_close(y, np.concatenate([a * b, a + b], axis=-1), 1e-6, what="slots")
    assert run.last_spec.n_bindings == 3
    vec = run.last_spec.meta.get("variant") == "pointwise_x4"
    assert vec == (config != (1,) and cols % 4 == 0)
    bad = dict(out_views=views[:1])
    with pytest.raises(CodegenError, match="1 output views for 2 outputs"):
        codegen.emit(dataclasses.replace(k, **bad), run.dev.limits, run.dev.features)
    wide = Strided(f32, shape, views[1].strides, cols, rows * 2 * cols - 1)
    with pytest.raises(CodegenError, match="output 1 reads element"):
        codegen.emit(dataclasses.replace(k, out_views=(views[0], wide)), run.dev.limits,
                     run.dev.features)
