"""The kernel-family registry: every archetype an op lowers to resolves to the family of that
name, each description type belongs to one family, and registering a name or type twice fails."""

import dataclasses

import pytest

import meganeura.ops  # noqa: F401  (registers the ops)
from meganeura import kernels
from meganeura.graph import registered_ops
from meganeura.kernels import CodegenError, archetype, archetype_of, families
from meganeura.kernels.archetypes import register
from meganeura.kernels.gather import DynamicSliceKernel, DynamicUpdateSliceKernel
from meganeura.ops.lowering import Kernel


def _kernel_lowerings():
    return {name: op.lowering.archetype for name, op in registered_ops().items()
            if isinstance(op.lowering, Kernel)}


def test_every_kernel_lowering_resolves_to_its_family():
    lows = _kernel_lowerings()
    assert {"dynamic_slice", "dynamic_update_slice", "one_hot", "conv2d"} <= set(lows)
    for op, name in lows.items():
        fam = archetype(name)
        assert fam.name == name, (op, name, fam.name)
        assert fam.make is not None, f"{op}: family {name!r} cannot build a description"


def test_description_types_map_back_to_their_family():
    for name, fam in families().items():
        desc = object.__new__(fam.desc_type)  # archetype_of looks at the type only
        assert archetype_of(desc).name == name
    assert {"pointwise", "reduce", "matmul", "one_hot", "concat"} <= set(families())


def test_dynamic_slice_is_not_dynamic_update_slice():
    assert archetype("dynamic_slice").desc_type is DynamicSliceKernel
    assert archetype("dynamic_update_slice").desc_type is DynamicUpdateSliceKernel
    assert archetype("dynamic_slice").in_place is None
    assert archetype("dynamic_update_slice").in_place is not None


def test_duplicates_are_refused():
    @dataclasses.dataclass(frozen=True)
    class Fresh:
        pass

    with pytest.raises(CodegenError, match="already registered"):
        register("one_hot", Fresh, lambda *a: None)
    with pytest.raises(CodegenError, match="already belongs"):
        register("fresh_family", kernels.PointwiseKernel, lambda *a: None)
    assert "fresh_family" not in families()


def test_emit_without_family():
    with pytest.raises(CodegenError, match="no WGSL emitter"):
        kernels.emit(object())
