"""runtime/device.py: implementation choice, adapter rules (never OpenGL), limits and features,
pipeline cache and compile errors, buffer helpers."""

import numpy as np
import pytest

from meganeura.dtypes import bool_, f16, f32, i32
from meganeura.errors import DeviceError, LimitError
from meganeura.kernels import Instr, KernelSpec, PointwiseKernel, Strided, emit
from meganeura.runtime import device as devmod
from meganeura.runtime.device import BackendNameError, get_device, resolve_backend

# --------------------------------------------------------------------------- backend names


def test_resolve_backend_env(monkeypatch):
    monkeypatch.delenv("MEGANEURA_WEBGPU", raising=False)
    assert resolve_backend(None) == "wgpu"
    for raw, want in (("wgpu", "wgpu"), (" DAWN ", "dawn"), ("auto", "auto"), ("", "wgpu"),
                      ("wgpu-native", "wgpu")):
        monkeypatch.setenv("MEGANEURA_WEBGPU", raw)
        assert resolve_backend(None) == want
    monkeypatch.setenv("MEGANEURA_WEBGPU", "vulkan")
    with pytest.raises(BackendNameError, match="MEGANEURA_WEBGPU"):
        resolve_backend(None)
    with pytest.raises(DeviceError, match="MEGANEURA_WEBGPU"):
        get_device()
    # an explicit argument wins over the environment
    assert resolve_backend("wgpu") == "wgpu"


def test_bad_backend_name():
    with pytest.raises(BackendNameError, match="expected one of wgpu, dawn, auto"):
        get_device("opengl")
    with pytest.raises(ValueError):  # BackendNameError is also a ValueError
        resolve_backend("cuda")
    with pytest.raises(BackendNameError):
        resolve_backend(3)


# --------------------------------------------------------------------------- adapters


class _FakeAdapter:
    def __init__(self, backend, adapter_type="CPU", name="llvmpipe"):
        self.info = {"backend_type": backend, "adapter_type": adapter_type, "device": name,
                     "description": "fake"}


class _FakeGPU:
    def __init__(self, adapters):
        self._adapters = adapters

    def enumerate_adapters_sync(self):
        return list(self._adapters)


def test_never_opengl(monkeypatch):
    import wgpu

    monkeypatch.setattr(wgpu, "gpu", _FakeGPU([_FakeAdapter("OpenGL")]))
    with pytest.raises(DeviceError) as e:
        devmod._open_wgpu()
    msg = str(e.value)
    assert "OpenGL" in msg and "llvmpipe" in msg
    assert "apt-get install mesa-vulkan-drivers libvulkan1" in msg
    monkeypatch.setattr(wgpu, "gpu", _FakeGPU([]))
    with pytest.raises(DeviceError, match="no adapters at all"):
        devmod._open_wgpu()


def test_adapter_preference():
    gl = _FakeAdapter("OpenGL", "DiscreteGPU", "gl")
    cpu = _FakeAdapter("Vulkan", "CPU", "llvmpipe")
    igpu = _FakeAdapter("Vulkan", "IntegratedGPU", "igpu")
    dgpu = _FakeAdapter("Vulkan", "DiscreteGPU", "dgpu")
    metal = _FakeAdapter("Metal", "IntegratedGPU", "m1")
    assert devmod._pick([gl, cpu, igpu, dgpu]) is dgpu
    assert devmod._pick([gl, cpu, igpu]) is igpu
    assert devmod._pick([cpu, metal]) is metal
    assert devmod._pick([gl]) is None


def test_dawn_missing_or_unusable_and_auto(monkeypatch, dev):
    try:
        import wgpudawn  # noqa: F401

        has_dawn = True
    except ImportError:
        has_dawn = False
    if not has_dawn:
        with pytest.raises(DeviceError, match="wgpudawn"):
            get_device("dawn")

    def no_dawn():
        raise DeviceError("no dawn here")

    monkeypatch.setattr(devmod, "_open_dawn", no_dawn)
    wgpu_dev = get_device("wgpu")
    monkeypatch.setattr(devmod, "_CACHE", {"wgpu": wgpu_dev})  # as if Dawn never opened
    assert devmod._open_auto() is wgpu_dev  # falls back to the cached wgpu device


# --------------------------------------------------------------------------- the device


