"""The attention kernels one at a time (emit → dispatch → read back) against the float64 numpy
reference of ``ops/attention.py``: every tile configuration of ``CONFIGS`` that fits the device,
forced, on awkward shapes (blocks and tiles cut by the sizes, grouped-query heads, causal,
window, mask, q_offset, Dv != D, scalar head dims), plus the heuristic and the tuner's
candidates."""

import dataclasses

import numpy as np
import pytest

from meganeura import kernels
from meganeura.dtypes import f32
from meganeura.kernels import attention as A
from meganeura.kernels.common import make_target
from meganeura.kernels.ir import Strided
from meganeura.ops.attention import _attention_ref, _grad_parts

C = Strided.contiguous


def _problem(rng, dims, attrs, mask_shape=None):
    """Inputs (float32), the attrs dict and the float64 references (out, lse, dq, dk, dv)."""
    B, Hq, Hkv, Sq, Skv, D, Dv = dims
    a = {"causal": False, "scale": 1.0 / np.sqrt(D), "window": 0, "q_offset": 0,
         "has_mask": mask_shape is not None, **attrs}
    x = {"q": rng.normal(size=(B, Hq, Sq, D)), "k": rng.normal(size=(B, Hkv, Skv, D)),
         "v": rng.normal(size=(B, Hkv, Skv, Dv))}
    if mask_shape is not None:
        m = rng.normal(size=mask_shape)
        m[..., ::5] = -np.inf
        x["mask"] = m
    x = {n: v.astype(np.float32) for n, v in x.items()}
    base = [x[n].astype(np.float64) for n in x]
    out, lse = _attention_ref(base, a)
    dout = rng.normal(size=out.shape).astype(np.float32)
    delta = (dout.astype(np.float64) * out).sum(-1)
    x.update(dout=dout, lse=lse.astype(np.float32), delta=delta.astype(np.float32))
    grads = _grad_parts(base + [dout.astype(np.float64), lse, delta], a)
    return x, a, dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])


def _desc(kind, x, a, config=(), out_bshd=False):
    views = {n: C(f32, v.shape) for n, v in x.items()}
    mask = views.get("mask")
    extra = (None, None, None) if kind == "fwd" else (views["dout"], views["lse"], views["delta"])
    return A.KIND_TYPES[kind](kind, views["q"], views["k"], views["v"], mask, *extra,
                              a["causal"], a["scale"], a["window"], a["q_offset"],
                              name=f"attention_{kind}", config=config, out_bshd=out_bshd)


def _run(run, kind, x, desc):
    names = ["q", "k", "v"] + (["mask"] if "mask" in x else [])
    if kind != "fwd":
        names += ["dout", "lse", "delta"]
    q, k, v = x["q"].shape, x["k"].shape, x["v"].shape
    outs = {"fwd": [(q[:3] + v[3:], f32), (q[:3], f32)], "dq": [(q, f32)],
            "dkdv": [(k, f32), (v, f32)]}[kind]
    return run(desc, [x[n] for n in names], outs)


def _check(got, want, what):
    want = np.asarray(want, np.float64)
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got)), f"{what}: non-finite pattern differs"
    scale = max(float(np.abs(want[fin]).max(initial=0.0)), 1e-30)
    err = float(np.abs(got[fin] - want[fin]).max(initial=0.0)) / scale
    assert err <= 2e-5, f"{what}: relative error {err:.3g}"


def _check_kind(run, kind, x, a, ref, config=()):
    desc = _desc(kind, x, a, config)
    got = _run(run, kind, x, desc)
    names = {"fwd": ["out", "lse"], "dq": ["dq"], "dkdv": ["dk", "dv"]}[kind]
    for n, gv in zip(names, got, strict=True):
        _check(gv, ref[n], f"{kind} {n} config={config or 'heuristic'}")
    return run.last_spec


