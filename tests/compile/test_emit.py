"""Emission records which binding slots a kernel updates in place, so the roofline counts
their bytes twice (read, then written) and an exported program keeps that record."""

from __future__ import annotations

import dataclasses

import numpy as np

import meganeura as mn
from meganeura.compile.emit import inplace_slots
from meganeura.compile.executable import Dispatch, Loc, from_manifest, to_manifest
from meganeura.kernels.ir import KernelSpec

from ..kernels.test_attention_fast import attention_desc


def test_an_input_and_an_output_on_one_range_is_in_place():
    # slots: in0, in1, out (out bound to in0's range)
    assert inplace_slots((0, 1, 0), [0, 1], n_in=2) == (0,)


def test_two_inputs_on_one_range_are_one_read_not_an_update():
    # q and k views of one projection, written to a separate output
    assert inplace_slots((0, 0, 2), [0, 2], n_in=2) == ()


def test_unknown_input_count_records_nothing():
    assert inplace_slots((0, 1, 0), [0, 1], n_in=None) == ()


def test_in_place_bytes_count_twice():
    spec = KernelSpec("k", "", 2, (1, 1, 1))
    a, b = Loc("param", "w", 0, 400), Loc("temp", "", 0, 100)
    assert Dispatch("k", spec, (a, b)).bytes == 500
    assert Dispatch("k", spec, (a, b), inplace=(0,)).bytes == 900


def _sgd_session():
    g = mn.Graph("inplace")
    x = g.input("x", (8, 6))
    t = g.input("t", (8, 4))
    w = g.param("w", (6, 4))
    d = (x @ w) - t
    return mn.compile(g, loss=(d * d).mean(), optimizer=mn.optim.SGD(lr=0.1))


def test_training_step_counter_update_is_recorded_in_place_and_survives_export():
    s = _sgd_session()
    s.step(x=np.ones((8, 6), np.float32), t=np.zeros((8, 4), np.float32))
    updates = [d for d in s.executable.train.dispatches if d.inplace]
    assert updates, "the optimizer's in-place updates must be recorded"
    for d in updates:
        assert d.bytes == sum(b.nbytes for b in d.binds) + sum(d.binds[i].nbytes
                                                              for i in d.inplace)
    manifest, modules = to_manifest(s.executable)
    again = from_manifest(manifest, modules, {})  # the graph has no constant leaves
    assert [d.inplace for d in again.train.dispatches] == \
        [d.inplace for d in s.executable.train.dispatches]


def test_fast_precision_takes_tensor_core_attention_only_where_it_pays():
    """Under precision "fast" on a device with f16 subgroup matrices, a long attention
    forward (Whisper's 1,500 positions) is emitted on the tensor cores; a short one
    (SmolLM2's 128), the backward kernels and every kernel under "strict" stay f32."""
    from meganeura.compile.emit import emit_kernel
    from meganeura.kernels import attention_fast as AF
    from meganeura.kernels import make_target

    target = make_target({"max_compute_workgroup_storage_size": 49152,
                          "max_compute_invocations_per_workgroup": 1024},
                         {"shader-f16", "subgroups", AF.SG_FEATURE})

    def precision(desc, mode):
        binds = [object() for _ in range(5 if desc.kind == "fwd" else 7)]  # distinct ranges
        return emit_kernel(desc, binds, target, mode).spec.meta["precision"]

    long_fwd = attention_desc("fwd", 6, 6, 1500)
    assert AF.pays(long_fwd)
    assert precision(long_fwd, "fast") == "fast"
    assert precision(long_fwd, "strict") == "strict"
    assert precision(attention_desc("fwd", 9, 3, 128), "fast") == "strict"
    assert precision(attention_desc("dq", 6, 6, 1500), "fast") == "strict"
    assert not AF.pays(attention_desc("fwd", 6, 6, 1500, D=40))  # head dim not 16k


def test_tensor_core_attention_counts_as_tensor_cores():
    """The roofline measures a tensor-core attention forward against the f16 tensor peak and
    ``kernel_variants`` lists it with the tensor-core matmuls (``sgmat*``)."""
    from meganeura.compile.emit import emit_kernel
    from meganeura.kernels import attention_fast as AF
    from meganeura.kernels import make_target

    target = make_target({"max_compute_workgroup_storage_size": 49152,
                          "max_compute_invocations_per_workgroup": 1024},
                         {"shader-f16", "subgroups", AF.SG_FEATURE})
    desc = attention_desc("fwd", 6, 6, 1500)
    binds = [object() for _ in range(5)]
    assert emit_kernel(desc, binds, target, "fast").tensor_cores
    assert not emit_kernel(desc, binds, target, "strict").tensor_cores


def test_ranges_written_through_strided_views_count_the_bytes_written():
    """An output written through a strided view of a concat's buffer binds the whole buffer
    but writes only its slots: the roofline counts those bytes (both outputs' when two share
    the range), the whole range where anything else binds it."""
    from meganeura.compile.emit import written_through_views
    from meganeura.dtypes import f32
    from meganeura.kernels import Instr, PointwiseKernel, Strided

    shape = (1, 4, 8)
    views = tuple(Strided(f32, shape, (64, 16, 1), off, 64) for off in (0, 8))
    desc = PointwiseKernel(shape, (Strided.contiguous(f32, shape),) * 2,
                           (Instr("{0}", (("in", 0),), f32), Instr("{0}", (("in", 1),), f32)),
                           (0, 1), out_views=views)
    assert written_through_views(desc, (0, 1, 2, 2), [0, 1, 2]) == ((2, 2 * 32 * 4),)
    one = dataclasses.replace(desc, outputs=(0,), out_views=views[:1])
    assert written_through_views(one, (0, 1, 2), [0, 1, 2]) == ((2, 32 * 4),)
    assert written_through_views(one, (0, 1, 0), [0, 1]) == ()  # also read: the whole range
    assert written_through_views(dataclasses.replace(one, out_views=()), (0, 1, 2), [0, 1, 2]) \
        == ()
    spec = KernelSpec("k", "", 3, (1, 1, 1))
    locs = (Loc("temp", "", 0, 128), Loc("temp", "", 256, 128), Loc("temp", "", 512, 256))
    assert Dispatch("k", spec, locs).bytes == 512
    assert Dispatch("k", spec, locs, written=((2, 128),)).bytes == 384


def test_strided_slot_writes_are_recorded_and_survive_export(gpu):
    """A concat's halves written through strided views by separate kernels: each dispatch
    binds the whole concat but counts the bytes of its own half, also after export."""
    g = mn.Graph("halves")
    x, y, w = g.param("x", (1, 6, 8)), g.param("y", (1, 6, 8)), g.param("w", (16, 3))
    c = mn.ops.concat([(x * 2.0).exp(), y.tanh()], axis=-1)
    s = mn.compile(g, outputs={"out": mn.ops.matmul(c, w)}, fuse=True)
    placed = [d for d in s.executable.infer.dispatches if d.written]
    assert placed, [d.label for d in s.executable.infer.dispatches]
    for d in placed:
        assert all(n < d.binds[j].nbytes for j, n in d.written)
    manifest, modules = to_manifest(s.executable)
    again = from_manifest(manifest, modules, {})
    assert [d.written for d in again.infer.dispatches] == \
        [d.written for d in s.executable.infer.dispatches]
