"""Short loops (``kernels/attention.py`` ``SHORT_LOOP``): K/V tile 0 loaded before Q is staged
(``SHORT_EARLY_KV``) and the own block staged through registers (``SHORT_REG_STAGE``), each
switch on and off, and the forward's tiles (``SHORT_FWD_FIRST``), against the float64
reference with NaN-poisoned outputs (causal, GQA, odd lengths cut by the tiles); long loops
(Whisper's 1,500 positions) emit exactly the WGSL they emit with the switches off."""

import dataclasses

import numpy as np
import pytest

from meganeura import kernels
from meganeura.dtypes import f32
from meganeura.kernels import attention as A
from meganeura.kernels.common import make_target
from meganeura.kernels.ir import Strided
from meganeura.ops.attention import _dkdv_ref
from tests.kernels.test_attention import _check, _desc, _problem, _run_poisoned

SWITCHES = [(False, False), (True, False), (False, True), (True, True)]
NAMES = ("q", "k", "v", "dout", "lse", "delta")


@pytest.mark.parametrize("early,reg", SWITCHES)
def test_fwd_and_dq_short(dev, rng, monkeypatch, early, reg):
    """fwd (lse too) and dQ, causal GQA over 37 positions (heuristic tiles and 16-key ones),
    q_offset: equal to the reference with either switch; the WGSL shows which staging ran."""
    monkeypatch.setattr(A, "SHORT_EARLY_KV", early)
    monkeypatch.setattr(A, "SHORT_REG_STAGE", reg)
    dims = (1, 6, 2, 37, 40, 8, 8)
    x, a, ref = _problem(rng, dims, {"causal": True, "q_offset": 3})
    B, Hq, _, Sq, _, _, Dv = dims
    for cfg in ((), (8, 8, 1, 2)):
        desc = _desc("fwd", x, a, cfg)
        wgsl = kernels.emit(desc, dev.limits, dev.features).wgsl
        assert ("gQs0" in wgsl) == reg
        # early: the first K load comes before Q's staging
        assert (wgsl.index("pk0 = ") < wgsl.index("Qs[")) == early
        out, lse = _run_poisoned(dev, desc, [x[n] for n in ("q", "k", "v")],
                                 [(B, Hq, Sq, Dv), (B, Hq, Sq)])
        _check(out, ref["out"], f"short fwd out {cfg}")
        _check(lse, ref["lse"], f"short fwd lse {cfg}")
        (dq,) = _run_poisoned(dev, _desc("dq", x, a, cfg), [x[n] for n in NAMES],
                              [x["q"].shape])
        _check(dq, ref["dq"], f"short dq {cfg}")


@pytest.mark.parametrize("reg", [False, True])
def test_dkdv_short_reg_stage(dev, rng, monkeypatch, reg):
    """dK/dV with the dQ partials and δ from O, 3 query chunks, causal (blocks no row of a
    chunk sees stage nothing), K/V staged through registers or not: the same values, every
    element written."""
    monkeypatch.setattr(A, "SHORT_REG_STAGE", reg)
    dims = (1, 4, 2, 41, 41, 8, 8)
    B, Hq, _, Sq, _, _, Dv = dims
    x, a, ref = _problem(rng, dims, {"causal": True})
    out = ref["out"].astype(np.float32)
    a2 = {**a, "splits": 3, "split_heads": True, "dq_block": 16, "delta_out": True}
    x64 = [x[k].astype(np.float64) for k in NAMES[:5]]
    (want,) = _dkdv_ref(x64 + [out.astype(np.float64)], a2)
    desc = dataclasses.replace(_desc("dkdv", x, a), delta=Strided.contiguous(f32, out.shape),
                               splits=3, split_heads=True, dq_block=16, delta_out=True)
    assert ("gKs0" in kernels.emit(desc, dev.limits, dev.features).wgsl) == reg
    (flat,) = _run_poisoned(dev, desc, [x[k] for k in NAMES[:5]] + [out], [(want.size,)])
    _check(flat, want, f"short dk|dv|dq partials, reg stage {reg}")


def test_short_fwd_first_config(dev, rng, monkeypatch):
    """``SHORT_FWD_FIRST`` is what a short forward tries first (here 16 rows × 32 keys on 256
    invocations), and the kernel with it is exact; a long forward ignores it."""
    cfg = (16, 16, 1, 2)
    monkeypatch.setattr(A, "SHORT_FWD_FIRST", (cfg,))
    dims = (1, 3, 1, 70, 70, 4, 4)
    x, a, ref = _problem(rng, dims, {"causal": True})
    desc = _desc("fwd", x, a)
    spec = kernels.emit(desc, dev.limits, dev.features)
    assert spec.meta["config"] == cfg
    out, lse = _run_poisoned(dev, desc, [x[n] for n in ("q", "k", "v")],
                             [(1, 3, 70, 4), (1, 3, 70)])
    _check(out, ref["out"], "fwd 16x16 out")
    _check(lse, ref["lse"], "fwd 16x16 lse")
    q = Strided.contiguous(f32, (1, 3, A.SHORT_LOOP, 4))
    long = A.AttentionFwdKernel("fwd", q, q, q, None, None, None, None, True, 0.5, 0, 0)
    assert kernels.emit(long, dev.limits, dev.features).meta["config"] != cfg


