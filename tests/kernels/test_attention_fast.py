"""``precision="fast"`` attention forward (kernels/attention_fast.py).  On a device with f16
subgroup matrices (Dawn on the H200) the tensor-core kernel runs and must pass the fast gates
against float64 (DESIGN.md §5: forward ≤ 1e-2 relative L2; gradients, which stay strict,
≤ 5e-2 and cosine ≥ 0.99); on any other device fast is the strict program, bit for bit.  On
every device the tensor-core WGSL is emitted for a device that has the feature and validated
by the local WGSL compiler with the subgroup-matrix builtins replaced by scalar stand-ins."""

import dataclasses
import re

import numpy as np
import pytest

import meganeura as mn
from meganeura import kernels, ops, reference
from meganeura.kernels import attention_fast as AF
from meganeura.kernels.common import BUFFER_VIEW_FEATURE

from .test_attention import _desc, _problem, _run

H200_LIMITS = {"max_compute_workgroup_storage_size": 49152,
               "max_compute_invocations_per_workgroup": 1024}
TC_FEATURES = {"shader-f16", "subgroups", AF.SG_FEATURE, BUFFER_VIEW_FEATURE}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    fin = np.isfinite(b)
    assert np.array_equal(fin, np.isfinite(a)), "non-finite pattern differs"
    return float(np.linalg.norm(a[fin] - b[fin]) / max(np.linalg.norm(b[fin]), 1e-30))


def _stubbed(src: str) -> str:
    """The fast WGSL with subgroup-matrix builtins as scalar functions (syntax and types of
    everything else checkable by a compiler without the extension)."""
    src = "\n".join(ln for ln in src.splitlines()
                    if not ln.startswith(("enable subgroups", "enable chromium", "diagnostic",
                                          "requires buffer_view"))
                    and "= bufferView<" not in ln)
    # a packed staging buffer (attention_fast.PACKED) as its two views, separate arrays here
    src = re.sub(r"var<workgroup> (\w)hB: buffer<(\d+)>;",
                 lambda m: (f"var<workgroup> {m[1]}h: array<f16, {int(m[2]) // 2}>;\n"
                            f"var<workgroup> {m[1]}w: array<vec2<u32>, {int(m[2]) // 8}>;"), src)
    # the f32 scratch with its vec4 view (attention_fast.LANE_VEC)
    src = re.sub(r"var<workgroup> SfB: buffer<(\d+)>;",
                 lambda m: (f"var<workgroup> Sf: array<f32, {int(m[1]) // 4}>;\n"
                            f"var<workgroup> SfV: array<vec4<f32>, {int(m[1]) // 16}>;"), src)
    src = re.sub(r"subgroupMatrixLoad<[^>]*>>\(&?(\w+), ", r"sml_\1(", src)
    src = src.replace("subgroupMatrixMultiplyAccumulate(", "smma(")
    src = src.replace("subgroup_matrix_result<f32, 16, 16>()", "f32()")
    src = re.sub(r"subgroupMatrixStore\(&?Sf, ", "sms(", src)
    src = src.replace("subgroupMatrixStore(&Of, ", "smso(")
    src = src.replace("subgroupAny(", "sga(")
    src = src.replace("subgroupShuffleXor(", "sgx(")  # Dawn wants "enable subgroups;" for it
    stubs = [f"fn sml_{a}(o: u32, c: bool, s: u32) -> f32 {{ return f32({a}[o + s]); }}"
             for a in ("Kh", "Vh", "Ph") + (("Of",) if "var<workgroup> Of" in src else ())]
    stubs += ["fn smma(a: f32, b: f32, c: f32) -> f32 { return a * b + c; }",
              "fn sms(o: u32, v: f32, c: bool, s: u32) { Sf[o + s] = v; }",
              "fn sgx(x: f32, m: u32) -> f32 { return x + f32(m); }",
              "fn sga(b: bool) -> bool { return b; }"]
    if "var<workgroup> Of" in src:
        stubs.append("fn smso(o: u32, v: f32, c: bool, s: u32) { Of[o + s] = v; }")
    return src.replace("\n@compute", "\n" + "\n".join(stubs) + "\n@compute", 1)


# (B, Hq, Hkv, Sq, Skv, D, Dv), attrs, mask shape
CASES = {
    "gqa_causal": ((1, 6, 2, 37, 37, 64, 64), {"causal": True}, None),
    "cross_mask": ((2, 2, 2, 21, 83, 32, 32), {}, (2, 1, 21, 83)),
    "d128_window": ((1, 2, 1, 40, 40, 128, 128), {"causal": True, "window": 13}, None),
    "decode": ((1, 9, 3, 1, 100, 64, 64), {"causal": True, "q_offset": 99}, None),
}


