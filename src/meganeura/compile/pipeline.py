"""The compile pipeline as one list of stages: Program → passes → schedule + memory (Plan)
→ kernels (WGSL) → ``Executable``.  Nothing here touches a GPU: the device is seen only as a
``Target`` (its limits and features)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ..errors import GraphBuildError, LimitError
from ..kernels.common import Target
from ..program import Program
from .emit import emit_stream
from .executable import Executable, GroupBuffer, PinnedTensor
from .fast_attention import fast_attention_chunks
from .memory import NO_GROUPS, LeafGroups, find_leaf_groups, make_plan
from .passes import run_pipeline
from .tune import Timer, TuneReport, TuningCache, tune_plan

_DEBUG = set(filter(None, os.environ.get("MEGANEURA_DEBUG", "").split(",")))


@dataclass(frozen=True)
class CompileOptions:
    """Checked once by ``compile()``; every stage reads them from here."""

    precision: str = "strict"
    fuse: bool = True
    plan_memory: bool = True
    group_params: bool = True
    max_bindings: int = 8  # storage buffers per sibling-reduction group (``binding_cap``)
    inference: bool = True  # False: a training program's session only steps (no infer stream)


@dataclass
class Tuning:
    """How this compile tunes kernel configurations (see ``tune.py``)."""

    mode: str | bool = "cache"
    device_key: str = ""
    cache: TuningCache | None = None
    timer: Timer | None = None
    report: TuneReport = field(default_factory=TuneReport)


def binding_alignment(target: Target) -> int:
    """The device's storage-buffer offset alignment (bytes), a power of two ≥ 4; WebGPU's
    largest allowed value (256) when the adapter does not say."""
    a = int(target.limits.get("min_storage_buffer_offset_alignment", 256) or 256)
    return a if a >= 4 and a & (a - 1) == 0 and a <= 256 else 256


def binding_cap(target: Target) -> int:
    """Storage buffers a sibling-reduction group may bind (``siblings.py``): the device's
    ``max_storage_buffers_per_shader_stage`` (the H200: 16, lavapipe: 32), WebGPU's guaranteed
    8 for ``portable`` targets (the defaults) — so CI on lavapipe plans the large groups a
    real GPU gets, and a portable artifact binds no more than every device allows."""
    return max(8, int(target.lim("max_storage_buffers_per_shader_stage") or 8))


def compile_program(program: Program, target: Target, options: CompileOptions,
                    shares_tensors: bool = False, tuning: Tuning | None = None) -> Executable:
    """Every stage after the Program, in order.  ``shares_tensors``: the session shares
    persistent tensors with another one, so parameters keep their own buffers (no groups)."""
    t0 = time.perf_counter()
    program = fast_attention_chunks(program, target, options.precision)
    lowered = run_pipeline(program, debug="graph" in _DEBUG)
    _check_leaf_sizes(lowered, target)
    use_groups = options.group_params and not shares_tensors
    groups = find_leaf_groups(lowered.graph, any_rank=not program.training) if use_groups \
        else NO_GROUPS
    align = binding_alignment(target)

    def stream(inference: bool, tag: str):
        plan = make_plan(lowered, inference, options.fuse, options.plan_memory, groups, align,
                         options.max_bindings)
        if tuning is not None:
            plan = tune_plan(plan, target, tuning.mode, tuning.device_key, tuning.cache,
                             tuning.timer, tuning.report)
        return emit_stream(plan, target, options.precision, tag)

    train = stream(False, "train") if program.training or program.loss is not None else None
    # a session that only steps (``inference=False``: distributed's gradient program) skips
    # the inference stream; a program without training stream always gets one
    want_infer = options.inference or train is None
    infer = stream(True, "infer") if program.outputs and want_infer else None
    if tuning is not None and tuning.cache is not None:
        tuning.cache.save()
    leaves = {name: PinnedTensor(name, lf.kind, lf.value.type,
                                 lf.data if lf.kind == "constant" else None)
              for name, lf in lowered.graph.leaves.items()}
    return Executable(options.precision, leaves, _group_buffers(groups), _group_home(groups),
                      train, infer, time.perf_counter() - t0)


def _check_leaf_sizes(lowered: Program, target: Target) -> None:
    """A tensor the device cannot bind, or an empty one (WGSL has no zero-length arrays or
    workgroup grids), is named before any kernel is planned around it."""
    _check_not_empty(lowered)
    limit = target.lim("max_storage_buffer_binding_size")
    for name, lf in lowered.graph.leaves.items():
        nbytes = max(lf.value.size, 1) * lf.value.dtype.gpu_itemsize
        if nbytes > limit:
            raise LimitError(f"{lf.kind} {name!r} ({lf.value.type}) needs "
                             f"{nbytes / 2**20:.1f} MiB but the device binds at most "
                             f"{limit / 2**20:.1f} MiB per storage buffer")


def _check_not_empty(lowered: Program) -> None:
    for name, lf in lowered.graph.leaves.items():
        if lf.value.size == 0:
            raise GraphBuildError(f"{lf.kind} {name!r} ({lf.value.type}) has no elements: the "
                                  "GPU backends need at least one element per tensor (the "
                                  "reference backend evaluates empty tensors)")
    for node in lowered.graph.nodes:
        for v in node.outputs:
            if v.size == 0:
                raise GraphBuildError(f"{node.op} computes an empty tensor ({v.type}): the GPU "
                                      "backends need at least one element per tensor (the "
                                      "reference backend evaluates empty tensors)")


def _group_buffers(groups: LeafGroups) -> tuple[GroupBuffer, ...]:
    return tuple(GroupBuffer(name, dtype, n) for name, (dtype, n, _) in groups.groups.items())


def _group_home(groups: LeafGroups) -> dict[str, tuple[str, int]]:
    return {name: (g, off * groups.groups[g][0].gpu_itemsize)
            for name, (g, off) in groups.home.items()}
