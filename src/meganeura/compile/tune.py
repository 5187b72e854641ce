"""Search-based tuning: each kernel family offers a few configurations of a description
(``kernels.candidates``); the fastest one on this device is found by timing them, and kept in
an on-disk cache so later compiles only look it up.

Modes (``compile(tune=…)``, ``$MEGANEURA_TUNE``): ``"cache"`` (default) uses cached choices and
the family's heuristic default elsewhere, so an untuned compile costs nothing extra; ``True``
(``MEGANEURA_TUNE=1``) times every description that has no cache entry and saves the winners;
``False`` (``MEGANEURA_TUNE=0``) ignores the cache.

Cache keys: the device (implementation, adapter, driver description), a fingerprint of the
kernels package's source (any change to an emitter invalidates its entries) and the
description.  A corrupt cache file is set aside (``.corrupt``) and tuning starts afresh."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import kernels
from ..errors import GraphBuildError
from ..kernels.common import Target
from .memory import KernelOp, Plan

CACHE_VERSION = 1
MODES = ("cache", True, False)

# timer(spec, buffer byte sizes per binding slot) -> seconds per dispatch
Timer = Callable[[object, list[int]], float]


def tune_mode(option) -> str | bool:
    """The tuning mode from ``compile(tune=…)`` or, when None, ``$MEGANEURA_TUNE``."""
    if option is None:
        env = os.environ.get("MEGANEURA_TUNE", "").strip().lower()
        option = {"": "cache", "cache": "cache", "1": True, "true": True, "0": False,
                  "false": False}.get(env, env)
        if option not in MODES:
            raise GraphBuildError(f"$MEGANEURA_TUNE must be 0, 1 or cache, got {env!r}")
    if option not in MODES:
        raise GraphBuildError(f"tune must be True, False or 'cache', got {option!r}")
    return option


def default_cache_path() -> Path:
    env = os.environ.get("MEGANEURA_TUNE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meganeura" / "tuning.json"


_KERNELS_FINGERPRINT: str | None = None


def kernels_fingerprint() -> str:
    """Hash of the kernels package's source: a cached choice is only valid for the emitters
    that were timed."""
    global _KERNELS_FINGERPRINT
    if _KERNELS_FINGERPRINT is None:
        h = hashlib.sha1(str(CACHE_VERSION).encode())
        for f in sorted(Path(kernels.__file__).parent.glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
        _KERNELS_FINGERPRINT = h.hexdigest()[:16]
    return _KERNELS_FINGERPRINT


class TuningCache:
    """Chosen configurations on disk: ``{key: {"choice": repr, "us": [...]}}`` (JSON)."""

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else default_cache_path()
        self.entries: dict[str, dict] = self._load()
        self.dirty = False

    def _load(self) -> dict:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or \
                    not isinstance(data.get("entries"), dict):
                raise ValueError("unknown layout or version")
            return data["entries"]
        except (OSError, ValueError) as e:
            bad = self.path.with_name(self.path.name + ".corrupt")
            warnings.warn(f"tuning cache {self.path} is unreadable ({e}); moved to {bad}, "
                          "starting afresh", stacklevel=2)
            try:
                os.replace(self.path, bad)
            except OSError:
                pass
            return {}

    @staticmethod
    def key(device_key: str, desc) -> str:
        text = f"{device_key}|{kernels_fingerprint()}|{desc!r}"
        return hashlib.sha1(text.encode()).hexdigest()

    def get(self, device_key: str, desc) -> dict | None:
        return self.entries.get(self.key(device_key, desc))

    def put(self, device_key: str, desc, choice, times_us: list[float]) -> None:
        self.entries[self.key(device_key, desc)] = {
            "choice": repr(choice), "us": [round(t, 3) for t in times_us],
            "family": type(desc).__name__}
        self.dirty = True

    def save(self) -> None:
        """Atomic write (temp file in the same folder, then rename)."""
        if not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tuning-", dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "entries": self.entries}, f, indent=0)
        os.replace(tmp, self.path)
        self.dirty = False


@dataclass
class TuneReport:
    """What tuning did for one compile (``session.tuning``)."""

    cached: int = 0  # descriptions whose choice came from the cache
    timed: int = 0  # descriptions timed now
    untuned: int = 0  # descriptions with candidates but no entry (mode "cache")
    changed: int = 0  # kernels whose configuration differs from the heuristic default


def tune_plan(plan: Plan, target: Target, mode, device_key: str, cache: TuningCache | None,
              timer: Timer | None, report: TuneReport) -> Plan:
    """``plan`` with each kernel description replaced by its tuned configuration."""
    if mode is False or cache is None or (mode == "cache" and not cache.entries):
        return plan
    chosen: dict = {}
    kernels_out = []
    for k in plan.kernels:
        if isinstance(k, KernelOp):
            if k.desc not in chosen:
                chosen[k.desc] = _choose(k, target, mode, device_key, cache, timer, report)
            if chosen[k.desc] is not k.desc:
                report.changed += 1
                k = dataclasses.replace(k, desc=chosen[k.desc])
        kernels_out.append(k)
    return dataclasses.replace(plan, kernels=kernels_out)


def _choose(k: KernelOp, target: Target, mode, device_key: str, cache: TuningCache,
            timer: Timer | None, report: TuneReport):
    cands = kernels.candidates(k.desc, target)
    if len(cands) < 2:
        return k.desc
    entry = cache.get(device_key, k.desc)
    if entry is not None:
        for c in cands:
            if repr(c) == entry["choice"]:
                report.cached += 1
                return c if c != k.desc else k.desc
    if mode is not True or timer is None:
        report.untuned += 1
        return k.desc
    times = [_time_candidate(c, k.binds, target, timer) for c in cands]
    best = min(range(len(cands)), key=times.__getitem__)
    cache.put(device_key, k.desc, cands[best], [t * 1e6 for t in times])
    report.timed += 1
    return cands[best] if best else k.desc


def _time_candidate(desc, binds, target: Target, timer: Timer) -> float:
    """Seconds per dispatch of one configuration (inf when it fails to emit or compile)."""
    alias = kernels.binding_aliases(binds)
    try:
        spec = kernels.emit(desc, target.limits, target.features, alias=alias)
    except kernels.CodegenError:
        return float("inf")
    sizes = [b.nbytes for i, b in enumerate(binds) if alias[i] == i]
    return timer(spec, sizes)
