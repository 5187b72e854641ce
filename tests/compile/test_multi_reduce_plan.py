"""Sibling reductions grouped into one dispatch (compile/siblings.py): which reductions
group (same shape, axes and split; inputs ready; binding cap) and which must not (an input
made later), and that grouped plans compute what the reference does."""

import numpy as np
import pytest

import meganeura as mn
from meganeura import nn, optim, reference
from meganeura.compile.schedule import MAX_BINDINGS


def _multi(labels):
    return [lbl for lbl in labels if lbl.startswith("multi_reduce")]


def test_ready_siblings_group_and_a_later_input_keeps_its_own_kernel(gpu):
    """r1 = Σx and r3 = Σx² group; r2 = Σ(x·tanh(x@w)) reads a matmul made after them, so it
    is not moved before it; r4 reduces other axes and stays alone.  Values match float64."""
    g = mn.Graph("sib")
    x = g.input("x", (40, 24))
    w = g.param("w", (24, 24))
    r1 = x.sum(axis=0) * 2.0  # (an epilogue: the kernel is scheduled at the product)
    r3 = (x * x).sum(axis=0) * 2.0
    y = (x @ w).tanh()
    r2 = (x * y).sum(axis=0) * 2.0
    r4 = (x * x).sum(axis=1) * 2.0
    outs = {"r1": r1, "r2": r2, "r3": r3, "r4": r4}
    s = mn.compile(g, outputs=outs)
    labels = s.kernel_labels(inference=True)
    multi = _multi(labels)
    assert len(multi) == 1 and "{+mul; <mul> +mul}" in multi[0], labels
    assert sum(lbl.startswith("reduce_sum") for lbl in labels) == 2, labels
    assert labels.index(multi[0]) < next(i for i, lbl in enumerate(labels) if "matmul" in lbl)
    xs = np.random.default_rng(0).normal(size=(40, 24)).astype(np.float32)
    ws = np.random.default_rng(1).normal(size=(24, 24)).astype(np.float32) * 0.2
    s.set_params({"w": ws})
    got = s.run(x=xs)
    want = reference.evaluate(g, list(outs.values()), {"x": xs, "w": ws}, np.float64)
    for (name, _), ref in zip(outs.items(), want, strict=True):
        np.testing.assert_allclose(got[name], ref, rtol=1e-5, atol=1e-5, err_msg=name)


def test_group_size_stays_within_the_binding_cap(gpu):
    """Eight sums of distinct inputs over one shape: each group binds at most the cap's
    storage buffers (8 portable, the device's limit otherwise), so they split into several
    kernels; every result is exact either way."""
    g = mn.Graph("cap")
    xs = [g.input(f"x{i}", (8, 16)) for i in range(8)]
    outs = {f"s{i}": (x * x).sum(axis=0) * 1.5 for i, x in enumerate(xs)}
    cap = gpu.limits.get("max_storage_buffers_per_shader_stage", 8)
    feeds = {f"x{i}": np.full((8, 16), i + 1, np.float32) for i in range(8)}
    for portable, limit in ((True, MAX_BINDINGS), (False, cap)):
        s = mn.compile(g, outputs=outs, portable=portable)
        multi = _multi(s.kernel_labels(inference=True))
        sizes = [int(lbl.split("[", 1)[1].split("]")[0]) for lbl in multi]
        assert sizes and all(2 * n <= limit for n in sizes), (portable, multi)
        got = s.run(**feeds)
        for i in range(8):
            np.testing.assert_allclose(got[f"s{i}"], np.full(16, 8 * (i + 1) ** 2 * 1.5),
                                       rtol=1e-6)


def test_batch_norm_training_groups_its_gradient_sums(gpu):
    """Batch norm's backward sums group, also when split into partial and final passes (a
    reduced extent past the post-pass limit); training matches the float64 reference."""
    g = mn.Graph("bn")
    x = g.input("x", (2, 4, 48, 48))  # 4,608 elements per channel: split reductions
    w = g.param("w", (4, 4, 3, 3))
    h = mn.ops.conv2d(x, w, padding=1)
    y = nn.BatchNorm2d(4)(g, h)
    loss = (y.relu() * y).mean()

    def sess(backend=None, **kw):
        s = mn.compile(g, loss=loss, outputs={}, optimizer=optim.SGD(lr=0.1), backend=backend,
                       **kw)
        s.set_params({"w": np.linspace(-0.3, 0.3, 144, dtype=np.float32).reshape(4, 4, 3, 3)})
        return s

    s = sess()
    multi = _multi(s.kernel_labels())
    assert any("[partial]" in lbl for lbl in multi) and any("[final]" in lbl for lbl in multi), \
        s.kernel_labels()
    ref = sess("reference", dtype=np.float64)
    xs = np.random.default_rng(0).normal(size=(2, 4, 48, 48)).astype(np.float32)
    for _ in range(2):
        np.testing.assert_allclose(s.step(x=xs).loss, ref.step(x=xs).loss, rtol=1e-5)
    for name, v in ref.get_params().items():
        np.testing.assert_allclose(s.get_params()[name], v, rtol=1e-4, atol=1e-6, err_msg=name)


