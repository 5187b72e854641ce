"""Checkpoints: safetensors files holding parameters, optimizer state (incl. the step counter that
drives LR schedules), the step and a fingerprint of the model graph.

Writes are atomic: a temp file in the same directory (named after the target and the writing
process), fsynced, then renamed over the target, and the directory fsynced, so a crash leaves
either the old or the new checkpoint, never a torn one.  Temp files that a killed save left
behind for the same target are removed by the next save.  Files get the permissions the umask
gives (like every other output), not the 0600 of ``tempfile.mkstemp``.

Each tensor's bytes carry a CRC-32 in the metadata; loads verify it (files written before
checksums existed still load), validate every tensor (names, shapes, dtypes, finiteness) and
the step before returning anything.  Saves refuse non-finite tensors too, so a diverged run
cannot overwrite the last good checkpoint."""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import zlib
from collections.abc import Mapping

import numpy as np

from .errors import CheckpointError
from .graph import TensorType

FORMAT = "meganeura-checkpoint-1"
MAX_STEP = 2**53  # beyond this a float64 step counter can no longer count by ones
_RESERVED = frozenset({"format", "fingerprint", "step", "scalars", "crc32"})
_ACTIVE: set[str] = set()  # temp files this process is writing right now
_ACTIVE_LOCK = threading.Lock()


def _crc(arr: np.ndarray) -> str:
    """CRC-32 of a tensor's little-endian bytes (what safetensors stores), as 8 hex digits."""
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return f"{zlib.crc32(a.tobytes()) & 0xFFFFFFFF:08x}"


def _check_finite(tensors: Mapping[str, np.ndarray], where: str) -> None:
    bad = []
    for k, v in tensors.items():
        v = np.asarray(v)
        if v.dtype.kind in "fc" and not np.isfinite(v).all():
            n = int(v.size - np.count_nonzero(np.isfinite(v)))
            bad.append(f"{k!r} ({n} of {v.size} values NaN/inf)")
    if bad:
        raise CheckpointError(f"{where}: non-finite tensors: " + ", ".join(sorted(bad)))


def _check_step(step, where: str) -> int:
    """The step as an int in [0, MAX_STEP]; a negative or absurd step means a corrupt file or
    a caller bug, and would silently derail LR schedules."""
    s = str(step).strip()
    if not re.fullmatch(r"\d{1,16}", s) or int(s) > MAX_STEP:
        raise CheckpointError(f"{where}: bad step {str(step)[:40]!r} (expected an integer from 0 "
                              f"to {MAX_STEP})")
    return int(s)


