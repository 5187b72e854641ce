"""The tuner: candidates timed on the device, the fastest kept in an on-disk cache keyed by
device, kernels source and description; corrupt or outdated caches never break a compile."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

import meganeura as mn
from meganeura import kernels
from meganeura.compile import tune
from meganeura.compile.memory import KernelOp, Plan
from meganeura.compile.tune import TuneReport, TuningCache, tune_mode, tune_plan
from meganeura.graph import TensorType
from meganeura.kernels.common import (
    WG,
    Bindings,
    flat_index,
    make_grid,
    make_target,
    module_header,
    module_source,
)
from meganeura.ops._common import defop
from meganeura.ops.lowering import Kernel

TARGET = make_target()


@dataclass(frozen=True)
class TwiceKernel:
    """y = 2·x over n elements; ``per_thread`` (1 or 4) is a tuning field: same result."""

    n: int
    per_thread: int = 1
    name: str = "toy_twice"


def _emit(k: TwiceKernel, limits=None, features=None, alias=None):
    t = make_target(limits, features)
    bd = Bindings([mn.f32, mn.f32], alias)
    per = k.per_thread
    grid = make_grid(k.name, -(-k.n // (WG * per)), t)
    body = flat_index(grid, -(-k.n // per), "    ")
    for j in range(per):
        body.append(f"    if (i * {per}u + {j}u < {k.n}u) {{ {bd.name(1)}[i * {per}u + {j}u] = "
                    f"2.0 * {bd.name(0)}[i * {per}u + {j}u]; }}")
    src = module_source(module_header(False) + bd.decls(), (), WG, body)
    return kernels.KernelSpec(k.name, src, bd.n, grid.workgroups)


def _candidates(desc, target):
    return [TwiceKernel(desc.n, 1), TwiceKernel(desc.n, 4)]


def _register_once():
    if "toy_twice" in kernels.families():
        return
    kernels.register("toy_twice", TwiceKernel, _emit, contiguous_inputs=True,
                     make=lambda attrs, ins, outs: TwiceKernel(max(outs[0].size, 1)),
                     candidates=_candidates)
    defop("toy_twice", lambda types, a: [TensorType(types[0].shape, types[0].dtype)],
          lambda xs, a: [(2 * xs[0]).astype(xs[0].dtype)], None, Kernel("toy_twice"))


def _plan(n=1000):
    from meganeura.compile.executable import Loc

    binds = [Loc("input", "x", 0, 4 * n), Loc("out", "y", 0, 4 * n)]
    return Plan(kernels=[KernelOp(TwiceKernel(n), binds, "twice")])


def test_modes_from_the_option_and_the_environment(monkeypatch):
    monkeypatch.delenv("MEGANEURA_TUNE", raising=False)
    assert tune_mode(None) == "cache"
    monkeypatch.setenv("MEGANEURA_TUNE", "1")
    assert tune_mode(None) is True
    monkeypatch.setenv("MEGANEURA_TUNE", "0")
    assert tune_mode(None) is False
    monkeypatch.setenv("MEGANEURA_TUNE", "always")
    with pytest.raises(mn.GraphBuildError, match="MEGANEURA_TUNE must be 0, 1 or cache"):
        tune_mode(None)
    with pytest.raises(mn.GraphBuildError, match="tune must be True, False or 'cache'"):
        tune_mode("yes")


def test_the_fastest_candidate_is_chosen_and_cached(tmp_path):
    _register_once()
    cache = TuningCache(tmp_path / "t.json")
    calls = []

    def timer(spec, sizes):  # pretend 4 per thread is faster
        calls.append(sizes)
        return 1e-6 if "i * 4u" in spec.wgsl else 2e-6

    rep = TuneReport()
    plan = tune_plan(_plan(), TARGET, True, "dev-a", cache, timer, rep)
    assert plan.kernels[0].desc.per_thread == 4 and rep.timed == 1 and rep.changed == 1
    assert calls == [[4000, 4000], [4000, 4000]]
    cache.save()
    again = TuningCache(tmp_path / "t.json")
    rep2 = TuneReport()
    plan2 = tune_plan(_plan(), TARGET, "cache", "dev-a", again, None, rep2)
    assert plan2.kernels[0].desc.per_thread == 4 and rep2.cached == 1 and rep2.timed == 0
    # another device, or another kernels source: a miss, heuristic default kept
    rep3 = TuneReport()
    assert tune_plan(_plan(), TARGET, "cache", "dev-b", again, None, rep3).kernels[0].desc \
        .per_thread == 1
    assert rep3.untuned == 1


def test_kernel_source_changes_invalidate_entries(tmp_path, monkeypatch):
    _register_once()
    cache = TuningCache(tmp_path / "t.json")
    tune_plan(_plan(), TARGET, True, "dev", cache, lambda s, z: 1.0 if "4u" in s.wgsl else 2.0,
              TuneReport())
    monkeypatch.setattr(tune, "_KERNELS_FINGERPRINT", "something-else")
    rep = TuneReport()
    assert tune_plan(_plan(), TARGET, "cache", "dev", cache, None, rep).kernels[0].desc \
        .per_thread == 1
    assert rep.untuned == 1 and rep.cached == 0


@pytest.mark.parametrize("content", ["{not json", '{"version": 999, "entries": {}}', "[]",
                                     '{"version": 1, "entries": 3}'])
def test_a_corrupt_cache_is_set_aside(tmp_path, content):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.warns(UserWarning, match="unreadable"):
        cache = TuningCache(path)
    assert cache.entries == {} and not path.exists()
    assert (tmp_path / "t.json.corrupt").read_text() == content


def test_saves_are_atomic_and_leave_no_temp_files(tmp_path):
    cache = TuningCache(tmp_path / "sub" / "t.json")
    cache.put("dev", TwiceKernel(8), TwiceKernel(8, 4), [2.0, 1.0])
    cache.save()
    data = json.loads((tmp_path / "sub" / "t.json").read_text())
    assert data["version"] == tune.CACHE_VERSION and len(data["entries"]) == 1
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["t.json"]


def test_compile_tunes_on_the_device_then_reuses_the_cache(gpu, tmp_path, monkeypatch):
    """The real path on lavapipe (a tiny space): tune=True times both configurations, the
    next compile finds them in the cache; results are right either way."""
    _register_once()
    monkeypatch.setenv("MEGANEURA_TUNE_CACHE", str(tmp_path / "t.json"))
    g = mn.Graph("twice")
    x = g.input("x", (3000,))
    y = g.apply("toy_twice", x)
    xb = np.arange(3000, dtype=np.float32)
    s = mn.compile(g, outputs={"y": y}, tune=True)
    assert s.tuning.timed == 1
    np.testing.assert_array_equal(s.run(x=xb)["y"], 2 * xb)
    s2 = mn.compile(g, outputs={"y": y})  # default mode "cache"
    assert s2.tuning.cached == 1 and s2.tuning.timed == 0
    np.testing.assert_array_equal(s2.run(x=xb)["y"], 2 * xb)
    s3 = mn.compile(g, outputs={"y": y}, tune=False)
    assert s3.tuning.cached == 0
