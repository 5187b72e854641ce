"""The long-loop forward (keys >= ``SHORT_LOOP``: Whisper's 1,500 positions) with its tiles
unrolled over arrays of rows (``FWD_UNROLL``) and rolled, against the float64 reference with
NaN-poisoned outputs.  Long loops are forced at small sizes by lowering ``SHORT_LOOP`` (the
lavapipe suite stays fast): tile configurations of every ownership shape, causal GQA and
window rules cut by the tiles (tiles with no visible key, chunks with none), an additive mask
with -inf, split-K chunks, and the H200's Whisper tile (64 rows × 32 keys at D = 64, 46 KiB)."""

import dataclasses

import numpy as np
import pytest

from meganeura import kernels
from meganeura.dtypes import f32
from meganeura.kernels import attention as A
from meganeura.kernels.common import make_target
from meganeura.kernels.ir import Strided
from meganeura.ops.attention import _attention_ref, _split_fwd_ref, fwd_splits
from tests.kernels.test_attention import _check, _desc, _problem, _run_poisoned

H200 = {"max_compute_workgroup_storage_size": 49152,
        "max_compute_invocations_per_workgroup": 1024}
# unrolled kernels compile slowly on lavapipe: a few ownership shapes (rows × keys per
# invocation, scalar and vec4 units, RM = 1 / 2 / 4) stand for all
UNROLLED = ((8, 8, 2, 2), (16, 8, 1, 4), (4, 8, 1, 2), (8, 4, 4, 8))


def _fwd(dev, x, desc, n=1):
    """out, lse of ``desc`` (``n`` key chunks: the partials) with NaN-poisoned outputs."""
    q, v = x["q"].shape, x["v"].shape
    names = ["q", "k", "v"] + (["mask"] if "mask" in x else [])
    return _run_poisoned(dev, desc, [x[k] for k in names],
                         [(n * q[0],) + q[1:3] + v[3:], (n * q[0],) + q[1:3]])


@pytest.fixture
def long_loops(monkeypatch):
    monkeypatch.setattr(A, "SHORT_LOOP", 1)


@pytest.mark.parametrize("unroll", [False, True])
def test_configs_long(dev, rng, long_loops, monkeypatch, unroll):
    """Causal GQA with q_offset (row blocks whose last tiles are hidden) and a window with a
    cross-length key range: every configuration that fits the device rolled, the
    ``UNROLLED`` ones unrolled."""
    monkeypatch.setattr(A, "FWD_UNROLL", UNROLLED if unroll else ())
    t = make_target(dev.limits, dev.features)
    for dims, attrs in (((1, 4, 2, 37, 70, 8, 8), {"causal": True, "q_offset": 33}),
                        ((2, 2, 1, 21, 75, 4, 12), {"window": 9, "q_offset": 40})):
        x, a, ref = _problem(rng, dims, attrs)
        fit = [c for c in A.CONFIGS if A.config_fits("fwd", c, dims[5], dims[6], t)]
        for cfg in [c for c in fit if not unroll or c in UNROLLED]:
            desc = _desc("fwd", x, a, cfg)
            assert ("array<array<" in kernels.emit(desc, dev.limits, dev.features).wgsl) == unroll
            out, lse = _fwd(dev, x, desc)
            _check(out, ref["out"], f"out {cfg} unroll={unroll}")
            _check(lse, ref["lse"], f"lse {cfg} unroll={unroll}")


def test_mask_and_split_long(dev, rng, long_loops, monkeypatch):
    """Unrolled: an additive mask with -inf entries (a row that sees no key at all) and
    split-K chunks, one of them fully hidden by the causal rule: the partials equal the
    split reference."""
    monkeypatch.setattr(A, "FWD_UNROLL", UNROLLED)
    n, dims = 3, (2, 6, 2, 5, 90, 8, 8)
    x, a, _ = _problem(rng, dims, {"causal": True, "q_offset": 40}, mask_shape=(1, 1, 5, 90))
    x["mask"][:, :, 2, :] = -np.inf  # row 2 sees nothing: out 0, lse -inf
    base = [x[k].astype(np.float64) for k in ("q", "k", "v", "mask")]
    want = _attention_ref(base, a)
    out, lse = _fwd(dev, x, _desc("fwd", x, a, UNROLLED[0]))
    _check(out, want[0], "masked out")
    _check(lse, want[1], "masked lse")
    po, pl = _fwd(dev, x, dataclasses.replace(_desc("fwd", x, a, UNROLLED[0]), splits=n), n)
    want = _split_fwd_ref(base, {**a, "splits": n})
    _check(po, want[0], "split partial out")
    _check(pl, want[1], "split partial lse")


def test_whisper_split_choice():
    """Whisper's forward (1, 6, 1500, 64) on the H200's 48 KiB: 6 key chunks, the first split
    tile, a long loop, unrolled (no device)."""
    q = Strided.contiguous(f32, (1, 6, 1500, 64))
    desc = A.AttentionFwdKernel("fwd", q, q, q, None, None, None, None, False, 0.125, 0, 0,
                                splits=fwd_splits(1, 6, 6, 1500, 1500))
    assert desc.splits == 6 and not A.is_short(desc)
    assert A.resolve_config(desc, make_target(H200)) == A.SPLIT_FWD_FIRST[0] in A.FWD_UNROLL
    assert "array<array<" in kernels.emit(desc, H200).wgsl


@pytest.mark.parametrize("unroll,D", [(False, 64), (True, 64), (True, 32)])
def test_whisper_tile_h200(dev, rng, monkeypatch, unroll, D):
    """The tile the H200 takes for Whisper's split forward (``SPLIT_FWD_FIRST``: 64 rows × 32
    keys, vec4 head dim 64, 46 KiB), emitted for 48 KiB and run here with the runtime's
    storage check relaxed (lavapipe reports 32 KiB): 520 keys (a long loop, last tile cut), 2
    chunks, odd row count; unrolled (the default) and rolled, and at head dim 32 (fewer
    units than invocations per row: padding columns computed and not stored)."""
    monkeypatch.setattr(A, "FWD_UNROLL", A.FWD_UNROLL if unroll else ())
    dims = (1, 2, 2, 70, 520, D, D)
    x, a, _ = _problem(rng, dims, {})
    desc = dataclasses.replace(_desc("fwd", x, a, A.SPLIT_FWD_FIRST[0]), splits=2)
    spec = kernels.emit(desc, {**dev.limits, **H200}, dev.features)
    assert spec.meta["workgroup_storage"] > 32768 and not A.is_short(desc)
    assert ("array<array<" in spec.wgsl) == unroll
    monkeypatch.setattr(type(dev), "check_spec", lambda self, s: None)
    shapes = ((2, 2, 70, D), (2, 2, 70))
    outs = [dev.upload(np.full(s, np.nan, np.float32)) for s in shapes]
    dev.dispatch(spec, [dev.upload(x[n]) for n in ("q", "k", "v")] + outs)
    po, pl = [dev.read_array(b, s, f32) for b, s in zip(outs, shapes, strict=True)]
    want = _split_fwd_ref([x[k].astype(np.float64) for k in ("q", "k", "v")], {**a, "splits": 2})
    _check(po, want[0], "whisper tile partial out")
    _check(pl, want[1], "whisper tile partial lse")