def save_checkpoint(path, tensors: Mapping[str, np.ndarray], fingerprint: str, step: int,
                    extra: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` atomically to ``path`` with the fingerprint, the step, per-tensor
    checksums and ``extra`` string metadata (e.g. the CLI's epoch; read back with
    :func:`read_checkpoint`)."""
    from safetensors.numpy import save

    path = os.fspath(path)
    step = _check_step(step, f"refusing to save checkpoint {path!r}")
    _check_finite(tensors, f"refusing to save checkpoint {path!r}")
    extra = dict(extra or {})
    clash = sorted(_RESERVED & set(extra))
    if clash or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise CheckpointError(f"extra checkpoint metadata must map str to str and avoid the "
                              f"reserved keys {sorted(_RESERVED)} (got {sorted(extra)})")
    # safetensors' numpy writer stores rank-0 arrays as shape [1]: remember which were scalars
    scalars = sorted(k for k, v in tensors.items() if np.ndim(v) == 0)
    stored = {k: np.ascontiguousarray(v).reshape(np.shape(v) or (1,)) for k, v in tensors.items()}
    meta = {**extra, "format": FORMAT, "fingerprint": fingerprint, "step": str(step),
            "scalars": ",".join(scalars),
            "crc32": json.dumps({k: _crc(v) for k, v in sorted(stored.items())})}
    if os.path.isdir(path):
        raise CheckpointError(f"cannot save checkpoint {path!r}: it is a directory")
    try:
        _write_atomic(path, save(stored, metadata=meta))
    except OSError as e:  # the OS's message would name the temp file, not the target
        err = OSError(f"cannot save checkpoint {path!r}: {e.strerror or e}")
        err.errno = e.errno
        raise err from e


def _write_atomic(path: str, data: bytes) -> None:
    """``data`` to ``path`` via a temp file in the same directory: write, fsync, rename,
    fsync the directory.  The temp file is created with mode 0666 so the umask applies."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    base = os.path.basename(path)
    _remove_stale_temps(directory, base)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        tmp = os.path.join(directory, f".tmp-{base}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
    with _ACTIVE_LOCK:
        _ACTIVE.add(tmp)
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
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(tmp)
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    """Make the rename itself durable (not possible on every OS/filesystem: best effort)."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _remove_stale_temps(directory: str, base: str) -> None:
    """Delete ``.tmp-<base>-<pid>-<random>`` files whose writer is gone (a save killed by
    SIGKILL or a power cut): from a dead process, or from this process but not being written
    now.  Files of live writers are left alone (on Windows the OS refuses to delete them)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        parts = name.rsplit("-", 2)
        if len(parts) != 3 or parts[0] != f".tmp-{base}" or not parts[1].isdigit():
            continue
        full = os.path.join(directory, name)
        if _writer_alive(int(parts[1]), full):
            continue
        try:
            os.unlink(full)
        except OSError:
            pass


def _writer_alive(pid: int, tmp: str) -> bool:
    if pid == os.getpid():
        with _ACTIVE_LOCK:
            return tmp in _ACTIVE
    if os.name == "nt":  # os.kill would terminate it; open files cannot be unlinked there
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but belongs to someone else
        return True
    return True


def read_metadata(path) -> dict[str, str]:
    """The metadata of a checkpoint file without reading its tensors (what the CLI stores
    beside the training state, e.g. the epoch to resume from)."""
    from safetensors import safe_open

    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is a directory, not a file")
    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path!r} does not exist") from None
    except Exception as e:  # safetensors raises several types for truncated/corrupt files
        raise CheckpointError(f"checkpoint {path!r} is corrupt or truncated: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a meganeura checkpoint (format "
                              f"{meta.get('format')!r})")
    return dict(meta)


def read_checkpoint(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors and the metadata of a checkpoint file, checksums and finiteness verified;
    CheckpointError if unreadable."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is a directory, not a file")
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
    _verify_checksums(path, tensors, meta)
    _check_finite(tensors, f"checkpoint {path!r}")
    for k in filter(None, meta.get("scalars", "").split(",")):
        if k in tensors and tensors[k].size == 1:
            tensors[k] = tensors[k].reshape(())
    return tensors, meta


def _verify_checksums(path: str, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]):
    """Compare every tensor with the CRC-32 saved for it (a flipped bit in the data section
    otherwise loads silently).  Files without a checksum table predate it and pass."""
    if "crc32" not in meta:
        return
    try:
        table = json.loads(meta["crc32"])
        if not isinstance(table, dict):
            raise ValueError("not an object")
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path!r} has a corrupt checksum table ({e})") from None
    unlisted = sorted(set(tensors) ^ set(table))
    if unlisted:
        raise CheckpointError(f"checkpoint {path!r}: tensors and checksum table disagree on "
                              f"{unlisted}")
    bad = sorted(k for k, v in tensors.items() if _crc(v) != table[k])
    if bad:
        raise CheckpointError(f"checkpoint {path!r} is corrupt: checksum mismatch in tensors "
                              f"{bad}")


def load_checkpoint(path, expected: Mapping[str, TensorType], fingerprint: str,
                    strict_fingerprint: bool = True) -> tuple[dict[str, np.ndarray], int]:
    """Tensors and step of a checkpoint, validated against ``expected`` names and types (and
    the graph fingerprint unless ``strict_fingerprint`` is off)."""
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
    step = _check_step(meta.get("step", "0"), f"checkpoint {os.fspath(path)!r}")
    return tensors, step