def _fitting(dev, kind, D, Dv):
    t = make_target(dev.limits, dev.features)
    return [c for c in A.CONFIGS if A.config_fits(kind, c, D, Dv, t)]


# (B, Hq, Hkv, Sq, Skv, D, Dv), attrs: sizes cut blocks and tiles
SHAPES = {
    "gqa_causal": ((1, 4, 2, 37, 37, 8, 8), {"causal": True}),
    "cross_window": ((2, 2, 1, 21, 45, 4, 12), {"window": 9, "q_offset": 20}),
}


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_config(run, dev, rng, kind, shape):
    dims, attrs = SHAPES[shape]
    x, a, ref = _problem(rng, dims, attrs)
    for cfg in _fitting(dev, kind, dims[5], dims[6]):
        _check_kind(run, kind, x, a, ref, cfg)


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
def test_mask_scalar_head_dim_and_offset(run, rng, kind):
    """Additive mask with -inf entries (broadcast over batch), D = 5, Dv = 3, causal with a
    q_offset, heuristic configuration."""
    dims = (2, 3, 1, 11, 19, 5, 3)
    x, a, ref = _problem(rng, dims, {"causal": True, "q_offset": 6}, mask_shape=(1, 3, 11, 19))
    _check_kind(run, kind, x, a, ref)
    _check_kind(run, kind, x, a, ref, (4, 8, 2, 2))


@pytest.mark.parametrize("D", [32, 64, 128])
def test_head_dims(run, rng, D):
    """The head dims of real models with the heuristic tiles (one causal GQA problem)."""
    x, a, ref = _problem(rng, (1, 4, 2, 70, 70, D, D), {"causal": True})
    for kind in ("fwd", "dq", "dkdv"):
        _check_kind(run, kind, x, a, ref)


def test_decode_rows(run, rng):
    """One query position (KV-cache decode) with G = 3: few rows, many keys."""
    x, a, ref = _problem(rng, (1, 6, 2, 1, 77, 8, 8), {"causal": True, "q_offset": 76})
    spec = _check_kind(run, "fwd", x, a, ref)
    assert spec.meta["tiles"][0] <= 4


def test_out_bshd(run, rng):
    x, a, ref = _problem(rng, (1, 3, 3, 10, 10, 8, 8), {})
    desc = _desc("fwd", x, a, out_bshd=True)
    out, lse = _run(run, "fwd", x, desc)
    want = ref["out"].transpose(0, 2, 1, 3)
    _check(out.reshape(want.shape), want, "out_bshd")
    _check(lse, ref["lse"], "lse")


def test_candidates_heuristic_first_and_valid(dev):
    """The tuner's list: the heuristic first, distinct, each emitting within the limits."""
    t = make_target(dev.limits, dev.features)
    q, kv, row = C(f32, (1, 6, 1500, 64)), C(f32, (1, 6, 1500, 64)), C(f32, (1, 6, 1500))
    for kind in ("fwd", "dq", "dkdv"):
        extra = (None, None, None) if kind == "fwd" else (q, row, row)
        desc = A.KIND_TYPES[kind](kind, q, kv, kv, None, *extra, False, 0.125, 0, 0)
        cands = kernels.candidates(desc, t)
        assert 2 <= len(cands) <= 8
        assert cands[0].config == A.resolve_config(desc, t)
        assert len({c.config for c in cands}) == len(cands)
        for c in cands:
            spec = kernels.emit(c, dev.limits, dev.features)
            assert spec.meta["workgroup_storage"] <= t.lim("max_compute_workgroup_storage_size")


def test_bad_config_is_an_error(dev):
    q = C(f32, (1, 2, 8, 8))
    desc = A.AttentionFwdKernel("fwd", q, q, q, None, None, None, None, False, 0.3, 0, 0,
                                config=(8, 8, 3, 4))
    with pytest.raises(kernels.CodegenError):
        kernels.emit(desc, dev.limits, dev.features)
    with pytest.raises(kernels.CodegenError):
        kernels.emit(dataclasses.replace(desc, config=(64, 64, 4, 4)), dev.limits, dev.features)


