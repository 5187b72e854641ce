"""runtime/device.py ``Device.pipelines``: a plan's distinct pipelines created together
(threads on wgpu-native, asynchronous creation on Dawn, or one after the other), with the same
results, errors and cache state whatever the mode."""

import threading
import time
from collections import OrderedDict

import numpy as np
import pytest

from meganeura.errors import DeviceError, LimitError
from meganeura.kernels import KernelSpec
from meganeura.runtime import device as devmod
from meganeura.runtime.device import pipeline_key

MODES = ("sequential", "threads", "async")

SRC = """
@group(0) @binding(0) var<storage, read_write> b0: array<f32>;
@compute @workgroup_size(4)
fn main(@builtin(global_invocation_id) g: vec3<u32>) { b0[g.x] = b0[g.x] * 2.0 + VAL; }
"""


def _specs(values, name="k"):
    """One kernel per value (distinct WGSL each), named ``{name}{i}``."""
    return [KernelSpec(f"{name}{i}", SRC.replace("VAL", v), 1, (1, 1, 1))
            for i, v in enumerate(values)]


@pytest.fixture
def fresh(dev, monkeypatch):
    """``dev`` with an empty pipeline cache (restored afterwards) and a counter of the
    pipelines the driver is asked to create (by kernel label)."""
    monkeypatch.setattr(dev, "_pipelines", OrderedDict())
    monkeypatch.setattr(dev, "pipeline_cache_size", 256)
    made, lock = [], threading.Lock()

    def counting(real):
        def create(**kw):
            with lock:
                made.append(kw["label"])
            return real(**kw)
        return create

    for name in ("create_compute_pipeline", "create_compute_pipeline_async"):
        monkeypatch.setattr(dev.device, name, counting(getattr(dev.device, name)))
    dev.made = made
    yield dev
    del dev.made


# --------------------------------------------------------------------------- the knobs


def test_create_mode_from_the_environment(monkeypatch):
    monkeypatch.delenv(devmod.PIPELINE_CREATE_VAR, raising=False)
    assert devmod.pipeline_create_mode("wgpu") == "threads"
    assert devmod.pipeline_create_mode("dawn") == "async"
    for raw, want in ((" Sequential ", "sequential"), ("async", "async"), ("threads", "threads")):
        monkeypatch.setenv(devmod.PIPELINE_CREATE_VAR, raw)
        assert devmod.pipeline_create_mode("wgpu") == want
    monkeypatch.setenv(devmod.PIPELINE_CREATE_VAR, "threads")
    with pytest.raises(DeviceError, match="not safe on Dawn"):
        devmod.pipeline_create_mode("dawn")
    # an explicit mode wins over the environment, and is checked the same way
    assert devmod.pipeline_create_mode("wgpu", "Async") == "async"
    with pytest.raises(DeviceError, match="not safe on Dawn"):
        devmod.pipeline_create_mode("dawn", "threads")
    monkeypatch.setenv(devmod.PIPELINE_CREATE_VAR, "parallel")
    with pytest.raises(DeviceError, match="MEGANEURA_PIPELINE_CREATE must be one of"):
        devmod.pipeline_create_mode("wgpu")


def test_thread_count_from_the_environment(monkeypatch):
    monkeypatch.delenv(devmod.PIPELINE_THREADS_VAR, raising=False)
    assert 1 <= devmod.pipeline_threads() <= devmod.DEFAULT_PIPELINE_THREADS
    monkeypatch.setenv(devmod.PIPELINE_THREADS_VAR, "3")
    assert devmod.pipeline_threads() == 3
    for bad in ("0", "-2", "four"):
        monkeypatch.setenv(devmod.PIPELINE_THREADS_VAR, bad)
        with pytest.raises(DeviceError, match="MEGANEURA_PIPELINE_THREADS"):
            devmod.pipeline_threads()


def test_unknown_mode_argument(fresh):
    with pytest.raises(DeviceError, match="creation mode must be one of"):
        fresh.pipelines(_specs(["1.0", "2.0"]), mode="parallel")
    assert fresh.made == []


# --------------------------------------------------------------------------- batches


@pytest.mark.parametrize("mode", MODES)
def test_batch_dedupes_hits_cache_and_caches_in_plan_order(fresh, mode):
    """Each distinct kernel is created once; cached ones are reused; the cache ends in plan
    order whatever order the driver finished in."""
    a, b, c, d = _specs(["1.0", "2.0", "3.0", "4.0"])
    hit = fresh.pipeline(b)
    fresh.made.clear()
    out = fresh.pipelines([a, b, c, a, d, c], mode=mode)
    assert sorted(fresh.made) == ["k0", "k2", "k3"]
    assert out[pipeline_key(b)] is hit and len(out) == 4
    assert [k[0] for k in fresh._pipelines] == [s.wgsl for s in (b, a, c, d)]
    fresh.made.clear()
    again = fresh.pipelines([d, c, b, a], mode=mode)
    assert fresh.made == [] and all(again[k] is out[k] for k in out)


