"""Hugging Face checkpoints: local folders (``config.json`` + ``model.safetensors`` or a sharded
``model.safetensors.index.json``) to our parameters, and back.

* :func:`read_safetensors` parses the format itself (8-byte header length, JSON header, raw
  little-endian data), so bf16 works without torch: it is widened to f32 with numpy bit ops.
  F32, F16, BF16 and F64 tensors (and integer ones) are read; float tensors load as f32.
* :func:`load_hf` reads a folder, builds the model config from ``config.json``
  (``model_type`` llama / whisper) and maps the tensors onto the model's parameters.  Any
  missing, unexpected or mis-shaped tensor raises :class:`HFCheckpointError` naming them all.
* :func:`save_hf` writes such a folder (f32, f16 or bf16; optionally sharded with an index).

Names: our Llama parameters are HF's ``LlamaForCausalLM`` names (a tied ``lm_head.weight`` and
the old ``rotary_emb.inv_freq`` buffers are skipped); Whisper's are HF's without the
``model.`` prefix, the decoder and ``proj_out`` are skipped, and ``embed_positions`` (a
constant of our graph) is checked against our sinusoid table instead of loaded.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointError

__all__ = ["HFCheckpointError", "read_safetensors", "write_safetensors", "read_folder",
           "map_params", "config_from_hf", "load_hf", "save_hf", "bf16_to_f32", "f32_to_bf16",
           "HFModel"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class HFCheckpointError(CheckpointError):
    """An HF folder/file is unreadable, or its tensors do not match the model's parameters."""


# ------------------------------------------------------------------------------ bf16


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 (exact: bf16 is the top half of an f32)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, np.uint16(0x7FC0), rounded)
    return rounded


# ------------------------------------------------------------------------------ safetensors


