"""Planner gates: memory aliasing and fusion reduce buffers and dispatches without changing
results (training steps on the GPU, fused+planned vs unfused+unplanned)."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import optim
from meganeura.models.mlp import mlp_classifier


def _sess(hidden, **kw):
    m = mlp_classifier(32, in_dim=64, hidden=hidden, classes=10)
    s = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                   optimizer=optim.AdamW(lr=1e-2, weight_decay=0.01, clip_grad_norm=5.0), **kw)
    s.init_params(seed=1)
    return s


@pytest.mark.parametrize("hidden", [(128,), (96,) * 7], ids=["digits-mlp", "8-layer-mlp"])
def test_planned_peak_at_most_0_6_of_naive(gpu, hidden):
    rep = _sess(hidden).memory_report()["train"]
    assert rep["naive_bytes"] > 0
    assert rep["planned_peak_bytes"] <= 0.6 * rep["naive_bytes"], rep
    off = _sess(hidden, plan_memory=False).memory_report()["train"]
    assert off["planned_peak_bytes"] > rep["planned_peak_bytes"]


def test_fusion_reduces_dispatches_and_planning_keeps_results(gpu):
    fused = _sess((48, 48))
    plain = _sess((48, 48), fuse=False, plan_memory=False)
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
    rng = np.random.default_rng(1)
    for _ in range(6):
        x = rng.normal(size=(16, 64)).astype(np.float32)
        y = rng.integers(0, 10, 16).astype(np.int32)
        np.testing.assert_allclose(g.step(x=x, y=y).loss, r.step(x=x, y=y).loss, rtol=1e-5)
    for k, v in r.get_params().items():
        np.testing.assert_allclose(g.get_params()[k], v, rtol=1e-4, atol=1e-5, err_msg=k)
    assert g.train.checked  # steps 2.. used the direct (unchecked) encode path


def test_profile_reports_every_kernel(gpu, tmp_path):
    s = _sess((16,))
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


def test_optimizer_states_update_in_place(gpu):
    """Adam's moments and the step counter are written straight into their own buffers (no
    temporaries, no end-of-step copies); training still matches the reference (see above)."""
    from meganeura.compile.executable import Copy

    s = _sess((32,))
    plan = s.executable.train
    copied = {k.dst.name for k in plan.ops if isinstance(k, Copy)}
    states = set(s.state_names)
    assert states and not (copied & states), copied & states
    # bound by some kernel (an in-place output shares its input's binding slot)
    written = {loc.name for d in plan.dispatches for loc in d.binds}
    assert states <= written


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


def test_parameters_live_in_the_optimizer_group_buffer(gpu):
    """The optimizer's flat parameter vector is the parameters' own storage: no concat of the
    parameters, no update copies; get/set_params still address each tensor; training equals
    the ungrouped session."""
    from meganeura.compile.executable import Copy

    s = _sess((24, 24))
    assert s.executable.group_home and set(s.param_names) <= set(s.executable.group_home)
    plan = s.executable.train
    assert not [k for k in plan.ops if isinstance(k, Copy)]
    m = mlp_classifier(32, in_dim=64, hidden=(24, 24), classes=10)
    plain = mn.compile(m.graph, loss=m.loss, outputs={"logits": m.logits},
                       optimizer=optim.AdamW(lr=1e-2, weight_decay=0.01, clip_grad_norm=5.0),
                       group_params=False)
    plain.init_params(seed=1)
    assert not plain.executable.group_home
    for k, v in plain.get_params().items():
        np.testing.assert_array_equal(s.get_params()[k], v)
    r = np.random.default_rng(0)
    for _ in range(3):
        x = r.normal(size=(32, 64)).astype(np.float32)
        y = r.integers(0, 10, 32).astype(np.int32)
        np.testing.assert_allclose(s.step(x=x, y=y).loss, plain.step(x=x, y=y).loss, rtol=1e-6)
    for k, v in plain.get_state().items():
        np.testing.assert_allclose(s.get_state()[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
    before = s.memory_report()["train"]["planned_peak_bytes"]
    assert before < plain.memory_report()["train"]["planned_peak_bytes"]


def test_gradients_are_computed_into_the_optimizer_vector(gpu):
    """Gradients that exist only to be concatenated into the optimizer's flat vector are
    written straight into their slots (no concat copy for them); results unchanged."""
    s = _sess((64, 64))  # 256-byte-aligned slots for every weight gradient
    labels = s.kernel_labels()
    plain = _sess((64, 64), plan_memory=False)
    n_concat = sum(lbl.startswith("concat") for lbl in labels)
    assert n_concat < sum(lbl.startswith("concat") for lbl in plain.kernel_labels())
    r = np.random.default_rng(0)
    for _ in range(3):
        x = r.normal(size=(32, 64)).astype(np.float32)
        y = r.integers(0, 10, 32).astype(np.int32)
        np.testing.assert_allclose(s.step(x=x, y=y).loss, plain.step(x=x, y=y).loss, rtol=1e-6)
    for k, v in plain.get_state().items():
        np.testing.assert_allclose(s.get_state()[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


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


def test_identical_layers_share_pipelines_through_parameter_ranges(gpu):
    """Parameters at 256-byte-aligned offsets of their group are bound as their own range of
    the group buffer, so identical layers compile to identical kernels (one pipeline each);
    training still matches the ungrouped session."""

    g = mn.Graph("deep")
    x = g.input("x", (16, 64))
    h = x
    for i in range(4):
        w = g.param(f"w{i}", (64, 64))
        h = (h @ w).tanh()
    loss = (h * h).mean()

    def sess(**kw):
        s = mn.compile(g, loss=loss, outputs={"h": h}, optimizer=optim.SGD(lr=0.1), **kw)
        s.init_params(seed=2)
        return s

    s = sess()
    stream = s.executable.train
    ranges = {b.offset for d in stream.dispatches for b in d.binds if b.pool == "group"}
    assert {64 * 64 * 4 * i for i in range(1, 4)} <= ranges  # w1..w3 bound at their ranges
    fwd = [d for d in stream.dispatches if d.label.startswith("matmul 1x16x64x64")]
    assert len(fwd) >= 4
    assert len({d.spec.wgsl for d in fwd[1:4]}) == 1  # w1..w3: one kernel text
    plain = sess(group_params=False)
    r = np.random.default_rng(0)
    for _ in range(3):
        xb = r.normal(size=(16, 64)).astype(np.float32)
        np.testing.assert_allclose(s.step(x=xb).loss, plain.step(x=xb).loss, rtol=1e-6)
    for k, v in plain.get_params().items():
        np.testing.assert_allclose(s.get_params()[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


def test_parameter_range_overlapping_its_group_falls_back_to_views(gpu):
    """A kernel reading a parameter and the whole flat vector of its group would bind
    overlapping writable ranges (invalid in WebGPU): the plan then reads the parameter through
    the group instead.  Training results match the reference interpreter."""
    from meganeura.compile.passes import run_pipeline
    from meganeura.compile.schedule import _make_plan, _OverlappingBindings, find_leaf_groups

    g = mn.Graph("overlap")
    a = g.param("a", (64,))
    b = g.param("b", (64,))
    flat = mn.ops.concat([a, b], axis=0)  # a flat vector of parameters: stored as one group
    y = flat[:64] * a + flat[64:]
    loss = (y * y).mean()

    def sess(backend=None):
        s = mn.compile(g, loss=loss, outputs={"y": y}, optimizer=optim.SGD(lr=0.1),
                       backend=backend)
        s.set_params({"a": np.linspace(-1, 1, 64, dtype=np.float32),
                      "b": np.linspace(0, 2, 64, dtype=np.float32)})
        return s

    s = sess()
    assert set(s.executable.group_home) == {"a", "b"}
    with pytest.raises(_OverlappingBindings):  # what the first attempt ran into
        lowered = run_pipeline(s.program)
        _make_plan(lowered, False, True, True, find_leaf_groups(lowered.graph), alias=True,
                   own_ranges=True)
    for k in s.executable.train.ops:
        locs = sorted((b.offset, b.nbytes) for b in getattr(k, "binds", ())
                      if b.pool == "group")
        for (o1, n1), (o2, n2) in zip(locs, locs[1:]):
            assert o2 >= o1 + n1 or (o1, n1) == (o2, n2), k.label
    ref = sess("reference")
    for _ in range(3):
        np.testing.assert_allclose(s.step().loss, ref.step().loss, rtol=1e-6)
    for k, v in ref.get_params().items():
        np.testing.assert_allclose(s.get_params()[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


def test_placement_policies():
    from meganeura.compile.schedule import _best_fit, _first_fit, _place

    live = [(0, 256), (512, 1024), (2048, 256)]  # holes: [256, 512) and [1536, 2048)
    assert _first_fit(live, 256) == 256 and _best_fit(live, 256) == 256
    assert _first_fit(live, 512) == 1536 and _best_fit(live, 512) == 1536
    assert _first_fit(live, 1024) == 2304 and _best_fit(live, 1024) == 2304
    live = [(0, 256), (1280, 256), (1792, 256)]  # holes of 1024 and 256 bytes
    assert _first_fit(live, 256) == 256 and _best_fit(live, 256) == 1536
    # a short-lived block placed into the big hole first-fit leaves no room for a later big one
    todo = [(1, 256, 0, 9), (2, 1024, 0, 1), (3, 256, 0, 9), (4, 256, 0, 9),
            (5, 256, 2, 3), (6, 1024, 4, 9)]
    offsets, size = _place(todo, _best_fit)
    spans = {v: (offsets[v], offsets[v] + n) for v, n, _, _ in todo}
    for v, _n, a, b in todo:  # blocks live at the same time never overlap
        for w, _m, c, d in todo:
            if v < w and not (b < c or d < a):
                assert spans[v][1] <= spans[w][0] or spans[w][1] <= spans[v][0], (v, w)
    assert size == max(e for _, e in spans.values())


def test_fused_projection_weights_are_a_range_of_the_group(gpu):
    """Weights concatenated for a fused projection that lie back to back in the optimizer's
    group (q, k, v of a layer) are that range of the group buffer: no concat kernel."""
    from meganeura.models.llama import llama_lm, tiny_llama

    cfg = tiny_llama(hidden_size=64, head_dim=16, intermediate_size=128)
    m = llama_lm(cfg, 1, 8)

    def sess(**kw):
        s = mn.compile(m.graph, loss=m.loss, outputs={}, optimizer=optim.SGD(lr=0.05), **kw)
        s.init_params(seed=4)
        return s

    def weight_concats(sess_):
        import re

        return [lbl for lbl in sess_.kernel_labels()  # 2-D (rows, hidden) weight concats
                if re.fullmatch(r"concat \(\d+, \d+\)->\(\d+, \d+\)", lbl)]

    s = sess()
    plain = sess(group_params=False)
    assert not weight_concats(s) and len(weight_concats(plain)) == 2 * cfg.num_hidden_layers
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 8)).astype(np.int32)
    feeds = {n: ids for n in s.program.feeds}
    for _ in range(2):
        np.testing.assert_allclose(s.step(**feeds).loss, plain.step(**feeds).loss, rtol=1e-5)
    for k, v in plain.get_params().items():
        np.testing.assert_allclose(s.get_params()[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_neighbouring_elementwise_kernels_merge(gpu):
    """Two stored elementwise results over one shape come from one dispatch; a kernel that
    reads its neighbour's output at other elements (a flip) stays separate.  Training matches
    the reference interpreter."""
    g = mn.Graph("merge")
    x = g.input("x", (16, 32))
    w = g.param("w", (32, 32))
    h = x @ w
    a = h.tanh()  # both stored (matmul operands), same shape, independent
    b = h.sigmoid()
    c = mn.ops.flip(a, (1,)) * 3.0  # reads a at mirrored columns
    loss = ((a @ w).sum() + (b @ w).sum() + (c @ w).sum()) / 100.0

    def sess(backend=None, **kw):
        s = mn.compile(g, loss=loss, outputs={}, optimizer=optim.SGD(lr=0.01),
                       backend=backend, **kw)
        s.set_params({"w": np.linspace(-0.2, 0.2, 32 * 32, dtype=np.float32).reshape(32, 32)})
        return s

    s = sess()
    labels = s.kernel_labels()
    merged = [lbl for lbl in labels if "+pointwise" in lbl]
    assert any("tanh" in lbl and "sigmoid" in lbl for lbl in merged), labels
    assert not any("flip" in lbl or ("tanh" in lbl and "mul" in lbl.split("|")[-1])
                   for lbl in merged), labels
    ref = sess("reference", dtype=np.float64)
    xs = np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32)
    for _ in range(2):
        np.testing.assert_allclose(s.step(x=xs).loss, ref.step(x=xs).loss, rtol=1e-5)
    np.testing.assert_allclose(s.get_params()["w"], ref.get_params()["w"], rtol=1e-5, atol=1e-7)


def test_plans_use_the_device_binding_alignment(gpu):
    """Bindings start at multiples of the device's storage-buffer offset alignment (lavapipe:
    32 bytes; the H200: 32 on wgpu-native, 16 on Dawn), not WebGPU's worst case of 256, so
    parameters of 24 floats still get their own ranges; training is unchanged."""
    from meganeura.compile.pipeline import binding_alignment
    from meganeura.kernels.common import make_target

    align = binding_alignment(make_target(gpu))
    assert align == int(gpu.limits["min_storage_buffer_offset_alignment"]) <= 256
    s = _sess((24, 24))
    offsets = {b.offset for d in s.executable.train.dispatches for b in d.binds}
    assert all(o % align == 0 for o in offsets)
    if align < 256:
        group_ranges = {b.offset for d in s.executable.train.dispatches for b in d.binds
                        if b.pool == "group" and b.offset % 256}
        assert group_ranges, "no parameter bound at a 32-byte (not 256-byte) aligned range"
    plain = _sess((24, 24), group_params=False)
    r = np.random.default_rng(0)
    for _ in range(3):
        x = r.normal(size=(32, 64)).astype(np.float32)
        y = r.integers(0, 10, 32).astype(np.int32)
        np.testing.assert_allclose(s.step(x=x, y=y).loss, plain.step(x=x, y=y).loss, rtol=1e-6)


def test_head_concats_are_written_in_place_even_nested(gpu):
    """Values made only to be concatenated along an axis with unit dimensions before it (the
    heads of a batch-1 attention gradient) are computed straight into their slots; a concat
    that itself only feeds an outer concat lies in the outer one's slot.  No concat kernel,
    results as the reference."""
    from meganeura import reference

    g = mn.Graph("heads")
    p = g.param("p", (1, 3, 4, 8))
    q = g.param("q", (1, 2, 4, 8))
    r = g.param("r", (1, 1, 4, 8))
    a = (p * 2.0).exp()
    b = q.tanh()
    c = mn.ops.concat([a, b], axis=1)  # (1, 5, 4, 8), only feeds the outer concat
    d = mn.ops.concat([c, r.sigmoid()], axis=1)  # (1, 6, 4, 8)
    out = (d * d).sum(axis=(2, 3))
    s = mn.compile(g, outputs={"out": out})
    r_ = np.random.default_rng(0)
    params = {n: r_.normal(size=v.shape).astype(np.float32) * 0.5 for n, v in g.params.items()}
    s.set_params(params)
    assert not [lbl for lbl in s.kernel_labels() if lbl.startswith("concat")], s.kernel_labels()
    want = reference.evaluate(g, [out], params, np.float64)[0]
    np.testing.assert_allclose(s.run()["out"], want, rtol=1e-5)


def test_norm_runs_its_elementwise_pass_in_the_reduction(gpu):
    """RMS-norm: the reduction stores rstd and, in the same dispatch, writes x * rstd * w over
    the rows; a reduction over more than POST_MAX_REDUCED elements keeps a separate
    elementwise kernel.  Both equal the reference."""
    from meganeura import reference
    from meganeura.compile.schedule import POST_MAX_REDUCED

    for width in (96, POST_MAX_REDUCED + 4):
        g = mn.Graph("norm")
        x = g.input("x", (6, width))
        w = g.param("w", (width,))
        rstd = ((x * x).mean(axis=-1, keepdims=True) + 1e-6).rsqrt()
        y = x * rstd * w
        s = mn.compile(g, outputs={"y": y, "rstd": rstd})
        xs = np.random.default_rng(0).normal(size=(6, width)).astype(np.float32)
        ws = np.linspace(0.5, 1.5, width, dtype=np.float32)
        s.set_params({"w": ws})
        labels = s.kernel_labels(inference=True)
        merged = any("=>" in lbl for lbl in labels)
        assert merged == (width <= POST_MAX_REDUCED), labels
        got = s.run(x=xs)
        want = reference.evaluate(g, [y, rstd], {"x": xs, "w": ws}, np.float64)
        np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["rstd"], want[1], rtol=1e-5)
