"""attention (and attention_grad through its VJP): forward, lse and VJPs against PyTorch's
scaled_dot_product_attention (float64, enable_gqa), and against finite differences on the
reference; causal, full, cross, grouped-query, sliding window, additive masks (also fully
masked rows and a differentiable mask), q_offset, Dv != D and S=1 decoding."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import meganeura as mn
from meganeura import ops
from meganeura.autodiff import grad
from meganeura.ops.attention import visible_mask
from meganeura.reference import evaluate

from ._torchref import Spec, check_op, rand


def _torch_mask(sq, skv, causal, window, q_offset, mask):
    vis = torch.tensor(visible_mask(sq, skv, causal, window or 0, q_offset))
    am = torch.zeros((sq, skv), dtype=torch.float64).masked_fill(~vis, -math.inf)
    return am if mask is None else am + mask


def _twin(causal=False, window=None, q_offset=0, scale=None, with_lse=False):
    def twin(q, k, v, mask=None):
        sq, skv = q.shape[2], k.shape[2]
        am = _torch_mask(sq, skv, causal, window, q_offset, mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=am, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        if not with_lse:
            return out
        g = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(g, dim=1)
        sc = (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        s = q @ kk.transpose(-1, -2) * sc + am
        return out, torch.logsumexp(s, -1)

    return twin


def _build(causal=False, window=None, q_offset=0, scale=None, with_lse=False):
    def build(q, k, v, mask=None):
        if with_lse:
            return ops.attention_with_lse(q, k, v, causal, scale, window, mask, q_offset)
        return ops.attention(q, k, v, causal=causal, scale=scale, window=window, mask=mask,
                             q_offset=q_offset)

    return build


# (B, Hq, Hkv, Sq, Skv, D, Dv), attrs
CASES = {
    "full": ((2, 2, 2, 3, 3, 4, 4), {}),
    "causal": ((1, 2, 2, 4, 4, 3, 3), {"causal": True}),
    "cross": ((1, 2, 2, 2, 5, 3, 3), {}),
    "cross_causal_offset": ((1, 1, 1, 2, 5, 3, 3), {"causal": True, "q_offset": 3}),
    "gqa_causal": ((1, 4, 2, 3, 3, 2, 2), {"causal": True}),
    "mqa": ((1, 3, 1, 2, 4, 3, 3), {}),
    "window_causal": ((1, 1, 1, 5, 5, 2, 2), {"causal": True, "window": 2}),
    "window_only": ((1, 1, 1, 3, 5, 2, 2), {"window": 2, "q_offset": 2}),
    "dv_ne_d": ((1, 2, 1, 3, 4, 3, 5), {"causal": True, "q_offset": 1}),
    "causal_negative_offset": ((1, 2, 1, 4, 3, 2, 2), {"causal": True, "q_offset": -2}),
    "decode_s1": ((1, 4, 2, 1, 6, 3, 3), {"causal": True, "q_offset": 5}),
    "decode_s1_window": ((2, 2, 1, 1, 6, 2, 2), {"causal": True, "q_offset": 5, "window": 3}),
    "scale": ((1, 1, 1, 3, 3, 4, 4), {"scale": 0.7, "causal": True}),
}


def _inputs(rng, dims):
    B, Hq, Hkv, Sq, Skv, D, Dv = dims
    return (rand(rng, (B, Hq, Sq, D)), rand(rng, (B, Hkv, Skv, D)), rand(rng, (B, Hkv, Skv, Dv)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention(case, rng):
    dims, attrs = CASES[case]
    check_op(_build(**attrs), _twin(**attrs), *_inputs(rng, dims))


def test_attention_lse_output_and_its_cotangent(rng):
    dims = (1, 4, 2, 3, 5, 3, 2)
    attrs = {"causal": True, "q_offset": 2}
    check_op(_build(**attrs, with_lse=True), _twin(**attrs, with_lse=True), *_inputs(rng, dims))


def test_attention_additive_mask_broadcast(rng):
    B, Hq, Hkv, Sq, Skv, D = 2, 2, 1, 3, 4, 3
    q, k, v = _inputs(rng, (B, Hq, Hkv, Sq, Skv, D, D))
    mask = rand(rng, (B, 1, Sq, Skv))
    check_op(lambda q, k, v, m: ops.attention(q, k, v, mask=m, causal=True, q_offset=1),
             lambda q, k, v, m: _twin(causal=True, q_offset=1)(q, k, v, m),
             q, k, v, Spec(mask, diff=False))


def test_attention_differentiable_mask(rng):
    B, Hq, Hkv, Sq, Skv, D = 1, 2, 1, 3, 4, 2
    q, k, v = _inputs(rng, (B, Hq, Hkv, Sq, Skv, D, D))
    mask = rand(rng, (Sq, Skv))  # broadcast over batch and heads; gradient summed back
    check_op(lambda q, k, v, m: ops.attention(q, k, v, mask=m, causal=True),
             lambda q, k, v, m: _twin(causal=True)(q, k, v, m), q, k, v, Spec(mask, diff=True))


def test_attention_kv_cache_mask_with_fully_hidden_rows(rng):
    """An -inf mask built from positions (KV-cache style), including a query row that sees no
    key at all: output zeros and no gradient from that row, as PyTorch."""
    B, H, Sq, Skv, D = 1, 2, 3, 5, 3
    q, k, v = _inputs(rng, (B, H, H, Sq, Skv, D, D))
    mask = np.zeros((1, 1, Sq, Skv))
    mask[..., 3:] = -np.inf  # cache slots not written yet
    mask[..., 1, :] = -np.inf  # a row with nothing visible
    out = check_op(lambda q, k, v, m: ops.attention(q, k, v, mask=m),
                   lambda q, k, v, m: _twin()(q, k, v, m), q, k, v, Spec(mask, diff=False),
                   fd=True)
    del out
    g = mn.Graph()
    vals = [g.input(n, a.shape) for n, a in zip("qkvm", (q, k, v, mask), strict=True)]
    o, lse = ops.attention_with_lse(*vals[:3], mask=vals[3])
    o_, lse_ = evaluate(g, [o, lse], dict(zip("qkvm", (q, k, v, mask), strict=True)), np.float64)
    assert np.all(o_[:, :, 1] == 0.0) and np.all(lse_[:, :, 1] == -np.inf)
    assert np.isfinite(o_).all()


def test_attention_finite_large_negative_mask_matches_torch(rng):
    """torch.finfo(float32).min is an ordinary (finite) score, in PyTorch as here."""
    q, k, v = _inputs(rng, (1, 1, 1, 2, 3, 2, 2))
    mask = np.zeros((2, 3))
    mask[0, 1:] = np.finfo(np.float32).min
    mask[1, :] = np.finfo(np.float32).min  # uniform average in both
    check_op(lambda q, k, v, m: ops.attention(q, k, v, mask=m),
             lambda q, k, v, m: _twin()(q, k, v, m), q, k, v, Spec(mask, diff=False), fd=False)


def test_attention_large_scores_are_stable(rng):
    q, k, v = _inputs(rng, (1, 2, 2, 4, 4, 3, 3))
    check_op(_build(causal=True), _twin(causal=True), q * 30.0, k * 30.0, v, fd=False)


def test_attention_grad_is_recomputed_not_saved():
    """The VJP builds no (Sq, Skv) tensor: only attention_grad and a reduce for delta."""
    g = mn.Graph()
    q = g.param("q", (1, 2, 64, 4))
    k = g.param("k", (1, 2, 64, 4))
    v = g.param("v", (1, 2, 64, 4))
    loss = ops.attention(q, k, v, causal=True).sum()
    g2, _ = grad(g, loss)
    live = g2.ancestors(list(_[n] for n in ("q", "k", "v")))
    for n in g2.nodes:
        if n.id in live:
            for o in n.outputs:
                assert o.size <= 2 * 64 * 4, f"{n.op} builds {o.type}"
    assert any(n.op == "attention_grad" for n in g2.nodes)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_attention_grad_expansion_matches_reference(split, with_mask, rng, monkeypatch):
    """The GPU lowering of attention_grad (dQ kernel + dK/dV kernel, the latter per kv head or
    per query head plus a sum over the group) computes the reference's values."""
    import sys

    monkeypatch.setattr(sys.modules["meganeura.ops.attention"], "SPLIT_HEADS_BELOW",
                        10**9 if split else 0)
    B, Hq, Hkv, Sq, Skv, D, Dv = 2, 4, 2, 3, 5, 3, 2
    g = mn.Graph()
    names = ["q", "k", "v"] + (["m"] if with_mask else []) + ["do", "lse", "delta"]
    shapes = [(B, Hq, Sq, D), (B, Hkv, Skv, D), (B, Hkv, Skv, Dv)] + \
        ([(Sq, Skv)] if with_mask else []) + [(B, Hq, Sq, Dv), (B, Hq, Sq), (B, Hq, Sq)]
    ins = [g.input(n, s) for n, s in zip(names, shapes, strict=True)]
    env = {n: rand(rng, s) for n, s in zip(names, shapes, strict=True)}
    attrs = dict(causal=True, scale=0.6, window=0, q_offset=2, has_mask=with_mask)
    # a consistent lse (the forward's) so P is a real softmax
    (env["lse"],) = evaluate(g, [ops.attention_with_lse(
        *ins[:3], causal=True, scale=0.6, q_offset=2, mask=ins[3] if with_mask else None)[1]],
        env, np.float64)
    outs = g.apply("attention_grad", *ins, **attrs)
    node = outs[0].node
    expanded = node.opdef.lowering.expand(g, node)
    ops_used = {v.node.op for v in expanded}
    assert ops_used & {"attention_grad_dkdv", "sum", "attention_grad_sum"}
    want = evaluate(g, list(outs), env, np.float64)
    got = evaluate(g, list(expanded), env, np.float64)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_attention_errors():
    g = mn.Graph()
    q = g.input("q", (1, 3, 4, 8))
    k = g.input("k", (1, 2, 4, 8))
    v = g.input("v", (1, 2, 4, 8))
    with pytest.raises(mn.ShapeError, match="divide"):
        ops.attention(q, k, v)
    k1 = g.input("k1", (1, 1, 4, 7))
    v1 = g.input("v1", (1, 1, 4, 8))
    with pytest.raises(mn.ShapeError, match="head dims"):
        ops.attention(q, k1, v1)
    k2 = g.input("k2", (1, 1, 4, 8))
    with pytest.raises(mn.ShapeError, match="mask shape"):
        ops.attention(q, k2, v1, mask=g.input("m", (5, 4)))
    with pytest.raises(mn.DTypeError, match="additive"):
        ops.attention(q, k2, v1, mask=g.input("mb", (4, 4), mn.bool_))
    with pytest.raises(mn.ShapeError, match="window"):
        ops.attention(q, k2, v1, window=0)
    with pytest.raises(mn.GraphBuildError, match="q_offset"):
        ops.attention(q, k2, v1, q_offset=g.input("pos", (), mn.i32))
    with pytest.raises(mn.ShapeError, match=r"\(batch, heads, seq, dim\)"):
        ops.attention(g.input("q3", (3, 4, 8)), k2, v1)


