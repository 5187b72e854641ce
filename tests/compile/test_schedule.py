"""Scheduling (compile/schedule.py): fusion reduces dispatches without changing results
(training steps on the GPU, fused vs unfused), views as strides, split reductions and split-K
matmuls, epilogues, values computed into their concat slot."""

import numpy as np

import meganeura as mn
from meganeura import optim
from meganeura.models.mlp import mlp_classifier

from .conftest import assert_trains_alike


def test_fusion_reduces_dispatches_and_planning_keeps_results(gpu, mlp_session):
    fused = mlp_session((48, 48))
    plain = mlp_session((48, 48), fuse=False, plan_memory=False)
    assert fused.memory_report()["train"]["dispatches"] < plain.memory_report()["train"][
        "dispatches"]
    r = np.random.default_rng(0)
    for _ in range(4):
        x = r.normal(size=(32, 64)).astype(np.float32)
        y = r.integers(0, 10, 32).astype(np.int32)
        a, b = fused.step(x=x, y=y), plain.step(x=x, y=y)
        np.testing.assert_allclose(a.loss, b.loss, rtol=1e-6)
        np.testing.assert_allclose(a.outputs["logits"], b.outputs["logits"], rtol=1e-6, atol=1e-6)
    pa, pb = fused.get_state(), plain.get_state()
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_gpu_training_matches_reference_session(gpu):
    m = mlp_classifier(16, in_dim=64, hidden=(32,), classes=10)
    opt = lambda: optim.AdamW(lr=optim.WarmupCosine(1e-2, 2, 10), weight_decay=0.05)  # noqa: E731
    g = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits}, optimizer=opt())
    r = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits}, optimizer=opt(),
                   backend="reference")
    g.init_params(seed=5)
    r.init_params(seed=5)
    assert_trains_alike(g, r, steps=6, batch=16, rtol=1e-5, atol=1e-5, seed=1)
    assert g.train.checked  # steps 2.. used the direct (unchecked) encode path


def test_profile_reports_every_kernel(gpu, mlp_session, tmp_path):
    s = mlp_session((16,))
    x = np.zeros((32, 64), np.float32)
    y = np.zeros(32, np.int32)
    prof = s.profile(steps=2, x=x, y=y)
    assert prof.dispatches_per_step == s.memory_report()["train"]["dispatches"]
    assert sum(k.calls for k in prof.kernels) == 2 * prof.dispatches_per_step
    assert "matmul" in str(prof)
    s.export_trace(str(tmp_path / "t.json"))
    import json

    ev = json.load(open(tmp_path / "t.json"))["traceEvents"]
    assert len(ev) == 2 * prof.dispatches_per_step


def test_matmul_epilogue_fusion_bias_activation_and_reduce_consumer(gpu):
    """Bias + activation fuse into the matmul; a matmul consumed by a fused reduce prologue is
    computed first; both give the reference result."""
    from meganeura import ops, reference

    g = mn.Graph()
    x = g.param("x", (2, 5, 7))
    w = g.param("w", (3, 7))
    b = g.param("b", (3,))
    h = (ops.matmul(x, w, transpose_b=True) + b).tanh()
    s = ((x @ ops.transpose(w, 0, 1)) * 2.0).sum(-1)  # matmul -> mul -> reduce prologue
    loss = (h * h).sum() + s.sum()
    g2, grads = mn.grad(g, loss)
    outs = {"h": g2[h], "s": g2[s], **grads}
    r = np.random.default_rng(0)
    env = {"x": r.normal(size=(2, 5, 7)), "w": r.normal(size=(3, 7)), "b": r.normal(size=3)}
    env = {k: v.astype(np.float32) for k, v in env.items()}
    want = dict(zip(outs, reference.evaluate(g2, list(outs.values()), env, np.float64)))
    sess = mn.compile(g2, outputs=outs)
    labels = sess.kernel_labels(inference=True)
    assert any(lbl.startswith("matmul") and "+add,tanh" in lbl for lbl in labels), labels
    sess.set_params(env)
    got = sess.run()
    for k in outs:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-4, err_msg=k)