def _combine(run, po, pl, n, out_bshd=False):
    from meganeura.kernels.attention_combine import AttentionCombineKernel

    desc = AttentionCombineKernel(C(f32, po.shape), C(f32, pl.shape), n, out_bshd=out_bshd)
    B = po.shape[0] // n
    return run(desc, [po, pl], [((B,) + po.shape[1:], f32), ((B,) + pl.shape[1:], f32)])


@pytest.fixture(params=[True, False], ids=["vec4", "scalar"])
def combine_units(request, monkeypatch):
    """The combine kernel by vec4 units (``VEC_COMBINE``, where rows allow) and by scalars."""
    from meganeura.kernels import attention_combine

    monkeypatch.setattr(attention_combine, "VEC_COMBINE", request.param)
    return request.param


@pytest.mark.parametrize("n,keys", [(2, 0), (5, 0), (2, 32), (5, 10)])
def test_split_fwd_and_combine(run, rng, n, keys, combine_units):
    """Split-K forward (keys in n chunks, even or of ``chunk_keys`` each with a short last one,
    some chunks fully hidden by the causal rule or the mask) then the combine kernel == the
    unsplit reference; the partials match the op's reference of the split kernel."""
    from meganeura.ops.attention import _split_fwd_ref

    dims = (2, 6, 2, 3, 45, 8, 8)
    x, a, ref = _problem(rng, dims, {"causal": True, "q_offset": 20},
                         mask_shape=(1, 1, 1, 45))
    a = {**a, "splits": n, "chunk_keys": keys}
    desc = dataclasses.replace(_desc("fwd", x, a), splits=n, chunk_keys=keys)
    po, pl = run(desc, [x[k] for k in ("q", "k", "v", "mask")],
                 [((n * 2, 6, 3, 8), f32), ((n * 2, 6, 3), f32)])
    want = _split_fwd_ref([x[k].astype(np.float64) for k in ("q", "k", "v", "mask")], a)
    _check(po, want[0], "partial out")
    _check(pl, want[1], "partial lse")
    out, lse = _combine(run, po, pl, n)
    _check(out, ref["out"], "combined out")
    _check(lse, ref["lse"], "combined lse")
    bshd, _ = _combine(run, po, pl, n, out_bshd=True)
    want = ref["out"].transpose(0, 2, 1, 3)
    _check(bshd.reshape(want.shape), want, "combined out (bshd)")


@pytest.mark.parametrize("kind,splits,keys", [("fwd", 3, 10), ("fwd", 3, 23), ("fwd", 1, 45),
                                              ("dq", 3, 16)])
def test_chunk_keys_that_do_not_split_are_refused(rng, kind, splits, keys):
    """``chunk_keys`` must give exactly ``splits`` chunks of a forward (45 keys: 3 chunks of
    10 leave keys out, of 23 one chunk is empty), else a CodegenError names it."""
    x, a, _ = _problem(rng, (1, 2, 2, 5, 45, 8, 8), {"causal": False, "q_offset": 0})
    if kind != "fwd":
        x = {**x, "dout": x["q"], "lse": x["q"][..., 0], "delta": x["q"][..., 0]}
    desc = dataclasses.replace(_desc(kind, x, a), splits=splits, chunk_keys=keys)
    with pytest.raises(kernels.CodegenError, match="chunk_keys"):
        kernels.emit(desc)