def test_medium_column_reduction_is_split(gpu):
    """A column sum over 600 rows of 64 outputs (two workgroups unsplit) runs as partial and
    final passes (COLUMN_MIN_CHUNK); a row sum of the same size stays one kernel."""
    g = mn.Graph("col")
    x = g.input("x", (600, 64))
    outs = {"c": x.sum(axis=0) * 1.0, "r": x.T.sum(axis=0) * 1.0}
    s = mn.compile(g, outputs=outs)
    labels = s.kernel_labels(inference=True)
    col = [lbl for lbl in labels if "->(64,)" in lbl]
    row = [lbl for lbl in labels if "->(600,)" in lbl]
    assert any("[partial]" in lbl for lbl in col) and not any("[" in lbl for lbl in row), labels
    xs = np.random.default_rng(0).normal(size=(600, 64)).astype(np.float32)
    got = s.run(x=xs)
    np.testing.assert_allclose(got["c"], xs.astype(np.float64).sum(0), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got["r"], xs.astype(np.float64).sum(1), rtol=1e-5, atol=1e-4)


def test_shapes_differing_by_size_one_dims_group(gpu):
    """Σx over (1, 40, 24) and Σx² over its (40, 24) reshape are siblings once size-1 dims
    are squeezed; values match float64."""
    g = mn.Graph("sq")
    x = g.input("x", (1, 40, 24))
    outs = {"a": x.sum(axis=(0, 1)) * 2.0, "b": (x.reshape((40, 24)) ** 2).sum(axis=0) * 2.0}
    s = mn.compile(g, outputs=outs)
    labels = s.kernel_labels(inference=True)
    assert len(_multi(labels)) == 1 and not any(lbl.startswith("reduce") for lbl in labels), \
        labels
    xs = np.random.default_rng(0).normal(size=(1, 40, 24)).astype(np.float32)
    got = s.run(x=xs)
    x64 = xs.astype(np.float64)
    np.testing.assert_allclose(got["a"], x64.sum(axis=(0, 1)) * 2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["b"], (x64[0] ** 2).sum(axis=0) * 2, rtol=1e-5, atol=1e-5)


def test_device_binding_cap_groups_the_post_pass_sum(gpu):
    """Batch norm at 7x7: the third backward sum has a post pass and needs 9 bindings with
    the other two (rstd bound as input and as epilogue extra), so it joins them only under the
    device's cap (lavapipe 32, the H200 16), not under a portable build's 8; both training
    steps match float64."""
    g = mn.Graph("bn7")
    x = g.input("x", (2, 4, 7, 7))
    w = g.param("w", (4, 4, 3, 3))
    y = nn.BatchNorm2d(4)(g, mn.ops.conv2d(x, w, padding=1))
    loss = (y.relu() * y).mean()

    def sess(backend=None, **kw):
        s = mn.compile(g, loss=loss, outputs={}, optimizer=optim.SGD(lr=0.1), backend=backend,
                       **kw)
        s.set_params({"w": np.linspace(-0.3, 0.3, 144, dtype=np.float32).reshape(4, 4, 3, 3)})
        return s

    if gpu.limits.get("max_storage_buffers_per_shader_stage", 8) < 9:
        pytest.skip("this adapter binds at most 8 storage buffers per stage")
    narrow = sess(portable=True)
    assert not any("=>" in lbl for lbl in _multi(narrow.kernel_labels()))
    wide = sess()
    assert any("=>" in lbl for lbl in _multi(wide.kernel_labels())), wide.kernel_labels()
    assert len(wide.kernel_labels()) < len(narrow.kernel_labels())
    ref = sess("reference", dtype=np.float64)
    xs = np.random.default_rng(0).normal(size=(2, 4, 7, 7)).astype(np.float32)
    for _ in range(2):
        want = ref.step(x=xs).loss
        for s in (narrow, wide):
            np.testing.assert_allclose(s.step(x=xs).loss, want, rtol=1e-5)
    for name, v in ref.get_params().items():
        for s in (narrow, wide):
            np.testing.assert_allclose(s.get_params()[name], v, rtol=1e-4, atol=1e-6)


def test_binding_cap_follows_the_device_limit():
    """Portable targets (WebGPU's defaults) keep 8; a device reporting 16 gets 16; a limit
    below WebGPU's minimum never lowers it."""
    from meganeura.compile.pipeline import binding_cap
    from meganeura.kernels.common import make_target

    assert binding_cap(make_target(None)) == MAX_BINDINGS == 8
    wide = make_target({"max_storage_buffers_per_shader_stage": 16})
    assert binding_cap(wide) == 16
    assert binding_cap(make_target({"max_storage_buffers_per_shader_stage": 4})) == 8