@pytest.mark.parametrize("dims", [(1, 6, 2, 70, 70, 64, 64), (1, 3, 1, 45, 45, 3, 5)])
def test_short_fwd_default_tiles(dev, rng, dims):
    """The default short forward: the first ``SHORT_FWD_FIRST`` tile that fits the device
    (16 × 64 where 44 KiB of workgroup storage are allowed, else 16 × 32; scalar head dims fit
    16 × 64 everywhere), exact on causal GQA with odd lengths (NaN-poisoned outputs)."""
    x, a, ref = _problem(rng, dims, {"causal": True})
    B, Hq, _, Sq, _, D, Dv = dims
    t = make_target(dev.limits, dev.features)
    want = next(c for c in A.SHORT_FWD_FIRST if A.config_fits("fwd", c, D, Dv, t))
    desc = _desc("fwd", x, a)
    assert kernels.emit(desc, dev.limits, dev.features).meta["config"] == want
    if D == 3:
        assert want == (16, 16, 1, 4)
    out, lse = _run_poisoned(dev, desc, [x[n] for n in ("q", "k", "v")],
                             [(B, Hq, Sq, Dv), (B, Hq, Sq)])
    _check(out, ref["out"], f"fwd {want} out")
    _check(lse, ref["lse"], f"fwd {want} lse")


def _whisper_specs(limits):
    """Whisper-tiny's attention kernels at 1,500 positions as its program builds them (the
    forward in 6 key chunks, dK/dV with dQ partials in 4 query chunks), plus a dQ kernel."""
    q = Strided.contiguous(f32, (1, 6, 1500, 64))
    row = Strided.contiguous(f32, (1, 6, 1500))
    common = (q, q, q, None)
    return [kernels.emit(d, limits, set()).wgsl for d in (
        A.AttentionFwdKernel("fwd", *common, None, None, None, False, 0.125, 0, 0, splits=6),
        A.AttentionGradDqKernel("dq", *common, q, row, row, False, 0.125, 0, 0),
        A.AttentionGradDkdvKernel("dkdv", *common, q, row, row, False, 0.125, 0, 0, splits=4,
                                  dq_block=32))]


def test_long_loops_unchanged(monkeypatch):
    """Whisper's kernels (loops of 1,500) are byte-identical with the short-loop switches on
    and off (no device: emitted for the H200's 48 KiB of workgroup storage)."""
    limits = {"max_compute_workgroup_storage_size": 49152,
              "max_compute_invocations_per_workgroup": 1024}
    new = _whisper_specs(limits)
    monkeypatch.setattr(A, "SHORT_EARLY_KV", False)
    monkeypatch.setattr(A, "SHORT_REG_STAGE", False)
    monkeypatch.setattr(A, "SHORT_FWD_FIRST", ())
    assert _whisper_specs(limits) == new


def test_short_fwd_h200_tile_at_head_dim_64(dev, rng, monkeypatch):
    """The tile the H200 takes for SmolLM2's forward (16 rows × 64 keys, 256 invocations,
    44 KiB of workgroup storage at D = 64) is emitted for the H200's 48 KiB and run here with
    the runtime's storage check relaxed (lavapipe reports 32 KiB but runs it): exact on causal
    GQA with odd lengths, NaN-poisoned outputs — the vec4 head-dim path of that tile, which
    the 32-KiB default never reaches on this device."""
    dims = (1, 6, 2, 70, 70, 64, 64)
    x, a, ref = _problem(rng, dims, {"causal": True})
    desc = _desc("fwd", x, a)
    h200 = {**dev.limits, "max_compute_workgroup_storage_size": 49152}
    spec = kernels.emit(desc, h200, dev.features)
    assert spec.meta["config"] == A.SHORT_FWD_FIRST[0] == (16, 16, 1, 4)
    monkeypatch.setattr(type(dev), "check_spec", lambda self, s: None)
    shapes = [(1, 6, 70, 64), (1, 6, 70)]
    outs = [dev.upload(np.full(s, np.nan, np.float32)) for s in shapes]
    dev.dispatch(spec, [dev.upload(x[n]) for n in ("q", "k", "v")] + outs)
    out, lse = [dev.read_array(b, s, f32) for b, s in zip(outs, shapes, strict=True)]
    _check(out, ref["out"], "fwd 16x64 D=64 out")
    _check(lse, ref["lse"], "fwd 16x64 D=64 lse")
