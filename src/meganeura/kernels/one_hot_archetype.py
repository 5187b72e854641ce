"""one_hot as a registered archetype (its emitter is codegen/one_hot.py)."""

from .archetypes import register_archetype
from .ir import OneHotKernel
from .one_hot import emit


def _make(attrs, inputs, outputs):
    return OneHotKernel(inputs[0], attrs["num_classes"], attrs["dtype"])


register_archetype("one_hot", OneHotKernel, _make, emit)
