"""compile/fast_attention.py: the key-chunk count of attention forwards under precision "fast"
on tensor-core targets (fewer chunks than the strict kernel's), and nothing anywhere else."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
from meganeura import ops, optim
from meganeura.compile import fast_attention as FA
from meganeura.compile.passes import run_pipeline
from meganeura.kernels import attention_fast as AF
from meganeura.kernels.common import make_target
from meganeura.ops.attention import fwd_splits
from meganeura.program import build_program

TC = make_target(None, {AF.SG_FEATURE, "subgroups", "shader-f16"})
PLAIN = make_target(None, {"subgroups", "shader-f16"})


def _program(B, H, Sq, Skv, D, train=True):
    g = mn.Graph("att")
    q = g.input("q", (B, H, Sq, D))
    k, v = g.param("k", (B, H, Skv, D)), g.param("v", (B, H, Skv, D))
    out = ops.attention(q, k, v)
    if not train:
        return build_program(g, None, {"out": out}, None)
    return build_program(g, (out * out).mean(), {}, optim.SGD(lr=0.1))


def _splits(program) -> dict[str, set]:
    """The ``splits`` of the lowered attention_fwd / attention_combine nodes."""
    got: dict[str, set] = {}
    for n in run_pipeline(program).graph.nodes:
        if n.op in ("attention_fwd", "attention_combine"):
            got.setdefault(n.op, set()).add(n.attrs.get("splits", 1))
    return got


def test_whisper_gets_a_tail_chunk_on_tensor_cores():
    """Whisper-tiny's (1, 6, 1500, 64): the strict kernel's 6 even chunks; for the tensor-core
    forward 3 of 448 keys (216 workgroups) and a short fourth of 156 (its 72
    workgroups in the wave's idle slots); forward and combine agree."""
    assert fwd_splits(1, 6, 6, 1500, 1500) == 6
    assert AF.fast_chunks(1, 6, 6, 1500, 1500, 6) == 3
    prog = _program(1, 6, 1500, 1500, 64)
    fast = FA.fast_attention_chunks(prog, TC, "fast")
    hints = [(n.attrs.get("fwd_chunks"), n.attrs.get("fwd_chunk_keys"))
             for n in fast.graph.nodes if n.op == "attention"]
    assert hints == [(4, 448)]
    assert _splits(fast) == {"attention_fwd": {4}, "attention_combine": {4}}
    keys = {n.attrs.get("chunk_keys") for n in run_pipeline(fast).graph.nodes
            if n.op == "attention_fwd"}
    assert keys == {448}
    assert _splits(prog) == {"attention_fwd": {6}, "attention_combine": {6}}


def test_without_the_tail_chunk_whisper_gets_three(monkeypatch):
    monkeypatch.setattr(AF, "TAIL_CHUNK", False)
    fast = FA.fast_attention_chunks(_program(1, 6, 1500, 1500, 64), TC, "fast")
    hints = [(n.attrs.get("fwd_chunks"), n.attrs.get("fwd_chunk_keys"))
             for n in fast.graph.nodes if n.op == "attention"]
    assert hints == [(3, None)]
    assert _splits(fast) == {"attention_fwd": {3}, "attention_combine": {3}}


def test_o_shared_layout_keeps_one_wave(monkeypatch):
    """With O in workgroup memory (one row block: twice the workgroups per chunk) the wave
    budget doubles, so Whisper still gets 3 chunks (432 workgroups), not 1."""
    monkeypatch.setattr(AF, "O_SHARED", True)
    assert AF.fast_chunks(1, 6, 6, 1500, 1500, 6) == 3


@pytest.mark.parametrize("precision,target", [("strict", TC), ("fast", PLAIN)])
def test_strict_and_plain_targets_keep_the_op_choice(precision, target):
    prog = _program(1, 6, 1500, 1500, 64)
    assert FA.fast_attention_chunks(prog, target, precision) is prog


def test_attention_the_fast_kernel_skips_is_untouched():
    """Short key loops (SmolLM2's 128 keys) stay on the strict kernel, with its chunks; a
    large batch gets one chunk (no combine) where the strict kernel would split."""
    prog = _program(1, 9, 128, 128, 64, train=False)
    assert FA.fast_attention_chunks(prog, TC, "fast") is prog
    assert AF.fast_chunks(8, 6, 6, 1500, 1500, fwd_splits(8, 6, 6, 1500, 1500)) == 1


@pytest.mark.parametrize("H,wave,split", [(1, 2, (2, 0)), (2, 3, (2, 384))])
def test_fewer_chunks_compute_the_same(gpu, monkeypatch, H, wave, split):
    """Through a real session: with the hint (a small wave budget forces 2 chunks instead of
    the op's 8 at this shape; with 2 heads a budget of 3 leaves one slot idle, so a chunk of
    384 keys and a short one of 128) the forward matches float64: to 1e-5 on lavapipe, where
    the fast kernel is not there (the strict kernel at these chunks: the pass's plumbing is
    under test), to the fast gate (1e-2) where the tensor cores run it (f16 operands)."""
    monkeypatch.setattr(FA, "has_tensor_cores", lambda target: True)
    monkeypatch.setattr(AF, "FAST_WAVE_WGS", wave)
    B, S, D = 1, 512, 32
    assert fwd_splits(B, H, H, 64, S) == 8
    assert AF.fast_split(B, H, H, 64, S, 8) == split
    label = "attention_fwd (2,"  # (chunks · B, …) partials
    rng = np.random.default_rng(0)
    qv = rng.standard_normal((B, H, 64, D)).astype(np.float32)
    kv, vv = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(2))
    g = mn.Graph("att")
    q = g.input("q", (B, H, 64, D))
    k, v = g.param("k", (B, H, S, D)), g.param("v", (B, H, S, D))
    out = ops.attention(q, k, v)
    sess = mn.compile(g, outputs={"out": out}, device=gpu, precision="fast")
    labels = [d.label for _, s in sess._streams() for d in s.stream.dispatches]
    assert any(lb.startswith(label) for lb in labels), labels
    sess.set_params({"k": kv, "v": vv})
    got = sess.run(q=qv)["out"]
    s = np.einsum("bhqd,bhkd->bhqk", qv.astype(np.float64), kv) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), vv)
    tol = 1e-2 if AF.SG_FEATURE in gpu.features else 1e-5
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= tol
