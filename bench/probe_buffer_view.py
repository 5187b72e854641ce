"""Does this Dawn accept WGSL's ``buffer_view`` language extension, and can f16 subgroup
matrices load from a workgroup ``buffer`` written through a packed (``vec4<u32>``) view?

That would let the tensor-core kernels stage f16 tiles with one 16-byte workgroup store per 8
values instead of eight 2-byte stores (``array<f16>`` cannot be written packed in plain WGSL).

    python3 bench/probe_buffer_view.py [dawn|wgpu]      (default dawn)

Prints one line per probe (ok / the error's first line) and exits 0 either way.
"""

from __future__ import annotations

import sys

import numpy as np

from meganeura.dtypes import f32

PACKED = """
requires buffer_view;
enable f16;
var<workgroup> wb : buffer<512>;
@group(0) @binding(0) var<storage, read_write> o : array<f32>;
@compute @workgroup_size(32)
fn main(@builtin(local_invocation_index) i: u32) {
  let w = bufferView<array<vec4<u32>, 32>>(&wb, 0);
  let a = pack2x16float(vec2<f32>(f32(8u * i), f32(8u * i + 1u)));
  let b = pack2x16float(vec2<f32>(f32(8u * i + 2u), f32(8u * i + 3u)));
  let c = pack2x16float(vec2<f32>(f32(8u * i + 4u), f32(8u * i + 5u)));
  let d = pack2x16float(vec2<f32>(f32(8u * i + 6u), f32(8u * i + 7u)));
  (*w)[i] = vec4<u32>(a, b, c, d);
  workgroupBarrier();
  let h = bufferView<array<f16, 256>>(&wb, 0);
  for (var j = 0u; j < 8u; j++) { o[8u * i + j] = f32((*h)[8u * ((i + 5u) % 32u) + j]); }
}
"""

SGMAT = """
requires buffer_view;
enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;
diagnostic(off, chromium.subgroup_matrix_uniformity);
var<workgroup> wb : buffer<1024>;
@group(0) @binding(0) var<storage, read_write> x : array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> o : array<f32>;
@compute @workgroup_size(32)
fn main(@builtin(local_invocation_index) i: u32) {
  let w = bufferView<array<vec4<u32>, 64>>(&wb, 0);
  for (var r = 0u; r < 2u; r++) {
    let q = 2u * i + r;
    let lo = x[2u * q]; let hi = x[2u * q + 1u];
    (*w)[q] = vec4<u32>(pack2x16float(lo.xy), pack2x16float(lo.zw),
                        pack2x16float(hi.xy), pack2x16float(hi.zw));
  }
  workgroupBarrier();
  let h = bufferView<array<f16, 512>>(&wb, 0);
  let a = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(h, 0u, false, 16u);
  let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(h, 256u, false, 16u);
  var c = subgroup_matrix_result<f32, 16, 16>();
  c = subgroupMatrixMultiplyAccumulate(a, b, c);
  subgroupMatrixStore(&o, 0u, c, false, 16u);
}
"""


def _run(dev, src: str, inputs: list[np.ndarray], n_out: int) -> np.ndarray:
    """Compile ``src``, bind ``inputs`` (f32) then one f32 output of ``n_out``, run one
    workgroup (the device's own dispatch helpers)."""
    from meganeura.kernels import KernelSpec

    spec = KernelSpec("probe", src, len(inputs) + 1, (1, 1, 1))
    bufs = [dev.upload(np.ascontiguousarray(a, np.float32)) for a in inputs]
    bufs.append(dev.create_buffer(4 * n_out))
    dev.dispatch(spec, bufs)
    return dev.read_array(bufs[-1], (n_out,), f32)


def main(backend: str = "dawn") -> int:
    from meganeura.runtime.device import get_device

    dev = get_device(backend)
    print(f"device: {dev.adapter_name} ({dev.backend_type})")
    try:
        feats = sorted(dev.module.gpu.wgsl_language_features)
        print("wgsl language features:", ", ".join(feats))
    except Exception as e:  # noqa: BLE001 - a probe reports, it does not fail
        print("wgsl language features: unknown:", str(e).splitlines()[0])
    try:
        got = _run(dev, PACKED, [], 256).reshape(32, 8)
        want = np.arange(256, dtype=np.float32).reshape(32, 8)[(np.arange(32) + 5) % 32]
        print("packed store, f16 view:", "ok" if np.array_equal(got, want) else f"WRONG {got[:2]}")
    except Exception as e:  # noqa: BLE001
        print("packed store, f16 view: error:", " | ".join(str(e).strip().splitlines())[:800])
    rng = np.random.default_rng(0)
    x = rng.integers(-4, 5, size=512).astype(np.float32)
    try:
        got = _run(dev, SGMAT, [x], 256).reshape(16, 16)
        want = x[:256].reshape(16, 16) @ x[256:].reshape(16, 16)
        err = float(np.abs(got - want).max())
        print("subgroup matrices from a packed buffer view:", "ok" if err == 0 else f"WRONG {err}")
    except Exception as e:  # noqa: BLE001
        print("subgroup matrices from a packed buffer view: error:",
              " | ".join(str(e).strip().splitlines())[:800])
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