def test_chunk_groups():
    """A workgroup walks the largest divisor of the chunk count whose chunks stay within
    ``GROUP_KEYS`` keys: Whisper's 6 chunks of 250 keys in pairs, unsplit kernels alone.
    (That the walked chunks are right is ``test_fast_mode_takes_tensor_cores_for_long_attention``
    at 4 and 6 forced chunks, on a device with tensor cores.)"""
    assert AF.chunk_group(attention_desc("fwd", 6, 6, 1500, splits=6)) == 2
    assert AF.chunk_group(attention_desc("fwd", 6, 6, 1500)) == 1
    assert AF.chunk_group(attention_desc("fwd", 6, 6, 512, splits=4)) == 4
    assert AF.chunk_group(attention_desc("fwd", 6, 6, 516, splits=6)) == 3  # 6 x 86 > 512


def attention_desc(kind: str, Hq: int, Hkv: int, S: int, D: int = 64, splits: int = 1):
    """A contiguous f32 attention description (no data) of (1, Hq / Hkv heads, S, D)."""
    from meganeura.dtypes import f32
    from meganeura.kernels import Strided
    from meganeura.kernels.attention import KIND_TYPES

    q = Strided.contiguous(f32, (1, Hq, S, D))
    kv = Strided.contiguous(f32, (1, Hkv, S, D))
    rows = Strided.contiguous(f32, (1, Hq, S))
    extra = (None, None, None) if kind == "fwd" else (q, rows, rows)
    return KIND_TYPES[kind](kind, q, kv, kv, None, *extra, False, D ** -0.5, 0, 0,
                            splits=splits)


# layout switches of kernels/attention_fast.py (the default first)
VARIANTS = {"default": {}, "unpacked": {"PACKED": False}, "no_prefetch": {"PREFETCH": False},
            "pad4": {"SF_PAD": 4},
            "rows1": {"ROW_BLOCKS": 1}, "rows3": {"ROW_BLOCKS": 3}, "lean_off": {"LEAN": False},
            "o_shared": {"O_SHARED": True}, "split_prefetch": {"SPLIT_PREFETCH": True},
            "o_shared_split": {"O_SHARED": True, "SPLIT_PREFETCH": True},
            "rows1_split": {"ROW_BLOCKS": 1, "SPLIT_PREFETCH": True},
            "scalar_loads": {"VEC_LOADS": False}, "lane_scalar": {"LANE_VEC": False},
            "serial_reduce": {"TREE_REDUCE": False}, "loop_stage": {"REG_STAGE": False},
            "no_hoist": {"HOIST_FIRST": False}, "scalar_out": {"OUT_VEC": False},
            "exp_f16": {"EXP_F16": True}, "f16_values": {"PACK_F32": False}}


