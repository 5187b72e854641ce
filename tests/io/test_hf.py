"""HF folders: written here from the PyTorch twins (no network), read back into our
parameters — f32/f16/bf16, single file or sharded — and the error cases."""

import json
import os
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import meganeura as mn
from meganeura.io import hf
from meganeura.models.llama import LlamaConfig, llama_lm, tiny_llama
from meganeura.models.whisper import WhisperEncoderConfig, tiny_whisper, whisper_encoder
from tests.models.twins_transformer import LlamaForCausalLM, WhisperClassifier, params_of


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _hf_llama_folder(path, cfg, dtype=torch.float32, seed=0):
    """What ``save_pretrained`` writes: config.json + model.safetensors (tied head dropped)."""
    torch.manual_seed(seed)
    tw = LlamaForCausalLM(cfg)
    os.makedirs(path, exist_ok=True)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in tw.state_dict().items()
          if k not in tw.tied_skip}
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f)
    return tw, sd


def test_llama_folder_round_trip_runs_like_the_twin(tmp_path):
    cfg = tiny_llama()
    tw, _ = _hf_llama_folder(tmp_path / "m", cfg)
    got = hf.load_hf(tmp_path / "m")
    assert got.kind == "llama" and got.config == cfg
    want = params_of(tw, tw.tied_skip)
    assert set(got.params) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got.params[k], v, err_msg=k)
    m = llama_lm(cfg, 1, 6, loss=False)
    s = mn.compile(m.graph, outputs={"logits": m.logits}, backend="reference")
    s.set_params(got.params, strict=True)
    ids = np.arange(6, dtype=np.int32)[None] * 5
    ref = tw(torch.from_numpy(ids).long())[0].detach().numpy()
    assert _rel(s.run(ids=ids)["logits"], ref) <= 1e-5
    # our writer round-trips too (the HF layout, sharded with an index)
    hf.save_hf(tmp_path / "ours", got.params, cfg, max_shard_bytes=20_000)
    assert os.path.exists(tmp_path / "ours" / hf.INDEX)
    assert len([f for f in os.listdir(tmp_path / "ours") if f.endswith(".safetensors")]) > 1
    again = hf.load_hf(tmp_path / "ours")
    for k, v in got.params.items():
        np.testing.assert_array_equal(again.params[k], v, err_msg=k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_decode_exactly(tmp_path, dtype):
    cfg = tiny_llama(tie_word_embeddings=False)
    _, sd = _hf_llama_folder(tmp_path, cfg, dtype=dtype)
    got = hf.load_hf(tmp_path).params
    for k, t in sd.items():
        assert got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], t.float().numpy(), err_msg=k)


def test_bf16_encoding_matches_torch_rounding(tmp_path):
    x = np.random.default_rng(0).normal(size=4096).astype(np.float32) * 10.0 ** np.arange(
        -8, 8).repeat(256).astype(np.float32)
    ours = hf.f32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    hf.write_safetensors(tmp_path / "x.safetensors", {"x": x}, dtype="bf16")
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "x.safetensors"))["x"]
    assert back.dtype == torch.bfloat16
    np.testing.assert_array_equal(hf.read_safetensors(tmp_path / "x.safetensors")["x"],
                                  back.float().numpy())


