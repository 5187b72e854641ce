"""Export a compiled program and run it again without the compiler (``sess.export(path)``,
``mn.load_program(path)``; the browser runtime in web/ reads the same files).

An artifact is a folder:
  manifest.json       the Executable (compile/executable.py ``to_manifest``) plus the program's
                      interface: feeds per stream, value ranges, outputs, fingerprint, version
  kernels/NNN.wgsl    each distinct WGSL module once
  weights.safetensors parameters, states and constants (their current values); with
                      ``weights="f16"`` the f32 parameters are stored as f16 (half the
                      download) and upcast to f32 on load (listed in ``program.stored_f16``;
                      states and constants stay exact)
It is written to a temporary folder beside the target and renamed into place, so a reader never
sees half an artifact.  Loading needs numpy, safetensors and a WebGPU implementation: no graph,
no ops, no torch."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..compile.executable import FORMAT_VERSION, from_manifest, tensor_type, to_manifest
from ..errors import CheckpointError, FeedError
from ..graph import TensorType, ValueRange
from .executable import GPUStream, PinnedBuffers

MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


WEIGHT_FORMATS = ("f32", "f16")
F16_MAX = float(np.finfo(np.float16).max)


def export_session(sess, path: str | os.PathLike, weights: str = "f32") -> Path:
    """Write ``sess`` (a GPUSession) as an artifact folder at ``path`` (replaced if present).
    ``weights="f16"`` stores the f32 parameters as f16 (the program still computes in f32)."""
    from safetensors.numpy import save_file

    from .. import __version__

    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"export: weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    manifest, modules = to_manifest(sess.executable)
    prog = sess.program
    manifest["program"] = {
        "meganeura_version": __version__,
        "fingerprint": prog.model_fingerprint,
        "feeds": {"train": _types(prog.feeds) if prog.training else {},
                  "infer": _types(prog.inference_feeds()) if prog.outputs else {}},
        "outputs": list(prog.outputs),
        "has_loss": prog.loss is not None,
        "persistent": list(prog.persistent),
        "feed_ranges": {n: [[r.lo, r.hi, list(r.also), r.what] for r in rs]
                        for n, rs in sess.feed_ranges.items()},
    }
    tensors = dict(sess.get_state())
    halves = _to_f16(tensors, sess.param_names) if weights == "f16" else []
    manifest["program"]["stored_f16"] = halves
    tensors.update({n: lf.data for n, lf in sess.executable.leaves.items()
                    if lf.kind == "constant"})
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        (tmp / "kernels").mkdir()
        for i, src in enumerate(modules):
            (tmp / "kernels" / f"{i:03d}.wgsl").write_text(src)
        save_file({n: np.ascontiguousarray(v) for n, v in tensors.items()}, str(tmp / WEIGHTS))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _publishable(tmp)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _to_f16(tensors: dict[str, np.ndarray], params: list[str]) -> list[str]:
    """Round the f32 parameters of ``tensors`` to f16 in place; their names.  A parameter
    beyond f16's range would load as inf, so it is refused, by name."""
    names = [n for n in params if tensors[n].dtype == np.float32]
    for n in names:
        big = float(np.abs(tensors[n]).max(initial=0.0))
        if big > F16_MAX:
            raise ValueError(f"export(weights='f16'): parameter {n!r} holds {big:g}, beyond "
                             f"f16's range ({F16_MAX:g}); export it with weights='f32'")
        tensors[n] = tensors[n].astype(np.float16)
    return names


def _types(feeds: Mapping[str, TensorType]) -> dict:
    return {n: {"shape": list(t.shape), "dtype": t.dtype.name} for n, t in feeds.items()}


