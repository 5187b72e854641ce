"""``meganeura finetune`` then ``generate --checkpoint``: a tiny Llama GGUF written here learns
a fixed answer style on the numpy reference and on the GPU (lavapipe); the loss is the
response tokens' only; the checkpoint is what generation then runs; bad data files are one
line."""

import json
import re

import numpy as np
import pytest

from meganeura.checkpoint import read_checkpoint
from meganeura.cli import main
from meganeura.compile import compile
from meganeura.finetune import IGNORE, build_session, encode_pair, encode_pairs, load_finetuned
from meganeura.generate import LlamaGenerator
from meganeura.io.gguf import load_gguf
from meganeura.models.llama import llama_lm
from meganeura.optim import AdamW
from tests.io.gguf_util import write_tiny_chat_llama
from tests.test_cli import _fails

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

# a recognisable style: whatever the question, the answer ends in "zz yy"
PAIRS = [(q, f"{a} zz yy") for q, a in [("abc", "ab"), ("ab ab", "c"), ("a b c", "abc"),
                                         ("cab", "b a"), ("bac", "c c"), ("c", "ab ab"),
                                         ("abc abc", "a"), ("b", "abc b")]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_chat_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "style.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in PAIRS))
    return str(path)


def _finetune(model, data, out, backend, capsys, epochs="4"):
    rc = main(["finetune", model, "--data", data, "--epochs", epochs, "--lr", "1e-2",
               "--batch-size", "4", "--seq-len", "16", "--out", str(out), "--backend", backend,
               "--quiet"])
    out_text, err = capsys.readouterr()
    assert rc == 0, err
    first, last = map(float, re.search(r"loss ([\d.]+) \(first epoch\) -> ([\d.]+)",
                                       out_text).groups())
    return first, last


@pytest.mark.parametrize("backend", ["reference", "wgpu"])
def test_finetune_lowers_the_loss(tiny_gguf, data, tmp_path, backend, capsys, request):
    if backend == "wgpu":
        request.getfixturevalue("gpu")
    first, last = _finetune(tiny_gguf, data, tmp_path, backend, capsys)
    assert last < 0.7 * first, (first, last)
    tensors, meta = read_checkpoint(tmp_path / "finetuned.safetensors")
    assert meta["finetune.epoch"] == "4"
    base = load_gguf(tiny_gguf).params
    assert set(tensors) == set(base)  # HF names, parameters only
    assert not np.allclose(tensors["model.norm.weight"], base["model.norm.weight"])


def test_labels_cover_only_the_response(tiny_gguf):
    tok = load_gguf(tiny_gguf).tokenizer
    ex = encode_pair(tok, "abc ab", "c zz")
    assert ex.ids[:ex.n_prompt] == tok.encode("abc ab")  # the prompt generate will feed
    assert ex.ids[-1] == tok.eos_id
    ids, labels, cut = encode_pairs(tok, [("abc ab", "c zz")], 12)
    n = len(ex.ids)
    assert cut == 0 and list(ids[0, :n]) == ex.ids
    assert (labels[0, :ex.n_prompt] == IGNORE).all() and (labels[0, n:] == IGNORE).all()
    assert list(labels[0, ex.n_prompt:n]) == ex.ids[ex.n_prompt:]
    _, _, cut = encode_pairs(tok, [("abc ab", "c zz")], ex.n_prompt + 1)
    assert cut == 1


def test_loss_ignores_prompt_tokens(tiny_gguf):
    """The first step's loss equals the mean next-token CE over response positions computed
    from the same model's logits in numpy; changing a prompt token's label changes nothing."""
    m = load_gguf(tiny_gguf)
    ids, labels, _ = encode_pairs(m.tokenizer, PAIRS[:2], 16)
    sess = build_session(m.config, m.params, 2, 16, AdamW(1e-3), backend="reference")
    loss = sess.step(ids=ids, labels=labels).loss
    g = llama_lm(m.config, 2, 16, loss=False)
    inf = compile(g.graph, outputs={"logits": g.logits}, backend="reference")
    inf.set_params(m.params, strict=True)
    z = inf.run(ids=ids)["logits"][:, :-1].astype(np.float64)
    tgt = labels[:, 1:]
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    keep = tgt != IGNORE
    want = -np.take_along_axis(logp, np.where(keep, tgt, 0)[..., None], -1)[..., 0][keep].mean()
    assert loss == pytest.approx(want, rel=1e-5)
    full = ids.copy()  # every position labelled: a different (larger-support) loss
    sess2 = build_session(m.config, m.params, 2, 16, AdamW(1e-3), backend="reference")
    assert abs(sess2.step(ids=ids, labels=full).loss - want) > 1e-3


def test_generate_with_checkpoint_runs_the_finetuned_weights(tiny_gguf, data, tmp_path,
                                                              capsys):
    _finetune(tiny_gguf, data, tmp_path, "reference", capsys, epochs="30")
    ckpt = str(tmp_path / "finetuned.safetensors")
    rc = main(["generate", tiny_gguf, "abc", "--checkpoint", ckpt, "--max-new-tokens", "12",
               "--backend", "reference"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    m = load_gguf(tiny_gguf)
    ids = m.tokenizer.encode("abc")
    gen = LlamaGenerator(m.config, load_finetuned(ckpt, m.params), max_len=len(ids) + 12,
                         backend="reference")
    want = gen.generate(np.array([ids]), 12, eos_token_id=m.tokenizer.eos_id)[0, len(ids):]
    want = [t for t in want if t != m.tokenizer.eos_id]
    assert out == m.tokenizer.decode(want) + "\n"
    assert out.endswith(" zz yy\n")  # the style was learnt, and the end of the turn


def test_bad_data_files_give_one_line_errors(tiny_gguf, data, tmp_path, capsys):
    files = {"empty.jsonl": "\n\n", "notjson.jsonl": '{"prompt": "a", "response": "b"}\nhello\n',
             "nokey.jsonl": '{"prompt": "a"}\n', "list.jsonl": "[1, 2]\n",
             "blank.jsonl": '{"prompt": "a", "response": ""}\n',
             "long.jsonl": json.dumps({"prompt": "abc " * 20, "response": "b"}) + "\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    base = ["finetune", tiny_gguf, "--backend", "reference", "--out", str(tmp_path / "o"),
            "--batch-size", "1"]
    cases = [("empty.jsonl", "empty.jsonl: no examples"),
             ("notjson.jsonl", "notjson.jsonl:2: not JSON"),
             ("nokey.jsonl", "nokey.jsonl:1: missing key 'response'"),
             ("list.jsonl", "list.jsonl:1: expected a JSON object, got list"),
             ("blank.jsonl", "'response' must be a non-empty string"),
             ("long.jsonl", "example 1: the prompt is"),
             ("bin.jsonl", "bin.jsonl: not UTF-8 text"),
             ("missing.jsonl", "No such file or directory")]
    for name, msg in cases:
        _, line = _fails(base + ["--data", str(tmp_path / name), "--seq-len", "16"], capsys)
        assert msg in line, (name, line)
    _, line = _fails(["finetune", tiny_gguf, "--data", data, "--batch-size", "99",
                      "--seq-len", "16", "--backend", "reference",
                      "--out", str(tmp_path / "o")], capsys)
    assert "--batch-size 99 is larger than the 8 examples" in line
    _, line = _fails(["finetune", tiny_gguf, "--data", data, "--seq-len", "100",
                      "--backend", "reference", "--out", str(tmp_path / "o")], capsys)
    assert "exceeds the model's context of 64" in line
    _, line = _fails(["generate", tiny_gguf, "a", "--checkpoint", str(tmp_path / "no.st"),
                      "--backend", "reference"], capsys)
    assert "does not exist" in line


def _run(tiny_gguf, data, out, backend, capsys, *extra):
    rc = main(["finetune", tiny_gguf, "--data", data, "--epochs", "2", "--lr", "1e-2",
               "--batch-size", "4", "--seq-len", "16", "--out", str(out), "--backend", backend,
               "--quiet", *extra])
    text, err = capsys.readouterr()
    assert rc == 0, err
    return text


@pytest.mark.parametrize("backend", ["reference", "wgpu"])
def test_resumed_finetune_equals_the_uninterrupted_run(tiny_gguf, data, tmp_path, backend,
                                                       capsys, request):
    """4 steps (2 epochs of 2) in one go == 1 step, resume, 2 steps (across the epoch
    boundary), resume, 1 step: parameters, AdamW moments, step (the LR schedule's position),
    loss history and data order all continue exactly."""
    if backend == "wgpu":
        request.getfixturevalue("gpu")
    _run(tiny_gguf, data, tmp_path / "a", backend, capsys)
    b = tmp_path / "b"
    state = str(b / "finetune-state.safetensors")
    assert "continue with --resume" in _run(tiny_gguf, data, b, backend, capsys,
                                            "--stop-after", "1")
    _run(tiny_gguf, data, b, backend, capsys, "--resume", state, "--stop-after", "2")
    assert read_checkpoint(state)[1]["cli.epoch"] == "1"
    assert "(last epoch)" in _run(tiny_gguf, data, b, backend, capsys, "--resume", state)
    for name in ("finetune-state.safetensors", "finetuned.safetensors"):
        want, wmeta = read_checkpoint(tmp_path / "a" / name)
        got, gmeta = read_checkpoint(b / name)
        assert set(got) == set(want) and gmeta["step"] == wmeta["step"] == "4", name
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=f"{name}: {k}")
    full, meta = read_checkpoint(b / "finetune-state.safetensors")
    assert json.loads(meta["cli.losses"]) == json.loads(
        read_checkpoint(tmp_path / "a" / "finetune-state.safetensors")[1]["cli.losses"])
    assert len(json.loads(meta["cli.losses"])) == 4
    extra = set(full) - set(load_gguf(tiny_gguf).params)
    assert "optim.step" in extra and len(extra) > 1  # the optimizer's moments too


def test_resume_refuses_other_settings_and_missing_files(tiny_gguf, data, tmp_path, capsys):
    _run(tiny_gguf, data, tmp_path, "reference", capsys, "--stop-after", "1")
    state = str(tmp_path / "finetune-state.safetensors")
    base = ["finetune", tiny_gguf, "--data", data, "--batch-size", "4", "--seq-len", "16",
            "--backend", "reference", "--out", str(tmp_path), "--quiet", "--epochs", "2",
            "--lr", "1e-2"]
    _, line = _fails(base[:-1] + ["3e-2", "--resume", state], capsys)
    assert "comes from a run with --lr 0.01" in line
    _, line = _fails(base + ["--resume", str(tmp_path / "nope.safetensors")], capsys)
    assert "no checkpoint" in line and "finetune-state.safetensors" in line
    _, line = _fails(base + ["--resume", str(tmp_path / "finetuned.safetensors")], capsys)
    assert "was not written by 'meganeura finetune'" in line