def test_whisper_folder_with_model_prefix_decoder_and_positions(tmp_path):
    cfg = tiny_whisper()
    torch.manual_seed(0)
    tw = WhisperClassifier(cfg)
    from meganeura.models.whisper import position_table

    with torch.no_grad():
        tw.encoder.embed_positions.weight.copy_(torch.from_numpy(position_table(cfg)))
    # a WhisperForConditionalGeneration-style checkpoint: model.encoder.*, model.decoder.*,
    # proj_out; no classification head
    sd = {"model." + k: v.detach().contiguous() for k, v in tw.state_dict().items()
          if not k.startswith("head.")}
    sd["model.decoder.layers.0.fc1.weight"] = torch.zeros(4, 4)
    sd["proj_out.weight"] = torch.zeros(4, 4)
    save_file(sd, str(tmp_path / "model.safetensors"))
    hf_cfg = cfg.to_hf() | {"decoder_layers": 1, "architectures": ["WhisperForConditional"
                                                                   "Generation"]}
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    got = hf.load_hf(tmp_path, num_classes=cfg.num_classes)
    assert got.kind == "whisper" and got.config == cfg
    want = params_of(tw, tw.skip)
    assert set(got.params) == set(want) - {"head.weight", "head.bias"}
    for k, v in got.params.items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    m = whisper_encoder(cfg, 1, loss=False)
    s = mn.compile(m.graph, outputs={"f": m.features}, backend="reference")
    s.set_params(got.params)
    mel = np.random.default_rng(1).normal(size=m.mel.shape).astype(np.float32)
    ref = tw.encoder(torch.from_numpy(mel)).detach().numpy()
    assert _rel(s.run(mel=mel)["f"], ref) <= 1e-5
    with pytest.raises(hf.HFCheckpointError, match="missing 2: \\['head.bias', 'head.weight'\\]"):
        hf.load_hf(tmp_path, strict_head=True)
    # a position table that is not the sinusoid is refused, not silently replaced
    sd["model.encoder.embed_positions.weight"] = torch.ones(8, 32)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(hf.HFCheckpointError, match="embed_positions"):
        hf.load_hf(tmp_path)
    assert isinstance(hf.config_from_hf(hf_cfg), WhisperEncoderConfig)


def test_missing_extra_and_misshaped_tensors_are_all_named(tmp_path):
    cfg = tiny_llama()
    _, sd = _hf_llama_folder(tmp_path, cfg)
    del sd["model.layers.1.mlp.up_proj.weight"]
    del sd["model.norm.weight"]
    sd["model.layers.9.self_attn.q_proj.weight"] = torch.zeros(2, 2)
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 31)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(hf.HFCheckpointError) as e:
        hf.load_hf(tmp_path)
    msg = str(e.value)
    assert isinstance(e.value, mn.CheckpointError)
    for part in ("missing 2", "model.layers.1.mlp.up_proj.weight", "model.norm.weight",
                 "unexpected 1", "model.layers.9.self_attn.q_proj.weight",
                 "mis-shaped 1", "model.layers.0.self_attn.k_proj.weight: (16, 31), "
                 "expected (16, 32)"):
        assert part in msg, (part, msg)


def test_folder_errors(tmp_path):
    with pytest.raises(hf.HFCheckpointError, match="not a directory"):
        hf.load_hf(tmp_path / "nope")
    (tmp_path / "a").mkdir()
    with pytest.raises(hf.HFCheckpointError, match="no config.json"):
        hf.load_hf(tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text(json.dumps(tiny_llama().to_hf()))
    with pytest.raises(hf.HFCheckpointError, match="neither model.safetensors"):
        hf.load_hf(tmp_path / "a")
    (tmp_path / "a" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(hf.HFCheckpointError, match="header length|corrupt"):
        hf.load_hf(tmp_path / "a")
    # a truncated data section
    hf.write_safetensors(tmp_path / "t.safetensors", {"x": np.ones((64, 64), np.float32)})
    raw = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(raw[:-100])
    with pytest.raises(hf.HFCheckpointError, match="bad data offsets"):
        hf.read_safetensors(tmp_path / "t.safetensors")
    # a sharded folder whose index names a missing shard
    cfg = tiny_llama()
    _hf_llama_folder(tmp_path / "s", cfg)
    os.remove(tmp_path / "s" / "model.safetensors")
    (tmp_path / "s" / hf.INDEX).write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(hf.HFCheckpointError, match="shard 'model-00001-of-00002"):
        hf.load_hf(tmp_path / "s")
    with pytest.raises(hf.HFCheckpointError, match="unsupported model_type 'gpt_neox'"):
        hf.config_from_hf({"model_type": "gpt_neox"})
    with pytest.raises(mn.GraphBuildError, match="rope_scaling"):
        LlamaConfig.from_hf(cfg.to_hf() | {"rope_scaling": {"rope_type": "llama3"}})


def test_reader_agrees_with_safetensors_numpy(tmp_path):
    from safetensors.numpy import save_file as np_save

    r = np.random.default_rng(0)
    t = {"a": r.normal(size=(3, 5)).astype(np.float32), "b": r.normal(size=7).astype(np.float16),
         "c": np.arange(6, dtype=np.int64).reshape(2, 3), "d": np.zeros((0, 4), np.float32)}
    np_save(t, str(tmp_path / "x.safetensors"))
    got = hf.read_safetensors(tmp_path / "x.safetensors")
    kept = hf.read_safetensors(tmp_path / "x.safetensors", keep_dtype=True)
    assert got["b"].dtype == np.float32 and kept["b"].dtype == np.float16
    for k, v in t.items():
        np.testing.assert_array_equal(got[k], v)
        assert kept[k].dtype == v.dtype
    assert set(hf.read_safetensors(tmp_path / "x.safetensors", ["a"])) == {"a"}
    with pytest.raises(hf.HFCheckpointError, match="not in the file"):
        hf.read_safetensors(tmp_path / "x.safetensors", ["zz"])


def _raw_safetensors(path, header: bytes, data: bytes = b"\0" * 64):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize("header", [
    b"[" * 100_000 + b"]" * 100_000,  # once a RecursionError
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"x": {"dtype": "F32", "shape": [1' + b"0" * 5000 + b'], "data_offsets": [0, 4]}}',
    b'{"x": {"dtype": "F32", "shape": ["a"], "data_offsets": [0, 4]}}',
    b'{"x": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}}',
    b'{"x": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}',
    b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}',
    b'{"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}',
    b'{"x": {"dtype": "F32", "shape": [1099511627776, 1099511627776], "data_offsets": [0, 4]}}',
], ids=["deep-list", "deep-dict", "huge-int", "str-dim", "negative-dims", "bool-dim",
        "str-offsets", "list-dtype", "overflowing-shape"])
