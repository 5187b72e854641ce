"""Attention and index kernels through the whole GPU path (passes → plan → codegen → runtime)
against the numpy reference (float64): forward, lse and the gradients (dq, dk, dv, dmask), for
causal, full, cross, grouped-query, sliding-window, masked, q_offset, Dv != D and decode (S=1)
cases with odd sizes that cross tile boundaries; embedding/embedding_grad and the dynamic slices;
and the memory gate: a causal attention training graph's planned peak grows ~linearly in S."""

import sys

import numpy as np
import pytest

import meganeura as mn
from meganeura import ops, reference
from meganeura.kernels import attention as cg_attention
from meganeura.kernels.common import make_target

TOL = 1e-4


def _rel(got, want):
    want = np.asarray(want, np.float64)
    got = np.asarray(got, np.float64)
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got)), "non-finite pattern differs"
    assert np.array_equal(got[~fin], want[~fin])
    scale = max(float(np.abs(want[fin]).max(initial=0.0)), 1e-30)
    return float(np.abs(got[fin] - want[fin]).max(initial=0.0)) / scale


def _run_case(gpu, dims, attrs, mask=None, mask_grad=False, seed=0, also_unfused=False):
    B, Hq, Hkv, Sq, Skv, D, Dv = dims
    R = np.random.default_rng(seed)
    g = mn.Graph()
    q = g.param("q", (B, Hq, Sq, D))
    k = g.param("k", (B, Hkv, Skv, D))
    v = g.param("v", (B, Hkv, Skv, Dv))
    env = {"q": R.normal(size=q.shape), "k": R.normal(size=k.shape),
           "v": R.normal(size=v.shape)}
    m = None
    if mask is not None:
        m = (g.param if mask_grad else g.input)("m", mask.shape)
        env["m"] = mask
    o, lse = ops.attention_with_lse(q, k, v, mask=m, **attrs)
    ct = g.input("ct", o.shape)
    env["ct"] = R.normal(size=o.shape)
    g2, grads = mn.grad(g, (o * ct).sum())
    outs = {"o": g2[o], "lse": g2[lse], **{f"d{n}": x for n, x in grads.items()}}
    env = {n: a.astype(np.float32) for n, a in env.items()}
    want = dict(zip(outs, reference.evaluate(g2, list(outs.values()), env, np.float64)))
    params = {n: env[n] for n in g.params}
    feeds = {n: env[n] for n in env if n not in params}
    sess = mn.compile(g2, outputs=outs, device=gpu, check_finite=False)
    sess.set_params(params)
    got = sess.run(**feeds)
    for n in outs:
        err = _rel(got[n], want[n])
        assert err <= TOL, f"{n}: relative error {err:.3g}"
    if also_unfused:
        plain = mn.compile(g2, outputs=outs, device=gpu, fuse=False, plan_memory=False,
                           check_finite=False)
        plain.set_params(params)
        got2 = plain.run(**feeds)
        again = sess.run(**feeds)
        for n in outs:
            # the same program twice: bit-identical (fixed summation orders, no races)
            np.testing.assert_array_equal(again[n], got[n], err_msg=n)
            # Fused and unfused programs are not promised to be bit-identical: the drivers'
            # shader compilers contract a*b+c into fma differently in the two (e.g. in the
            # delta = rowsum(dO·O) reduce), and dS = P·(dP - delta) amplifies such an ulp of
            # delta by cancellation (exact on lavapipe; on the H200 the register-tiled kernels
            # exceeded a 4e-7 bound here, 2026-11-30)
            np.testing.assert_allclose(got2[n], got[n], rtol=2e-6, atol=1e-6, err_msg=n)
    return sess


