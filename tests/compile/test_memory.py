"""Memory planning (compile/memory.py): the arena, parameter groups, in-place updates and
binding ranges reduce buffers and copies without changing results."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import optim
from meganeura.models.mlp import mlp_classifier

from .conftest import assert_trains_alike


@pytest.mark.parametrize("hidden", [(128,), (96,) * 7], ids=["digits-mlp", "8-layer-mlp"])
def test_planned_peak_at_most_0_6_of_naive(gpu, mlp_session, hidden):
    rep = mlp_session(hidden).memory_report()["train"]
    assert rep["naive_bytes"] > 0
    assert rep["planned_peak_bytes"] <= 0.6 * rep["naive_bytes"], rep
    off = mlp_session(hidden, plan_memory=False).memory_report()["train"]
    assert off["planned_peak_bytes"] > rep["planned_peak_bytes"]


def test_optimizer_states_update_in_place(gpu, mlp_session):
    """Adam's moments and the step counter are written straight into their own buffers (no
    temporaries, no end-of-step copies); training still matches the reference (see above)."""
    from meganeura.compile.executable import Copy

    s = mlp_session((32,))
    plan = s.executable.train
    copied = {k.dst.name for k in plan.ops if isinstance(k, Copy)}
    states = set(s.state_names)
    assert states and not (copied & states), copied & states
    # bound by some kernel (an in-place output shares its input's binding slot)
    written = {loc.name for d in plan.dispatches for loc in d.binds}
    assert states <= written


def test_parameters_live_in_the_optimizer_group_buffer(gpu, mlp_session):
    """The optimizer's flat parameter vector is the parameters' own storage: no concat of the
    parameters, no update copies; get/set_params still address each tensor; training equals
    the ungrouped session."""
    from meganeura.compile.executable import Copy

    s = mlp_session((24, 24))
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
    assert_trains_alike(s, plain)
    before = s.memory_report()["train"]["planned_peak_bytes"]
    assert before < plain.memory_report()["train"]["planned_peak_bytes"]


def test_gradients_are_computed_into_the_optimizer_vector(gpu, mlp_session):
    """Gradients that exist only to be concatenated into the optimizer's flat vector are
    written straight into their slots (no concat copy for them); results unchanged."""
    s = mlp_session((64, 64))  # 256-byte-aligned slots for every weight gradient
    labels = s.kernel_labels()
    plain = mlp_session((64, 64), plan_memory=False)
    n_concat = sum(lbl.startswith("concat") for lbl in labels)
    assert n_concat < sum(lbl.startswith("concat") for lbl in plain.kernel_labels())
    assert_trains_alike(s, plain)


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
    plan = s.executable.train
    ranges = {b.offset for d in plan.dispatches for b in d.binds if b.pool == "group"}
    assert {64 * 64 * 4 * i for i in range(1, 4)} <= ranges  # w1..w3 bound at their ranges
    fwd = [d for d in plan.dispatches if d.label.startswith("matmul 1x16x64x64")]
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
    from meganeura.compile.memory import (
        _candidates,
        _Request,
        binds_overlapping_group_ranges,
        find_leaf_groups,
    )
    from meganeura.compile.passes import run_pipeline

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
    # what the plan decides first: with parameters as their own ranges, a kernel would bind
    # a parameter's range and its whole group
    lowered = run_pipeline(s.program)
    groups = find_leaf_groups(lowered.graph)
    own = _candidates(_Request(lowered, False, True, True, groups, 256), own_ranges=True)
    assert any(binds_overlapping_group_ranges(c) for c in own)
    for k in s.executable.train.dispatches:
        locs = sorted((b.offset, b.nbytes) for b in k.binds if b.pool == "group")
        for (o1, n1), (o2, n2) in zip(locs, locs[1:]):
            assert o2 >= o1 + n1 or (o1, n1) == (o2, n2), k.label
    ref = sess("reference")
    for _ in range(3):
        np.testing.assert_allclose(s.step().loss, ref.step().loss, rtol=1e-6)
    for k, v in ref.get_params().items():
        np.testing.assert_allclose(s.get_params()[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


def test_placement_policies():
    from meganeura.compile.memory import _best_fit, _first_fit, _place

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


def test_placement_never_overlaps_live_blocks_on_random_lifetimes():
    """Both fits on many random lifetimes: blocks alive at once never overlap, and the arena
    is the largest end (the fits assume sorted, disjoint live blocks; this checks it holds)."""
    from meganeura.compile.memory import _best_fit, _first_fit, _place

    rng = np.random.default_rng(7)
    for trial in range(40):
        n = int(rng.integers(2, 40))
        starts = np.sort(rng.integers(0, 50, n))
        todo = [(i, int(rng.integers(1, 5000)), int(s), int(s + rng.integers(0, 20)))
                for i, s in enumerate(starts)]
        for fit in (_first_fit, _best_fit):
            offsets, size = _place(todo, fit, align=32)
            spans = {v: (offsets[v], offsets[v] + -(-nb // 32) * 32) for v, nb, _, _ in todo}
            for v, _n, a, b in todo:
                assert offsets[v] % 32 == 0
                for w, _m, c, d in todo:
                    if v < w and not (b < c or d < a):
                        assert spans[v][1] <= spans[w][0] or spans[w][1] <= spans[v][0], \
                            (trial, fit.__name__, v, w)
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


def test_plans_use_the_device_binding_alignment(gpu, mlp_session):
    """Bindings start at multiples of the device's storage-buffer offset alignment (lavapipe:
    32 bytes; the H200: 32 on wgpu-native, 16 on Dawn), not WebGPU's worst case of 256, so
    parameters of 24 floats still get their own ranges; training is unchanged."""
    from meganeura.compile.pipeline import binding_alignment
    from meganeura.kernels.common import make_target

    align = binding_alignment(make_target(gpu))
    assert align == int(gpu.limits["min_storage_buffer_offset_alignment"]) <= 256
    s = mlp_session((24, 24))
    offsets = {b.offset for d in s.executable.train.dispatches for b in d.binds}
    assert all(o % align == 0 for o in offsets)
    if align < 256:
        group_ranges = {b.offset for d in s.executable.train.dispatches for b in d.binds
                        if b.pool == "group" and b.offset % 256}
        assert group_ranges, "no parameter bound at a 32-byte (not 256-byte) aligned range"
    plain = mlp_session((24, 24), group_params=False)
    r = np.random.default_rng(0)
    for _ in range(3):
        x = r.normal(size=(32, 64)).astype(np.float32)
        y = r.integers(0, 10, 32).astype(np.int32)
        np.testing.assert_allclose(s.step(x=x, y=y).loss, plain.step(x=x, y=y).loss, rtol=1e-6)


def test_overlap_predicate_sees_a_parameter_range_inside_its_group():
    """``overlapping_ranges``: only distinct ranges of one group buffer sharing bytes count."""
    from meganeura.compile.executable import Loc
    from meganeura.compile.memory import overlapping_ranges

    whole = Loc("group", "g0", 0, 512)
    param = Loc("group", "g0", 256, 128)
    assert overlapping_ranges([param, whole])  # a parameter's own range and its whole group
    assert overlapping_ranges([Loc("group", "g0", 0, 300), param])  # partly
    assert not overlapping_ranges([whole, whole])  # identical: bound once by the runtime
    assert not overlapping_ranges([Loc("group", "g0", 0, 256), param])  # back to back
    assert not overlapping_ranges([param, Loc("group", "g1", 0, 512)])  # another group
    assert not overlapping_ranges([Loc("temp", "", 0, 512), Loc("temp", "", 256, 128)])
    assert not overlapping_ranges([])


def test_inference_stores_fused_weights_back_to_back(gpu):
    """An inference program that concatenates parameters along axis 0 (fused q/k/v, gate/up
    weights) stores them back to back: the concat is their buffer, no kernel per run; outputs
    and get/set_params equal the ungrouped session."""
    g = mn.Graph("fused")
    x = g.input("x", (4, 8))
    wq, wk = g.param("wq", (6, 8)), g.param("wk", (3, 8))
    y = mn.ops.matmul(x, mn.ops.concat([wq, wk], 0), transpose_b=True).tanh()
    r = np.random.default_rng(0)
    params = {"wq": r.normal(size=(6, 8)).astype(np.float32),
              "wk": r.normal(size=(3, 8)).astype(np.float32)}
    xb = r.normal(size=(4, 8)).astype(np.float32)
    grouped, plain = (mn.compile(g, outputs={"y": y}, group_params=gp) for gp in (True, False))
    for s in (grouped, plain):
        s.set_params(params)
    assert set(grouped.executable.group_home) == {"wq", "wk"}
    assert not [lbl for lbl in grouped.kernel_labels(True) if lbl.startswith("concat")]
    assert [lbl for lbl in plain.kernel_labels(True) if lbl.startswith("concat")]
    np.testing.assert_array_equal(grouped.run(x=xb)["y"], plain.run(x=xb)["y"])
    for k, v in params.items():
        np.testing.assert_array_equal(grouped.get_params()[k], v)