def test_malformed_headers_are_checkpoint_errors(tmp_path, header):
    path = _raw_safetensors(tmp_path / "m.safetensors", header)
    with pytest.raises(hf.HFCheckpointError, match="m.safetensors"):
        hf.read_safetensors(path)


def test_deeply_nested_config_or_index_is_a_checkpoint_error(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(hf.HFCheckpointError, match="config.json: invalid JSON"):
        hf.read_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama().to_hf()))
    (tmp_path / hf.INDEX).write_text('{"weight_map":' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(hf.HFCheckpointError, match="invalid JSON"):
        hf.read_folder(tmp_path)
    (tmp_path / hf.INDEX).write_text(json.dumps({"weight_map": {"a": ["x.safetensors"]}}))
    with pytest.raises(hf.HFCheckpointError, match="is not a file name"):
        hf.read_folder(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors",
                                   "/abs/outside.safetensors", "..", "", "."])
def test_index_shards_outside_the_folder_are_refused(tmp_path, shard):
    """An index must not make the reader open files outside the model folder, even existing
    ones holding the right tensor names."""
    hf.write_safetensors(tmp_path / "outside.safetensors", {"model.norm.weight": np.ones(4)})
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_llama().to_hf()))
    if shard.startswith("/abs/"):
        shard = str(tmp_path / "outside.safetensors")
    (folder / hf.INDEX).write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    with pytest.raises(hf.HFCheckpointError, match="outside the model folder"):
        hf.read_folder(folder)


def test_index_shards_in_subfolders_and_symlinked_blobs_still_load(tmp_path):
    """Relative names inside the folder stay valid, and so do shards that are symlinks into a
    blob store elsewhere (the layout of the HF hub cache)."""
    blobs, folder = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir()
    (folder / "sub").mkdir(parents=True)
    hf.write_safetensors(blobs / "abc", {"a": np.ones(3, np.float32)})
    hf.write_safetensors(folder / "sub" / "b.safetensors", {"b": np.zeros(2, np.float32)})
    os.symlink(blobs / "abc", folder / "a.safetensors")
    (folder / "config.json").write_text("{}")
    (folder / hf.INDEX).write_text(json.dumps(
        {"weight_map": {"a": "a.safetensors", "b": "./sub/b.safetensors"}}))
    _, tensors = hf.read_folder(folder)
    assert sorted(tensors) == ["a", "b"]


# --------------------------------------------------------------------------- RoPE settings


