"""Multi-output reduction emitter (kernels/multi_reduce.py) on the device: each member against
float64 numpy and bit for bit against its own single ``ReduceKernel`` (same layout, same
order of arithmetic), over row, column, serial and split layouts, odd shapes, f16 inputs,
mixed kinds and dtypes, epilogues with extra inputs; bad descriptions raise."""

import numpy as np
import pytest

from meganeura import kernels as codegen
from meganeura.dtypes import f16, f32, i32
from meganeura.errors import LimitError
from meganeura.kernels import (
    CodegenError,
    Instr,
    MultiReduceKernel,
    ReduceKernel,
    ReduceMember,
    Strided,
)

from ._util import assert_close

IN0, IN1 = ("in", 0), ("in", 1)


def _out(shape, axes):
    return tuple(n for d, n in enumerate(shape) if d not in axes)


def _bn_members(dt=f32):
    """Batch norm's backward sums: sum(dy), sum(dy * x) scaled by an extra, max(|x|)."""
    return (
        ReduceMember("sum", (Instr("{0}", (IN0,), dt),), out_dtype=f32),
        ReduceMember("sum", (Instr("({0} * {1})", (IN0, IN1), dt),),
                     (Instr("({0} * {1})", (("acc", 0), ("x", 0)), dt),), f32),
        ReduceMember("max", (Instr("abs({0})", (IN1,), dt),), out_dtype=f32),
    )


def _single(k: MultiReduceKernel, m: ReduceMember) -> ReduceKernel:
    return ReduceKernel(k.shape, k.axes, m.kind, k.inputs, m.prologue, m.epilogue,
                        k.extra if m.epilogue else (), m.out_dtype, split=k.split)


@pytest.mark.parametrize("shape,axes", [
    ((4, 8, 6, 6), (0, 2, 3)),  # batch norm statistics (N, H, W), several workgroups
    ((300, 70), (0,)),  # column reduction, odd extents
    ((5, 37, 6), (1,)),  # middle axis
    ((7, 3, 5), (1,)),  # tiny reduced extent: serial, one invocation per output
    ((3, 1500, 5), (0, 1)),  # long reduced range: the unrolled loop
])
def test_members_match_float64_and_single_kernels(run, rng, shape, axes):
    dy = rng.standard_normal(shape).astype(np.float32)
    x = (rng.standard_normal(shape) * 2 - 0.5).astype(np.float32)
    out = _out(shape, axes)
    scale = rng.standard_normal(out).astype(np.float32)
    k = MultiReduceKernel(shape, axes, (Strided.contiguous(f32, shape),) * 2, _bn_members(),
                          (Strided.contiguous(f32, out),))
    got = run(k, [dy, x, scale], [(out, f32)] * 3)
    d64, x64 = dy.astype(np.float64), x.astype(np.float64)
    refs = [d64.sum(axis=axes), (d64 * x64).sum(axis=axes) * scale, np.abs(x64).max(axis=axes)]
    for j, (g, r) in enumerate(zip(got, refs, strict=True)):
        assert_close(g, r, 1e-5, 1e-4, what=f"member {j} of {shape} over {axes}")
    for j, m in enumerate(k.members):
        ins = [dy, x] + ([scale] if m.epilogue else [])
        (alone,) = run(_single(k, m), ins, [(out, f32)])
        np.testing.assert_array_equal(got[j], alone, err_msg=f"member {j} vs its own kernel")


