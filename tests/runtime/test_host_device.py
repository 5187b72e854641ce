"""compile(device=<a raw wgpu GPUDevice>): meganeura runs on a device the host application opened
(a render loop's), on the host's queue, in order with the host's own submissions.  Every test
runs for a wgpu-native host device and for a Dawn one (wgpudawn); the Dawn cases skip, naming
why, where Dawn finds no adapter (it refuses Debian 12's lavapipe: they run on the H200)."""

import numpy as np
import pytest
import wgpu

import meganeura as mn
from meganeura import optim
from meganeura.models.mlp import mlp_classifier
from meganeura.runtime.device import Device, _describe_adapter, _good, as_device


def _dawn_adapter():
    """Dawn's adapter as an application asks for it, or a skip that says what is missing."""
    wgpudawn = pytest.importorskip("wgpudawn", reason="Dawn host device: the optional package "
                                   "wgpudawn (meganeura[dawn]) is not installed here")
    try:
        adapter = wgpudawn.gpu.request_adapter_sync(power_preference="high-performance")
        found = _describe_adapter(adapter) if adapter is not None else "no adapter"
    except Exception as e:
        adapter, found = None, f"no adapter: {str(e).strip().splitlines()[0] if str(e) else e}"
    if adapter is None or not _good(adapter):
        pytest.skip(f"Dawn host device: Dawn found no Vulkan, Metal or D3D12 adapter here "
                    f"({found}); Dawn refuses Mesa 22 lavapipe (GPU-NOTES.md), so this runs "
                    f"on a real GPU (the H200 run)")
    return wgpudawn, adapter


@pytest.fixture(scope="module", params=["wgpu", "dawn"])
def host(request):
    """(implementation, its wgpu-py module, a device opened the way an application of that
    implementation does it: default limits, no features)."""
    if request.param == "dawn":
        module, adapter = _dawn_adapter()
    else:
        module = wgpu
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    return request.param, module, adapter.request_device_sync(label="host")


@pytest.fixture(scope="module")
def host_device(host):
    return host[2]


def _batch(seed=0, n=16):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 64)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)


def _session(device=None):
    m = mlp_classifier(16)
    sess = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                      optimizer=optim.AdamW(lr=1e-2), device=device)
    sess.init_params(seed=0)
    return sess


def test_raw_device_is_wrapped_once_with_its_own_limits(host, host_device, gpu):
    dev = as_device(host_device)
    assert isinstance(dev, Device) and dev.device is host_device
    assert dev.queue is host_device.queue and dev is as_device(host_device)
    assert dev is not gpu and dev.implementation == host[0]
    assert dev.backend_type.lower() == "vulkan"
    assert dev.module is host[1]
    # the limits the host opened the device with, not the adapter's
    want = host_device.limits["max-storage-buffer-binding-size"]
    assert dev.limits["max_storage_buffer_binding_size"] == want
    assert dev.features == frozenset(host_device.features)


def test_training_on_the_host_device_matches_meganeura_own(host_device, gpu):
    x, y = _batch()
    a, b = _session(host_device), _session()
    assert a.dev.device is host_device and b.dev is gpu
    for _ in range(3):
        la, lb = a.step(x=x, y=y).loss, b.step(x=x, y=y).loss
        np.testing.assert_allclose(la, lb, rtol=1e-5)
    for n, v in b.get_params().items():
        np.testing.assert_allclose(a.get_params()[n], v, rtol=1e-4, atol=1e-6)
    # a second session on the same raw device reuses the wrapper and its pipelines
    c = _session(host_device)
    assert c.dev is a.dev
    pipes = [[getattr(cmd, "pipeline", None) for cmd in s.train.commands] for s in (a, c)]
    assert any(pipes[0]) and pipes[0] == pipes[1]


def test_host_submissions_are_ordered_with_the_steps(host, host_device):
    """The host overwrites a weight with a GPU copy submitted on the shared queue just before a
    step (the step must see it), then copies the updated weight out right after the step (it
    must see the step's update), never reading back in between."""
    x, y = _batch(1)
    sess, ref = _session(host_device), _session(host_device)
    name = sess.param_names[0]
    new = np.full(sess.get_params()[name].shape, 0.01, np.float32)
    ref.set_params({name: new})
    want_loss = ref.step(x=x, y=y).loss
    want_after = ref.get_params()[name]
    assert not np.isclose(_session(host_device).step(x=x, y=y).loss, want_loss)  # it matters

    buf, off, size = sess.gpu_buffer(name)
    assert size == new.nbytes
    mod = host[1]
    u = mod.BufferUsage
    src = host_device.create_buffer_with_data(data=new.tobytes(), usage=u.COPY_SRC)
    dst = host_device.create_buffer(size=size, usage=u.COPY_DST | u.MAP_READ)
    enc = host_device.create_command_encoder()
    enc.copy_buffer_to_buffer(src, 0, buf, off, size)
    host_device.queue.submit([enc.finish()])  # before the step
    r = sess.step(x=x, y=y)  # submits without waiting
    enc = host_device.create_command_encoder()
    enc.copy_buffer_to_buffer(buf, off, dst, 0, size)
    host_device.queue.submit([enc.finish()])  # after the step
    dst.map_sync(mod.MapMode.READ)
    got = np.frombuffer(dst.read_mapped(), np.float32).reshape(new.shape).copy()
    dst.unmap()
    np.testing.assert_allclose(r.loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(got, want_after, rtol=1e-6)
    assert not np.allclose(got, new)  # the step did update it


def test_gpu_buffer_names_only_persistent_tensors(host_device):
    with pytest.raises(KeyError, match="not a parameter or state"):
        _session(host_device).gpu_buffer("x")


class _ForeignDevice(wgpu.GPUDevice):
    """A GPUDevice of some other implementation (e.g. a browser's, through pyodide)."""


@pytest.mark.parametrize("bad, match", [
    ("gpu", r"device= takes a wgpu GPUDevice .* got str"),
    (object(), r"got object"),
    (_ForeignDevice.__new__(_ForeignDevice), r"implementation .*test_host_device.* not supported"),
])
def test_device_that_is_not_a_wgpu_native_gpudevice_is_refused(bad, match):
    m = mlp_classifier(4)
    with pytest.raises(mn.DeviceError, match=match):
        mn.compile(m.graph, outputs={"logits": m.logits}, device=bad)


def test_load_program_runs_on_the_host_device(host_device, tmp_path):
    x, _ = _batch(2)
    sess = _session()
    sess.export(tmp_path / "mlp")
    prog = mn.load_program(tmp_path / "mlp", device=host_device)
    assert prog.dev is as_device(host_device)
    np.testing.assert_allclose(prog.run(x=x)["logits"], sess.run(x=x)["logits"], rtol=1e-5,
                               atol=1e-6)


def test_host_device_on_an_adapter_meganeura_refuses(host_device, monkeypatch):
    """E.g. wgpu-native's OpenGL fallback: kernels would lack f16/subgroups and differ."""
    from meganeura.runtime import device as device_module

    monkeypatch.setattr(device_module, "_HOSTED", type(device_module._HOSTED)())
    monkeypatch.setattr(device_module, "_good", lambda adapter: False)
    with pytest.raises(mn.DeviceError, match=r"host's GPUDevice runs on .*Vulkan, Metal or D3D12"):
        as_device(host_device)