def test_second_order_through_attention_is_a_clear_error():
    g = mn.Graph()
    q = g.param("q", (1, 1, 2, 2))
    loss = ops.attention(q, q, q).sum()
    g1, gr = grad(g, loss)
    l2 = (gr["q"] * gr["q"]).sum()
    with pytest.raises(mn.AutodiffError, match="attention_grad"):
        grad(g1, l2)


@pytest.mark.parametrize("chunks,keys", [(3, 0), (3, 16), (4, 12)])
def test_split_forward_expansion_matches_reference(chunks, keys, rng):
    """The forward's expansion into key chunks (even, or ``fwd_chunk_keys`` each with a short
    last one: 16 + 16 + 13, 12 + 12 + 12 + 9 of 45 keys) and the combine compute the unsplit
    attention's output and lse (float64 reference)."""
    g = mn.Graph()
    q, k, v = (g.input(n, s) for n, s in (("q", (1, 2, 5, 8)), ("k", (1, 2, 45, 8)),
                                          ("v", (1, 2, 45, 8))))
    env = {n: rand(rng, s) for n, s in (("q", (1, 2, 5, 8)), ("k", (1, 2, 45, 8)),
                                        ("v", (1, 2, 45, 8)))}
    attrs = dict(causal=True, scale=0.4, window=0, q_offset=40, has_mask=False,
                 fwd_chunks=chunks, **({"fwd_chunk_keys": keys} if keys else {}))
    outs = g.apply("attention", q, k, v, **attrs)
    node = outs[0].node
    expanded = node.opdef.lowering.expand(g, node)
    fwd = next(n for n in g.nodes if n.op == "attention_fwd")
    assert fwd.attrs["splits"] == chunks and fwd.attrs.get("chunk_keys", 0) == keys
    # chunk c's lse is the log-sum-exp over its own keys only (numpy, independent of the ref)
    (part_lse,) = evaluate(g, [fwd.outputs[1]], env, np.float64)
    ck = keys or -(-45 // chunks)
    sc = np.einsum("bhqd,bhkd->bhqk", env["q"], env["k"]) * 0.4
    sc = np.where(np.arange(45)[None, :] <= 40 + np.arange(5)[:, None], sc, -np.inf)
    for c in range(chunks):
        part = sc[..., c * ck:(c + 1) * ck]
        np.testing.assert_allclose(part_lse[c:c + 1],
                                   np.log(np.exp(part).sum(-1)), rtol=1e-12)
    want = evaluate(g, list(outs), env, np.float64)
    got = evaluate(g, list(expanded), env, np.float64)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("splits,keys", [(3, 10), (3, 23), (1, 45)])
def test_split_forward_refuses_chunk_keys_that_do_not_split(splits, keys):
    g = mn.Graph()
    q, k, v = (g.input(n, s) for n, s in (("q", (1, 2, 5, 8)), ("k", (1, 2, 45, 8)),
                                          ("v", (1, 2, 45, 8))))
    with pytest.raises(mn.ShapeError, match="chunk_keys"):
        g.apply("attention_fwd", q, k, v, causal=False, scale=0.4, window=0, q_offset=0,
                has_mask=False, splits=splits, chunk_keys=keys)
