"""The one registry of kernel families: description type -> emitter (and, for families an op
lowers to with ``lowering.Kernel(name)``, the ``make`` hook building the description).

A family registers once, in its own module, with ``@kernel_family(name, desc_type, make=…)`` on
its emitter:
  make(attrs, inputs: list[Strided], outputs: list[TensorType]) -> a kernel description
  emit(desc, limits=None, features=None, alias=None) -> KernelSpec
The planner resolves the node's inputs to strided views (views folded in; with
``contiguous_inputs`` it copies them to contiguous buffers first), binds inputs then outputs in
order, and never needs to know the family.  Descriptions are hashable dataclasses; each
description type belongs to exactly one family (``archetype_of``), each name too (``archetype``),
and registering either twice is an error.  Families the scheduler builds itself (pointwise,
reduce, matmul, concat, pad_slice) have ``make=None``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .common import CodegenError


@dataclass(frozen=True)
class Archetype:
    name: str
    desc_type: type
    make: Callable[..., Any] | None
    emit: Callable[..., Any]
    contiguous_inputs: bool = False
    # epilogue(desc, extra: Strided views over the output, instrs, out_dtype) -> desc | None:
    # the same kernel with a fused pointwise epilogue (ReLU/SiLU/residual after a conv)
    epilogue: Callable[..., Any] | None = None
    # in_place(desc) -> desc | None: a variant whose output is input 0's own buffer (the
    # planner binds both to one range), writing only what changes (KV-cache updates)
    in_place: Callable[..., Any] | None = None
    # candidates(desc, target: Target) -> list[desc]: the configurations worth timing for this
    # description (the same computation, tuning fields set: tiles, split, variant), the
    # heuristic default first.  The tuner (compile/tune.py) times them on the device and keeps
    # the fastest in its cache; families without the hook are never tuned.
    candidates: Callable[..., Any] | None = None


_BY_NAME: dict[str, Archetype] = {}
_BY_DESC: dict[type, Archetype] = {}


def register(name: str, desc_type: type, emit, make=None, contiguous_inputs: bool = False,
             epilogue=None, in_place=None, candidates=None) -> Archetype:
    """Add a family; a name or description type registered before is an error (one type
    cannot stand for two families: ``archetype_of`` would pick one silently)."""
    if name in _BY_NAME:
        raise CodegenError(f"kernel family {name!r} is already registered")
    if desc_type in _BY_DESC:
        raise CodegenError(f"{desc_type.__name__} already belongs to kernel family "
                           f"{_BY_DESC[desc_type].name!r}; {name!r} needs its own type")
    a = Archetype(name, desc_type, make, emit, contiguous_inputs, epilogue, in_place,
                  candidates)
    _BY_NAME[name] = a
    _BY_DESC[desc_type] = a
    return a


def kernel_family(name: str, desc_type: type, make=None, contiguous_inputs: bool = False,
                  epilogue=None, in_place=None, candidates=None):
    """Decorator registering the decorated emitter as family ``name`` (see ``register``)."""

    def deco(emit):
        register(name, desc_type, emit, make, contiguous_inputs, epilogue, in_place, candidates)
        return emit

    return deco


def archetype(name: str) -> Archetype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no kernel archetype {name!r} registered; known: "
                       f"{sorted(_BY_NAME)}") from None


def archetype_of(desc) -> Archetype | None:
    return _BY_DESC.get(type(desc))


def families() -> dict[str, Archetype]:
    """Every registered family by name."""
    return dict(_BY_NAME)


def emit(desc, limits=None, features=None, alias=None):
    """The ``KernelSpec`` of one kernel description (its family's emitter).  ``alias``: one
    entry per binding slot, the first slot bound to the same buffer range (identity = none
    shared; see ``binding_aliases``)."""
    a = _BY_DESC.get(type(desc))
    if a is None:
        raise CodegenError(f"no WGSL emitter for {type(desc).__name__}; known: "
                           f"{', '.join(sorted(t.__name__ for t in _BY_DESC))}")
    return a.emit(desc, limits, features, alias)


def candidates(desc, target) -> list:
    """Configurations of ``desc`` worth timing on ``target`` (its family's ``candidates``
    hook), the heuristic default first; ``[desc]`` for families that are not tuned."""
    a = _BY_DESC.get(type(desc))
    if a is None or a.candidates is None:
        return [desc]
    found = list(dict.fromkeys(a.candidates(desc, target)))  # distinct, order kept
    return found or [desc]