def test_threads_really_overlap(fresh, monkeypatch):
    """Mode ``threads`` runs creations at the same time on worker threads (a slow driver
    call is simulated: the GIL is free during it, as during the real C call)."""
    monkeypatch.setenv(devmod.PIPELINE_THREADS_VAR, "4")
    spans, real = [], fresh.device.create_compute_pipeline

    def slow(**kw):
        t0 = time.perf_counter()
        time.sleep(0.05)
        pipe = real(**kw)
        spans.append((t0, time.perf_counter(), threading.get_ident()))
        return pipe

    monkeypatch.setattr(fresh.device, "create_compute_pipeline", slow)
    fresh.pipelines(_specs([f"{i}.5" for i in range(8)]), mode="threads")
    assert len({t for _, _, t in spans}) > 1 and threading.get_ident() not in {
        t for _, _, t in spans}
    spans.sort()
    assert any(s1 < e0 for (_, e0, _), (s1, _, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("mode", MODES)
def test_bad_wgsl_among_many_names_the_first_bad_kernel(fresh, mode):
    """Two kernels the compiler refuses among valid ones: the first in plan order raises,
    with the message ``pipeline`` gives (driver message + numbered WGSL); valid kernels before
    it are cached."""
    specs = _specs(["1.0", "2.0", "undefined_a", "3.0", "undefined_b", "4.0"])
    with pytest.raises(DeviceError) as e:
        fresh.pipelines(specs, mode=mode)
    msg = str(e.value)
    assert "kernel 'k2'" in msg and "undefined_a" in msg and "--- WGSL ---" in msg
    assert "kernel 'k4'" not in msg and not isinstance(e.value, LimitError)
    assert e.value.__cause__ is not None
    cached = {k[0] for k in fresh._pipelines}
    assert {specs[0].wgsl, specs[1].wgsl} <= cached
    assert specs[2].wgsl not in cached and specs[4].wgsl not in cached
    if mode == "sequential":  # nothing after the error is created
        assert "k3" not in fresh.made and "k5" not in fresh.made


def test_limits_checked_before_any_creation(fresh):
    """A kernel over the device's limits anywhere in the batch raises LimitError before the
    driver compiles anything."""
    specs = _specs(["1.0", "2.0", "3.0"])
    maxwg = fresh.limits["max_compute_workgroups_per_dimension"]
    specs.append(KernelSpec("huge", SRC.replace("VAL", "9.0"), 1, (maxwg + 1, 1, 1)))
    with pytest.raises(LimitError, match="'huge'.*per dimension"):
        fresh.pipelines(specs, mode="threads")
    assert fresh.made == [] and not fresh._pipelines


# --------------------------------------------------------------------------- whole programs


def _train(dev, mode, monkeypatch):
    """Two SGD steps of a small MLP whose pipelines were all created in ``mode`` (empty
    cache first): losses, parameters and the stream's distinct pipeline count."""
    import meganeura as mn
    from meganeura import optim
    from meganeura.models.mlp import mlp_classifier

    monkeypatch.setenv(devmod.PIPELINE_CREATE_VAR, mode)
    monkeypatch.setattr(dev, "_pipelines", OrderedDict())
    m = mlp_classifier(8, in_dim=12, hidden=(16, 16), classes=5)
    s = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                   optimizer=optim.SGD(lr=0.1), device=dev)
    s.init_params(seed=3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 12)).astype(np.float32)
    y = rng.integers(0, 5, 8).astype(np.int32)
    losses = [s.step(x=x, y=y).loss for _ in range(2)]
    assert set(s.train.build_times) == {"pipelines", "commands"}
    n = len({id(c.pipeline) for c in s.train.commands if hasattr(c, "pipeline")})
    return losses, s.get_params(), s.run(x=x)["logits"], n


def test_modes_give_bit_identical_programs(dev, monkeypatch):
    """The same training program compiled with each creation mode computes bit-identical
    losses, parameters and outputs."""
    ref_losses, ref_params, ref_logits, n = _train(dev, "sequential", monkeypatch)
    assert n >= 4  # enough distinct pipelines for concurrency to matter
    for mode in ("threads", "async"):
        losses, params, logits, _ = _train(dev, mode, monkeypatch)
        assert losses == ref_losses
        np.testing.assert_array_equal(logits, ref_logits)
        for k, v in ref_params.items():
            np.testing.assert_array_equal(params[k], v, err_msg=f"{mode}: {k}")