def test_split_partials(run, rng):
    """Partial mode: each of ``split`` chunks of the reduced range reduced separately, the
    partials stored (split, *out) in the accumulator dtype, for every member."""
    shape, axes, split = (4, 5, 2000), (0, 2), 6
    dy = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    members = _bn_members()[:1] + (ReduceMember("sum", (Instr("({0} * {1})", (IN0, IN1),
                                                               f32),)),)
    k = MultiReduceKernel(shape, axes, (Strided.contiguous(f32, shape),) * 2, members,
                          split=split)
    got = run(k, [dy, x], [((split, 5), f32)] * 2)
    red = np.moveaxis(dy.astype(np.float64), 1, -1).reshape(-1, 5)  # reduced index order
    prod = np.moveaxis(dy.astype(np.float64) * x, 1, -1).reshape(-1, 5)
    chunk = -(-red.shape[0] // split)
    for j, v in enumerate((red, prod)):
        ref = np.stack([v[c * chunk:(c + 1) * chunk].sum(axis=0) for c in range(split)])
        assert_close(got[j], ref, 1e-5, 1e-4, what=f"partials of member {j}")
        (alone,) = run(_single(k, members[j]), [dy, x], [((split, 5), f32)])
        np.testing.assert_array_equal(got[j], alone)


def test_f16_input_and_integer_member(run, dev, rng):
    """f16 values accumulate in f32 (stored as f16); an i32 member beside them."""
    if "shader-f16" not in dev.features:
        pytest.fail("the test device lacks shader-f16 (lavapipe has it)")
    shape, axes = (6, 33, 10), (1,)
    h = rng.standard_normal(shape).astype(np.float16)
    n = rng.integers(-50, 50, shape).astype(np.int32)
    members = (ReduceMember("sum", (Instr("({0} * {0})", (IN0,), f16),), out_dtype=f16),
               ReduceMember("min", (Instr("{0}", (IN1,), i32),)))
    k = MultiReduceKernel(shape, axes, (Strided.contiguous(f16, shape),
                                        Strided.contiguous(i32, shape)), members)
    out = _out(shape, axes)
    got_h, got_n = run(k, [h, n], [(out, f16), (out, i32)])
    h64 = h.astype(np.float64)
    assert_close(got_h, (h64 * h64).sum(axis=axes), 2e-3, 1e-2, what="f16 sum of squares")
    np.testing.assert_array_equal(got_n, n.min(axis=axes))


def test_strided_shared_input(run, rng):
    """Members read one input through two views (transposed and plain); loads are per
    binding, so each view is read at its own element."""
    base = rng.standard_normal((24, 24)).astype(np.float32)
    plain = Strided.contiguous(f32, (24, 24))
    trans = Strided(f32, (24, 24), (1, 24), 0, 576)
    members = (ReduceMember("sum", (Instr("{0}", (IN0,), f32),)),
               ReduceMember("sum", (Instr("({0} - {1})", (IN0, IN1), f32),)))
    k = MultiReduceKernel((24, 24), (1,), (plain, trans), members)
    got = run(k, [base, base], [((24,), f32)] * 2, alias=(0, 0, 2, 3))
    b64 = base.astype(np.float64)
    assert_close(got[0], b64.sum(axis=1), 1e-5, 1e-5, what="rows")
    assert_close(got[1], (b64 - b64.T).sum(axis=1), 1e-5, 1e-5, what="rows minus columns")


def test_bad_descriptions_raise(dev):
    s = Strided.contiguous(f32, (4, 8))
    one = (Instr("{0}", (IN0,), f32),)
    with pytest.raises(CodegenError, match="no members"):
        codegen.emit(MultiReduceKernel((4, 8), (1,), (s,), ()))
    with pytest.raises(CodegenError, match="unknown reduction"):
        codegen.emit(MultiReduceKernel((4, 8), (1,), (s,), (ReduceMember("mean", one),)))
    with pytest.raises(CodegenError, match="no epilogue"):
        codegen.emit(MultiReduceKernel((4, 8), (1,), (s,), (ReduceMember(
            "sum", one, (Instr("{0}", (("acc", 0),), f32),)),), split=2))
    with pytest.raises(CodegenError, match="input 1 of 1"):
        codegen.emit(MultiReduceKernel((4, 8), (1,), (s,), (ReduceMember(
            "sum", (Instr("{0}", (IN1,), f32),)),)))
    with pytest.raises(LimitError, match="storage buffers"):
        codegen.emit(MultiReduceKernel((4, 8), (1,), (s,), (ReduceMember("sum", one),) * 8))


def _post_members():
    """sum(dy); sum(dy * x) whose post pass writes dy - r * x and (dy - r * x) * w (w read by
    the post pass alone); max|x| whose post pass writes x / r."""
    g = (Instr("({0} - {1} * {2})", (IN0, ("r", 0), IN1), f32),
         Instr("({0} * {1})", (("t", 0), ("in", 2)), f32))
    return (ReduceMember("sum", (Instr("{0}", (IN0,), f32),)),
            ReduceMember("sum", (Instr("({0} * {1})", (IN0, IN1), f32),), post=g,
                         post_outputs=(0, 1)),
            ReduceMember("max", (Instr("abs({0})", (IN1,), f32),),
                         post=(Instr("({0} / {1})", (IN1, ("r", 0)), f32),), post_outputs=(0,)))


def _single_post(k: MultiReduceKernel, m: ReduceMember) -> ReduceKernel:
    """``m`` as a ``ReduceKernel`` of its own: shared inputs 0 and 1 read as ``ri``, input 2
    as its post input 0."""
    post = tuple(Instr(i.expr, tuple(("in", 0) if a == ("in", 2) else
                                     ("ri", a[1]) if a[0] == "in" else a for a in i.args),
                       i.dtype) for i in m.post)
    return ReduceKernel(k.shape, k.axes, m.kind, k.inputs[:2], m.prologue,
                        post_inputs=k.inputs[2:] if m.post else (), post=post,
                        post_outputs=m.post_outputs)


@pytest.mark.parametrize("shape,axes", [
    ((4, 8, 14, 14), (0, 2, 3)),  # batch norm backward at 14x14: lanes per output
    ((7, 3, 5), (1,)),  # serial: one invocation per output
])
def test_post_pass_members_match_float64_and_single_kernels(run, rng, shape, axes):
    """Members with a post pass (each after the group's reduction, all post inputs loaded
    once) store what their own post-pass kernels store, bit for bit, and match float64."""
    dy, x, w = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    out = _out(shape, axes)
    k = MultiReduceKernel(shape, axes, (Strided.contiguous(f32, shape),) * 3, _post_members())
    got = run(k, [dy, x, w], [(out, f32), (out, f32), (shape, f32), (shape, f32), (out, f32),
                              (shape, f32)])
    d64, x64, w64 = (a.astype(np.float64) for a in (dy, x, w))
    s1, mx = (d64 * x64).sum(axis=axes, keepdims=True), np.abs(x64).max(axis=axes, keepdims=True)
    refs = [d64.sum(axis=axes), s1, d64 - s1 * x64, (d64 - s1 * x64) * w64, mx, x64 / mx]
    for j, (g, r) in enumerate(zip(got, refs, strict=True)):
        full = np.broadcast_to(r, shape) if g.size == np.prod(shape) else r
        assert_close(g, full.reshape(g.shape), 1e-5, 1e-3, what=f"output {j}")
    at = 0
    for j, m in enumerate(k.members):
        outs = [(out, f32)] + [(shape, f32)] * len(m.post_outputs)
        alone = run(_single_post(k, m), [dy, x] + ([w] if m.post else []), outs)
        for q, a in enumerate(alone):
            np.testing.assert_array_equal(got[at + q], a, err_msg=f"member {j} output {q}")
        at += len(outs)


def test_post_pass_member_needs_outputs_and_no_split(dev):
    s = Strided.contiguous(f32, (4, 8))
    one = (Instr("{0}", (IN0,), f32),)
    with pytest.raises(CodegenError, match="post pass needs"):
        codegen.emit(MultiReduceKernel((4, 8), (1,), (s,), (ReduceMember(
            "sum", one, post=one, post_outputs=(0,)),), split=2))
    with pytest.raises(CodegenError, match="post pass needs"):
        codegen.emit(MultiReduceKernel((4, 8), (1,), (s,), (ReduceMember(
            "sum", one, post=one),)))


def test_member_without_prologue_and_post_reading_any_input(run, rng):
    """The shared generator's generalizations: a member with no prologue reduces input 0 (as a
    ``ReduceKernel`` without one does), and a ``ReduceKernel``'s post pass may read, as
    ``("ri", i)``, an input its prologue does not read."""
    shape = (6, 40)
    a, b = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    full = Strided.contiguous(f32, shape)
    members = (ReduceMember("max", ()), ReduceMember("sum", (Instr("{0}", (IN1,), f32),)))
    k = MultiReduceKernel(shape, (1,), (full, full), members)
    mx, sb = run(k, [a, b], [((6,), f32)] * 2)
    np.testing.assert_array_equal(mx, a.max(1))
    assert_close(sb, b.astype(np.float64).sum(1), 1e-5, 1e-5, what="sum(b)")
    solo = ReduceKernel(shape, (1,), "max", (full, full), (), post=(
        Instr("({0} - {1})", (("ri", 1), ("r", 0)), f32),), post_outputs=(0,))
    r, y = run(solo, [a, b], [((6,), f32), (shape, f32)])
    np.testing.assert_array_equal(r, a.max(1))
    np.testing.assert_array_equal(y, b - a.max(1, keepdims=True))


def test_each_member_has_its_own_workgroup_array():
    """Three members at 32 × 8 lanes: three f32 arrays of 256, all counted by the limit check."""
    k = MultiReduceKernel((300, 70), (0,), (Strided.contiguous(f32, (300, 70)),) * 2,
                          _bn_members(), (Strided.contiguous(f32, (70,)),))
    spec = codegen.emit(k)
    assert spec.meta["layout"] == (32, 8) and spec.meta["workgroup_storage"] == 3 * 256 * 4
    with pytest.raises(LimitError, match="workgroup storage"):
        codegen.emit(k, {"max_compute_workgroup_storage_size": 3 * 256 * 4 - 4})


def test_the_layout_follows_the_first_members_input():
    """Member 0 reads a column-major input (outputs side by side), member 1 a row-major view:
    the first member decides."""
    cols = Strided.contiguous(f32, (300, 8))
    rows = Strided(f32, (300, 8), (1, 300), 0, 2400)
    members = (ReduceMember("sum", (Instr("{0}", (IN0,), f32),)),
               ReduceMember("sum", (Instr("{0}", (IN1,), f32),)))
    assert codegen.emit(MultiReduceKernel((300, 8), (0,), (cols, rows), members)).meta[
        "layout"] == (8, 32)
    assert codegen.emit(MultiReduceKernel((300, 8), (0,), (rows, cols), members)).meta[
        "layout"] == (1, 256)