def test_device_info(dev):
    assert get_device() is dev and get_device(dev.implementation) is dev
    assert dev.implementation in ("wgpu", "dawn")
    assert dev.backend_type.lower() in ("vulkan", "metal", "d3d12")
    d = dev.describe()
    for key in ("implementation", "backend_type", "adapter", "is_cpu", "features", "limits"):
        assert key in d
    lim = dev.limits
    for key in ("max_storage_buffer_binding_size", "max_buffer_size",
                "max_compute_workgroup_storage_size", "max_storage_buffers_per_shader_stage",
                "max_compute_workgroups_per_dimension", "max_compute_invocations_per_workgroup",
                "min_storage_buffer_offset_alignment"):
        assert isinstance(lim[key], int) and lim[key] > 0
    # the device got the adapter's real limits, not WebGPU's defaults
    alim = {k.replace("-", "_"): v for k, v in dict(dev.adapter.limits).items()}
    key = "max_storage_buffers_per_shader_stage"
    assert lim[key] == alim[key]
    assert lim["max_compute_workgroup_storage_size"] == alim["max_compute_workgroup_storage_size"]
    if "llvmpipe" in dev.adapter_name:
        assert dev.is_cpu
        assert dev.has_f16 and dev.has_subgroups and dev.has_timestamps  # GPU-NOTES


def _spec(wgsl, n=1, wg=(1, 1, 1), **meta):
    return KernelSpec("t", wgsl, n, wg, meta=meta)


SRC = """
@group(0) @binding(0) var<storage, read_write> b0: array<f32>;
@compute @workgroup_size(4)
fn main(@builtin(global_invocation_id) g: vec3<u32>) { b0[g.x] = b0[g.x] * 2.0 + VAL; }
"""


