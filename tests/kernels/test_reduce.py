"""Reduce emitter on the device vs numpy: any axes (middle, several, all, none), sum/max/min
with negative values, prologue/epilogue DAGs with broadcast and extra inputs, strided inputs,
integer and bool values, f16, a 10^7-element sum, limits."""

import numpy as np
import pytest

from meganeura import kernels as codegen
from meganeura.dtypes import bool_, f16, f32, i32, u32
from meganeura.errors import LimitError
from meganeura.kernels import CodegenError, Instr, ReduceKernel, Strided
from meganeura.kernels.reduce import UNROLL, choose_layout, split_plan

from ._util import assert_close, view_of

NP = {"sum": np.sum, "max": np.max, "min": np.min}


def _out(shape, axes):
    return tuple(n for d, n in enumerate(shape) if d not in axes)


def _plain(shape, axes, kind, dtype=f32):
    return ReduceKernel(tuple(shape), tuple(axes), kind, (Strided.contiguous(dtype, shape),), ())


@pytest.mark.parametrize(
    "shape,axes",
    [
        ((5, 37, 6), (1,)),  # middle axis
        ((5, 37, 6), (0,)),  # leading axis (column reduction)
        ((5, 37, 6), (2,)),  # last axis, tiny: serial
        ((5, 37, 6), (0, 2)),  # non-adjacent axes
        ((5, 37, 6), (0, 1, 2)),  # everything
        ((300, 70), (1,)),  # rows: one workgroup per row
        ((300, 70), (0,)),  # columns: outputs side by side
        ((40, 2), (0,)),  # two columns: TX = 2
        ((3, 4, 5, 6), (1, 3)),
        ((7, 1, 9), (1,)),  # size-1 reduced axis
        ((6, 8), ()),  # nothing reduced: a copy
    ],
)
@pytest.mark.parametrize("kind", ["sum", "max", "min"])
def test_axes_kinds(run, rng, shape, axes, kind):
    x = (rng.standard_normal(shape) * 3 - 1).astype(np.float32)
    (y,) = run(_plain(shape, axes, kind), [x], [(_out(shape, axes), f32)])
    ref = NP[kind](x.astype(np.float64), axis=axes) if axes else x
    assert_close(y, ref, 1e-5, 1e-5, what=f"{kind} over {axes} of {shape}")


def test_all_negative_max_min(run, rng):
    x = (-5 - rng.random((13, 50))).astype(np.float32)
    for kind in ("max", "min"):
        for axes in ((0,), (1,), (0, 1)):
            (y,) = run(_plain(x.shape, axes, kind), [x], [(_out(x.shape, axes), f32)])
            np.testing.assert_array_equal(y, NP[kind](x, axis=axes))


def test_strided_input(run, rng):
    base = rng.standard_normal((20, 30)).astype(np.float32)
    v = base.T[3:25:2, 1:18]  # transposed, sliced, stepped
    k = ReduceKernel(v.shape, (1,), "sum", (view_of(base, v),), ())
    (y,) = run(k, [base], [((v.shape[0],), f32)])
    assert_close(y, v.astype(np.float64).sum(1), 1e-5, 1e-5, what="strided rows")
    k = ReduceKernel(v.shape, (0,), "max", (view_of(base, v),), ())
    (y,) = run(k, [base], [((v.shape[1],), f32)])
    np.testing.assert_array_equal(y, v.max(0))


def test_prologue_epilogue_mean_var(run, rng):
    """var = mean((x - mean)^2) over the middle axis; mean broadcast with stride 0 along it."""
    x = rng.standard_normal((4, 33, 5)).astype(np.float32)
    mean = x.astype(np.float64).mean(1).astype(np.float32)  # (4, 5)
    mean_view = Strided(f32, (4, 33, 5), (5, 0, 1), 0, 20)
    k = ReduceKernel(
        (4, 33, 5), (1,), "sum",
        (Strided.contiguous(f32, (4, 33, 5)), mean_view),
        (Instr("({0} - {1})", (("in", 0), ("in", 1)), f32),
         Instr("({0} * {0})", (("t", 0),), f32)),
        (Instr("({0} * f32(0.030303030303030304))", (("acc", 0),), f32),
         Instr("sqrt({0})", (("t", 0),), f32)),
        name="std",
    )
    (y,) = run(k, [x, mean], [((4, 5), f32)])
    assert_close(y, x.astype(np.float64).std(1), 1e-5, what="std")


def test_logsumexp_with_extra(run, rng):
    """Prologue exp(x - m) (m broadcast), epilogue log(acc) + m with m as an extra input given
    in keepdims form."""
    x = (rng.standard_normal((6, 40)) * 4).astype(np.float32)
    m = x.max(1, keepdims=True)
    k = ReduceKernel(
        (6, 40), (1,), "sum",
        (Strided.contiguous(f32, (6, 40)), Strided(f32, (6, 1), (1, 0), 0, 6)),
        (Instr("exp({0} - {1})", (("in", 0), ("in", 1)), f32),),
        (Instr("log({0})", (("acc", 0),), f32), Instr("({0} + {1})", (("t", 0), ("x", 0)), f32)),
        (Strided(f32, (6, 1), (1, 0), 0, 6),),
        name="logsumexp",
    )
    (y,) = run(k, [x, m, m], [((6,), f32)])
    ref = np.log(np.exp(x.astype(np.float64) - m).sum(1)) + m[:, 0]
    assert_close(y, ref, 1e-5, what="logsumexp")


