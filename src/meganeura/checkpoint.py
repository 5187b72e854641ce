"""Checkpoints: safetensors files holding parameters, optimizer state (incl. the step counter that
drives LR schedules), the step and a fingerprint of the model graph.

Writes are atomic: a temp file in the same directory, fsynced, then renamed over the target, so
a crash leaves either the old or the new checkpoint, never a torn one.  Loads validate every
tensor (names, shapes, dtypes, finiteness of the file) before returning anything."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

import numpy as np

from .errors import CheckpointError
from .graph import TensorType

FORMAT = "meganeura-checkpoint-1"


def save_checkpoint(path, tensors: Mapping[str, np.ndarray], fingerprint: str, step: int) -> None:
    from safetensors.numpy import save

    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # safetensors' numpy writer stores rank-0 arrays as shape [1]: remember which were scalars
    scalars = sorted(k for k, v in tensors.items() if np.ndim(v) == 0)
    meta = {"format": FORMAT, "fingerprint": fingerprint, "step": str(int(step)),
            "scalars": ",".join(scalars)}
    data = save({k: np.ascontiguousarray(v).reshape(np.shape(v) or (1,))
                 for k, v in tensors.items()}, metadata=meta)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def read_checkpoint(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors and the metadata of a checkpoint file; CheckpointError if unreadable."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises several types for truncated/corrupt files
        raise CheckpointError(f"checkpoint {path!r} is corrupt or truncated: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a meganeura checkpoint (format "
                              f"{meta.get('format')!r})")
    for k in filter(None, meta.get("scalars", "").split(",")):
        if k in tensors and tensors[k].size == 1:
            tensors[k] = tensors[k].reshape(())
    return tensors, meta


def load_checkpoint(path, expected: Mapping[str, TensorType], fingerprint: str,
                    strict_fingerprint: bool = True) -> tuple[dict[str, np.ndarray], int]:
    tensors, meta = read_checkpoint(path)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    wrong = [f"{n}: file {tensors[n].dtype}{list(tensors[n].shape)} vs graph {t}"
             for n, t in expected.items()
             if n in tensors and (tensors[n].shape != t.shape or tensors[n].dtype != t.dtype.np)]
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if extra:
            parts.append(f"unexpected tensors {extra}")
        if wrong:
            parts.append("mismatched tensors [" + "; ".join(wrong) + "]")
        raise CheckpointError(f"checkpoint {os.fspath(path)!r} does not match this graph: "
                              + ", ".join(parts))
    if strict_fingerprint and meta.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {os.fspath(path)!r} was written by a different graph (fingerprint "
            f"{meta.get('fingerprint')} vs {fingerprint}); pass strict_fingerprint=False to load "
            "matching tensors anyway")
    try:
        step = int(meta.get("step", "0"))
    except ValueError:
        raise CheckpointError(f"checkpoint {os.fspath(path)!r} has a bad step entry") from None
    return tensors, step
