"""Llama / SmolLM2: outputs and gradients against the PyTorch twin on the GPU session
(lavapipe in CI), KV-cache decoding against full recompute, a tiny LM overfitting a text,
sampling, shared sessions and the SmolLM2-135M preset."""

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura import optim
from meganeura.generate import LlamaGenerator, sample
from meganeura.models.llama import (
    SMOLLM2_135M,
    LlamaConfig,
    cache_names,
    llama_decode,
    llama_lm,
    llama_prefill,
    tiny_llama,
)

from .twins_transformer import LlamaForCausalLM, grads_of, load_into, params_of
from .util_transformer import check_gates, grad_session, rel_l2

IMPLS = ["op", "composite"]  # the attention/embedding/cache ops, or primitive compositions


def _twin(cfg, seed=0):
    torch.manual_seed(seed)
    tw = LlamaForCausalLM(cfg)
    with torch.no_grad():  # HF's init scale keeps the tied logits moderate
        tw.model.embed_tokens.weight.normal_(0.0, 0.5)
    return tw


def _data(cfg, B, S, seed=0):
    r = np.random.default_rng(seed)
    ids = r.integers(0, cfg.vocab_size, (B, S)).astype(np.int32)
    labels = ids.copy()
    labels[0, -3:] = -100  # padding: ignored by the loss
    return ids, labels


@pytest.mark.parametrize("impl", IMPLS)
def test_forward_and_gradients_match_twin(gpu, impl):
    cfg = tiny_llama()  # GQA: 4 query heads on 2 KV heads
    B, S = 2, 8
    m = llama_lm(cfg, B, S, impl=impl)
    s = grad_session(m.graph, m.loss, {"logits": m.logits})
    tw = _twin(cfg)
    s.set_params(params_of(tw, tw.tied_skip), strict=True)
    ids, labels = _data(cfg, B, S)
    out = s.run(ids=ids, labels=labels)
    logits, loss = tw(torch.from_numpy(ids).long(), torch.from_numpy(labels).long())
    loss.backward()
    check_gates(out, {"logits": logits.detach().numpy(), "loss": loss.detach().numpy()},
                grads_of(tw))


def test_untied_head_and_ignore_index_on_reference():
    cfg = tiny_llama(tie_word_embeddings=False, num_key_value_heads=1)  # MQA
    B, S = 2, 6
    m = llama_lm(cfg, B, S, ignore_index=7, fuse=False)  # the unfused projections
    assert "lm_head.weight" in m.graph.params
    s = grad_session(m.graph, m.loss, {"logits": m.logits}, backend="reference")
    tw = _twin(cfg, seed=1)
    s.set_params(params_of(tw), strict=True)
    ids, labels = _data(cfg, B, S, seed=1)
    labels[labels == -100] = 7
    out = s.run(ids=ids, labels=labels)
    logits, loss = tw(torch.from_numpy(ids).long(), torch.from_numpy(labels).long(),
                      ignore_index=7)
    loss.backward()
    check_gates(out, {"logits": logits.detach().numpy(), "loss": loss.detach().numpy()},
                grads_of(tw))


@pytest.mark.parametrize("impl", IMPLS)
def test_kv_cache_decode_matches_full_recompute(gpu, impl):
    cfg = tiny_llama()
    B, P, N, L = 2, 5, 6, 12
    tw = _twin(cfg, seed=2)
    params = params_of(tw, tw.tied_skip)
    gen = LlamaGenerator(cfg, params, batch=B, max_len=L, impl=impl)
    r = np.random.default_rng(2)
    seq = r.integers(0, cfg.vocab_size, (B, P + N)).astype(np.int32)
    steps = [gen.prefill(seq[:, :P])]
    for t in range(P, P + N - 1):
        steps.append(gen.decode(seq[:, t]))
    assert gen.pos == P + N - 1
    # full recompute of the whole sequence (no cache) on the same device
    fm = llama_lm(cfg, B, P + N - 1, loss=False, impl=impl)
    full = mn.compile(fm.graph, outputs={"logits": fm.logits})
    full.set_params(params, strict=True)
    ref = full.run(ids=seq[:, : P + N - 1])["logits"]
    errs = [rel_l2(lg, ref[:, P - 1 + i]) for i, lg in enumerate(steps)]
    assert max(errs) <= 1e-4, errs
    # and the twin agrees with the full recompute
    twl = tw(torch.from_numpy(seq[:, : P + N - 1]).long())[0].detach().numpy()
    assert rel_l2(ref, twl) <= 1e-4
    # the cache rows written so far hold the prefix's keys; later rows are still zero
    cache = gen.cache()
    assert set(cache) == set(cache_names(cfg))
    assert np.abs(cache["cache.0.k"][:, :, : P + N - 1]).sum() > 0
    assert np.abs(cache["cache.0.k"][:, :, P + N - 1:]).sum() == 0

    # greedy generation = argmax of the twin's full recompute at every step
    out = gen.generate(seq[:, :P], N)
    assert out.shape == (B, P + N)
    twl = tw(torch.from_numpy(out[:, :-1]).long())[0].detach().numpy()
    np.testing.assert_array_equal(out[:, P:], twl[:, P - 1:].argmax(-1))
    # top_k=1 sampling is greedy; seeded sampling is reproducible
    np.testing.assert_array_equal(gen.generate(seq[:, :P], N, temperature=0.7, top_k=1), out)
    a = gen.generate(seq[:, :P], N, temperature=1.5, top_k=8, seed=3)
    np.testing.assert_array_equal(a, gen.generate(seq[:, :P], N, temperature=1.5, top_k=8,
                                                  seed=3))
    with pytest.raises(mn.FeedError, match="exceed max_len"):
        gen.generate(seq[:, :P], L)