def test_int_and_bool(run, rng):
    j = rng.integers(-1000, 1000, (9, 21)).astype(np.int32)
    for kind in ("sum", "max", "min"):
        (y,) = run(_plain(j.shape, (1,), kind, i32), [j], [((9,), i32)])
        np.testing.assert_array_equal(y, NP[kind](j, axis=1))
    x = rng.standard_normal((7, 30)).astype(np.float32)
    # any(x > 1.5) per row: bool prologue reduced with max, stored as bool
    k = ReduceKernel((7, 30), (1,), "max", (Strided.contiguous(f32, (7, 30)),),
                     (Instr("({0} > f32(1.5))", (("in", 0),), bool_),), name="any")
    (y,) = run(k, [x], [((7,), bool_)])
    np.testing.assert_array_equal(y, (x > 1.5).any(1))
    # count(x > 0) per column as i32
    k = ReduceKernel((7, 30), (0,), "sum", (Strided.contiguous(f32, (7, 30)),),
                     (Instr("({0} > 0.0)", (("in", 0),), bool_),
                      Instr("i32({0})", (("t", 0),), i32)), name="count")
    (y,) = run(k, [x], [((30,), i32)])
    np.testing.assert_array_equal(y, (x > 0).sum(0))


def test_out_dtype_and_f16(run, dev, rng):
    if not dev.has_f16:
        pytest.skip("device has no shader-f16")
    x = rng.standard_normal((5, 200)).astype(np.float16)
    k = ReduceKernel((5, 200), (1,), "sum", (Strided.contiguous(f16, (5, 200)),), (),
                     out_dtype=f32, name="sum_f16_to_f32")
    (y,) = run(k, [x], [((5,), f32)])
    assert_close(y, x.astype(np.float64).sum(1), 1e-5, 1e-5, what="f16 sum in f32")


def test_huge_sum(run, rng):
    n = 10**7
    x = rng.random(n, dtype=np.float32)
    (y,) = run(_plain((n,), (0,), "sum"), [x], [((), f32)])
    assert_close(y, x.astype(np.float64).sum(), 1e-4, what="sum of 1e7")
    # a column reduction over a long axis too
    x2 = rng.random((100_000, 3), dtype=np.float32)
    (y2,) = run(_plain(x2.shape, (0,), "sum"), [x2], [((3,), f32)])
    assert_close(y2, x2.astype(np.float64).sum(0), 1e-4, what="long columns")


def _run_split(run, dev, k, inputs, extra_inputs, out_shape, out_dtype=f32):
    plan = split_plan(k, dev)
    assert plan is not None
    partial, final, (tshape, tdt) = plan
    spec1 = codegen.emit(partial, dev)
    spec2 = codegen.emit(final, dev)
    bufs = [dev.upload(a) for a in inputs]
    temp = dev.create_buffer(int(np.prod(tshape)) * tdt.gpu_itemsize)
    out = dev.create_buffer(max(1, int(np.prod(out_shape))) * out_dtype.gpu_itemsize)
    dev.dispatch(spec1, bufs + [temp])
    dev.dispatch(spec2, [temp] + [dev.upload(a) for a in extra_inputs] + [out])
    return dev.read_array(out, out_shape, out_dtype), partial.split


def test_split_full_sum_and_columns(run, dev, rng):
    x = rng.random(300_001, dtype=np.float32)
    k = _plain(x.shape, (0,), "sum")
    y, split = _run_split(run, dev, k, [x], [], ())
    assert split > 1
    assert_close(y, x.astype(np.float64).sum(), 1e-5, what="split full sum")
    # a column reduction with few outputs, max with an epilogue and an extra input
    x2 = (rng.standard_normal((20_000, 6)) - 3).astype(np.float32)
    off = rng.standard_normal(6).astype(np.float32)
    k2 = ReduceKernel(x2.shape, (0,), "max", (Strided.contiguous(f32, x2.shape),),
                      (Instr("({0} * 2.0)", (("in", 0),), f32),),
                      (Instr("({0} + {1})", (("acc", 0), ("x", 0)), f32),),
                      (Strided.contiguous(f32, (6,)),), name="colmax")
    y2, split2 = _run_split(run, dev, k2, [x2], [off], (6,))
    assert split2 > 1
    np.testing.assert_array_equal(y2, (x2 * 2).max(0) + off)
    # enough parallelism already: no split
    assert split_plan(_plain((4096, 300), (1,), "sum"), dev) is None


def test_deterministic(run, rng):
    x = rng.standard_normal(100_003).astype(np.float32)
    k = _plain(x.shape, (0,), "sum")
    a = run(k, [x], [((), f32)])[0]
    b = run(k, [x], [((), f32)])[0]
    assert a.tobytes() == b.tobytes()


