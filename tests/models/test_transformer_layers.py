"""The transformer layers on the reference backend: norms, RoPE (constant tables and run-time
position ids), attention (composite formula vs the attention op vs PyTorch eager, with GQA,
causal offsets and masks), embeddings (op vs one-hot composite), sinusoids."""

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import meganeura as mn
from meganeura.dtypes import i32
from meganeura.nn.transformer import (
    Embedding,
    LayerNorm,
    RMSNorm,
    RoPE,
    apply_rope,
    attention,
    causal_mask,
    sinusoids,
)

from .twins_transformer import apply_rope as t_apply_rope
from .twins_transformer import eager_attention, rope_cos_sin
from .util_transformer import grad_session, rel_l2

R = np.random.default_rng(0)


def _run(g, loss, outputs, feeds, params=None):
    s = grad_session(g, loss, outputs, backend="reference")
    if params:
        s.set_params(params)
    return s.run(**feeds)


def test_rmsnorm_and_layernorm_match_torch():
    x = R.normal(size=(2, 3, 16)).astype(np.float32)
    w, b = R.normal(size=16).astype(np.float32), R.normal(size=16).astype(np.float32)
    for kind in ("rms", "ln"):
        g = mn.Graph()
        xi = g.input("x", x.shape)
        if kind == "rms":
            y = RMSNorm(16, 1e-5, name="n")(g, xi)
            params = {"n.weight": w}
        else:
            y = LayerNorm(16, 1e-5, name="n")(g, xi)
            params = {"n.weight": w, "n.bias": b}
        out = _run(g, (y * y).sum(), {"y": y}, {"x": x}, params)
        tw = {k: torch.from_numpy(v).requires_grad_() for k, v in params.items()}
        tx = torch.from_numpy(x)
        if kind == "rms":
            ty = tw["n.weight"] * (tx * torch.rsqrt(tx.pow(2).mean(-1, keepdim=True) + 1e-5))
        else:
            ty = F.layer_norm(tx, (16,), tw["n.weight"], tw["n.bias"], 1e-5)
        (ty * ty).sum().backward()
        assert rel_l2(out["y"], ty.detach().numpy()) <= 1e-6
        for k, t in tw.items():
            assert rel_l2(out[f"grad:{k}"], t.grad.numpy()) <= 1e-5, (kind, k)


def test_rope_tables_const_and_runtime_positions_agree_with_hf():
    rope = RoPE(8, 10000.0)
    g = mn.Graph()
    pos = g.input("pos", (5,), dtype=i32)
    c1, s1 = rope.tables(g, 5, offset=3)
    c2, s2 = rope.tables(g, pos, offset=3)
    x = g.input("x", (1, 2, 5, 8))
    y1, y2 = apply_rope(x, c1, s1), apply_rope(x, c2, s2)
    s = mn.compile(g, outputs={"y1": y1, "y2": y2}, backend="reference")
    xs = R.normal(size=(1, 2, 5, 8)).astype(np.float32)
    out = s.run(x=xs, pos=np.arange(5, dtype=np.int32))
    cos, sin = rope_cos_sin(8, 10000.0, torch.arange(5) + 3)
    ref = t_apply_rope(torch.from_numpy(xs), cos, sin).numpy()
    assert rel_l2(out["y1"], ref) <= 1e-6 and rel_l2(out["y2"], ref) <= 1e-6
    np.testing.assert_allclose(rope.inv_freq(), 1.0 / (10000.0 ** (torch.arange(
        0, 8, 2).float() / 8)).numpy(), rtol=1e-6)
    with pytest.raises(mn.ShapeError, match="even"):
        RoPE(7)


@pytest.mark.parametrize("case", ["gqa-causal", "mha-offset", "mqa-mask", "cross"])
def test_attention_composite_op_and_torch_agree(case):
    B, Hq, Hkv, Sq, Skv, D = {"gqa-causal": (2, 4, 2, 5, 5, 8), "mha-offset": (1, 2, 2, 3, 7, 4),
                              "mqa-mask": (2, 3, 1, 4, 6, 8), "cross": (1, 4, 2, 3, 9, 8)}[case]
    causal = case in ("gqa-causal", "mha-offset")
    off = Skv - Sq if case == "mha-offset" else 0
    mask_np = None
    if case == "mqa-mask":
        mask_np = np.where(R.random((B, 1, Sq, Skv)) < 0.3, -np.inf, 0.0).astype(np.float32)
        mask_np[..., 0] = 0.0  # every row sees at least one key
    g = mn.Graph()
    q = g.param("q", (B, Hq, Sq, D))
    k = g.param("k", (B, Hkv, Skv, D))
    v = g.param("v", (B, Hkv, Skv, D))
    m = g.const(mask_np) if mask_np is not None else None
    outs = {impl: attention(q, k, v, causal=causal, mask=m, q_offset=off, impl=impl)
            for impl in ("op", "composite")}
    w = g.input("w", (B, Hq, Sq, D))
    vals = {n: R.normal(size=t.shape).astype(np.float32) for n, t in g.params.items()}
    res = {}
    for impl, o in outs.items():
        res[impl] = _run(g, (o * w).sum(), {"o": o}, {"w": np.ones((B, Hq, Sq, D), np.float32)},
                         vals)
    t = {n: torch.from_numpy(a).requires_grad_() for n, a in vals.items()}
    tm = torch.from_numpy(mask_np) if mask_np is not None else None
    if causal:
        tm = torch.from_numpy(causal_mask(Sq, Skv, off))
    to = eager_attention(t["q"], t["k"], t["v"], 1 / math.sqrt(D), tm)
    to.sum().backward()
    for impl, r in res.items():
        assert rel_l2(r["o"], to.detach().numpy()) <= 1e-5, impl
        for n in vals:
            assert rel_l2(r[f"grad:{n}"], t[n].grad.numpy()) <= 1e-5, (impl, n)


def test_embedding_op_and_one_hot_composite_agree():
    ids = np.array([[3, 1, 3], [0, 5, 1]], np.int32)
    table = R.normal(size=(6, 4)).astype(np.float32)
    res = []
    for impl in ("op", "composite"):
        g = mn.Graph()
        i = g.input("ids", ids.shape, dtype=i32)
        e = Embedding(6, 4, name="emb", impl=impl)(g, i)
        assert Embedding(6, 4, name="emb").weight(g) is g.params["emb.weight"]  # tied reuse
        res.append(_run(g, (e * e).sum(), {"e": e}, {"ids": ids}, {"emb.weight": table}))
    np.testing.assert_allclose(res[0]["e"], table[ids])
    for k in res[0]:
        np.testing.assert_allclose(res[0][k], res[1][k], rtol=1e-6, atol=1e-7)
    with pytest.raises(mn.GraphBuildError, match="impl must be"):
        attention(*(g.param(n, (1, 1, 2, 2)) for n in "qkv"), impl="flash")


def test_sinusoids_match_whisper_formula():
    length, ch = 12, 16
    inc = math.log(10000) / (ch // 2 - 1)
    inv = torch.exp(-inc * torch.arange(ch // 2))
    t = torch.arange(length).view(-1, 1) * inv.view(1, -1)
    ref = torch.cat([t.sin(), t.cos()], dim=1).numpy()
    np.testing.assert_allclose(sinusoids(length, ch), ref, atol=2e-6)