def test_sampling_on_host():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    np.testing.assert_array_equal(sample(logits), np.zeros(4000))
    draws = sample(logits, temperature=1.0, rng=rng)
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    top2 = sample(logits, temperature=1.0, top_k=2, rng=rng)
    assert set(np.unique(top2)) == {0, 1}
    np.testing.assert_allclose(np.mean(top2 == 0), 0.5 / 0.8, atol=0.03)
    hot = sample(logits, temperature=0.05, rng=rng)  # low temperature: nearly greedy
    assert np.mean(hot == 0) > 0.99


def test_tiny_lm_overfits_a_text(gpu):
    text = "meganeura compiles graphs to webgpu. " * 3
    chars = sorted(set(text))
    cfg = tiny_llama(vocab_size=len(chars))
    enc = np.array([chars.index(c) for c in text], dtype=np.int32)
    B, S = 2, 24
    ids = np.stack([enc[:S], enc[S: 2 * S]])
    m = llama_lm(cfg, B, S)
    s = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                        optimizer=optim.AdamW(lr=2e-2, weight_decay=0.0))
    s.init_params(seed=0)
    losses = [s.step(ids=ids, labels=ids).loss for _ in range(60)]
    assert losses[-1] <= 0.1 * losses[0], (losses[0], losses[-1])
    # our trained weights copied into the twin give the same logits (weights both ways)
    tw = LlamaForCausalLM(cfg)
    params = s.get_params()
    load_into(tw, params, skip=tw.tied_skip)
    out = s.run(ids=ids)
    twl = tw(torch.from_numpy(ids).long())[0].detach().numpy()
    assert rel_l2(out["logits"], twl) <= 1e-4
    # and the generator, given those weights, continues the memorized text greedily
    gen = LlamaGenerator(cfg, params, max_len=S)
    got = gen.generate(ids[:1, :8], 12)[0]
    expect = ids[0, :20]
    assert np.mean(got == expect) >= 0.9, ("".join(chars[i] for i in got),
                                           "".join(chars[i] for i in expect))


def test_shared_sessions_see_each_others_updates():
    cfg = tiny_llama(num_hidden_layers=1)
    dec = llama_decode(cfg, 1, 8)
    pre = llama_prefill(cfg, 1, 3, 8)
    a = mn.compile(dec.graph, outputs={"logits": dec.logits}, backend="reference")
    a.init_params(seed=4)
    before = a.get_params()
    b = mn.compile(pre.graph, outputs={"logits": pre.logits}, backend="reference", share=a)
    for k, v in b.get_params().items():  # shared: not re-initialized
        np.testing.assert_array_equal(v, before[k])
    b.step(ids=np.array([[1, 2, 3]], np.int32))
    assert np.abs(a._read(["cache.0.k"])["cache.0.k"][:, :, :3]).sum() > 0
    other = llama_decode(tiny_llama(num_hidden_layers=1, head_dim=4, hidden_size=16), 1, 8)
    with pytest.raises(mn.GraphBuildError, match="same name but different types"):
        mn.compile(other.graph, outputs={"logits": other.logits}, backend="reference", share=a)