def _publishable(folder: Path) -> None:
    """The usual permissions (mkdtemp makes the folder private, safetensors the weights): a
    web server running as another user must be able to read the artifact it serves."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for d, dirs, files in os.walk(folder):
        for n in dirs:
            os.chmod(os.path.join(d, n), 0o777 & ~umask)
        for n in files:
            os.chmod(os.path.join(d, n), 0o666 & ~umask)


def _replace_dir(tmp: Path, target: Path) -> None:
    """Move the finished folder into place; an older artifact is removed only afterwards."""
    old = None
    if target.exists():
        if not target.is_dir() or not (target / MANIFEST).exists():
            raise CheckpointError(f"export: {os.fspath(target)!r} exists and is not a "
                                  "meganeura artifact; refusing to replace it")
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_program(path: str | os.PathLike, backend: str | None = None, device=None):
    """An exported artifact, ready to ``run`` (and ``step`` if it was a training program)."""
    return LoadedProgram(path, backend, device)


class LoadedProgram:
    """A program loaded from an artifact: the runtime alone executes it."""

    def __init__(self, path, backend: str | None = None, device=None):
        from .device import as_device

        self.path = Path(path)
        manifest, modules, weights = _read_artifact(self.path)
        self.manifest = manifest
        info = manifest["program"]
        constants = {n: weights[n] for n, d in manifest["leaves"].items()
                     if d["kind"] == "constant"}
        self.executable = from_manifest(manifest, modules, constants)
        self.dev = as_device(device, backend)
        self.buffers = PinnedBuffers(self.dev, self.executable, {})
        self.streams = {tag: GPUStream(self.dev, s, self.buffers)
                        for tag, s in (("train", self.executable.train),
                                       ("infer", self.executable.infer)) if s is not None}
        self.feeds = {tag: {n: tensor_type(d) for n, d in f.items()}
                      for tag, f in info["feeds"].items()}
        self.ranges = {n: [ValueRange(lo, hi, tuple(also), what) for lo, hi, also, what in rs]
                       for n, rs in info["feed_ranges"].items()}
        self.outputs = list(info["outputs"])
        self.buffers.write({n: weights[n] for n in info["persistent"]})

    def run(self, **feeds) -> dict[str, np.ndarray]:
        """Inference: the named outputs for these feeds."""
        return self._submit("infer", feeds)()

    def step(self, **feeds) -> dict[str, np.ndarray]:
        """One training step (update applied); returns loss (``__loss__``) and outputs."""
        return self._submit("train", feeds)()

    def get_state(self) -> dict[str, np.ndarray]:
        return self.buffers.read(self.manifest["program"]["persistent"])

    def _submit(self, tag: str, feeds):
        from .session import check_feeds

        if tag not in self.streams:
            what = "inference (no outputs)" if tag == "infer" else "training"
            raise FeedError(f"this artifact has no {what} stream")
        arrays = check_feeds(self.feeds[tag], feeds, True, self.ranges)
        self.buffers.write(arrays)
        return self.streams[tag].submit()



def _read_artifact(path: Path):
    """(manifest, WGSL modules, weights), every problem a CheckpointError naming the file."""
    from safetensors.numpy import load_file

    mf = path / MANIFEST
    if not mf.is_file():
        raise CheckpointError(f"{os.fspath(path)!r} is not a meganeura artifact (no {MANIFEST})")
    try:
        manifest = json.loads(mf.read_text())
        if manifest.get("version") != FORMAT_VERSION or "program" not in manifest:
            raise ValueError(f"format version {manifest.get('version')!r} (this meganeura "
                             f"reads {FORMAT_VERSION})")
        n_modules = 1 + max((op["module"] for s in manifest["streams"].values()
                             for op in s["ops"] if "module" in op), default=-1)
        modules = [(path / "kernels" / f"{i:03d}.wgsl").read_text() for i in range(n_modules)]
        weights = load_file(str(path / WEIGHTS))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"artifact {os.fspath(path)!r} is unreadable: {e}") from e
    missing = [n for n in manifest["program"]["persistent"] if n not in weights]
    if missing:
        raise CheckpointError(f"artifact {os.fspath(path)!r}: {WEIGHTS} lacks {missing[:5]}")
    return manifest, modules, _upcast(path, manifest, weights)


def _upcast(path: Path, manifest: dict, weights: dict[str, np.ndarray]) -> dict:
    """The f16-stored parameters (``program.stored_f16``) back as the f32 the program reads."""
    for n in manifest["program"].get("stored_f16", []):
        if weights.get(n) is None or weights[n].dtype != np.float16:
            got = "absent" if weights.get(n) is None else str(weights[n].dtype)
            raise CheckpointError(f"artifact {os.fspath(path)!r}: {WEIGHTS}: {n!r} should be "
                                  f"stored as f16 (manifest stored_f16), it is {got}")
        weights[n] = weights[n].astype(np.float32)
    return weights
