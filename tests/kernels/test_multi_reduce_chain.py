"""Chained row reductions in one dispatch (``ChainReduceKernel``, kernels/multi_reduce.py) on
the device against float64 numpy: a LayerNorm (mean, variance of the centered row in
registers, normalisation) over row lengths from 1 to the 4,096 cap, a softmax (max then sum),
the stored/register-only outputs, and the errors for rows over the cap and bad descriptions."""

import numpy as np
import pytest

from meganeura import kernels as codegen
from meganeura.dtypes import f32
from meganeura.kernels import CodegenError, Instr, ReduceMember, Strided
from meganeura.kernels.multi_reduce import CHAIN_MAX_REDUCED, ChainReduceKernel, chain_fits

from ._util import assert_close

EPS = 1e-5


def layer_norm_chain(rows: int, n: int, stored=((False, False), (False, True))):
    """(rows, n) LayerNorm: inputs x, w, b; stage 0 c = x - sum(x)/n, stage 1
    y = c * rsqrt(sum(c²)/n + eps) * w + b."""
    shape = (rows, n)
    inv = f"f32({1.0 / n!r})"
    mean = ReduceMember("sum", (Instr("{0}", (("in", 0),), f32),), out_dtype=f32,
                        post=(Instr(inv, (), f32), Instr("({0} * {1})", (("r", 0), ("t", 0)), f32),
                              Instr("({0} - {1})", (("in", 0), ("t", 1)), f32)),
                        post_outputs=(2,))
    var = ReduceMember("sum", (Instr("({0} * {0})", (("c", 0),), f32),), out_dtype=f32,
                       post=(Instr(inv, (), f32), Instr("({0} * {1})", (("r", 0), ("t", 0)), f32),
                             Instr(f"f32({EPS!r})", (), f32),
                             Instr("({0} + {1})", (("t", 1), ("t", 2)), f32),
                             Instr("inverseSqrt({0})", (("t", 3),), f32),
                             Instr("({0} * {1})", (("c", 0), ("t", 4)), f32),
                             Instr("({0} * {1})", (("t", 5), ("in", 1)), f32),
                             Instr("({0} + {1})", (("t", 6), ("in", 2)), f32)),
                       post_outputs=(7,))
    vec = Strided(f32, shape, (0, 1), 0, n)
    return ChainReduceKernel(shape, (1,), (Strided.contiguous(f32, shape), vec, vec),
                             (mean, var), stored)


def _ln64(x, w, b):
    x = x.astype(np.float64)
    c = x - x.mean(axis=1, keepdims=True)
    var = (c * c).mean(axis=1, keepdims=True)
    return x.sum(axis=1), c, (c * c).sum(axis=1), c / np.sqrt(var + EPS) * w + b


@pytest.mark.parametrize("n", [1, 7, 384, 1000, CHAIN_MAX_REDUCED])
def test_layer_norm_matches_float64(run, rng, n):
    rows = 3 if n > 1000 else 70  # several workgroups (70 rows: two for the serial layout)
    x = (rng.standard_normal((rows, n)) * 3 + 1.5).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    (y,) = run(layer_norm_chain(rows, n), [x, w, b], [((rows, n), f32)])
    assert_close(y, _ln64(x, w, b)[3], 2e-5, 2e-5, what=f"layer norm over {n}")
    tx, ty = run.last_spec.meta["layout"]
    assert run.last_spec.meta["per_lane"] <= 16 and (ty == 1) == (n <= 16), (tx, ty)


def test_every_output_stored(run, rng):
    """Stored flags on: the mean's sum, the centered row and the variance's sum are written
    too (what a training step keeps for the backward)."""
    rows, n = 9, 300
    x = rng.standard_normal((rows, n)).astype(np.float32)
    w, b = np.ones(n, np.float32), np.zeros(n, np.float32)
    k = layer_norm_chain(rows, n, ((True, True), (True, True)))
    got = run(k, [x, w, b], [((rows,), f32), ((rows, n), f32), ((rows,), f32), ((rows, n), f32)])
    for g, r, what in zip(got, _ln64(x, w, b), ("sum", "centered", "sum of squares", "y"),
                          strict=True):
        assert_close(g, r, 2e-5, 2e-5, what=what)
    assert run.last_spec.n_bindings == 7


@pytest.mark.parametrize("n", [1, 50, 2049])
def test_softmax_max_then_sum(run, rng, n):
    """A max stage then a sum stage (a row softmax): the max identity and a row that fills
    only part of the last element of each lane."""
    rows = 4
    x = (rng.standard_normal((rows, n)) * 4).astype(np.float32)
    mx = ReduceMember("max", (Instr("{0}", (("in", 0),), f32),), out_dtype=f32,
                      post=(Instr("exp({0} - {1})", (("in", 0), ("r", 0)), f32),),
                      post_outputs=(0,))
    sm = ReduceMember("sum", (Instr("{0}", (("c", 0),), f32),), out_dtype=f32,
                      post=(Instr("({0} / {1})", (("c", 0), ("r", 0)), f32),), post_outputs=(0,))
    k = ChainReduceKernel((rows, n), (1,), (Strided.contiguous(f32, (rows, n)),), (mx, sm),
                          ((True, False), (False, True)))
    m, p = run(k, [x], [((rows,), f32), ((rows, n), f32)])
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=1, keepdims=True))
    np.testing.assert_array_equal(m, x.max(axis=1))
    assert_close(p, e / e.sum(axis=1, keepdims=True), 1e-5, 1e-7, what=f"softmax over {n}")


