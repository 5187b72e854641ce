"""Batched generation of prompts of different lengths (left padding, per-row positions, padding
masked): every row's greedy tokens equal the prompt generated alone and transformers' own
batched ``generate`` with an attention mask."""

import numpy as np
import pytest

import meganeura as mn
from meganeura.generate import LlamaGenerator, left_pad
from meganeura.models.llama import tiny_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

N_NEW = 8
PROMPTS = [[5, 17, 42], [9, 1, 33, 60, 7, 21, 2], [11, 40, 3, 3, 58]]


def _hf_twin(cfg, seed=0):
    """transformers' LlamaForCausalLM of ``cfg`` (seeded, weights scaled so that logits are far
    apart: greedy ties would make a token-identity test depend on rounding) and its params."""
    hcfg = transformers.LlamaConfig(**{k: v for k, v in cfg.to_hf().items()
                                       if k not in ("rope_scaling", "torch_dtype")})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hcfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(8.0)
    model.generation_config.eos_token_id = None
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return model, sd


def _hf_batched(model, prompts, n):
    ids, start = left_pad(prompts)
    mask = (np.arange(ids.shape[1])[None] >= start[:, None]).astype(np.int64)
    with torch.no_grad():
        out = model.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()


def test_left_pad_and_its_errors():
    ids, start = left_pad([[1, 2], [3], [4, 5, 6]], pad_id=9)
    np.testing.assert_array_equal(ids, [[9, 1, 2], [9, 9, 3], [4, 5, 6]])
    np.testing.assert_array_equal(start, [1, 2, 0])
    with pytest.raises(mn.FeedError, match="prompt 1 is empty"):
        left_pad([[1], []])
    with pytest.raises(mn.FeedError, match="no prompts"):
        left_pad([])


@pytest.mark.parametrize("backend", ["reference", "wgpu"])
def test_batched_rows_equal_alone_and_transformers(backend, request):
    if backend == "wgpu":
        request.getfixturevalue("gpu")
    cfg = tiny_llama()
    model, params = _hf_twin(cfg)
    opts = {} if backend == "wgpu" else {"backend": backend}
    L = max(map(len, PROMPTS)) + N_NEW
    gen = LlamaGenerator(cfg, params, batch=len(PROMPTS), max_len=L, **opts)
    rows = gen.generate_batch(PROMPTS, N_NEW)
    assert gen.start.tolist() == [4, 0, 2]
    want = _hf_batched(model, PROMPTS, N_NEW)
    alone = LlamaGenerator(cfg, params, batch=1, max_len=L, **opts)
    for b, p in enumerate(PROMPTS):
        solo = alone.generate(np.array([p]), N_NEW)[0, len(p):]
        np.testing.assert_array_equal(rows[b], solo, err_msg=f"row {b} vs alone")
        np.testing.assert_array_equal(rows[b], want[b], err_msg=f"row {b} vs transformers")
    assert len({tuple(r) for r in rows}) == len(rows)  # rows that say different things
    # the logits themselves: a padded row's prefill equals its prompt alone
    ids, start = left_pad(PROMPTS)
    lg = gen.prefill(ids, start)
    for b, p in enumerate(PROMPTS):
        solo = alone.prefill(np.array([p]))[0]
        assert np.linalg.norm(lg[b] - solo) <= 1e-5 * np.linalg.norm(solo), b


def test_equal_lengths_use_the_plain_graphs_and_bad_starts_are_refused():
    cfg = tiny_llama()
    _, params = _hf_twin(cfg)
    gen = LlamaGenerator(cfg, params, batch=2, max_len=12, backend="reference")
    rows = gen.generate_batch([[1, 2, 3], [4, 5, 6]], 3)
    assert gen.start is None and gen._padded_decoder is None
    np.testing.assert_array_equal(np.stack(rows), gen.generate(np.array([[1, 2, 3],
                                                                          [4, 5, 6]]), 3)[:, 3:])
    with pytest.raises(mn.FeedError, match="start must be"):
        gen.prefill(np.zeros((2, 3), np.int32), np.array([3, 0]))  # a row without tokens
    with pytest.raises(mn.FeedError, match="generate_batch"):
        gen.generate([[1, 2], [3]], 2)


def test_generate_batch_stops_rows_at_eos():
    cfg = tiny_llama()
    _, params = _hf_twin(cfg)
    gen = LlamaGenerator(cfg, params, batch=3, max_len=16, backend="reference")
    free = gen.generate_batch(PROMPTS, N_NEW)
    eos = int(free[0][2])  # row 0's third token: it ends there
    rows = gen.generate_batch(PROMPTS, N_NEW, eos_token_id=eos)
    assert rows[0].tolist() == free[0][:3].tolist()
    for r, f in zip(rows, free):
        k = int(np.argmax(f == eos)) + 1 if eos in f else len(f)
        assert r.tolist() == f[:k].tolist()


# --------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from tests.io.gguf_util import write_tiny_chat_llama

    return write_tiny_chat_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_cli_generates_several_prompts_as_one_batch(tiny_gguf, tmp_path, capsys):
    from meganeura.cli import main
    from meganeura.io.gguf import load_gguf

    texts = ["abc ab", "a", "ab abc a b"]
    (tmp_path / "p.txt").write_text(texts[2] + "\n\n")
    rc = main(["generate", tiny_gguf, *texts[:2], "--prompts-file", str(tmp_path / "p.txt"),
               "--max-new-tokens", "5", "--backend", "reference"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "3 prompt(s)" in err and "tokens/s (all rows)" in err
    m = load_gguf(tiny_gguf)
    tok = m.tokenizer
    for b, text in enumerate(texts):  # each answer = that prompt generated alone
        ids = tok.encode(text)
        gen = LlamaGenerator(m.config, m.params, max_len=len(ids) + 5, backend="reference")
        new = gen.generate(np.array([ids]), 5, eos_token_id=tok.eos_id)[0, len(ids):]
        assert f"--- [{b}] {tok.decode([int(t) for t in new])}\n" in out, (b, out)


def test_cli_without_prompts_or_with_a_missing_file_is_one_line(tiny_gguf, tmp_path, capsys):
    from tests.test_cli import _fails

    _, line = _fails(["generate", tiny_gguf, "--backend", "reference"], capsys)
    assert "no prompt" in line
    _, line = _fails(["generate", tiny_gguf, "--prompts-file", str(tmp_path / "no.txt"),
                      "--backend", "reference"], capsys)
    assert "--prompts-file" in line and "no.txt" in line