def test_transformers5_folder_keeps_its_rope_theta(tmp_path):
    """transformers 5 writes ``rope_parameters`` and no top-level ``rope_theta``: the folder
    must load with its theta (100000, SmolLM2's), and run like transformers' own model."""
    transformers = pytest.importorskip("transformers")
    hcfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hcfg).eval()
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in written and written["rope_parameters"]["rope_theta"] == 100000
    got = hf.load_hf(tmp_path)
    assert got.config.rope_theta == 100000.0
    m = llama_lm(got.config, 1, 40, loss=False)
    s = mn.compile(m.graph, outputs={"logits": m.logits}, backend="reference")
    s.set_params(got.params, strict=True)
    ids = (np.arange(40, dtype=np.int32)[None] * 7) % 64
    with torch.no_grad():
        ref = model(torch.from_numpy(ids).long()).logits.numpy()
    assert _rel(s.run(ids=ids)["logits"], ref) <= 1e-5


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@pytest.mark.parametrize("scaling, backend", [({"rope_type": "linear", "factor": 2.0}, "reference"),
                                              (LLAMA3, "reference"), (LLAMA3, "wgpu")])
def test_scaled_rope_folders_run_like_transformers(tmp_path, scaling, backend, request):
    """linear and llama3 RoPE scaling (a transformers-5 folder, 40 positions, past the llama3
    original context of 16): logits of transformers' own model; the scaling matters (the
    same weights without it differ); the config round-trips through to_hf/from_hf."""
    transformers = pytest.importorskip("transformers")
    if backend == "wgpu":
        request.getfixturevalue("gpu")
    hcfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        rope_parameters={"rope_theta": 10000.0, **scaling}, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hcfg).eval()
    model.save_pretrained(tmp_path)
    got = hf.load_hf(tmp_path)
    assert got.config.rope_scaling.rope_type == scaling["rope_type"]
    assert LlamaConfig.from_hf(got.config.to_hf()) == got.config
    ids = (np.arange(40, dtype=np.int32)[None] * 7) % 64
    with torch.no_grad():
        ref = model(torch.from_numpy(ids).long()).logits.numpy()
    outs = []
    for cfg in (got.config, LlamaConfig(**{**got.config.__dict__, "rope_scaling": None})):
        m = llama_lm(cfg, 1, 40, loss=False)
        s = mn.compile(m.graph, outputs={"logits": m.logits},
                       **({"backend": backend} if backend == "reference" else {}))
        s.set_params(got.params, strict=True)
        outs.append(s.run(ids=ids)["logits"])
    assert _rel(outs[0], ref) <= 1e-5
    assert _rel(outs[1], ref) > 1e-3


@pytest.mark.parametrize("config, theta", [
    ({"rope_theta": 5e5}, 5e5),                                          # transformers 4
    ({"rope_theta": 5e5, "rope_scaling": None}, 5e5),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}, 1e5),  # transformers 5
    ({"rope_parameters": {"rope_theta": 2e4}}, 2e4),
    ({"rope_theta": 1e5, "rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}, 1e5),
    ({"rope_scaling": {"type": "default"}, "rope_theta": 7.0}, 7.0),
    ({}, 10000.0),
])
def test_rope_theta_is_read_from_both_config_layouts(config, theta):
    assert LlamaConfig.from_hf(tiny_llama().to_hf() | {"rope_theta": None} | config
                               ).rope_theta == theta


@pytest.mark.parametrize("config, message", [
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
     r"linear RoPE scaling needs \['factor'\]"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
     "llama3 RoPE scaling needs .*low_freq_factor"),
    ({"rope_parameters": {**LLAMA3, "high_freq_factor": 0.5}}, "bad llama3 RoPE scaling"),
    ({"rope_parameters": {"rope_type": "linear", "factor": -2.0}}, "bad linear RoPE scaling"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "'longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type 'dynamic' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}}}, "per-layer-type"),
    ({"rope_parameters": "default"}, "must be an object"),
    ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e5}}, "contradicts"),
    ({"rope_parameters": {"rope_theta": -1.0}}, "positive number"),
])
def test_unimplemented_rope_variants_are_refused(config, message):
    with pytest.raises(mn.GraphBuildError, match=message):
        LlamaConfig.from_hf(tiny_llama().to_hf() | {"rope_theta": None} | config)