def test_many_outputs_wrapped_grid(run, dev, rng):
    x = rng.standard_normal((1000, 20)).astype(np.float32)
    limits = dict(dev.limits, max_compute_workgroups_per_dimension=30)
    (y,) = run(_plain(x.shape, (1,), "max"), [x], [((1000,), f32)], limits=limits)
    assert max(run.last_spec.workgroups) <= 30
    np.testing.assert_array_equal(y, x.max(1))


def test_limits_and_errors():
    k = _plain((8, 1000), (1,), "sum")
    spec = codegen.emit(k)
    assert spec.meta["workgroup_storage"] > 0
    with pytest.raises(LimitError, match="workgroup storage"):
        codegen.emit(k, {"max_compute_workgroup_storage_size": 64})
    with pytest.raises(LimitError, match="storage buffers"):
        codegen.emit(k, {"max_storage_buffers_per_shader_stage": 1})
    with pytest.raises(CodegenError, match="unknown reduction"):
        codegen.emit(ReduceKernel((4,), (0,), "prod", (Strided.contiguous(f32, (4,)),), ()))
    with pytest.raises(CodegenError, match="out of range"):
        codegen.emit(ReduceKernel((4,), (3,), "sum", (Strided.contiguous(f32, (4,)),), ()))


@pytest.mark.parametrize(
    "shape,axes",
    [
        ((6, 300), (1,)),  # rows: a normalization over the last axis (one workgroup per row)
        ((300, 8), (0,)),  # columns: outputs side by side
        ((5, 37, 6), (2,)),  # tiny reduced extent: serial
        ((3, 4, 5, 6), (1, 3)),  # several axes
    ],
)
def test_post_pass_normalizes_with_the_result(run, rng, shape, axes):
    """An RMS-norm in one kernel: rstd = rsqrt(mean(x²) + eps) stored, then x * rstd * w over
    the input shape (w broadcast along the kept axes) from the same workgroup."""
    x = rng.standard_normal(shape).astype(np.float32)
    wshape = tuple(n if d in axes else 1 for d, n in enumerate(shape))
    w = rng.standard_normal(wshape).astype(np.float32)
    n_red = int(np.prod([shape[a] for a in axes]))
    wst = tuple(0 if d not in axes else st // 4 for d, st in enumerate(
        np.broadcast_to(w, shape).strides))
    desc = ReduceKernel(
        shape, axes, "sum", (Strided.contiguous(f32, shape),),
        (Instr("({0} * {0})", (("in", 0),), f32),),
        (Instr(f"inverseSqrt({{0}} / {float(n_red)} + 1e-6)", (("acc", 0),), f32),),
        post_inputs=(Strided.contiguous(f32, shape), Strided(f32, shape, wst, 0, w.size)),
        post=(Instr("({0} * {1})", (("in", 0), ("r", 0)), f32),
              Instr("({0} * {1})", (("t", 0), ("in", 1)), f32)),
        post_outputs=(1, 0),
    )
    out_shape = _out(shape, axes)
    r, y, xhat = run(desc, [x, x, w], [(out_shape, f32), (shape, f32), (shape, f32)])
    ms = np.mean(x.astype(np.float64) ** 2, axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(ms + 1e-6)
    assert_close(r, rstd.reshape(out_shape), 1e-5, what="rstd")
    assert_close(xhat, x * rstd, 1e-5, 1e-6, what="xhat")
    assert_close(y, x * rstd * w, 1e-5, 1e-6, what="y")


def test_post_pass_refuses_a_split():
    desc = ReduceKernel((4, 64), (1,), "sum", (Strided.contiguous(f32, (4, 64)),), (),
                        split=2, post=(Instr("{0}", (("r", 0),), f32),), post_outputs=(0,))
    with pytest.raises(CodegenError, match="post pass"):
        codegen.emit(desc)


def test_post_pass_reads_the_reductions_own_input(run, rng):
    """``("ri", i)``: the post pass reads the reduction's input ``i`` through its own binding
    (RMS-norm backward: dx = w·dy·rstd − x·rstd³·mean(dy·w·x))."""
    shape = (7, 50)
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    full = Strided.contiguous(f32, shape)
    desc = ReduceKernel(
        shape, (1,), "sum", (full, full),
        (Instr("({0} * {1})", (("in", 0), ("in", 1)), f32),),
        (Instr("({0} / 50.0)", (("acc", 0),), f32),),
        post=(Instr("({0} - {1} * {2})", (("ri", 1), ("ri", 0), ("r", 0)), f32),),
        post_outputs=(0,),
    )
    m, out = run(desc, [x, dy], [((7,), f32), (shape, f32)])
    mean = np.mean(x.astype(np.float64) * dy, axis=1, keepdims=True)
    assert_close(m, mean[:, 0], 1e-5, 1e-6, what="mean")
    assert_close(out, dy - x * mean, 1e-5, 1e-6, what="post")
    assert run.last_spec.n_bindings == 4  # x, dy, mean, out: no extra binding for x, dy


@pytest.mark.parametrize("n", [1, 255, 256, 257, 300_001, 2_000_003])
def test_sums_of_small_integers_are_exact(run, dev, n):
    """Integer-valued f32 inputs whose partial sums stay below 2^24 sum exactly in any order:
    one dropped or doubled element changes the answer (a tolerance would hide it).  Split
    reductions (partial + final pass) are checked the same way."""
    rng = np.random.default_rng(n)
    x = rng.integers(0, 4, n).astype(np.float32)  # total < 4·2e6 < 2^24
    x[0] = x[-1] = 1.0  # the ends of the first and last chunk count
    (y,) = run(_plain((n,), (0,), "sum"), [x], [((), f32)])
    assert float(y) == float(x.sum(dtype=np.float64)), f"sum of {n}"
    k = _plain((n,), (0,), "sum")
    if split_plan(k, dev) is not None:
        ys, split = _run_split(run, dev, k, [x], [], ())
        assert split > 1 and float(ys) == float(x.sum(dtype=np.float64)), f"split sum of {n}"
    cols = rng.integers(-3, 4, (n if n < 300_000 else 50_001, 5)).astype(np.float32)
    kc = _plain(cols.shape, (0,), "sum")
    (yc,) = run(kc, [cols], [((5,), f32)])
    np.testing.assert_array_equal(yc, cols.sum(0, dtype=np.float64))
    if split_plan(kc, dev) is not None:
        ycs, _ = _run_split(run, dev, kc, [cols], [], (5,))
        np.testing.assert_array_equal(ycs, cols.sum(0, dtype=np.float64))


def test_split_max_finds_a_single_peak_anywhere(run, dev):
    """The peak at the very last element (end of the last chunk), the first, and the middle."""
    n = 400_003
    for pos in (0, n // 2, n - 1):
        x = np.zeros(n, np.float32)
        x[pos] = 7.0
        k = _plain((n,), (0,), "max")
        y, split = _run_split(run, dev, k, [x], [], ())
        assert split > 1 and float(y) == 7.0, pos


def test_post_pass_after_an_epilogue_with_an_extra_input(run, rng):
    """Extra (epilogue) inputs and post inputs side by side: each reads through its own
    strides (w broadcast over the rows: stride 0 along the kept axis)."""
    shape = (7, 50)
    x = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float32)
    w = rng.standard_normal(50).astype(np.float32)
    full = Strided.contiguous(f32, shape)
    desc = ReduceKernel(
        shape, (1,), "sum", (full,), (),
        (Instr("({0} / 50.0 + {1})", (("acc", 0), ("x", 0)), f32),),
        (Strided.contiguous(f32, (7,)),),
        post_inputs=(full, Strided(f32, shape, (0, 1), 0, 50)),
        post=(Instr("(({0} - {1}) * {2})", (("in", 0), ("r", 0), ("in", 1)), f32),),
        post_outputs=(0,),
    )
    r, y = run(desc, [x, b, x, w], [((7,), f32), (shape, f32)])
    want = x.astype(np.float64).mean(1) + b
    assert_close(r, want, 1e-5, 1e-6, what="mean + b")
    assert_close(y, (x - r[:, None]) * w, 1e-5, 1e-6, what="post")


def test_split_rule(dev):
    """Split only when one dispatch has fewer than half the target workgroups, into
    ceil(target / workgroups) chunks (at most one per min_chunk elements)."""
    assert split_plan(_plain((200, 4096), (1,), "sum"), dev) is None  # 200 ≥ 256 / 2
    partial, final, (tshape, tdt) = split_plan(_plain((3, 300_000), (1,), "sum"), dev)
    assert partial.split == 86 and tshape == (86, 3) and tdt is f32  # ceil(256 / 3)
    partial, _, _ = split_plan(_plain((3, 4096), (1,), "sum"), dev)
    assert partial.split == 4  # 4096 // 1024 chunks, not 86


def test_split_rule_boundaries(dev):
    """The split rule's edges: exactly half the target workgroups stays one dispatch (127
    splits into ceil(256 / 127) = 3); exactly 2 · min_chunk reduced elements split in 2;
    an already split kernel, or one whose accumulator is wider than its values (f16: the
    epilogue would see f32), is never split again."""
    assert split_plan(_plain((128, 4096), (1,), "sum"), dev) is None
    assert split_plan(_plain((127, 4096), (1,), "sum"), dev)[0].split == 3
    assert split_plan(_plain((3, 2048), (1,), "sum"), dev)[0].split == 2
    assert split_plan(_plain((3, 2047), (1,), "sum"), dev) is None
    presplit = ReduceKernel((3, 300_000), (1,), "sum",
                            (Strided.contiguous(f32, (3, 300_000)),), (), split=2)
    assert split_plan(presplit, dev) is None
    assert split_plan(_plain((3, 300_000), (1,), "sum", f16), dev) is None
    # without a prologue input 0 is the value, whatever dtype a later (unread) input has
    two = ReduceKernel((3, 300_000), (1,), "sum", (Strided.contiguous(f32, (3, 300_000)),
                                                    Strided.contiguous(f16, (3,))), ())
    assert split_plan(two, dev)[0].split == 86


def test_layout_choice():
    """Outputs side by side (TX > 1) as soon as there are two of them and the kept dim is the
    contiguous one; rows (TX = 1) when the reduced dim is."""
    assert codegen.emit(_plain((300, 2), (0,), "sum")).meta["layout"] == (2, 128)
    assert codegen.emit(_plain((300, 1), (0,), "sum")).meta["layout"] == (1, 256)
    assert codegen.emit(_plain((2, 300), (1,), "sum")).meta["layout"] == (1, 256)
    # up to SERIAL_MAX = 16 reduced elements: one invocation per output, no lanes to combine
    assert choose_layout((16,), False, 16, 5, 256) == (8, 1)
    assert choose_layout((17,), False, 17, 5, 256) == (1, 32)
    assert codegen.emit(_plain((300, 5), (1,), "sum")).meta["workgroup_storage"] == 0
    assert choose_layout((5,), False, 5, 100, 256) == (64, 1)  # serial: 64 outputs a group
    # kept dims split by the reduced one: the last kept stride decides
    assert codegen.emit(_plain((4, 300, 8), (1,), "sum")).meta["layout"] == (32, 8)


def test_two_lanes_per_output_get_their_workgroup_array(run, rng):
    """A 64-invocation cap leaves 32 columns two lanes each (TY = 2, unrolled): the smallest
    layout that combines lanes declares (and reports, for the limit check) its workgroup array,
    starts lane 1 at row 1 and stops its unrolled loop before the last rows.  The view is the
    top of a larger buffer, so a read past its rows would add the 1e3s below it."""
    base = rng.standard_normal((310, 64)).astype(np.float32)
    base[300:] = 1e3
    v = base[:300]
    k = ReduceKernel(v.shape, (0,), "sum", (view_of(base, v),), ())
    cap = {**run.dev.limits, "max_compute_invocations_per_workgroup": 64}
    spec = codegen.emit(k, cap)
    assert spec.meta["layout"] == (32, 2) and spec.meta["workgroup_storage"] == 32 * 2 * 4
    assert "acc0_3" in spec.wgsl
    (y,) = run(k, [base], [((64,), f32)], limits=cap)
    assert_close(y, v.astype(np.float64).sum(0), 1e-5, 1e-5, what="column sums")


def test_post_pass_with_two_lanes_per_output(run, rng):
    """TY = 2 (a 64-invocation cap, 32 columns): both lanes of a column walk its rows again in
    the post pass, lane 1 from row 1."""
    x = rng.standard_normal((300, 64)).astype(np.float32)
    full = Strided.contiguous(f32, (300, 64))
    k = ReduceKernel((300, 64), (0,), "max", (full,), (),
                     post=(Instr("({0} - {1})", (("ri", 0), ("r", 0)), f32),), post_outputs=(0,))
    cap = {**run.dev.limits, "max_compute_invocations_per_workgroup": 64}
    assert codegen.emit(k, cap).meta["layout"] == (32, 2)
    m, d = run(k, [x], [((64,), f32), ((300, 64), f32)], limits=cap)
    np.testing.assert_array_equal(m, x.max(0))
    np.testing.assert_array_equal(d, x - x.max(0))


def test_a_split_of_two_and_its_partials(run, dev, rng):
    """The smallest split (2 chunks) stores each chunk's partials in its own row; a split
    larger than the reduced extent is clamped to it; the partials buffer is checked against
    the binding limit as split × outputs (here 32 KiB where a binding holds 16)."""
    x = rng.standard_normal((3, 2048)).astype(np.float32)
    y, split = _run_split(run, dev, _plain((3, 2048), (1,), "sum"), [x], [], (3,))
    assert split == 2
    assert_close(y, x.astype(np.float64).sum(1), 1e-5, 1e-5, what="split of 2")
    b = rng.random((3, 64)) < 0.5  # a count split in 2: each chunk's partial count (u32)
    kb = ReduceKernel((3, 64), (1,), "sum", (Strided.contiguous(bool_, (3, 64)),), (), split=2)
    (parts,) = run(kb, [b], [((2, 3), u32)])
    np.testing.assert_array_equal(parts, [b[:, :32].sum(1), b[:, 32:].sum(1)])
    one = ReduceKernel((3, 1), (1,), "sum", (Strided.contiguous(f32, (3, 1)),), (), split=4)
    assert codegen.emit(one).meta["split"] == 1
    row = Strided(f32, (4096, 2048), (0, 1), 0, 2048)  # 8 KiB read, 32 KiB of partials
    k = ReduceKernel((4096, 2048), (1,), "sum", (row,), (), split=2, name="p")
    with pytest.raises(LimitError, match="'p'.*output"):
        codegen.emit(k, {"max_storage_buffer_binding_size": 16384})


def test_negative_axes_down_to_minus_rank():
    a = codegen.emit(_plain((3, 40), (-2,), "sum"))
    b = codegen.emit(_plain((3, 40), (0,), "sum"))
    assert a.wgsl == b.wgsl
    with pytest.raises(CodegenError, match="out of range"):
        codegen.emit(_plain((3, 40), (-3,), "sum"))


def test_without_prologue_input_0_is_reduced_whatever_follows():
    """No prologue: input 0 is the value; later inputs (a post pass's) have their own dtypes."""
    k = ReduceKernel((4, 8), (1,), "sum", (Strided.contiguous(f32, (4, 8)),), (),
                     post_inputs=(Strided.contiguous(i32, (4, 8)),),
                     post=(Instr("(f32({0}) * {1})", (("in", 0), ("r", 0)), f32),),
                     post_outputs=(0,), name="r")
    assert codegen.emit(k).meta["binding_dtypes"] == (f32, i32, f32, f32)


def test_a_post_output_larger_than_a_binding_is_refused():
    """The post output has the input's full shape: here 1 KiB where a binding holds 512 bytes
    (the input is a broadcast row of 256 bytes, the reduced output 16)."""
    row = Strided(f32, (4, 64), (0, 1), 0, 64)
    k = ReduceKernel((4, 64), (1,), "sum", (row,), (),
                     post=(Instr("({0} * {1})", (("ri", 0), ("r", 0)), f32),),
                     post_outputs=(0,), name="r")
    codegen.emit(k, {"max_storage_buffer_binding_size": 1024})
    with pytest.raises(LimitError, match="post output"):
        codegen.emit(k, {"max_storage_buffer_binding_size": 512})


def test_a_post_input_past_its_binding_is_named_as_a_post_input():
    """Errors name a ReduceKernel's post inputs as such (the generator appends them to the
    inputs, so the numbering would otherwise run on)."""
    x = Strided.contiguous(f32, (4, 8))
    desc = ReduceKernel((4, 8), (1,), "sum", (x,), (),
                        post_inputs=(Strided(f32, (4, 8), (8, 1), 0, 31),),
                        post=(Instr("({0} * {1})", (("in", 0), ("r", 0)), f32),),
                        post_outputs=(0,), name="r")
    with pytest.raises(CodegenError, match="'r': post input 0 reads element 31"):
        codegen.emit(desc)


@pytest.mark.parametrize("n,unrolled", [(1792, False), (1793, True), (2048, True)])
def test_unroll_rule(run, rng, n, unrolled):
    """UNROLL independent accumulators once an invocation folds at least 2 · UNROLL elements
    (ceil(n / 256) per invocation of a 256-wide row: 7, 8, 8); the sums stay right either way."""
    k = _plain((4, n), (1,), "sum")
    spec = codegen.emit(k)
    assert spec.meta["layout"] == (1, 256)
    assert ("acc0_1" in spec.wgsl) == unrolled and ("acc0_3" in spec.wgsl) == unrolled
    x = rng.standard_normal((4, n)).astype(np.float32)
    (y,) = run(k, [x], [((4,), f32)])
    assert_close(y, x.astype(np.float64).sum(1), 1e-5, 1e-5, what=f"sum of {n}")


def test_empty_reduced_axis(run):
    """A sum over an empty axis is 0 (one dispatch, never split); max and min have no value
    there and are refused."""
    k = _plain((3, 0), (1,), "sum")
    assert codegen.emit(k).meta["split"] == 1
    (y,) = run(k, [np.zeros((3, 0), np.float32)], [((3,), f32)])
    np.testing.assert_array_equal(y, np.zeros(3, np.float32))
    for kind in ("max", "min"):
        with pytest.raises(CodegenError, match=f"{kind} over an empty axis"):
            codegen.emit(_plain((3, 0), (1,), kind))


def test_an_epilogue_may_ignore_the_total(run, rng):
    """The epilogue's operands are any of its own: one reading only an extra input still gets
    that input loaded."""
    m = rng.standard_normal(6).astype(np.float32)
    k = ReduceKernel((6, 40), (1,), "sum", (Strided.contiguous(f32, (6, 40)),), (),
                     (Instr("({0} * 2.0)", (("x", 0),), f32),), (Strided.contiguous(f32, (6,)),),
                     name="extra_only")
    (y,) = run(k, [np.ones((6, 40), np.float32), m], [((6,), f32)])
    np.testing.assert_array_equal(y, m * 2)


def test_a_member_needs_an_input_or_a_prologue():
    with pytest.raises(CodegenError, match="'r' has neither inputs nor a prologue"):
        codegen.emit(ReduceKernel((4,), (0,), "sum", (), (), name="r"))
    k = ReduceKernel((4,), (0,), "sum", (), (Instr("1.0", (), f32),), name="ones")
    assert codegen.emit(k).meta["reduced"] == 4


def test_an_extra_input_past_its_binding_is_refused():
    x = Strided.contiguous(f32, (6, 40))
    short = Strided(f32, (6,), (1,), 0, 5)  # 6 outputs read from a 5-element binding
    k = ReduceKernel((6, 40), (1,), "sum", (x,), (),
                     (Instr("({0} + {1})", (("acc", 0), ("x", 0)), f32),), (short,), name="r")
    with pytest.raises(CodegenError, match="extra input 0 reads element 5 but its binding "
                                           "holds 5"):
        codegen.emit(k)


def test_a_small_invocation_limit_narrows_the_columns(run):
    """Outputs side by side are capped by the invocation limit too (below 32 invocations the
    column layout used to ask for 32 and fail the limit check): one lane per output then, never
    more lanes than fit.  Column sums stay right at a cap of 16."""
    assert choose_layout((300,), True, 300, 64, 32) == (32, 1)
    assert choose_layout((300,), True, 300, 64, 16) == (16, 1)
    x = np.arange(300 * 20, dtype=np.float32).reshape(300, 20) % 7
    cap = {**run.dev.limits, "max_compute_invocations_per_workgroup": 16}
    (y,) = run(_plain(x.shape, (0,), "sum"), [x], [((20,), f32)], limits=cap)
    assert run.last_spec.meta["layout"] == (16, 1)
    np.testing.assert_array_equal(y, x.sum(0))


def test_layout_follows_the_first_input_the_first_member_reads():
    """Columns (TX > 1) when that input's kept dim is contiguous and its reduced one is not:
    an input broadcast along the reduced axis (stride 0) still counts as columns; a prologue
    reading a column-major and a row-major input takes the layout of the first (input 0)."""
    bcast = Strided(f32, (8, 300), (1, 0), 0, 8)
    assert codegen.emit(ReduceKernel((8, 300), (1,), "sum", (bcast,), ())).meta["layout"] \
        == (8, 32)
    cols = Strided.contiguous(f32, (300, 8))
    rows = Strided(f32, (300, 8), (1, 300), 0, 2400)  # the transpose of an (8, 300) array
    two = (Instr("({0} * {1})", (("in", 0), ("in", 1)), f32),)
    assert codegen.emit(ReduceKernel((300, 8), (0,), "sum", (cols, rows), two)).meta[
        "layout"] == (8, 32)
    assert codegen.emit(ReduceKernel((300, 8), (0,), "sum", (rows, cols), two)).meta[
        "layout"] == (1, 256)


def test_axes_are_checked_up_to_rank_minus_one_and_split_0_means_none():
    with pytest.raises(CodegenError, match="out of range"):
        codegen.emit(_plain((3, 40), (2,), "sum"))
    for split in (0, None):
        k = ReduceKernel((3, 40), (1,), "sum", (Strided.contiguous(f32, (3, 40)),), (),
                         split=split)
        assert codegen.emit(k).meta["split"] == 1


def test_the_stored_dtype_is_the_last_epilogue_instrs():
    k = ReduceKernel((3, 40), (1,), "sum", (Strided.contiguous(f32, (3, 40)),), (),
                     (Instr("log({0})", (("acc", 0),), f32),
                      Instr("({0} > 0.0)", (("t", 0),), bool_)))
    assert codegen.emit(k).meta["binding_dtypes"] == (f32, bool_)


def test_split_plan_counts_workgroups_and_the_value_dtype(dev):
    """A full reduction is one workgroup, so it splits into the whole target (256 chunks);
    the value dtype is the prologue's last instr (a bool compare cast to f32 splits like f32);
    the half-target threshold is rounded down (127 workgroups of a 255 target: one pass)."""
    full = _plain((300_000,), (0,), "sum")
    assert codegen.emit(full).workgroups == (1, 1, 1)
    assert split_plan(full, dev)[0].split == 256
    pos = ReduceKernel((3, 300_000), (1,), "sum", (Strided.contiguous(f32, (3, 300_000)),),
                       (Instr("({0} > 0.0)", (("in", 0),), bool_),
                        Instr("f32({0})", (("t", 0),), f32)))
    assert split_plan(pos, dev)[0].split == 86
    assert split_plan(_plain((127, 4096), (1,), "sum"), dev, target_workgroups=255) is None


def test_split_partials_with_two_lanes_and_on_a_wrapped_grid(run, rng):
    """Split partials where lane 1 of two must start one row after lane 0 (a 64-invocation
    cap: TY = 2), and on a 2-D grid with more workgroups than split × outputs: those idle
    ones must not write past the partials (the buffer here has a third row that stays 0)."""
    x = rng.standard_normal((300, 64)).astype(np.float32)
    cap = {**run.dev.limits, "max_compute_invocations_per_workgroup": 64}
    k = ReduceKernel(x.shape, (0,), "sum", (Strided.contiguous(f32, x.shape),), (), split=2)
    (parts,) = run(k, [x], [((2, 64), f32)], limits=cap)
    assert run.last_spec.meta["layout"] == (32, 2)
    x64 = x.astype(np.float64)
    assert_close(parts, [x64[:150].sum(0), x64[150:].sum(0)], 1e-5, 1e-5, what="partials")
    y = rng.standard_normal((5, 64)).astype(np.float32)
    k = ReduceKernel(y.shape, (1,), "max", (Strided.contiguous(f32, y.shape),), (), split=2)
    grid = {**run.dev.limits, "max_compute_workgroups_per_dimension": 4}
    (parts,) = run(k, [y], [((3, 5), f32)], limits=grid)
    assert run.last_spec.workgroups == (4, 3, 1)  # 12 workgroups for 2 × 5
    np.testing.assert_array_equal(parts, [y[:, :32].max(1), y[:, 32:].max(1), np.zeros(5)])


def test_two_extra_inputs_each_from_its_binding(run, rng):
    x = rng.standard_normal((6, 40)).astype(np.float32)
    a, b = (rng.standard_normal(6).astype(np.float32) for _ in range(2))
    k = ReduceKernel((6, 40), (1,), "sum", (Strided.contiguous(f32, (6, 40)),), (),
                     (Instr("({0} * {1} + {2})", (("acc", 0), ("x", 0), ("x", 1)), f32),),
                     (Strided.contiguous(f32, (6,)),) * 2, name="two_extras")
    (y,) = run(k, [x, a, b], [((6,), f32)])
    assert_close(y, x.astype(np.float64).sum(1) * a + b, 1e-5, 1e-5, what="sum * a + b")


def test_a_bool_sum_without_epilogue_stores_the_reduced_value_as_a_bool(run, rng):
    """Without an epilogue the stored value is the reduced value in its own dtype: for bool
    values the u32 count becomes a bool (any true), whatever type stores it; a count needs a
    prologue cast (test_int_and_bool)."""
    b = rng.random((3, 64)) < 0.3
    b[1] = False
    k = ReduceKernel((3, 64), (1,), "sum", (Strided.contiguous(bool_, (3, 64)),), (),
                     out_dtype=i32)
    (y,) = run(k, [b], [((3,), i32)])
    np.testing.assert_array_equal(y, b.any(1).astype(np.int32))


def _emitter_order_sum(x: np.ndarray, ty: int) -> np.float32:
    """``x`` (1-D f32) summed in exactly the emitter's order: lane ``y`` of ``ty`` folds
    ``x[y::ty]`` into UNROLL accumulators (element s of each whole group of UNROLL into
    accumulator s) while a whole group remains, the rest into accumulator 0, combines them as
    ``(a0 + a1) + (a2 + a3)``, then the lanes pairwise (lane l += lane l + s, s = ty/2 … 1)."""
    f = np.float32
    n = len(x)
    unrolled = -(-n // ty) >= 2 * UNROLL
    lanes = []
    for y in range(ty):
        acc, r = [f(0)] * UNROLL, y
        while unrolled and r + (UNROLL - 1) * ty < n:
            acc = [f(acc[s] + x[r + s * ty]) for s in range(UNROLL)]
            r += UNROLL * ty
        for i in range(r, n, ty):
            acc[0] = f(acc[0] + x[i])
        lanes.append(f(f(acc[0] + acc[1]) + f(acc[2] + acc[3])) if unrolled else acc[0])
    s = ty // 2
    while s >= 1:
        lanes[:s] = [f(lanes[i] + lanes[i + s]) for i in range(s)]
        s //= 2
    return lanes[0]


@pytest.mark.parametrize("shape,layout", [((2, 2048), (1, 256)), ((3, 16), (4, 1)),
                                          ((3, 9), (4, 1))])
def test_the_order_of_the_arithmetic_is_the_documented_one(run, rng, shape, layout):
    """Bit for bit what ``_emitter_order_sum`` computes, with values spanning eight decades
    (so any other grouping rounds differently): 8 elements per lane (two whole groups), and
    one invocation per output folding 16 (four groups) or 9 (two, then one alone)."""
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 4, shape)).astype(np.float32)
    k = _plain(shape, (1,), "sum")
    (y,) = run(k, [x], [((shape[0],), f32)])
    assert run.last_spec.meta["layout"] == layout
    want = [_emitter_order_sum(row, layout[1]) for row in x]
    np.testing.assert_array_equal(y, np.array(want, np.float32))