def test_deterministic(run, rng):
    rows, n = 5, 1000
    x = rng.standard_normal((rows, n)).astype(np.float32)
    w, b = np.ones(n, np.float32), np.zeros(n, np.float32)
    k = layer_norm_chain(rows, n)
    first = run(k, [x, w, b], [((rows, n), f32)])[0]
    np.testing.assert_array_equal(first, run(k, [x, w, b], [((rows, n), f32)])[0])


def test_bad_descriptions_raise():
    k = layer_norm_chain(2, CHAIN_MAX_REDUCED + 1)
    with pytest.raises(CodegenError, match="does not fit one workgroup"):
        codegen.emit(k)
    ok = layer_norm_chain(2, 8)
    with pytest.raises(CodegenError, match="stored flags"):
        codegen.emit(ChainReduceKernel(ok.shape, ok.axes, ok.inputs, ok.stages, ((True,),)))
    with pytest.raises(CodegenError, match="at least two stages"):
        codegen.emit(ChainReduceKernel(ok.shape, ok.axes, ok.inputs, ok.stages[:1],
                                       ok.stored[:1]))
    early = ReduceMember("sum", (Instr("{0}", (("c", 0),), f32),), out_dtype=f32,
                         post=ok.stages[0].post, post_outputs=(2,))
    with pytest.raises(CodegenError, match=r"reads \('c', 0\)"):
        codegen.emit(ChainReduceKernel(ok.shape, ok.axes, ok.inputs, (early, ok.stages[1]),
                                       ok.stored))
    no_post = ReduceMember("sum", ok.stages[0].prologue, out_dtype=f32)
    with pytest.raises(CodegenError, match="needs a post pass"):
        codegen.emit(ChainReduceKernel(ok.shape, ok.axes, ok.inputs, (no_post, ok.stages[1]),
                                       ((True,), (False, True))))


def test_epilogues_read_extra_inputs(run, rng):
    """Stage epilogues scaled by a per-row extra input (a norm's backward: sums times rstd),
    the extra bound once for both stages, rows spread over a 3-d shape (reduced last)."""
    shape = (2, 5, 40)
    x = rng.standard_normal(shape).astype(np.float32)
    scale = rng.standard_normal((2, 5)).astype(np.float32)
    first = ReduceMember("sum", (Instr("{0}", (("in", 0),), f32),),
                         (Instr("({0} * {1})", (("acc", 0), ("x", 0)), f32),), f32,
                         post=(Instr("({0} - {1})", (("in", 0), ("r", 0)), f32),),
                         post_outputs=(0,))
    second = ReduceMember("sum", (Instr("({0} * {1})", (("c", 0), ("in", 0)), f32),),
                          (Instr("({0} * {1})", (("acc", 0), ("x", 0)), f32),), f32,
                          post=(Instr("({0} * {1})", (("c", 0), ("r", 0)), f32),),
                          post_outputs=(0,))
    k = ChainReduceKernel(shape, (2,), (Strided.contiguous(f32, shape),), (first, second),
                          ((True, False), (True, True)), (Strided.contiguous(f32, (2, 5)),))
    r0, r1, y = run(k, [x, scale], [((2, 5), f32), ((2, 5), f32), (shape, f32)])
    x64, s64 = x.astype(np.float64), scale.astype(np.float64)
    want0 = x64.sum(axis=2) * s64
    c = x64 - want0[..., None]
    want1 = (c * x64).sum(axis=2) * s64
    assert_close(r0, want0, 1e-5, 1e-5, what="first result")
    assert_close(r1, want1, 1e-5, 1e-5, what="second result")
    assert_close(y, c * want1[..., None], 1e-5, 1e-5, what="second post pass")
    assert run.last_spec.n_bindings == 5


@pytest.mark.parametrize("rows", [50, 128])
def test_column_chain_reads_neighbouring_rows_together(run, rng, rows):
    """A chain over axis 0 of (rows, 300) (a batch norm over the batch): 32 neighbouring
    outputs per workgroup; 128 rows are the most that layout holds, 129 do not fit."""
    n = 300
    mean = ReduceMember("sum", (Instr("{0}", (("in", 0),), f32),), out_dtype=f32,
                        post=(Instr(f"({{0}} - {{1}} * f32({1.0 / rows!r}))",
                                    (("in", 0), ("r", 0)), f32),), post_outputs=(0,))
    var = ReduceMember("sum", (Instr("({0} * {0})", (("c", 0),), f32),), out_dtype=f32)
    k = ChainReduceKernel((rows, n), (0,), (Strided.contiguous(f32, (rows, n)),), (mean, var),
                          ((False, True), (True,)))
    x = (rng.standard_normal((rows, n)) + 2).astype(np.float32)
    c, ss = run(k, [x], [((rows, n), f32), ((n,), f32)])
    x64 = x.astype(np.float64)
    c64 = x64 - x64.mean(axis=0)
    assert_close(c, c64, 2e-5, 2e-5, what="centered")
    assert_close(ss, (c64 * c64).sum(axis=0), 2e-5, 2e-5, what="sum of squares")
    assert run.last_spec.meta["layout"][0] == 32
    too_long = ChainReduceKernel((129, n), (0,), (Strided.contiguous(f32, (129, n)),),
                                 (mean, var), k.stored)
    with pytest.raises(CodegenError, match="elements per invocation"):
        codegen.emit(too_long)
    assert chain_fits(k) and not chain_fits(too_long)