# (B, Hq, Hkv, Sq, Skv, D, Dv), attrs — odd sizes: several row blocks and key tiles
CASES = {
    "causal": ((1, 2, 2, 37, 37, 8, 8), {"causal": True}),
    "full": ((2, 1, 1, 19, 19, 4, 4), {}),
    "cross": ((1, 2, 2, 11, 70, 8, 8), {}),
    "gqa_causal": ((1, 6, 2, 23, 23, 8, 8), {"causal": True}),
    "gqa_causal_offset": ((1, 4, 1, 9, 41, 4, 4), {"causal": True, "q_offset": 32}),
    "window_causal": ((1, 2, 1, 45, 45, 4, 4), {"causal": True, "window": 7}),
    "window_only": ((1, 1, 1, 13, 29, 4, 4), {"window": 9, "q_offset": 10}),
    "dv_ne_d_scalar": ((1, 3, 3, 17, 21, 5, 3), {"causal": True, "q_offset": 4}),
    "dv_ne_d_vec": ((1, 2, 1, 10, 12, 4, 12), {}),
    "causal_negative_offset": ((1, 2, 1, 9, 6, 4, 4), {"causal": True, "q_offset": -3}),
    "decode_s1": ((1, 3, 1, 1, 77, 8, 8), {"causal": True, "q_offset": 76}),
    "decode_s1_batch": ((3, 4, 2, 1, 9, 4, 4), {"causal": True, "q_offset": 8, "scale": 0.3}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_gpu(gpu, case):
    dims, attrs = CASES[case]
    _run_case(gpu, dims, attrs, also_unfused=case == "gqa_causal")


def test_attention_gpu_additive_mask_with_hidden_rows(gpu):
    """KV-cache style mask (broadcast (Skv,) ... (1, 1, Sq, Skv)) with -inf entries and a row
    with no visible key: zeros, lse = -inf, no gradient, as the reference (and PyTorch)."""
    Sq, Skv = 7, 33
    mask = np.zeros((1, 1, Sq, Skv))
    mask[..., 25:] = -np.inf
    mask[..., 3, :] = -np.inf
    mask[..., 5, :4] = 2.5
    sess = _run_case(gpu, (2, 2, 1, Sq, Skv, 4, 4), {}, mask=mask)
    del sess


def test_attention_gpu_differentiable_mask(gpu):
    R = np.random.default_rng(5)
    _run_case(gpu, (1, 2, 1, 9, 10, 4, 4), {"causal": True, "q_offset": 1},
              mask=R.normal(size=(9, 10)), mask_grad=True)


@pytest.mark.parametrize("split", [False, True])
def test_attention_gpu_large_tiles(gpu, monkeypatch, split):
    """Without the small-problem rule the tiles are the real-size ones (the first of CONFIGS
    that fits: 32 rows per forward block for D = 8) and dK/dV sums the query
    heads of a group in the kernel (split=False) or per query head plus a reduce (split=True);
    odd sizes still cross tile boundaries."""
    monkeypatch.setattr(cg_attention, "MIN_WORKGROUPS", 1)
    monkeypatch.setattr(sys.modules["meganeura.ops.attention"], "SPLIT_HEADS_BELOW",
                        10**9 if split else 0)
    # the separate dQ kernel (the fused dQ's partials fix the dK/dV key block)
    monkeypatch.setattr(sys.modules["meganeura.ops.attention"], "FUSED_DQ_MAX_D", 0)
    sess = _run_case(gpu, (1, 4, 2, 41, 41, 8, 8), {"causal": True}, seed=3)
    specs = [d.spec for d in sess.executable.infer.dispatches]
    tiles = {spec.meta["archetype"]: spec.meta["tiles"] for spec in specs if "tiles" in spec.meta}
    t = make_target(gpu.limits, gpu.features)
    fwd_cfg = cg_attention.choose_config("fwd", 82, 2, 8, 8, t)
    dkdv_cfg = cg_attention.choose_config("dkdv", 41, 4 if split else 2, 8, 8, t)
    assert tiles["attention_fwd"][0] == fwd_cfg[0] * fwd_cfg[2] == 32  # first of CONFIGS
    assert tiles["attention_dkdv"][0] == dkdv_cfg[0] * dkdv_cfg[2] >= 16
    dkdv = [lbl for lbl in sess.kernel_labels(inference=True) if "dkdv" in lbl]
    assert dkdv == [f"attention_grad_dkdv {(1, 4 if split else 2, 41, 8)},"
                    f"{(1, 4 if split else 2, 41, 8)}"]


def test_attention_gpu_strided_inputs_need_no_copy(gpu):
    """q/k/v as permuted views of (B, S, H, D) projections are read in place."""
    B, S, H, D = 1, 13, 2, 4
    R = np.random.default_rng(1)
    g = mn.Graph()
    x = g.input("x", (B, S, H * D))
    w = {n: g.param(n, (H * D, H * D)) for n in ("wq", "wk", "wv")}

    def heads(t):
        return (t).reshape(B, S, H, D).permute(0, 2, 1, 3)

    o = ops.attention(heads(x @ w["wq"]), heads(x @ w["wk"]), heads(x @ w["wv"]), causal=True)
    y = o.permute(0, 2, 1, 3).reshape(B, S, H * D)
    loss = (y * y).mean()
    g2, grads = mn.grad(g, loss)
    outs = {"y": g2[y], **{f"d{n}": v for n, v in grads.items()}}
    env = {"x": R.normal(size=x.shape).astype(np.float32),
           **{n: (R.normal(size=(H * D, H * D)) * 0.5).astype(np.float32) for n in w}}
    want = dict(zip(outs, reference.evaluate(g2, list(outs.values()), env, np.float64)))
    sess = mn.compile(g2, outputs=outs, device=gpu)
    sess.set_params({n: env[n] for n in w})
    got = sess.run(x=env["x"])
    for n in outs:
        assert _rel(got[n], want[n]) <= TOL, n
    labels = sess.kernel_labels(inference=True)
    assert not any(lbl.startswith(f"copy {(B, H, S, D)}") for lbl in labels), labels


def test_attention_memory_grows_linearly_in_sequence_length(gpu):
    """Training graph of 2 causal attention layers: planned peak from S=128 to S=512 grows
    ~4x (activations O(S·heads)), not ~16x (an S×S score matrix)."""

    def peak(S):
        B, H, D = 1, 2, 4
        dm = H * D
        g = mn.Graph()
        x = g.input("x", (B, S, dm))
        h = x
        for layer in range(2):
            def proj(n, h=h, layer=layer):
                return (h @ g.param(f"{n}{layer}", (dm, dm), init=mn.init.normal(0.3)))

            def heads(t):
                return t.reshape(B, S, H, D).permute(0, 2, 1, 3)

            o = ops.attention(heads(proj("q")), heads(proj("k")), heads(proj("v")), causal=True)
            h = h + o.permute(0, 2, 1, 3).reshape(B, S, dm)
        loss = (h * h).mean()
        sess = mn.compile(g, loss=loss, optimizer=mn.optim.SGD(lr=0.01), device=gpu)
        loss = sess.step(x=np.random.default_rng(0).normal(size=(B, S, dm)).astype(np.float32))
        assert np.isfinite(loss.loss)
        return sess.memory_report()["train"]["planned_peak_bytes"]

    p128, p512 = peak(128), peak(512)
    assert p512 / p128 < 6.0, (p128, p512)  # measured: 4.0x


@pytest.mark.parametrize("D", [64, 128, 5])
@pytest.mark.parametrize("storage", [16384, 32768, 49152])
def test_attention_tile_configs_fit_the_limits(D, storage):
    """Every kernel finds a tile configuration within WebGPU's minimum (16 KiB), lavapipe's
    (32 KiB) and the H200's (48 KiB) workgroup storage; WGSL is emitted (no device needed)."""
    from meganeura.dtypes import f32
    from meganeura.kernels.common import DEFAULT_LIMITS
    from meganeura.kernels.ir import Strided

    limits = dict(DEFAULT_LIMITS, max_compute_workgroup_storage_size=storage)
    C = Strided.contiguous
    q, kv = C(f32, (2, 9, 128, D)), C(f32, (2, 3, 128, D))
    row = C(f32, (2, 9, 128))
    for kind in ("fwd", "dq", "dkdv"):
        extra = (None, None, None) if kind == "fwd" else (q, row, row)
        spec = cg_attention.emit(cg_attention.AttentionKernel(
            kind, q, kv, kv, None, *extra, True, 0.125, 0, 0), limits)
        assert spec.meta["workgroup_storage"] <= storage
        assert spec.meta["workgroup_size"] <= 256
    if storage == 49152 and D == 64:  # the H200: Whisper-tiny's encoder, the measured best
        t = make_target(limits)
        assert cg_attention.choose_config("fwd", 1500, 6, 64, 64, t) == (8, 16, 4, 2)


# ---------------------------------------------------------------------------------- index ops


def _grad_case(gpu, build, shapes, feeds, seed=0):
    R = np.random.default_rng(seed)
    g = mn.Graph()
    ps = {n: g.param(n, s) for n, s in shapes.items()}
    ins = {n: g.input(n, a.shape, mn.i32) for n, a in feeds.items()}
    y = build(g, ps, ins)
    ct = g.input("ct", y.shape)
    g2, grads = mn.grad(g, (y * ct).sum())
    outs = {"y": g2[y], **{f"d{n}": v for n, v in grads.items()}}
    env = {n: R.normal(size=s).astype(np.float32) for n, s in shapes.items()}
    env.update(feeds)
    env["ct"] = R.normal(size=y.shape).astype(np.float32)
    want = dict(zip(outs, reference.evaluate(g2, list(outs.values()), env, np.float64)))
    sess = mn.compile(g2, outputs=outs, device=gpu)
    sess.set_params({n: env[n] for n in shapes})
    got = sess.run(**{n: env[n] for n in env if n not in shapes})
    for n in outs:
        assert _rel(got[n], want[n]) <= 1e-5, n
    return got, want


def test_embedding_and_grad_gpu(gpu):
    V, D = 300, 13
    ids = np.random.default_rng(0).integers(-3, V + 3, (3, 53)).astype(np.int32)
    ids[0, :10] = 7  # many repeats of one row
    got, want = _grad_case(gpu, lambda g, p, i: ops.embedding(i["ids"], p["table"]) * 2.0,
                           {"table": (V, D)}, {"ids": ids})
    used = np.zeros(V, bool)
    used[ids[(ids >= 0) & (ids < V)]] = True
    assert np.all(got["dtable"][~used] == 0.0)


@pytest.mark.parametrize("V,N", [(70000, 100), (50, 2100)])
def test_embedding_grad_gpu_is_deterministic_and_exact_order(gpu, V, N):
    """Many rows (2-D grid) / many tokens (several chunks of ids): run twice, identical bits;
    equal to the float32 reference summed in position order."""
    D = 3
    R = np.random.default_rng(2)
    ids = R.integers(0, 40, N).astype(np.int32)
    ids[::7] = V - 1
    g = mn.Graph()
    i_ = g.input("ids", (N,), mn.i32)
    d_ = g.input("dout", (N, D))
    y = ops.embedding_grad(i_, d_, V)
    dout = R.normal(size=(N, D)).astype(np.float32)
    sess = mn.compile(g, outputs={"y": y}, device=gpu)
    a = sess.run(ids=ids, dout=dout)["y"]
    b = sess.run(ids=ids, dout=dout)["y"]
    assert np.array_equal(a, b)
    (want,) = reference.evaluate(g, [y], {"ids": ids, "dout": dout}, np.float32)
    np.testing.assert_allclose(a, want, rtol=1e-6, atol=1e-6)
    assert np.all(a[40:V - 1] == 0.0)


def test_take_gpu(gpu):
    idx = np.array([[4, 0], [2, 4], [7, -1]], np.int32)  # 7, -1: out of range -> zeros
    _grad_case(gpu, lambda g, p, i: ops.take(p["x"], i["idx"], axis=1) * 3.0,
               {"x": (2, 5, 3)}, {"idx": idx})


@pytest.mark.parametrize("start", [0, 3, 9, -4])
def test_dynamic_update_slice_gpu(gpu, start):
    got, want = _grad_case(
        gpu,
        lambda g, p, i: ops.dynamic_update_slice(p["x"], p["u"].permute(0, 2, 1, 3),
                                                 i["pos"], axis=2) * 1.5,
        {"x": (2, 3, 10, 4), "u": (2, 2, 3, 4)}, {"pos": np.array(start, np.int32)})


@pytest.mark.parametrize("start", [0, 5, 99])
def test_dynamic_slice_gpu(gpu, start):
    _grad_case(gpu, lambda g, p, i: ops.dynamic_slice(p["x"], i["pos"], 3, axis=1) + 1.0,
               {"x": (4, 9, 5)}, {"pos": np.array([start], np.int32)})


def test_kv_cache_decode_step_gpu(gpu):
    """One decode step: write the new K/V row at a runtime position into the cache, attend
    with a position mask (-inf for unwritten slots)."""
    H, Smax, D = 2, 16, 4
    g = mn.Graph()
    kc = g.input("k_cache", (1, H, Smax, D))
    vc = g.input("v_cache", (1, H, Smax, D))
    pos = g.input("pos", (), mn.i32)
    q = g.input("q", (1, 2 * H, 1, D))
    kn = g.input("k_new", (1, H, 1, D))
    vn = g.input("v_new", (1, H, 1, D))
    k2 = ops.dynamic_update_slice(kc, kn, pos, 2)
    v2 = ops.dynamic_update_slice(vc, vn, pos, 2)
    slots = g.const(np.arange(Smax, dtype=np.int32))
    mask = ops.where(slots <= pos, 0.0, float("-inf"))
    o = ops.attention(q, k2, v2, mask=mask)
    outs = {"o": o, "k": k2}
    R = np.random.default_rng(4)
    env = {n: R.normal(size=v.shape).astype(np.float32) for n, v in g.inputs.items()
           if n != "pos"}
    env["pos"] = np.array(5, np.int32)
    sess = mn.compile(g, outputs=outs, device=gpu)
    got = sess.run(**env)
    want = dict(zip(outs, reference.evaluate(g, list(outs.values()), env, np.float64)))
    for n in outs:
        assert _rel(got[n], want[n]) <= TOL, n


def test_forward_output_stored_heads_last_for_the_projection(gpu):
    """attention → (B, S, H·D) → output projection: the kernel stores its output as
    (B, S, H, D), so the projection reads it in place (no transposing copy); the gradients
    (which read the output too, for delta) match the reference."""
    R = np.random.default_rng(3)
    B, H, S, D = 1, 3, 9, 8
    g = mn.Graph()
    q = g.param("q", (B, H, S, D))
    k = g.param("k", (B, H, S, D))
    v = g.param("v", (B, H, S, D))
    w = g.param("w", (H * D, 5))
    o = ops.attention(q, k, v, causal=True)
    y = ops.reshape(ops.permute(o, (0, 2, 1, 3)), (B, S, H * D)) @ w
    g2, grads = mn.grad(g, (y * y).sum())
    outs = {"y": g2[y], **{f"d{n}": x for n, x in grads.items()}}
    env = {n: R.normal(size=x.shape).astype(np.float32) for n, x in g.params.items()}
    sess = mn.compile(g2, outputs=outs, device=gpu)
    sess.set_params(env)
    labels = sess.kernel_labels(inference=True)
    assert any("[bshd]" in lbl for lbl in labels) and not any(
        lbl.startswith("copy") for lbl in labels), labels
    got = sess.run()
    want = dict(zip(outs, reference.evaluate(g2, list(outs.values()), env, np.float64)))
    for n in outs:
        assert _rel(got[n], want[n]) <= TOL, n