def _header(path: str) -> tuple[dict, int, int]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFCheckpointError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise HFCheckpointError(f"{path}: header length {n} exceeds the file size "
                                        f"{size}")
            header = json.loads(f.read(n))
    except OSError as e:
        raise HFCheckpointError(f"cannot read {path}: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError and integers too long to parse; RecursionError a
        # header nested thousands of levels deep — all corrupt (or hostile) files
        raise HFCheckpointError(f"{path}: corrupt safetensors header "
                                f"({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise HFCheckpointError(f"{path}: corrupt safetensors header")
    return header, 8 + n, size


def _entry(path: str, name: str, info) -> tuple[str, np.dtype, tuple[int, ...], int, int]:
    """(dtype tag, numpy dtype, shape, start, end) of one header entry, checked to be the
    types the format prescribes, so a malformed header is a clear HFCheckpointError rather
    than a TypeError deep in numpy."""
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    try:
        dt, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    except (KeyError, TypeError):
        raise HFCheckpointError(f"{path}: bad header entry for {name!r}") from None
    if (not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(is_int(o) for o in offsets)):
        raise HFCheckpointError(f"{path}: bad header entry for {name!r} (shape {shape!r}, "
                                f"data_offsets {offsets!r})")
    if dt == "BF16":
        np_dt = np.dtype(np.uint16)
    elif isinstance(dt, str) and dt in _DTYPES:
        np_dt = np.dtype(_DTYPES[dt])
    else:
        raise HFCheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dt!r}")
    return dt, np_dt, tuple(shape), offsets[0], offsets[1]


def read_safetensors(path, names: Iterable[str] | None = None,
                     keep_dtype: bool = False) -> dict[str, np.ndarray]:
    """Tensors of a ``.safetensors`` file (all, or ``names``).  Float tensors come back as f32
    (bf16/f16 widened exactly) unless ``keep_dtype`` (then bf16 is returned as f32 still,
    numpy having no bf16)."""
    path = os.fspath(path)
    header, start, size = _header(path)
    want = None if names is None else set(names)
    if want is not None:
        absent = sorted(want - set(header))
        if absent:
            raise HFCheckpointError(f"{path}: tensors not in the file: {absent}")
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            if name == "__metadata__" or (want is not None and name not in want):
                continue
            dt, np_dt, shape, a, b = _entry(path, name, info)
            count = math.prod(shape)
            if b - a != count * np_dt.itemsize or a < 0 or start + b > size:
                raise HFCheckpointError(f"{path}: tensor {name!r} ({dt}{list(shape)}) has bad "
                                        f"data offsets [{a}, {b}) (file of {size} bytes)")
            f.seek(start + a)
            arr = np.frombuffer(f.read(b - a), dtype=np_dt.newbyteorder("<"), count=count)
            arr = arr.astype(np_dt.newbyteorder("="), copy=False).reshape(shape)
            if dt == "BF16":
                arr = bf16_to_f32(arr)
            elif arr.dtype.kind == "f" and not keep_dtype:
                arr = arr.astype(np.float32)
            out[name] = arr
    return out


def write_safetensors(path, tensors: Mapping[str, np.ndarray], dtype: str = "f32",
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write float tensors as F32, F16 or BF16 (``dtype``), others as they are."""
    dtype = dtype.lower()
    if dtype not in ("f32", "f16", "bf16"):
        raise ValueError(f"dtype must be f32, f16 or bf16, got {dtype!r}")
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs, off = [], 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        if arr.dtype.kind == "f":
            if dtype == "bf16":
                data, tag = f32_to_bf16(arr.astype(np.float32)), "BF16"
            else:
                data = arr.astype(np.float32 if dtype == "f32" else np.float16)
                tag = "F32" if dtype == "f32" else "F16"
        else:
            data, tag = arr, _NAMES[arr.dtype]
        raw = np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": tag, "shape": list(arr.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)


# ------------------------------------------------------------------------------ folders


def _read_json(path: str, missing: str):
    """A JSON file's content; HFCheckpointError (``missing`` when absent) on any failure,
    including documents nested deeply enough to exhaust Python's recursion limit."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise HFCheckpointError(missing) from None
    except OSError as e:
        raise HFCheckpointError(f"cannot read {path}: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise HFCheckpointError(f"{path}: invalid JSON ({type(e).__name__}: "
                                f"{str(e)[:200]})") from None


def read_folder(folder) -> tuple[dict, dict[str, np.ndarray]]:
    """(config dict, tensors) of an HF folder; ``model.safetensors`` or the sharded index."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise HFCheckpointError(f"{folder}: not a directory")
    cfg_path = os.path.join(folder, "config.json")
    config = _read_json(cfg_path, f"{folder}: no config.json")
    if not isinstance(config, dict):
        raise HFCheckpointError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
    single, index = os.path.join(folder, SINGLE), os.path.join(folder, INDEX)
    if os.path.exists(index):
        return config, _read_shards(folder, index)
    if os.path.exists(single):
        return config, read_safetensors(single)
    raise HFCheckpointError(f"{folder}: neither {SINGLE} nor {INDEX} found")


def _read_shards(folder: str, index: str) -> dict[str, np.ndarray]:
    """The tensors of a sharded checkpoint, each shard read once for the names it holds."""
    doc = _read_json(index, f"{index}: missing")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise HFCheckpointError(f"{index}: invalid index (no \"weight_map\" object)")
    by_file: dict[str, list[str]] = {}
    for name, fn in weight_map.items():
        if not isinstance(fn, str):
            raise HFCheckpointError(f"{index}: shard name {fn!r} of tensor {name!r} is not a "
                                    "file name")
        by_file.setdefault(fn, []).append(name)
    tensors: dict[str, np.ndarray] = {}
    for fn, names in sorted(by_file.items()):
        path = _shard_path(folder, index, fn, names)
        if not os.path.exists(path):
            raise HFCheckpointError(f"{index}: shard {fn!r} (holding {sorted(names)[:3]}…) "
                                    "is missing")
        tensors.update(read_safetensors(path, names))
    return tensors


def _shard_path(folder: str, index: str, fn: str, names: list[str]) -> str:
    """The path of shard ``fn`` named by an index file, refused unless it is a plain relative
    name inside ``folder``: an index must not make us read ``/etc/passwd`` or ``../other``.
    Checked lexically, not with realpath: HF's cache folders hold symlinks into a blob store
    outside the snapshot folder, and those are legitimate."""
    norm = os.path.normpath(fn)
    if (os.path.isabs(fn) or os.path.splitdrive(fn)[0] or norm == os.curdir
            or norm.split(os.sep)[0] == os.pardir or "\0" in fn):
        raise HFCheckpointError(f"{index}: shard {fn!r} (holding {sorted(names)[:3]}…) points "
                                f"outside the model folder {folder!r}; shard names must be "
                                "relative paths inside it")
    return os.path.join(folder, norm)


def map_params(tensors: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]],
               rename: Callable[[str], str | None] = lambda n: n,
               allow_missing: Iterable[str] = ()) -> dict[str, np.ndarray]:
    """Our parameters (f32) from checkpoint tensors.  ``rename(hf_name)`` gives our name, or
    None to skip the tensor.  Every expected parameter not in ``allow_missing`` must be present
    with its exact shape, and nothing unexpected may remain; otherwise one HFCheckpointError
    lists all missing, unexpected and mis-shaped tensors."""
    out, extra, bad, bad_names = {}, [], [], set()
    for hf_name, arr in tensors.items():
        name = rename(hf_name)
        if name is None:
            continue
        if name not in expected:
            extra.append(hf_name if name == hf_name else f"{hf_name} (as {name})")
            continue
        if tuple(arr.shape) != tuple(expected[name]):
            bad.append(f"{hf_name}: {tuple(arr.shape)}, expected {tuple(expected[name])}")
            bad_names.add(name)
            continue
        if arr.dtype.kind != "f":
            bad.append(f"{hf_name}: dtype {arr.dtype}, expected a float tensor")
            bad_names.add(name)
            continue
        out[name] = np.ascontiguousarray(arr, dtype=np.float32)
    missing = sorted(set(expected) - set(out) - set(allow_missing) - bad_names)
    if missing or extra or bad:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {missing}")
        if extra:
            parts.append(f"unexpected {len(extra)}: {sorted(extra)}")
        if bad:
            parts.append(f"mis-shaped {len(bad)}: {bad}")
        raise HFCheckpointError("checkpoint does not match the model — " + "; ".join(parts))
    return out


# ------------------------------------------------------------------------------ models


@dataclass
class HFModel:
    """What :func:`load_hf` returns: the model config and our parameters by name."""

    kind: str  # "llama" | "whisper" | "bert"
    config: object
    params: dict[str, np.ndarray]
    hf_config: dict = field(default_factory=dict)


def config_from_hf(config: Mapping | str | os.PathLike, **kw):
    """Our model config from an HF config dict or folder (by ``model_type``)."""
    if not isinstance(config, Mapping):
        path = os.path.join(os.fspath(config), "config.json")
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise HFCheckpointError(f"cannot read {path}: {e}") from None
    mt = config.get("model_type")
    if mt == "llama":
        from ..models.llama import LlamaConfig

        return LlamaConfig.from_hf(config)
    if mt == "whisper":
        from ..models.whisper import WhisperEncoderConfig

        return WhisperEncoderConfig.from_hf(config, **kw)
    if mt == "bert":
        from ..models.bert import BertConfig

        return BertConfig.from_hf(config)
    raise HFCheckpointError(f"unsupported model_type {mt!r} (supported: llama, whisper, bert)")


def _expected(graph) -> dict[str, tuple[int, ...]]:
    return {n: v.shape for n, v in graph.params.items()}


def _llama_rename(cfg):
    def rename(n: str) -> str | None:
        if n.endswith("rotary_emb.inv_freq"):
            return None
        if n == "lm_head.weight" and cfg.tie_word_embeddings:
            return None  # HF ties it to the embeddings on load
        return n

    return rename


def _whisper_rename(cfg, tensors):
    from ..models.whisper import position_table

    def rename(n: str) -> str | None:
        if n.startswith("model."):
            n = n[len("model."):]
        if n.startswith("decoder.") or n.startswith("proj_out."):
            return None
        if n == "encoder.embed_positions.weight":
            return None
        return n

    for hf in ("model.encoder.embed_positions.weight", "encoder.embed_positions.weight"):
        if hf in tensors:
            got, want = tensors[hf], position_table(cfg)
            if got.shape != want.shape or not np.allclose(got, want, atol=1e-2):
                err = (float(np.abs(got - want).max()) if got.shape == want.shape
                       else f"shape {got.shape}")
                raise HFCheckpointError(f"{hf} differs from the sinusoid table the encoder "
                                        f"uses as a constant ({err}, expected "
                                        f"{want.shape})")
    return rename


def _bert_rename(n: str) -> str | None:
    """BertModel names, also under BertFor*'s ``bert.`` prefix; the pooler (sentence
    embeddings do not use it), task heads (``cls.``, ``classifier.``) and the
    ``position_ids`` buffer are skipped."""
    if n.startswith("bert."):
        n = n[len("bert."):]
    if n.startswith(("pooler.", "cls.", "classifier.")) or n == "embeddings.position_ids":
        return None
    return n


def load_hf(folder, num_classes: int | None = None, strict_head: bool = False) -> HFModel:
    """Read an HF folder and map it onto our model's parameters.

    Llama (``model_type`` llama): every parameter of :func:`~meganeura.models.llama.llama_lm`.
    Whisper: the encoder's parameters; our classification ``head`` is not in HF checkpoints and
    may be missing (unless ``strict_head``) — it keeps its initialization then.
    ``num_classes`` sets the Whisper head size (default 64)."""
    hf_cfg, tensors = read_folder(folder)
    mt = hf_cfg.get("model_type")
    if mt == "whisper":
        from ..models.whisper import whisper_encoder

        cfg = config_from_hf(hf_cfg, **({"num_classes": num_classes} if num_classes else {}))
        expected = _expected(whisper_encoder(cfg, 1, loss=False).graph)
        allow = () if strict_head else ("head.weight", "head.bias")
        params = map_params(tensors, expected, _whisper_rename(cfg, tensors), allow)
        return HFModel("whisper", cfg, params, hf_cfg)
    cfg = config_from_hf(hf_cfg)
    if mt == "bert":
        from ..models.bert import bert_encoder

        expected = _expected(bert_encoder(cfg, 1, 2).graph)
        return HFModel("bert", cfg, map_params(tensors, expected, _bert_rename), hf_cfg)
    from ..models.llama import llama_lm

    expected = _expected(llama_lm(cfg, 1, 2, loss=False).graph)
    return HFModel("llama", cfg, map_params(tensors, expected, _llama_rename(cfg)), hf_cfg)


def save_hf(folder, params: Mapping[str, np.ndarray], config: Mapping | object,
            dtype: str = "f32", max_shard_bytes: int | None = None,
            prefix: str = "") -> None:
    """Write an HF-style folder: ``config.json`` (a dict, or a config with ``to_hf()``) and
    ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` plus the index when
    the tensors exceed ``max_shard_bytes``.  ``prefix`` is prepended to every name (e.g.
    ``"model."`` for Whisper)."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    cfg = config.to_hf() if hasattr(config, "to_hf") else dict(config)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tensors = {prefix + k: np.asarray(v) for k, v in params.items()}
    if not max_shard_bytes:
        write_safetensors(os.path.join(folder, SINGLE), tensors, dtype)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nb = tensors[name].nbytes
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nb
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(folder, fn), shard, dtype)
        weight_map.update({n: fn for n in shard})
    total = sum(v.nbytes for v in tensors.values())
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