def test_combine_empty_rows(run, combine_units):
    """Rows whose chunks are all empty (lse -inf) give 0 and -inf, not NaN."""
    pl = np.full((3, 1, 2), -np.inf, np.float32)
    pl[1, 0, 1] = 0.5
    po = np.zeros((3, 1, 2, 4), np.float32)
    po[1, 0, 1] = [1, 2, 3, 4]
    out, lse = _combine(run, po.reshape(3, 1, 2, 4), pl, 3)
    assert np.array_equal(out[0, 0, 0], [0, 0, 0, 0]) and lse[0, 0, 0] == -np.inf
    np.testing.assert_allclose(out[0, 0, 1], [1, 2, 3, 4])
    assert lse[0, 0, 1] == np.float32(0.5)


@pytest.mark.parametrize("split_heads", [False, True])
def test_split_dkdv(run, rng, split_heads):
    """dK/dV over 3 chunks of query positions: the partial sums (the op's reference) and
    their total (the unsplit gradient)."""
    from meganeura.ops.attention import _dkdv_ref

    n, dims = 3, (1, 4, 2, 29, 23, 8, 4)
    x, a, ref = _problem(rng, dims, {"causal": True, "q_offset": 3})
    a = {**a, "splits": n, "split_heads": split_heads}
    desc = dataclasses.replace(_desc("dkdv", x, a), splits=n, split_heads=split_heads)
    H = 4 if split_heads else 2
    dk, dv = run(desc, [x[k] for k in ("q", "k", "v", "dout", "lse", "delta")],
                 [((n, H, 23, 8), f32), ((n, H, 23, 4), f32)])
    names = ("q", "k", "v", "dout", "lse", "delta")
    want = _dkdv_ref([x[k].astype(np.float64) for k in names], a)
    _check(dk, want[0], "partial dk")
    _check(dv, want[1], "partial dv")
    fold = (lambda t: t.reshape(n, 1, 2, 2, 23, -1).sum((0, 3))) if split_heads else \
        (lambda t: t.sum(0, keepdims=True))
    _check(fold(dk.astype(np.float64)), ref["dk"], "summed dk")
    _check(fold(dv.astype(np.float64)), ref["dv"], "summed dv")


def _run_poisoned(dev, desc, inputs, shapes):
    """Like ``run`` but the f32 outputs start as NaN (fresh buffers are zeros, which would
    hide an element the kernel never writes)."""
    spec = kernels.emit(desc, dev.limits, dev.features)
    outs = [dev.upload(np.full(s, np.nan, np.float32)) for s in shapes]
    dev.dispatch(spec, [dev.upload(a) for a in inputs] + outs)
    return [dev.read_array(b, s, f32) for b, s in zip(outs, shapes, strict=True)]


RULES = {"mask": {}, "causal": {"causal": True, "q_offset": 3},
         "window": {"window": 9, "q_offset": 20}}