@pytest.fixture(params=sorted(VARIANTS))
def layout(request, monkeypatch):
    for name, val in VARIANTS[request.param].items():
        monkeypatch.setattr(AF, name, val)
    return request.param


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_wgsl_is_valid(dev, rng, case, layout):
    dims, attrs, mshape = CASES[case]
    x, a, _ = _problem(rng, dims, attrs, mask_shape=mshape)
    keys = x["k"].shape[2]
    for splits, ck in ((1, 0), (3, 0), (3, -(-keys // 3) + 1)):  # even, and a short last chunk
        desc = dataclasses.replace(_desc("fwd", x, a), precision="fast", splits=splits,
                                   chunk_keys=ck)
        spec = kernels.emit(desc, H200_LIMITS, TC_FEATURES)
        assert spec.meta["precision"] == "fast"
        assert spec.meta["variant"].startswith("sgmat_attention_fwd")
        assert "subgroupMatrixMultiplyAccumulate" in spec.wgsl
        dev.device.create_shader_module(code=_stubbed(spec.wgsl))


def test_vec4_reads_only_where_every_view_allows():
    """``VEC_LOADS``: contiguous q/k/v bindings are declared as vec4 arrays and read one unit
    at a time; a view whose offset or row stride is not a multiple of 4 keeps scalar reads
    (of that binding only)."""
    from meganeura.kernels import Strided

    d = dataclasses.replace(attention_desc("fwd", 6, 6, 600), precision="fast", splits=3)
    w = kernels.emit(d, H200_LIMITS, TC_FEATURES).wgsl
    # q, k, v read and out written by vec4 units (``OUT_VEC``); lse by scalars
    assert all(f"b{i}: array<vec4<f32>>" in w for i in range(4)) and "b4: array<f32>" in w
    assert "b1[((b) * " in w and ") / 4u];" in w
    odd = Strided(d.v.dtype, d.v.shape, (600 * 66, 600 * 66, 66, 1), 2, 6 * 600 * 66)
    w2 = kernels.emit(dataclasses.replace(d, v=odd), H200_LIMITS, TC_FEATURES).wgsl
    assert "b2: array<f32>" in w2 and "b1: array<vec4<f32>>" in w2


def test_packed_staging_needs_buffer_views(rng):
    """Packed staging (one ``vec2<u32>`` store per four f16) only where the device's WGSL has
    ``buffer_view``; without it the same kernel stages with f16 stores."""
    x, a, _ = _problem(rng, CASES["cross_mask"][0], CASES["cross_mask"][1],
                       mask_shape=CASES["cross_mask"][2])
    desc = dataclasses.replace(_desc("fwd", x, a), precision="fast")
    packed = kernels.emit(desc, H200_LIMITS, TC_FEATURES).wgsl
    plain = kernels.emit(desc, H200_LIMITS, TC_FEATURES - {BUFFER_VIEW_FEATURE}).wgsl
    assert packed.startswith("requires buffer_view;") and "pack2x16float" in packed
    assert "bufferView" not in plain and "buffer_view" not in plain
    assert "Kh[rr * " in plain and "Kw[rr * " in packed


@pytest.mark.parametrize("phase", sorted(AF.ABLATE_PHASES))
def test_ablations_emit_valid_wgsl(dev, rng, monkeypatch, phase):
    """The timing-only ablations (bench/attention_bench.py ``--fast-ab no-<phase>``) still
    emit valid WGSL, and leave out what they name."""
    x, a, _ = _problem(rng, CASES["gqa_causal"][0], CASES["gqa_causal"][1])
    desc = dataclasses.replace(_desc("fwd", x, a), precision="fast", splits=3)
    full = kernels.emit(desc, H200_LIMITS, TC_FEATURES).wgsl
    monkeypatch.setattr(AF, "ABLATE", frozenset({phase}))
    src = kernels.emit(desc, H200_LIMITS, TC_FEATURES).wgsl
    dev.device.create_shader_module(code=_stubbed(src))
    assert len(src) < len(full)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_forward(run, dev, rng, case, layout):
    """The fast kernel on this device: fast gates where it has tensor cores, else exactly the
    strict kernel."""
    dims, attrs, mshape = CASES[case]
    x, a, ref = _problem(rng, dims, attrs, mask_shape=mshape)
    desc = dataclasses.replace(_desc("fwd", x, a), precision="fast")
    out, lse = _run(run, "fwd", x, desc)
    spec = run.last_spec
    if AF.SG_FEATURE not in dev.features:
        strict = kernels.emit(dataclasses.replace(desc, precision="strict"), dev.limits,
                              dev.features)
        assert spec.wgsl == strict.wgsl and spec.meta["precision"] == "strict"
    else:
        assert spec.meta["precision"] == "fast"
        assert spec.meta["variant"].startswith("sgmat")  # reports count it on tensor cores
        # the packed staging and the scratch's vec views run wherever the device's WGSL has
        # buffer views
        views = (AF.PACKED or AF.lane_vec()) and BUFFER_VIEW_FEATURE in dev.features
        assert ("bufferView" in spec.wgsl) == views
    assert _rel(out, ref["out"]) <= 1e-2
    assert _rel(lse, ref["lse"]) <= 1e-2


def test_tail_chunk_split():
    """``fast_split``: Whisper's (1, 6, 1500, 64) gets 4 chunks of 448 keys (7, 7, 7 and 2.4
    tiles of 64: the last chunk's 72 workgroups in the 40 slots the 3 × 72 leave idle, then in
    those it frees), 3 even chunks without ``TAIL_CHUNK``; where the even split fills the wave,
    is capped by the op's count or the tail would not shorten the chunks, it is the even one."""
    assert AF.fast_split(1, 6, 6, 1500, 1500, 6) == (4, 448)
    assert AF.fast_split(1, 6, 6, 1500, 1500, 3) == (3, 0)  # the op's cap
    assert AF.fast_split(1, 8, 8, 1024, 1024, 4) == (4, 0)  # 4 x 64 workgroups fill 256
    assert AF.fast_split(1, 2, 2, 512, 512, 6) == (6, 0)
    n, keys = AF.fast_split(1, 8, 8, 1500, 1500, 5)
    assert (n, keys) == (3, 640) and keys * (n - 1) < 1500 <= keys * n


def test_tail_chunk_switch(monkeypatch):
    monkeypatch.setattr(AF, "TAIL_CHUNK", False)
    assert AF.fast_split(1, 6, 6, 1500, 1500, 6) == (3, 0)


@pytest.mark.parametrize("keys", [0, 40])
def test_fast_forward_uneven_chunks(run, dev, rng, keys):
    """The fast split forward with an even split and with ``chunk_keys`` (3 chunks: 40, 40 and
    3 keys of 83), then the combine: the fast gate against float64 on tensor cores, the strict
    kernel's 2e-5 elsewhere."""
    from meganeura.dtypes import f32
    from meganeura.kernels import Strided
    from meganeura.kernels.attention_combine import AttentionCombineKernel

    dims, attrs, mshape = CASES["cross_mask"]
    x, a, ref = _problem(rng, dims, attrs, mask_shape=mshape)
    n, (B, Hq, Sq, _), Dv = 3, x["q"].shape, x["v"].shape[3]
    desc = dataclasses.replace(_desc("fwd", x, a), precision="fast", splits=n,
                               chunk_keys=keys)
    names = ["q", "k", "v"] + (["mask"] if "mask" in x else [])
    po, pl = run(desc, [x[m] for m in names], [((n * B, Hq, Sq, Dv), f32),
                                                ((n * B, Hq, Sq), f32)])
    tc = AF.SG_FEATURE in dev.features
    assert run.last_spec.meta["precision"] == ("fast" if tc else "strict")
    comb = AttentionCombineKernel(Strided.contiguous(f32, po.shape),
                                  Strided.contiguous(f32, pl.shape), n)
    out, lse = run(comb, [po, pl], [((B, Hq, Sq, Dv), f32), ((B, Hq, Sq), f32)])
    assert _rel(out, ref["out"]) <= (1e-2 if tc else 2e-5)
    assert _rel(lse, ref["lse"]) <= (1e-2 if tc else 2e-5)


def _fast_and_strict(gpu, B, H, S, D):
    """compile(precision=fast / strict) of o = attention(q, k, v) with every gradient of
    (o · ct).sum(): both results and the float64 reference."""
    g = mn.Graph()
    q, k, v = (g.param(n, (B, H, S, D)) for n in "qkv")
    o = ops.attention(q, k, v, causal=True)
    ct = g.input("ct", o.shape)
    g2, grads = mn.grad(g, (o * ct).sum())
    outs = {"o": g2[o], **{f"d{n}": x for n, x in grads.items()}}
    r = np.random.default_rng(0)
    params = {n: r.normal(size=(B, H, S, D)).astype(np.float32) for n in "qkv"}
    feeds = {"ct": r.normal(size=o.shape).astype(np.float32)}
    got = {}
    for prec in ("fast", "strict"):
        sess = mn.compile(g2, outputs=outs, device=gpu, precision=prec)
        sess.set_params(params)
        got[prec] = sess.run(**feeds)
    want = dict(zip(outs, reference.evaluate(g2, list(outs.values()), {**params, **feeds},
                                             np.float64)))
    return got, want


def test_fast_mode_keeps_strict_attention(gpu):
    """compile(precision="fast") leaves short attention on the strict kernels (the tensor-core
    forward is slower below ``FAST_MIN_KEYS``: SmolLM2's 128 keys 12.9 against 10.0 µs on the
    H200): forward and every gradient bit-identical to the strict program, on every device."""
    got, want = _fast_and_strict(gpu, 1, 4, 70, 64)
    for n in got["fast"]:
        np.testing.assert_array_equal(got["fast"][n], got["strict"][n], err_msg=n)
    assert _rel(got["fast"]["o"], want["o"]) <= 1e-5


@pytest.mark.parametrize("splits", [1, 4, 6])
def test_fast_mode_takes_tensor_cores_for_long_attention(gpu, monkeypatch, splits):
    """From ``FAST_MIN_KEYS`` keys up the fast program's forward runs on the tensor cores where
    the device has them and passes the fast gates (forward ≤ 1e-2 relative L2, gradients —
    whose kernels stay strict but read the fast forward's lse — ≤ 5e-2 and cosine ≥ 0.99);
    elsewhere it is the strict program, bit for bit.  Forced key chunks: 4 chunks of 128 keys
    are walked by one workgroup each (``chunk_group``), 6 of 86 in two groups of 3."""
    import sys

    att_op = sys.modules["meganeura.ops.attention"]  # (the package's ``attention`` is the op)
    monkeypatch.setattr(att_op, "fwd_splits", lambda *dims: splits)
    got, want = _fast_and_strict(gpu, 1, 2, AF.FAST_MIN_KEYS, 64)
    if AF.SG_FEATURE not in gpu.features:
        for n in got["fast"]:
            np.testing.assert_array_equal(got["fast"][n], got["strict"][n], err_msg=n)
        return
    assert _rel(got["fast"]["o"], want["o"]) <= 1e-2
    assert _rel(got["fast"]["o"], want["o"]) > 1e-6  # f16 operands: not the strict kernel
    for n in ("dq", "dk", "dv"):
        a, b = got["fast"][n].ravel(), want[n].ravel()
        assert _rel(a, b) <= 5e-2, n
        assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.99, n