def test_long_reductions_split_into_partial_and_final_kernels(gpu):
    from meganeura import reference

    g = mn.Graph()
    x = g.param("x", (6000, 3))
    loss = (x * x).sum() + x.sum(0).sum()
    g2, grads = mn.grad(g, loss)
    outs = {"loss": g2[loss], "dx": grads["x"]}
    sess = mn.compile(g2, outputs=outs)
    labels = sess.kernel_labels(inference=True)
    assert any("[partial]" in lbl for lbl in labels), labels
    env = {"x": np.random.default_rng(0).normal(size=(6000, 3)).astype(np.float32)}
    sess.set_params(env)
    got = sess.run()
    want = reference.evaluate(g2, list(outs.values()), env, np.float64)
    np.testing.assert_allclose(got["loss"], want[0], rtol=1e-5)
    np.testing.assert_allclose(got["dx"], want[1], rtol=1e-5, atol=1e-6)


def test_split_k_matmul_for_few_tiles_and_long_k(gpu):
    """Small-M GEMMs with a long K (weight gradients, LM heads) are split along K into a
    batch of partial products and an ordered sum; results equal the reference."""
    from meganeura import ops, reference

    g = mn.Graph()
    a = g.param("a", (6, 3000))
    b = g.param("b", (5, 3000))
    y = ops.matmul(a, b, transpose_b=True)  # M=6, N=5, K=3000
    c = g.param("c", (5, 3000))
    r = g.input("r", (6, 5))
    z = (ops.matmul(a, c, transpose_b=True) + r).relu()  # epilogue runs in the ordered sum
    env = {"a": np.random.default_rng(0).normal(size=(6, 3000)).astype(np.float32),
           "b": np.random.default_rng(1).normal(size=(5, 3000)).astype(np.float32),
           "c": np.random.default_rng(3).normal(size=(5, 3000)).astype(np.float32),
           "r": np.random.default_rng(2).normal(size=(6, 5)).astype(np.float32) * 50}
    sess = mn.compile(g, outputs={"y": y, "z": z})
    labels = sess.kernel_labels(inference=True)
    assert any("split-K" in lbl for lbl in labels), labels
    assert any(lbl.endswith("[split-K sum] +add,relu") for lbl in labels), labels
    assert not any(lbl.startswith("pointwise") for lbl in labels), labels
    sess.set_params({k: env[k] for k in ("a", "b", "c")})
    got = sess.run(r=env["r"])
    want = reference.evaluate(g, [y, z], env, np.float64)
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(got["z"], want[1], rtol=1e-4, atol=1e-3)


def test_reductions_over_unit_axes_become_reshapes():
    from meganeura.compile.passes import run_pipeline
    from meganeura.program import build_program

    g = mn.Graph()
    x = g.param("x", (1, 4, 3))
    y = (x * 2.0).sum(0).max((1,), keepdims=True)  # sum over a size-1 axis; a real max
    p = run_pipeline(build_program(g, outputs={"y": y}))
    ops = [n.op for n in p.graph.nodes]
    assert ops.count("sum") == 0 and ops.count("max") == 1, ops


def test_matmul_epilogue_through_a_reshape(gpu):
    """A 2-D projection viewed as (batch, seq, features) plus bias and residual: one kernel."""
    from meganeura import ops, reference

    g = mn.Graph()
    x = g.param("x", (2, 5, 8))
    w = g.param("w", (8, 8))
    b = g.param("b", (8,))
    h = ops.matmul(x.reshape(10, 8), w, transpose_b=True).reshape(2, 5, 8)
    y = (h + b) + x
    env = {k: np.random.default_rng(i).normal(size=v.shape).astype(np.float32)
           for i, (k, v) in enumerate(g.params.items())}
    sess = mn.compile(g, outputs={"y": y})
    labels = sess.kernel_labels(inference=True)
    assert len(labels) == 1 and labels[0].startswith("matmul") and "+add" in labels[0], labels
    sess.set_params(env)
    np.testing.assert_allclose(sess.run()["y"], reference.evaluate(g, [y], env, np.float64)[0],
                               rtol=1e-5, atol=1e-5)


