"""Registry of dedicated kernel archetypes (``lowering.Kernel(archetype, params)``).

An op family that needs its own kernel (one_hot, conv2d, attention, gather…) registers here:
  make(attrs, inputs: list[Strided], outputs: list[TensorType]) -> a kernel description
  emit(desc, limits, features) -> KernelSpec
The planner resolves the node's inputs to strided views (views folded in; with
``contiguous_inputs`` it copies them to contiguous buffers first), binds inputs then outputs in
order, and never needs to know the archetype.  Descriptions are hashable dataclasses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Archetype:
    name: str
    desc_type: type
    make: Callable[..., Any]
    emit: Callable[..., Any]
    contiguous_inputs: bool = False
    # epilogue(desc, extra: Strided views over the output, instrs, out_dtype) -> desc | None:
    # the same kernel with a fused pointwise epilogue (ReLU/SiLU/residual after a conv)
    epilogue: Callable[..., Any] | None = None
    # in_place(desc) -> desc | None: a variant whose output is input 0's own buffer (the
    # planner binds both to one range), writing only what changes (KV-cache updates)
    in_place: Callable[..., Any] | None = None


_BY_NAME: dict[str, Archetype] = {}
_BY_DESC: dict[type, Archetype] = {}


def register_archetype(name: str, desc_type: type, make, emit,
                       contiguous_inputs: bool = False, epilogue=None,
                       in_place=None) -> Archetype:
    a = Archetype(name, desc_type, make, emit, contiguous_inputs, epilogue, in_place)
    _BY_NAME[name] = a
    _BY_DESC[desc_type] = a
    return a


def archetype(name: str) -> Archetype:
    _load_builtin()
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no kernel archetype {name!r} registered; known: "
                       f"{sorted(_BY_NAME)}") from None


def archetype_of(desc) -> Archetype | None:
    _load_builtin()
    return _BY_DESC.get(type(desc))


def emitter_for(desc) -> Callable | None:
    _load_builtin()
    a = _BY_DESC.get(type(desc))
    return a.emit if a else None


_loaded = False


def _load_builtin() -> None:
    """Import the modules that register archetypes (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib

    for mod in ("one_hot_archetype", "concat", "conv", "pool", "attention", "gather"):
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{mod}":
                raise