@pytest.mark.parametrize("rules", sorted(RULES))
@pytest.mark.parametrize("split_heads", [False, True])
def test_dkdv_with_dq_partials(run, dev, rng, split_heads, rules):
    """dK/dV that also writes dQ's partial sums per key block (GQA, query chunks, key blocks
    cut by the length; a mask with -inf entries, or causal/window rules that hide whole blocks
    from some rows: zeros there), all three packed in one flat output: the parts match the
    op's reference and the partials sum to dQ.  Every fitting configuration of the block for
    the masked non-split-heads case."""
    from meganeura.ops.attention import _dkdv_ref

    n, dims = 2, (1, 4, 2, 19, 37, 8, 8)
    x, a, ref = _problem(rng, dims, RULES[rules],
                         mask_shape=(1, 4, 19, 37) if rules == "mask" else None)
    t = make_target(dev.limits, dev.features)
    names = ("q", "k", "v") + (("mask",) if rules == "mask" else ()) + ("dout", "lse", "delta")
    H = 4 if split_heads else 2
    for blk in (16, 32):
        a2 = {**a, "splits": n, "split_heads": split_heads, "dq_block": blk}
        (want,) = _dkdv_ref([x[k].astype(np.float64) for k in names], a2)
        base = dataclasses.replace(_desc("dkdv", x, a), splits=n, split_heads=split_heads,
                                   dq_block=blk)
        # one output binding: 7 storage buffers with the mask, within WebGPU's default 8
        assert kernels.emit(base, dev.limits, dev.features).n_bindings == len(names) + 1
        sizes = A.packed_sizes(base)
        shapes = [(n, H, 37, 8), (n, H, 37, 8), (-(-37 // blk), 4, 19, 8)]
        assert sizes == tuple(int(np.prod(sh)) for sh in shapes) and want.size == sum(sizes)
        wants = np.split(want, np.cumsum(sizes)[:2])
        cfgs = [c for c in A.CONFIGS if c[0] * c[2] == blk and A.config_fits("dkdv", c, 8, 8, t)]
        every = rules == "mask" and not split_heads
        for cfg in [()] + cfgs[:None if every else 1]:
            (flat,) = _run_poisoned(dev, dataclasses.replace(base, config=cfg),
                                    [x[k] for k in names], [(sum(sizes),)])
            got = [g.reshape(sh) for g, sh in zip(np.split(flat, np.cumsum(sizes)[:2]), shapes,
                                                  strict=True)]
            for g, w, what in zip(got, wants, ("partial dk", "partial dv", "dq partials"),
                                  strict=True):
                _check(g, w.reshape(g.shape), f"{what} block {blk} {cfg}")
            _check(got[2].astype(np.float64).sum(0, keepdims=True), ref["dq"], f"dq {blk} {cfg}")


def test_dq_partials_block_must_match(dev):
    """The fused dQ's partials are laid out per key block: a configuration with another block
    is refused, and so is dq_block on a kernel other than dK/dV."""
    q = C(f32, (1, 2, 8, 8))
    row = C(f32, (1, 2, 8))
    desc = A.AttentionGradDkdvKernel("dkdv", q, q, q, None, q, row, row, True, 0.3, 0, 0,
                                     dq_block=16, config=(8, 8, 4, 2))
    with pytest.raises(kernels.CodegenError, match="key block"):
        kernels.emit(desc, dev.limits, dev.features)
    with pytest.raises(kernels.CodegenError, match="dq_block"):
        kernels.emit(dataclasses.replace(desc, kind="dq", config=()), dev.limits, dev.features)


def test_split_dq(run, rng):
    """dQ over 3 key chunks (a causal rule hides whole chunks of some rows): the partials
    (the op's reference) and their total."""
    from meganeura.ops.attention import _dq_ref

    n, dims = 3, (1, 4, 2, 13, 40, 8, 4)
    x, a, ref = _problem(rng, dims, {"causal": True, "q_offset": 20})
    a = {**a, "splits": n}
    names = ("q", "k", "v", "dout", "lse", "delta")
    (dqp,) = run(dataclasses.replace(_desc("dq", x, a), splits=n), [x[k] for k in names],
                 [((n, 4, 13, 8), f32)])
    (want,) = _dq_ref([x[k].astype(np.float64) for k in names], a)
    _check(dqp, want, "partial dq")
    _check(dqp.astype(np.float64).sum(0, keepdims=True), ref["dq"], "summed dq")


DELTA_DIMS = {"vec": (1, 4, 2, 19, 37, 8, 12), "scalar": (1, 3, 3, 17, 21, 5, 3)}


@pytest.mark.parametrize("rules", sorted(RULES))
@pytest.mark.parametrize("split_heads", [False, True])
@pytest.mark.parametrize("dims", sorted(DELTA_DIMS))
def test_dkdv_delta_from_out(run, dev, rng, split_heads, rules, dims):
    """``delta_out``: the dK/dV kernel (dQ partials, 2 query chunks) computes δ = rowsum(dO·O)
    itself from O, read through strides as the forward stores it for the output projection
    ((B, S, H, Dv)); vec4 and scalar head dims, Dv != D: the outputs (poisoned with NaN) match
    the reference given δ.  Every fitting 16-key configuration of the masked GQA case."""
    from meganeura.kernels.ir import Strided
    from meganeura.ops.attention import _dkdv_ref

    n, dims = 2, DELTA_DIMS[dims]
    B, Hq, Hkv, Sq, Skv, D, Dv = dims
    x, a, ref = _problem(rng, dims, RULES[rules],
                         mask_shape=(1, Hq, Sq, Skv) if rules == "mask" else None)
    out = ref["out"].astype(np.float32)
    stored = np.ascontiguousarray(out.transpose(0, 2, 1, 3))  # (B, Sq, Hq, Dv)
    o_view = Strided(f32, out.shape, (Sq * Hq * Dv, Dv, Hq * Dv, 1), 0, out.size)
    a2 = {**a, "splits": n, "split_heads": split_heads, "dq_block": 16}
    names = ("q", "k", "v") + (("mask",) if rules == "mask" else ()) + ("dout", "lse")
    x64 = [x[k].astype(np.float64) for k in names]
    (want,) = _dkdv_ref(x64 + [out.astype(np.float64)], {**a2, "delta_out": True})
    delta = (x["dout"].astype(np.float64) * out).sum(-1)
    np.testing.assert_allclose(want, _dkdv_ref(x64 + [delta], a2)[0], rtol=1e-12, atol=1e-12)
    base = dataclasses.replace(_desc("dkdv", x, a), delta=o_view, splits=n,
                               split_heads=split_heads, dq_block=16, delta_out=True)
    t = make_target(dev.limits, dev.features)
    cfgs = [c for c in A.CONFIGS if c[0] * c[2] == 16 and A.config_fits("dkdv", c, D, Dv, t, True)]
    every = rules == "mask" and not split_heads and dims == DELTA_DIMS["vec"]
    for cfg in [()] + cfgs[:None if every else 1]:
        desc = dataclasses.replace(base, config=cfg)
        spec = kernels.emit(desc, dev.limits, dev.features)
        assert "Dx[" in spec.wgsl and spec.n_bindings == len(names) + 2
        (flat,) = _run_poisoned(dev, desc, [x[k] for k in names] + [stored], [(want.size,)])
        _check(flat, want, f"dk|dv|dq partials, δ from O, {cfg}")


def test_delta_out_is_for_dkdv(dev):
    """``delta_out`` on a dQ kernel is refused (its δ must be given)."""
    q = C(f32, (1, 2, 8, 8))
    row = C(f32, (1, 2, 8))
    desc = A.AttentionGradDqKernel("dq", q, q, q, None, q, row, q, True, 0.3, 0, 0,
                                   delta_out=True)
    with pytest.raises(kernels.CodegenError, match="delta_out"):
        kernels.emit(desc, dev.limits, dev.features)


GRAD_SUM_CASES = [((1, 9, 3, 32, 32, 8, 8), 4, True, 16), ((2, 4, 2, 19, 37, 8, 4), 2, False, 16),
                  ((1, 2, 2, 7, 45, 5, 3), 1, True, 32)]


@pytest.mark.parametrize("case", range(len(GRAD_SUM_CASES)))
def test_grad_sum_kernel(run, dev, rng, case):
    """``attention_grad_sum``: dQ (key blocks' partials), dK and dV (query chunks × group heads)
    from one flat dK/dV output in one dispatch, every output element written (NaN-poisoned),
    equal to the op's reference; a flat input of the wrong size is refused."""
    from meganeura.kernels.attention_combine import AttentionGradSumKernel, grad_sum_sizes
    from meganeura.ops.attention import _grad_sum_ref

    dims, n, heads, blk = GRAD_SUM_CASES[case]
    B, Hq, Hkv, Sq, Skv, D, Dv = dims
    size = sum(grad_sum_sizes(dims, n, heads, blk))
    flat = rng.normal(size=(size,)).astype(np.float32)
    desc = AttentionGradSumKernel(C(f32, (size,)), dims, n, heads, blk)
    shapes = [(B, Hq, Sq, D), (B, Hkv, Skv, D), (B, Hkv, Skv, Dv)]
    got = _run_poisoned(dev, desc, [flat], shapes)
    want = _grad_sum_ref([flat.astype(np.float64)], {"dims": dims, "splits": n,
                                                     "split_heads": heads, "dq_block": blk})
    for g, w, what in zip(got, want, ("dq", "dk", "dv"), strict=True):
        _check(g, w, f"grad sum {what}")
    with pytest.raises(kernels.CodegenError, match="contiguous vector"):
        kernels.emit(dataclasses.replace(desc, part=C(f32, (size - 1,))), dev.limits,
                     dev.features)


@pytest.mark.parametrize("early", [False, True])
def test_first_tile_loaded_before_or_after_staging(dev, rng, monkeypatch, early):
    """``EARLY_LOADS``: dK/dV's first query-row tile loaded before K/V are staged (blocks no
    row sees staging nothing) or in the old order (the bench's before): 3 query chunks, causal
    (some blocks empty), the same values, no element left unwritten (NaN-poisoned)."""
    from meganeura.ops.attention import _dkdv_ref

    monkeypatch.setattr(A, "EARLY_LOADS", early)
    n, dims = 3, (1, 4, 2, 40, 40, 8, 8)
    x, a, _ = _problem(rng, dims, {"causal": True})
    a2 = {**a, "splits": n, "split_heads": True, "dq_block": 16}
    names = ("q", "k", "v", "dout", "lse", "delta")
    (want,) = _dkdv_ref([x[k].astype(np.float64) for k in names], a2)
    desc = dataclasses.replace(_desc("dkdv", x, a), splits=n, split_heads=True, dq_block=16)
    assert ("if (R_lo < R_hi)" in kernels.emit(desc, dev.limits, dev.features).wgsl) == early
    (flat,) = _run_poisoned(dev, desc, [x[k] for k in names], [(want.size,)])
    _check(flat, want, f"dk|dv|dq partials, early loads {early}")


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("dims", [(1, 4, 2, 37, 70, 64, 32), (2, 2, 2, 600, 600, 32, 32)])
def test_vec4_reads_give_the_same_bits(run, rng, monkeypatch, kind, dims):
    """``STRICT_VEC_LOADS``: q/k/v bindings declared as vec4 arrays and read one unit at a
    time compute bit-identical results (short and long loops, GQA, Dv != D, causal); a head
    dim that is no multiple of 4 keeps scalar reads."""
    x, a, ref = _problem(rng, dims, {"causal": True})
    got = {}
    for on in (False, True):
        monkeypatch.setattr(A, "STRICT_VEC_LOADS", on)
        got[on] = _run(run, kind, x, _desc(kind, x, a))
        wgsl = run.last_spec.wgsl
        assert ("b1: array<vec4<f32>>" in wgsl) == on, on
        if kind != "fwd":  # dout (slot 3) too
            assert ("b3: array<vec4<f32>>" in wgsl) == on, on
    for g0, g1 in zip(got[False], got[True], strict=True):
        np.testing.assert_array_equal(g0, g1)
    names = {"fwd": ["out", "lse"], "dq": ["dq"], "dkdv": ["dk", "dv"]}[kind]
    for n, gv in zip(names, got[True], strict=True):
        _check(gv, ref[n], f"{kind} {n} vec4")
    x2, a2, _ = _problem(rng, (1, 2, 2, 20, 20, 6, 6), {})
    monkeypatch.setattr(A, "STRICT_VEC_LOADS", True)
    _run(run, kind, x2, _desc(kind, x2, a2))
    assert "vec4<f32>>" not in run.last_spec.wgsl.split("fn main")[0].split("var<workgroup>")[0]