def test_smollm2_135m_preset_builds_with_hf_names():
    cfg = SMOLLM2_135M
    assert cfg.n_params == 134_515_008  # SmolLM2-135M
    m = llama_lm(cfg, 1, 128)
    params = m.graph.params
    assert sum(v.size for v in params.values()) == cfg.n_params
    assert params["model.embed_tokens.weight"].shape == (49152, 576)
    assert params["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert params["model.layers.0.mlp.gate_proj.weight"].shape == (1536, 576)
    assert "lm_head.weight" not in params and "model.norm.weight" in params
    assert m.logits.shape == (1, 128, 49152)
    assert LlamaConfig.from_hf(cfg.to_hf()) == cfg
    hf = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
          "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 128}
    c = LlamaConfig.from_hf(hf)
    assert (c.head_dim, c.num_key_value_heads) == (16, 4)
    with pytest.raises(mn.GraphBuildError, match="multiple"):
        tiny_llama(num_key_value_heads=3)


def test_lm_attention_state_grows_linearly_with_sequence(gpu):
    """memory_report: the LM's training plan grows O(S·heads) with the attention op (no S×S
    buffer saved), while the composite attention (matmul + softmax) grows ~S²."""
    cfg = tiny_llama(vocab_size=32, hidden_size=16, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8, intermediate_size=16)

    def peak(S, impl):
        m = llama_lm(cfg, 1, S, impl=impl)
        s = mn.compile(m.graph, loss=m.loss, optimizer=optim.SGD(lr=0.1), device=gpu)
        return s.memory_report()["train"]["planned_peak_bytes"]

    op = peak(512, "op") / peak(128, "op")
    comp = peak(512, "composite") / peak(128, "composite")
    assert op < 5.0, op  # 4x the sequence: about 4x the memory
    assert comp > 8.0, comp  # the S×S scores dominate without the flash-style op


def test_decode_updates_the_kv_cache_in_place(gpu):
    """A decode step writes only the new K/V rows into the cache states (no whole-cache copy
    kernel, no end-of-step copies); decoding still matches full recompute (test above)."""
    from meganeura.compile.executable import Copy
    from meganeura.init import init_leaves

    cfg = tiny_llama()
    gen = LlamaGenerator(cfg, init_leaves(llama_lm(cfg, 1, 4).graph, 0), batch=1, max_len=16)
    plan = gen.decoder.executable.train
    assert not [k for k in plan.ops if isinstance(k, Copy)]
    labels = [lbl for lbl in gen.decoder.kernel_labels() if "dynamic_update_slice" in lbl]
    assert labels and all(lbl.endswith("[in place]") for lbl in labels), labels


def test_training_plan_writes_gradients_into_the_optimizer_vector(gpu):
    """Every weight gradient — also those of the fused q/k/v and gate/up projections, which
    are split views of one product — is computed straight into the flat gradient vector
    (no concat copy of gradients), and parameters are updated in place (no copies)."""
    from meganeura.compile.executable import Copy

    # every parameter a multiple of 64 floats: 256-byte aligned slots, as in SmolLM2
    cfg = tiny_llama(hidden_size=64, head_dim=16, intermediate_size=128)
    m = llama_lm(cfg, 2, 8)
    s = mn.compile(m.graph, loss=m.loss, optimizer=optim.AdamW(lr=1e-3), device=gpu)
    n = sum(p.size for p in m.graph.params.values())
    flat = [lbl for lbl in s.kernel_labels() if lbl.startswith("concat") and f"->({n},)" in lbl]
    assert not flat, flat
    assert not [k for k in s.executable.train.ops if isinstance(k, Copy)]


def test_top_p_sampling_keeps_the_nucleus():
    rng = np.random.default_rng(1)
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    nucleus = sample(logits, temperature=1.0, rng=rng, top_p=0.75)  # 0.5 + 0.3 reach 0.75
    assert set(np.unique(nucleus)) == {0, 1}
    np.testing.assert_allclose(np.mean(nucleus == 0), 0.5 / 0.8, atol=0.03)
    assert set(np.unique(sample(logits, 1.0, rng=rng, top_p=0.5))) == {0}
    assert set(np.unique(sample(logits, 1.0, rng=rng, top_p=1.0))) == {0, 1, 2, 3}
    both = sample(logits, 1.0, top_k=3, rng=rng, top_p=0.8)  # of 0.5/0.3/0.15 renormalised
    assert set(np.unique(both)) == {0, 1}
