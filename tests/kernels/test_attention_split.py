"""Split-K attention through the whole GPU path: the op's expansion picks split-K for decoding
over a long cache (and, forced by lowering the thresholds, for the encoder forward and dK/dV),
and the compiled program (partials + ``attention_combine``, partial dK/dV + sums) matches the
float64 reference like the unsplit one (fwd ≤ 1e-4 here as in tests/runtime)."""

import sys

import pytest

from meganeura.ops.attention import fwd_splits, split_count
from tests.runtime.test_gpu_attention import _run_case

OPS = sys.modules["meganeura.ops.attention"]


def _archetypes(sess):
    return [d.spec.meta.get("archetype") for d in sess.executable.infer.dispatches]


def test_heuristic():
    """Decoding splits (more for longer caches), a 128-position training step does not,
    chunks are never empty."""
    assert fwd_splits(1, 9, 3, 1, 2048) == 32
    assert fwd_splits(1, 9, 3, 1, 512) == 8
    assert fwd_splits(8, 9, 3, 1, 2048) == 32
    assert fwd_splits(1, 9, 3, 128, 128) == 1
    assert fwd_splits(1, 6, 6, 1500, 1500) == 6
    for items in (1, 3, 100):
        for length in (256, 300, 1000, 4097):
            n = split_count(items, length)
            ch = -(-length // n)
            assert (n - 1) * ch < length


def test_decode_split(gpu):
    """One query position per head over a 300-row cache (GQA 6/2, causal offset, batch 2):
    split into chunks by the heuristic, combined exactly."""
    sess = _run_case(gpu, (2, 6, 2, 1, 300, 8, 8), {"causal": True, "q_offset": 299})
    assert "attention_combine" in _archetypes(sess)


@pytest.mark.parametrize("gqa", [False, True])
def test_forced_split_fwd_and_dkdv(gpu, monkeypatch, gqa):
    """Thresholds lowered so a small causal problem splits its forward keys and its dK/dV
    query positions (with and without per-head dK/dV): same results as the reference."""
    monkeypatch.setattr(OPS, "SPLIT_MIN_LEN_FULL", 16)
    monkeypatch.setattr(OPS, "SPLIT_MIN_LEN", 16)
    monkeypatch.setattr(OPS, "SPLIT_MIN_CHUNK", 8)
    dims = (1, 4, 2 if gqa else 4, 41, 45, 8, 8)
    sess = _run_case(gpu, dims, {"causal": True, "q_offset": 4})
    kinds = _archetypes(sess)
    assert "attention_combine" in kinds
    dkdv = [d.spec for d in sess.executable.infer.dispatches
            if d.spec.meta.get("archetype") == "attention_dkdv"]
    assert dkdv and all(s.workgroups[0] > 1 for s in dkdv)


def test_split_combine_writes_bshd(gpu, monkeypatch):
    """A split forward whose output is read with heads and positions swapped: the combine
    kernel stores (B, S, H, D) directly (no copy) and the values are right."""
    import numpy as np

    import meganeura as mn
    from meganeura import ops, reference

    monkeypatch.setattr(OPS, "SPLIT_MIN_LEN", 16)
    monkeypatch.setattr(OPS, "SPLIT_MIN_CHUNK", 8)
    B, H, S, D = 1, 2, 33, 4
    g = mn.Graph()
    q, k, v = (g.input(n, (B, H, S, D)) for n in "qkv")
    y = ops.attention(q, k, v).permute(0, 2, 1, 3).reshape(B, S, H * D)
    r = np.random.default_rng(0)
    feeds = {n: r.normal(size=(B, H, S, D)).astype(np.float32) for n in "qkv"}
    sess = mn.compile(g, outputs={"y": y}, device=gpu)
    got = sess.run(**feeds)["y"]
    (want,) = reference.evaluate(g, [y], feeds, np.float64)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    combine = [d.spec for d in sess.executable.infer.dispatches
               if d.spec.meta.get("archetype") == "attention_combine"]
    assert len(combine) == 1 and "orow = (r /" in combine[0].wgsl
    assert "array<vec4<f32>>" in combine[0].wgsl  # f32 rows of 4k: vec4 units (VEC_COMBINE)


@pytest.mark.parametrize("gqa", [False, True])
def test_fused_dq_and_split_dq(gpu, monkeypatch, gqa):
    """Through the compiled program: a short causal problem gets its dQ from the dK/dV
    kernel's 16-key partials (no dQ kernel); with the thresholds lowered so that its 45 keys
    count as long, a masked problem takes 32-key partials, a sliding-window one keeps the dQ
    kernel and splits it over key chunks; all match the reference."""
    import numpy as np

    dims = (1, 4, 2 if gqa else 4, 23, 45, 8, 8)
    sess = _run_case(gpu, dims, {"causal": True, "q_offset": 4})
    kinds = _archetypes(sess)
    assert "attention_dkdv" in kinds and "attention_dq" not in kinds
    monkeypatch.setattr(OPS, "FUSED_DQ_LONG", 16)
    monkeypatch.setattr(OPS, "SPLIT_MIN_LEN_FULL", 16)
    monkeypatch.setattr(OPS, "SPLIT_MIN_CHUNK", 8)
    mask = np.random.default_rng(1).normal(size=(1, 1, 23, 45)).astype(np.float32)
    sess = _run_case(gpu, dims, {}, mask=mask)
    assert "attention_dq" not in _archetypes(sess)
    sess = _run_case(gpu, dims, {"window": 30, "q_offset": 4})
    dq = [d.spec for d in sess.executable.infer.dispatches
          if d.spec.meta.get("archetype") == "attention_dq"]
    assert len(dq) == 1 and "let sc = " in dq[0].wgsl  # split over key chunks


def test_fused_dq_choice():
    """Whisper's encoder takes 32-key partials, SmolLM2's causal 128 positions 16-key ones;
    long causal/window loops, large heads and partials above the byte budget keep the dQ
    kernel (a long D = 128 loop splits it)."""
    from meganeura.ops.attention import dq_fused_block, grad_plan

    assert dq_fused_block(1, 6, 1500, 1500, 64, False, 0) == 32
    assert dq_fused_block(1, 9, 128, 128, 64, True, 0) == 16
    assert dq_fused_block(1, 6, 1500, 1500, 64, False, 8) == 0
    assert dq_fused_block(1, 6, 1500, 1500, 64, True, 0) == 0
    assert dq_fused_block(8, 16, 4096, 4096, 64, False, 0) == 0
    assert dq_fused_block(1, 8, 1024, 1024, 128, False, 0) == 0
    assert grad_plan(1, 6, 6, 1500, 1500, 64, False, 0) == {
        "dq_block": 32, "dq_splits": 1, "split_heads": False, "splits": 4, "grad_sum": False,
        "delta_in_kernel": False}
    # short: every sum in one kernel, so 4 chunks of 32 positions (288 workgroups); δ in dK/dV
    assert grad_plan(1, 9, 3, 128, 128, 64, True, 0) == {
        "dq_block": 16, "dq_splits": 1, "split_heads": True, "splits": 4, "grad_sum": True,
        "delta_in_kernel": True}
    assert grad_plan(1, 8, 8, 1024, 1024, 128, False, 0)["dq_splits"] == 4


SHORT_CASES = {
    "gqa_causal": ((1, 6, 2, 70, 70, 8, 8), {"causal": True}),
    "window_offset": ((2, 2, 1, 67, 75, 4, 12), {"window": 20, "q_offset": 8}),
}


@pytest.mark.parametrize("case", sorted(SHORT_CASES))
def test_short_backward_two_kernels(gpu, case):
    """A short problem's backward is the dK/dV kernel (δ from O inside it, dQ partials, query
    chunks) and one ``attention_grad_sum``: no reduce or multi-reduce kernel; the gradients
    match the float64 reference, and the program run twice is bit-identical."""
    dims, attrs = SHORT_CASES[case]
    B, Hq, Hkv, Sq, Skv, D, Dv = dims
    plan = OPS.grad_plan(B, Hq, Hkv, Sq, Skv, D, attrs.get("causal", False),
                         attrs.get("window", 0), Dv)
    assert plan["grad_sum"] and plan["delta_in_kernel"] and plan["splits"] == 2
    sess = _run_case(gpu, dims, attrs, also_unfused=True)
    kinds = _archetypes(sess)
    assert kinds[kinds.index("attention_dkdv"):] == ["attention_dkdv", "attention_grad_sum"]
    assert "reduce" not in kinds and "multi_reduce" not in kinds
    dkdv = next(d.spec for d in sess.executable.infer.dispatches
                if d.spec.meta.get("archetype") == "attention_dkdv")
    assert "Dx[" in dkdv.wgsl


def test_short_plan_switches(gpu, monkeypatch):
    """The short-problem plan's parts can each be turned off (the bench's before/after): no
    grad sum (the reduces return, no query chunks), no δ in the kernel (its reduce returns)."""
    dims, attrs = SHORT_CASES["gqa_causal"]
    monkeypatch.setattr(OPS, "GRAD_SUM", False)
    sess = _run_case(gpu, dims, attrs)
    assert "attention_grad_sum" not in _archetypes(sess)
    monkeypatch.setattr(OPS, "GRAD_SUM", True)
    monkeypatch.setattr(OPS, "DELTA_IN_KERNEL", False)
    sess = _run_case(gpu, dims, attrs)
    kinds = _archetypes(sess)
    assert "attention_grad_sum" in kinds and "reduce" in kinds