def test_pipeline_cache_and_dispatch(dev):
    spec = _spec(SRC.replace("VAL", "1.0"))
    p1 = dev.pipeline(spec)
    assert dev.pipeline(_spec(SRC.replace("VAL", "1.0"))) is p1
    assert dev.pipeline(_spec(SRC.replace("VAL", "2.0"))) is not p1
    buf = dev.upload(np.arange(4, dtype=np.float32))
    dev.dispatch(spec, [buf])
    np.testing.assert_array_equal(dev.read_array(buf, (4,), f32), [1, 3, 5, 7])
    # a binding range at an aligned offset
    align = dev.limits["min_storage_buffer_offset_alignment"]
    big = dev.upload(np.zeros(align // 4 + 4, np.float32))
    dev.dispatch(spec, [(big, align, 16)])
    got = dev.read_array(big, (align // 4 + 4,), f32)
    assert np.all(got[: align // 4] == 0) and np.all(got[align // 4 :] == 1)
    with pytest.raises(DeviceError, match="bindings"):
        dev.dispatch(spec, [buf, buf])


def test_pipeline_cache_is_a_bounded_lru(dev, monkeypatch):
    """The cache keeps at most ``pipeline_cache_size`` pipelines, evicting the least recently
    used; an evicted pipeline nobody holds is freed (it once grew forever)."""
    import gc
    import weakref
    from collections import OrderedDict

    monkeypatch.setattr(dev, "_pipelines", OrderedDict())
    monkeypatch.setattr(dev, "pipeline_cache_size", 3)
    specs = [_spec(SRC.replace("VAL", f"{i}.0")) for i in range(5)]
    first = [dev.pipeline(s) for s in specs[:3]]
    assert dev.pipeline(specs[0]) is first[0]  # a hit makes specs[0] the most recent
    dev.pipeline(specs[3])  # evicts specs[1], the least recently used
    assert [k[0] for k in dev._pipelines] == [specs[i].wgsl for i in (2, 0, 3)]
    gone = weakref.ref(first[1])
    del first
    gc.collect()
    assert gone() is None
    dev.pipeline(specs[4])
    assert len(dev._pipelines) == 3
    # budget 0: nothing is cached, pipelines still work
    monkeypatch.setattr(dev, "pipeline_cache_size", 0)
    assert dev.pipeline(specs[1]) is not None and len(dev._pipelines) == 0


def test_pipeline_cache_budget_from_the_environment(monkeypatch):
    monkeypatch.delenv("MEGANEURA_PIPELINE_CACHE", raising=False)
    assert devmod.pipeline_cache_budget() == devmod.DEFAULT_PIPELINE_CACHE
    monkeypatch.setenv("MEGANEURA_PIPELINE_CACHE", " 7 ")
    assert devmod.pipeline_cache_budget() == 7
    for bad in ("-1", "lots", "1.5"):
        monkeypatch.setenv("MEGANEURA_PIPELINE_CACHE", bad)
        with pytest.raises(DeviceError, match="MEGANEURA_PIPELINE_CACHE"):
            devmod.pipeline_cache_budget()


def test_sessions_share_cached_pipelines(dev):
    """Two sessions of the same graph get the very same pipeline objects from the cache."""
    import meganeura as mn
    from meganeura import optim
    from meganeura.models.mlp import mlp_classifier

    m = mlp_classifier(8, in_dim=12, hidden=(16,), classes=5)

    def pipelines():
        s = mn.compile(m.graph, loss=m.loss, optimizer=optim.SGD(lr=0.1), device=dev)
        return [c.pipeline for c in s.train.commands if hasattr(c, "pipeline")]

    a, b = pipelines(), pipelines()
    assert a and all(p is q for p, q in zip(a, b, strict=True))


def test_compile_error_message(dev):
    bad = _spec(SRC.replace("VAL", "undefined_thing"))
    with pytest.raises(DeviceError) as e:
        dev.pipeline(bad)
    assert "undefined_thing" in str(e.value) and "--- WGSL ---" in str(e.value)


def test_spec_limit_checks(dev):
    good = SRC.replace("VAL", "3.0")
    maxwg = dev.limits["max_compute_workgroups_per_dimension"]
    with pytest.raises(LimitError, match="per dimension"):
        dev.pipeline(_spec(good, wg=(maxwg + 1, 1, 1)))
    maxs = dev.limits["max_compute_workgroup_storage_size"]
    with pytest.raises(LimitError, match="workgroup storage"):
        dev.pipeline(_spec(good, workgroup_storage=maxs + 4))
    n = dev.limits["max_storage_buffers_per_shader_stage"] + 1
    with pytest.raises(LimitError, match="storage buffers"):
        dev.pipeline(_spec(good, n=n))


def test_f16_needs_feature(dev, monkeypatch):
    src = "enable f16;\n" + SRC.replace("VAL", "f32(f16(1.0))")
    if dev.has_f16:
        dev.pipeline(_spec(src))
    monkeypatch.setattr(dev, "features", frozenset())
    with pytest.raises(DeviceError, match="shader-f16"):
        dev.pipeline(_spec(src.replace("1.0", "1.5")))


def test_buffers_roundtrip(dev):
    for arr, dt in ((np.arange(7, dtype=np.float32), f32),
                    (np.array([1, -2, 3], dtype=np.int64), i32),  # int64 -> i32
                    (np.array([True, False, True]), bool_),  # bool -> u32
                    (np.arange(5, dtype=np.float16), f16),  # odd byte count: padded
                    (np.linspace(0, 1, 5), f32)):  # float64 -> f32
        buf = dev.upload(arr)
        assert buf.size % 4 == 0
        got = dev.read_array(buf, arr.shape, dt)
        np.testing.assert_array_equal(got, arr.astype(dt.np) if dt is not bool_ else arr)
    buf = dev.upload(np.arange(8, dtype=np.uint8).view(np.float32))
    assert dev.read_buffer(buf, 3, 3) == bytes([3, 4, 5])  # unaligned range
    empty = dev.create_buffer(0)
    assert empty.size == 4
    dev.write_buffer(buf, np.array([9.0], np.float32), 4)
    assert dev.read_array(buf, (2,), f32)[1] == 9.0
    dev.sync()
    with pytest.raises(DeviceError, match="dtype"):
        dev.upload(np.array(["a"]))
    with pytest.raises(LimitError, match="max_buffer_size"):
        dev.create_buffer(dev.limits["max_buffer_size"] + 8)


def test_emit_with_device_and_dispatch(dev):
    k = PointwiseKernel((3,), (Strided.contiguous(f32, (3,)),),
                        (Instr("mn_tanh({0})", (("in", 0),), f32),), (0,))
    spec = emit(k, dev)  # a Device stands for its limits and features
    x = np.array([-1e30, 0.5, 1e30], np.float32)
    bufs = [dev.upload(x), dev.create_buffer(12)]
    dev.dispatch(spec, bufs)
    np.testing.assert_allclose(dev.read_array(bufs[1], (3,), f32), np.tanh(x), rtol=1e-6)


def test_auto_through_the_real_code_path():
    """``auto`` in a fresh process, no monkeypatching: Dawn when it imports and finds an adapter,
    else wgpu-native; the device it reports is the machine's real Vulkan/Metal/D3D12 adapter
    (on lavapipe CI: llvmpipe via Vulkan, a CPU, never the OpenGL llvmpipe wgpu also lists),
    and a session compiled there trains.  (On lavapipe CI wgpudawn is not installed, so this
    takes the real fallback path; on the H200 with the extra it gets Dawn.)"""
    import json
    import subprocess
    import sys

    code = """
import importlib.util, json, numpy as np, wgpu, meganeura as mn
from meganeura.runtime.device import get_device
dev = get_device("auto")
raw = [dict(a.info) for a in wgpu.gpu.enumerate_adapters_sync()]
g = mn.Graph("t"); x = g.input("x", (4, 3)); w = g.param("w", (3, 2))
loss = ((x @ w) ** 2.0).mean()
s = mn.compile(g, loss=loss, optimizer=mn.optim.SGD(lr=0.1), backend="auto")
s.set_params({"w": np.ones((3, 2), np.float32)})
l0 = s.step(x=np.ones((4, 3), np.float32)).loss
l1 = s.step(x=np.ones((4, 3), np.float32)).loss
d = dev.describe()
print(json.dumps({"dev": {k: d[k] for k in ("implementation", "backend_type", "adapter",
                                          "adapter_type", "is_cpu")},
                  "raw": [(i.get("device"), i.get("backend_type"), i.get("adapter_type"))
                          for i in raw],
                  "has_dawn": importlib.util.find_spec("wgpudawn") is not None,
                  "same": s.dev is dev, "trained": bool(l1 < l0)}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    d = r["dev"]
    assert d["implementation"] in ("dawn", "wgpu") and r["same"] and r["trained"], r
    assert d["backend_type"] in ("Vulkan", "Metal", "D3D12"), d
    if not r["has_dawn"]:
        assert d["implementation"] == "wgpu"
    if d["implementation"] == "wgpu":  # one of the adapters wgpu-native itself lists
        good = [a for a in r["raw"] if a[1] in ("Vulkan", "Metal", "D3D12")]
        assert [d["adapter"], d["backend_type"], d["adapter_type"]] in good, r
    if "llvmpipe" in d["adapter"]:  # lavapipe: reported as a CPU adapter
        assert d["is_cpu"] and d["adapter_type"] == "CPU", d


def test_auto_without_any_vulkan_driver_says_so():
    """With every Vulkan driver hidden (an ICD list naming no file), ``auto`` raises a
    DeviceError that says no Vulkan/Metal/D3D12 adapter exists and how to install one; it never
    falls back to OpenGL.  Fresh process: the device cache and the loader are per process."""
    import os
    import subprocess
    import sys

    code = """
from meganeura.errors import DeviceError
from meganeura.runtime.device import get_device
try:
    dev = get_device("auto")
except DeviceError as e:
    print("DeviceError:", e)
else:
    print("OPENED", dev.implementation, dev.backend_type, dev.adapter_name)
"""
    env = dict(os.environ, VK_DRIVER_FILES="/nonexistent/none.json",
               VK_ICD_FILENAMES="/nonexistent/none.json")
    env.pop("VK_ADD_DRIVER_FILES", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    msg = out.stdout.strip().splitlines()[-1]
    assert msg.startswith("DeviceError:"), msg
    assert "no Vulkan, Metal or D3D12 adapter" in msg and "mesa-vulkan-drivers" in msg, msg


def test_buffer_view_probe(dev):
    """The WGSL ``buffer_view`` probe: a device whose compiler rejects the module (wgpu-native's
    naga has no buffer views) reports no feature and raises nothing; one that compiles it does.
    Only Dawn devices with subgroup matrices are asked (the packed staging's only users)."""
    from meganeura.kernels.common import BUFFER_VIEW_FEATURE

    class Accepts:
        def create_shader_module(self, code):
            assert code.startswith("requires buffer_view;")

    class Rejects:
        def create_shader_module(self, code):
            raise RuntimeError("unknown language extension 'buffer_view'")

    assert devmod._has_buffer_view(Accepts()) and not devmod._has_buffer_view(Rejects())
    if dev.implementation == "wgpu":
        assert not devmod._has_buffer_view(dev.device)
    if devmod.SUBGROUP_MATRIX_F16 not in dev.features:
        assert BUFFER_VIEW_FEATURE not in dev.features