def test_wide_outputs_fold_longer_reductions_serially():
    """Many contiguous outputs (partial sums of split-K, attention dQ blocks): one invocation
    per output up to 48 reduced elements from 65,536 outputs, up to 128 from 262,144
    (H200: 47 × 576,000 serial 97.5 µs vs lanes 209.6); a narrower output or a strided one
    keeps the lanes."""
    assert choose_layout((47,), True, 47, 576000, 256) == (64, 1)
    assert choose_layout((48,), True, 48, 65536, 256) == (64, 1)
    assert choose_layout((49,), True, 49, 65536, 256) == (32, 8)
    assert choose_layout((47,), True, 47, 65535, 256) == (32, 8)
    assert choose_layout((128,), True, 128, 262144, 256) == (64, 1)
    assert choose_layout((129,), True, 129, 262144, 256) == (32, 8)
    assert choose_layout((47,), False, 47, 576000, 256) == (1, 64)
    assert choose_layout((24,), True, 24, 4096, 256) == (32, 8)


def test_wide_serial_sum_exact(run, rng):
    """The serial layout at a reduced extent above SERIAL_MAX (40 rows, 65,536 outputs: the
    unrolled accumulators and the tail of 40 = 4·10) sums exactly like float64."""
    shape = (40, 65536)
    x = rng.standard_normal(shape).astype(np.float32)
    desc = _plain(shape, (0,), "sum")
    assert codegen.emit(desc).meta["layout"] == (64, 1)
    (y,) = run(desc, [x], [((65536,), f32)])
    assert_close(y, x.astype(np.float64).sum(0), 1e-5, 1e-5, what="wide serial sum")
