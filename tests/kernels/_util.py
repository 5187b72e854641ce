"""Helpers for the emitter tests (numpy views as Strided maps, a kernel runner, tolerances)."""

import numpy as np

from meganeura import kernels as codegen
from meganeura.dtypes import as_dtype, bool_
from meganeura.kernels.ir import Strided


def view_of(base: np.ndarray, v: np.ndarray) -> Strided:
    """The Strided map of numpy view ``v`` into its (contiguous) ``base`` array."""
    assert base.flags.c_contiguous
    item = base.itemsize
    off = (v.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // item
    strides = tuple(s // item for s in v.strides)
    return Strided(as_dtype(base.dtype), tuple(v.shape), strides, off, base.size)


class Runner:
    def __init__(self, dev):
        self.dev = dev

    def __call__(self, desc, inputs, outputs, limits=None, alias=None):
        """Emit ``desc``, bind ``inputs`` (numpy arrays: the raw buffers, in binding order) and
        fresh ``outputs`` ((shape, dtype) pairs), dispatch, return the outputs as numpy.
        ``alias`` (``emit``'s): only each range's first slot is bound (aliased inputs must be
        the same array)."""
        spec = codegen.emit(desc, self.dev.limits if limits is None else limits,
                            self.dev.features, alias=alias)
        bufs = [self.dev.upload(a) for a in inputs]
        for shape, dt in outputs:
            dt = as_dtype(dt)
            n = int(np.prod(shape, dtype=np.int64))
            bufs.append(self.dev.create_buffer(max(n, 1) * dt.gpu_itemsize))
        kept = bufs if alias is None else [b for i, b in enumerate(bufs) if alias[i] == i]
        self.dev.dispatch(spec, kept)
        res = []
        for buf, (shape, dt) in zip(bufs[len(inputs):], outputs, strict=True):
            dt = as_dtype(dt)
            arr = self.dev.read_array(buf, tuple(shape), dt)
            res.append(arr if dt is not bool_ else arr.astype(bool))
        self.last_spec = spec
        return res



def assert_close(got, ref, rtol, atol=0.0, what=""):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = np.abs(got - ref)
    tol = atol + rtol * np.abs(ref)
    bad = ~(err <= tol) & ~(np.isnan(got) & np.isnan(ref)) & ~(got == ref)
    if bad.any():
        i = np.argmax(np.where(bad, err - tol, -np.inf))
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} elements off; worst at "
            f"{np.unravel_index(i, bad.shape)}: got {got.flat[i]!r}, want {ref.flat[i]!r}"
        )


def no_subgroup_matrix_reason(dev) -> str | None:
    """None when ``dev`` runs the fast path on f16 subgroup matrices, else the exact reason it
    cannot (the tensor-core and fast-precision tests skip with it; the evidence for CPU drivers
    is in docs/mutation-testing.md)."""
    from meganeura.kernels.matmul import SG_FEATURE

    if SG_FEATURE in dev.features:
        return None
    adapter_features = set(getattr(dev.adapter, "features", ()) or ())
    if dev.implementation != "dawn":
        cause = "wgpu-native exposes no subgroup matrices (only Dawn does)"
    elif "chromium-experimental-subgroup-matrix" not in adapter_features:
        cause = ("Dawn offers chromium-experimental-subgroup-matrix only on Vulkan drivers with "
                 "VK_KHR_cooperative_matrix, and this driver has none")
    else:
        cause = "none of Dawn's subgroup-matrix configs is f16 16x16x16 at subgroup size 32"
    if dev.is_cpu:
        cause += ("; no CPU Vulkan driver can: lavapipe (Mesa 22.3.6 and 25.0.7 tried) and "
                  "SwiftShader lack VK_KHR_cooperative_matrix, and their subgroups are the SIMD "
                  "width (lavapipe 8 lanes with AVX2, 16 with AVX-512; SwiftShader 4), never 32")
    return (f"{dev.adapter_name} ({dev.implementation}) has no f16 subgroup matrices "
            f"({SG_FEATURE}): {cause}; these tests run on the GPU machine (bench/gpu_suite.sh, "
            f"Dawn on the H200); see docs/mutation-testing.md")


def compiled_matches_float64(gpu, graph, outs: dict, env: dict, feed: str, tol: float = 1e-4):
    """Compile ``outs`` of ``graph`` on ``gpu``, set every ``env`` entry but the ``feed`` input
    as parameters, run, and check each result against the float64 reference interpreter
    (max error ≤ ``tol`` · max |reference|).  Returns the session (its plan for more checks)."""
    import meganeura as mn
    from meganeura import reference

    want = dict(zip(outs, reference.evaluate(graph, list(outs.values()), env, np.float64)))
    sess = mn.compile(graph, outputs=outs, device=gpu)
    sess.set_params({k: v for k, v in env.items() if k != feed})
    got = sess.run(**{feed: env[feed]})
    for k in outs:
        scale = float(np.abs(want[k]).max())
        assert float(np.abs(got[k] - want[k]).max()) <= tol * scale, k
    return sess