def test_reshape_of_strided_views_matches_numpy():
    """reshape_strided agrees with numpy on random permuted/flipped views; when it declines,
    a copy is needed (numpy would copy too for those we check)."""
    from meganeura.compile.schedule import reshape_strided
    from meganeura.dtypes import f32
    from meganeura.kernels.ir import Strided

    rng = np.random.default_rng(0)
    done = 0
    for _ in range(800):
        shape = tuple(int(x) for x in rng.integers(1, 4, rng.integers(1, 5)))
        owner = np.arange(int(np.prod(shape))).reshape(shape)
        a = owner.transpose(rng.permutation(len(shape)))
        if rng.random() < 0.3:
            a = a[..., ::-1]
        off = (a.__array_interface__["data"][0] - owner.__array_interface__["data"][0]) // 8
        s = Strided(f32, a.shape, tuple(st // 8 for st in a.strides), off, a.size)
        n, dims = a.size, []
        while n > 1:
            d = int(rng.choice([x for x in range(2, n + 1) if n % x == 0]))
            dims.append(d)
            n //= d
        new = tuple(dims) or (1,)
        r = reshape_strided(s, new)
        if r is None:
            continue
        idx = np.indices(new).reshape(len(new), -1).T
        got = owner.reshape(-1)[r.offset + idx @ np.array(r.strides, dtype=np.int64)]
        np.testing.assert_array_equal(got.reshape(new), a.reshape(new))
        done += 1
    assert done > 400


def test_reduce_epilogue_fusion(gpu):
    """A pointwise consumer of a reduction at the reduced shape runs in the reduce kernel
    (RMSNorm statistics; a long split reduction with an extra input in its final pass)."""
    from meganeura import ops, reference

    g = mn.Graph()
    x = g.param("x", (6, 10))
    b = g.param("b", (6, 1))
    r = ops.rsqrt(ops.mean(x * x, -1, keepdims=True) + 1e-5) * b  # reduce + epilogue with extra
    y = x * r
    z = g.param("z", (5000, 2))
    t = ops.sum(z * z, 0) * ops.sum(z, 0) + 1.0  # split reduction; epilogue reads another sum
    env = {k: np.random.default_rng(i).normal(size=v.shape).astype(np.float32)
           for i, (k, v) in enumerate(g.params.items())}
    sess = mn.compile(g, outputs={"y": y, "t": t})
    labels = sess.kernel_labels(inference=True)
    assert any(lbl.startswith("reduce_sum") and "+" in lbl.split(">")[-1] for lbl in labels), labels
    sess.set_params(env)
    got = sess.run()
    want = reference.evaluate(g, [y, t], env, np.float64)
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["t"], want[1], rtol=1e-5)


def _matches_reference(g, outputs: dict, check: str, seed: int, scale: float = 1.0,
                       atol: float = 1e-6):
    """``g`` compiled for ``outputs`` on random parameters; output ``check`` against the
    float64 reference.  Returns the session."""
    from meganeura import reference

    s = mn.compile(g, outputs=outputs)
    r_ = np.random.default_rng(seed)
    params = {n: r_.normal(size=v.shape).astype(np.float32) * scale
              for n, v in g.params.items()}
    s.set_params(params)
    want = reference.evaluate(g, [outputs[check]], params, np.float64)[0]
    np.testing.assert_allclose(s.run()[check], want, rtol=1e-5, atol=atol)
    return s


def _concat_labels(s) -> list[str]:
    labels = s.kernel_labels(inference=True)
    assert labels
    return [lbl for lbl in labels if lbl.startswith("concat")]


def test_head_concats_are_written_in_place_even_nested(gpu):
    """Values made only to be concatenated along an axis with unit dimensions before it (the
    heads of a batch-1 attention gradient) are computed straight into their slots; a concat
    that itself only feeds an outer concat lies in the outer one's slot.  No concat kernel,
    results as the reference."""
    g = mn.Graph("heads")
    p = g.param("p", (1, 3, 4, 8))
    q = g.param("q", (1, 2, 4, 8))
    r = g.param("r", (1, 1, 4, 8))
    a = (p * 2.0).exp()
    b = q.tanh()
    c = mn.ops.concat([a, b], axis=1)  # (1, 5, 4, 8), only feeds the outer concat
    d = mn.ops.concat([c, r.sigmoid()], axis=1)  # (1, 6, 4, 8)
    s = _matches_reference(g, {"out": (d * d).sum(axis=(2, 3))}, "out", 0, scale=0.5,
                           atol=0.0)
    assert not _concat_labels(s)


def test_inner_axis_concats_of_elementwise_results_are_written_through_strided_views(gpu):
    """A concat along the last axis of rows (the gate and up halves of a fused projection's
    gradient) of values made by elementwise kernels for it alone: the kernels write into the
    concat's buffer through strided views (scalar stores here: rows of 21 elements rule out
    vec4, which tests/kernels/test_pointwise.py covers), so no concat kernel runs; an input
    with another reader, or one value in two slots, keeps the concat.  Results as the
    reference."""
    g = mn.Graph("rows")
    x = g.param("x", (1, 6, 8))
    y = g.param("y", (1, 6, 5))
    w = g.param("w", (21, 3))
    a, b = (x * 2.0).exp(), y.tanh()
    c = mn.ops.concat([a, b, x.sigmoid()], axis=-1)  # (1, 6, 21)
    s = _matches_reference(g, {"out": mn.ops.matmul(c, w)}, "out", 3, scale=0.5)
    assert not _concat_labels(s)
    views = [v for d in s.infer.stream.dispatches if d.spec.meta.get("archetype") == "pointwise"
             for v in [d.spec.wgsl.count("* 21u")]]
    assert sum(views) >= 1  # rows of the concat's stride
    # ``a`` read by something else as well: its slot is not placed, the concat copies it
    g2 = mn.Graph("rows2")
    x2, y2, w2 = g2.param("x", (1, 6, 8)), g2.param("y", (1, 6, 8)), g2.param("w", (16, 3))
    a2 = (x2 * 2.0).exp()
    out2 = mn.ops.matmul(mn.ops.concat([a2, y2.tanh()], axis=-1), w2)
    s2 = _matches_reference(g2, {"out": out2, "a": a2.sum()}, "out", 4, atol=1e-5)
    assert _concat_labels(s2)
    # one value in two slots (itself and through a view) stays where it is: both are copied
    g3 = mn.Graph("rows3")
    x3, w3 = g3.param("x", (1, 8, 8)), g3.param("w", (16, 3))
    a3 = (x3 * 2.0).exp()
    out3 = mn.ops.matmul(mn.ops.concat([a3, a3.transpose((0, 2, 1))], axis=-1), w3)
    _matches_reference(g3, {"out": out3}, "out", 5, atol=1e-5)


def test_plain_split_k_sums_are_vec4_pointwise_kernels(gpu, monkeypatch):
    """A split-K sum without an epilogue is a pointwise kernel over the partials' views
    (``SPLIT_SUM_POINTWISE``: vec4 where the output allows, scalar otherwise), the reduction
    when switched off; both give the float64 reference."""
    from meganeura import ops, reference
    from meganeura.compile import schedule

    rng = np.random.default_rng(4)
    for m, n, vec in ((8, 12, True), (6, 5, False)):  # 96 outputs: vec4; 30: scalar
        g = mn.Graph()
        a, b = g.param("a", (m, 3000)), g.param("b", (n, 3000))
        y = ops.matmul(a, b, transpose_b=True)
        env = {"a": rng.normal(size=(m, 3000)).astype(np.float32),
               "b": rng.normal(size=(n, 3000)).astype(np.float32)}
        want = reference.evaluate(g, [y], env, np.float64)[0]
        for pointwise in (True, False):
            monkeypatch.setattr(schedule, "SPLIT_SUM_POINTWISE", pointwise)
            sess = mn.compile(g, outputs={"y": y})
            (d,) = [d for d in sess.infer.stream.dispatches if "[split-K sum]" in d.label]
            kind = d.spec.meta.get("archetype")
            assert kind == ("pointwise" if pointwise else "reduce"), (kind, d.spec.meta)
            assert ("x4" in d.spec.meta.get("label_tag", "")) == (pointwise and vec), d.spec.meta
            sess.set_params(env)
            np.testing.assert_allclose(sess.run()["y"], want, rtol=1e-4, atol=1e-3)


def test_split_k_counts_64x64_tiles_to_three_per_sm():
    """GEMMs of 64+ 64x64 tiles but few 128x128 ones split K until SPLIT_K_FILL 64x64 tiles,
    and the split batch then runs on 64x64 tiles (choose_config): Whisper's long-K GEMMs get 3
    (432 workgroups), 1152x384x1500 gets 4; the small-M rule (SmolLM2, Whisper's 384x384) and
    the no-split cases are unchanged."""
    from meganeura.compile.schedule import SPLIT_K_FILL, split_k
    from meganeura.dtypes import f32
    from meganeura.kernels import MatmulKernel, Strided
    from meganeura.kernels.matmul import STRICT_LADDER, choose_config

    def sk(m, n, k):
        return split_k(MatmulKernel(1, m, n, k, Strided.contiguous(f32, (1, m, k)),
                                    Strided.contiguous(f32, (1, k, n))))

    for m, n, k, want in ((1500, 384, 1536, 3), (1536, 384, 1500, 3), (384, 1536, 1500, 3),
                          (1500, 384, 1152, 3), (1152, 384, 1500, 4)):
        s = sk(m, n, k)
        assert s == want, (m, n, k, s)
        assert s * -(-m // 64) * -(-n // 64) >= SPLIT_K_FILL
        assert choose_config(s, m, n, k // s) == STRICT_LADDER[1]  # 64x64, 8x4 per thread
    assert (sk(384, 384, 1500), sk(128, 576, 960), sk(128, 576, 1536)) == (6, 5, 12)
    assert sk(1500, 1536, 384) == 1 and sk(1500, 384, 384) == 1 and sk(2048, 2048, 4096) == 1


def test_small_m_split_partials_run_the_small_m_split_tile(gpu):
    """SmolLM2's 1x128x576x960 (K past the sliced rule's range, at most 1024) splits K into
    chunks of about 192 (5) computed on ``SMALL_M_SPLIT`` tiles, the partials knowing the
    whole GEMM (``split_of``); 1x128x576x1536 keeps split 12 of the ladder's 64x64 tiles; both
    give the float64 product."""
    from meganeura import ops, reference
    from meganeura.kernels.matmul import SMALL_M_SPLIT, config_name, partials_config

    rng = np.random.default_rng(5)
    for k, split, tile in ((960, 5, config_name(SMALL_M_SPLIT)),
                           (1536, 12, config_name(partials_config(12, 128, 576, 1536)))):
        g = mn.Graph()
        a, b = g.param("a", (128, k)), g.param("b", (k, 576))
        y = ops.matmul(a, b)
        env = {"a": rng.normal(size=(128, k)).astype(np.float32),
               "b": rng.normal(size=(k, 576)).astype(np.float32)}
        sess = mn.compile(g, outputs={"y": y})
        (d,) = [d for d in sess.infer.stream.dispatches if "[split-K " in d.label
                and "sum" not in d.label]
        assert d.label.endswith(f"[split-K {split}]"), d.label
        assert d.spec.meta["variant"] == tile, (k, d.spec.meta["variant"])
        assert (tile == "tiled16x32_4x4k8v_ks2") == (k == 960)
        sess.set_params(env)
        want = reference.evaluate(g, [y], env, np.float64)[0]
        np.testing.assert_allclose(sess.run()["y"], want, rtol=1e-4, atol=1e-3)
