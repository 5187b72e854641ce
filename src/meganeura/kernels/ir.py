"""The kernel-level IR between the plan and WGSL: what one dispatch computes, with no graph left.

The planner turns (fused) graph nodes into these descriptions; ``codegen.emit`` turns each into a
``KernelSpec`` (WGSL source, binding list, workgroup count).  Buffers are bound as exact tensor
ranges (256-byte aligned by the planner), so a shader indexes every tensor from 0; views
(permute, broadcast, slice, reshape) are folded in as strides and a constant element offset.

Binding order of every kernel: its inputs in declaration order, then its outputs,
as ``@group(0) @binding(i)``, all ``var<storage, read_write>`` (so binding usages never conflict).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..dtypes import DType

PRECISIONS = ("strict", "fast")  # compile(precision=…); "fast" reaches matmul kernels only


@dataclass(frozen=True)
class Strided:
    """How a kernel reads a bound tensor: logical ``shape`` with element ``strides`` (0 where
    broadcast) and an element ``offset``.  A contiguous row-major tensor has the usual strides."""

    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0
    # Number of elements of the bound buffer range (for bounds/size checks).
    extent: int = 0

    @staticmethod
    def contiguous(dtype: DType, shape: tuple[int, ...]) -> Strided:
        strides = contiguous_strides(shape)
        size = strides[0] * shape[0] if shape else 1
        return Strided(dtype, tuple(shape), strides, 0, size)


def contiguous_strides(shape) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    strides, acc = [], 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Instr:
    """One pointwise step: ``expr`` (a ``lowering.Pointwise`` expression) applied to ``args``.
    An arg ``("in", i)`` reads input ``i`` at the current element (through its Strided map,
    broadcast to the iteration shape); ``("t", j)`` is the result of instruction ``j``."""

    expr: str
    args: tuple[tuple[str, int], ...]
    dtype: DType
    helpers: tuple[str, ...] = ()


@dataclass(frozen=True)
class PointwiseKernel:
    """Fused elementwise DAG over iteration ``shape``: writes instruction ``outputs[k]``
    (contiguous, row-major, ``shape``) to output binding k, or where ``out_views[k]`` says."""

    shape: tuple[int, ...]
    inputs: tuple[Strided, ...]
    instrs: tuple[Instr, ...]
    outputs: tuple[int, ...]
    name: str = "pointwise"
    # Configuration (``kernels.pointwise``): ``(1,)`` one element per invocation, ``(4,)``
    # four (``vec4`` loads and stores); empty: the heuristic (vec4 wherever every operand's
    # layout allows it).
    config: tuple = ()
    # Empty, or per output None (contiguous) or a Strided over ``shape`` into its binding:
    # where each element goes (an output computed straight into its strided slot of a
    # concat's buffer, e.g. the gate and up gradients side by side in each row)
    out_views: tuple = ()


@dataclass(frozen=True)
class ReduceKernel:
    """Reduce ``axes`` of the iteration shape ``shape`` with ``kind`` (sum|max|min).

    ``prologue`` computes the value to reduce at each element of ``shape`` (instrs over
    ``("in", i)``/``("t", j)``; the value reduced is its last instruction).  ``epilogue`` maps the
    reduced value ``("acc", 0)``, epilogue-local results ``("t", j)`` and ``extra`` inputs
    ``("x", i)`` (Strided over the *output* shape) to the stored result (its last instruction;
    empty epilogue = store the reduced value).  Output: contiguous, shape = ``shape`` without
    ``axes`` (keepdims changes only the logical shape, not the data)."""

    shape: tuple[int, ...]
    axes: tuple[int, ...]
    kind: str
    inputs: tuple[Strided, ...]
    prologue: tuple[Instr, ...]
    epilogue: tuple[Instr, ...] = ()
    extra: tuple[Strided, ...] = ()
    out_dtype: DType | None = None
    name: str = "reduce"
    # > 1: partial mode (see codegen.reduce.split_plan): the reduced range is cut into ``split``
    # contiguous chunks, each reduced separately (prologue, no epilogue) and written to output
    # element ``chunk * n_out + o`` in the accumulator dtype (f32 for floats).
    split: int = 1
    # An elementwise pass over the *input* shape that reads the result broadcast back over the
    # reduced axes (a normalization: x * rstd * w), run by the same workgroup right after the
    # reduction.  ``post`` instrs read ``("in", i)`` from ``post_inputs`` (Strided over
    # ``shape``), ``("ri", i)`` the reduction's own input ``i`` (one the prologue reads),
    # ``("r", 0)`` the stored result and ``("t", j)``; ``post_outputs[k]`` (instr
    # indices) are written contiguous over ``shape``.  Bindings: inputs, extra, post_inputs,
    # out, post outputs.
    post_inputs: tuple[Strided, ...] = ()
    post: tuple[Instr, ...] = ()
    post_outputs: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReduceMember:
    """One reduction of a ``MultiReduceKernel``: its ``kind``, ``prologue`` (instrs over the
    shared ``("in", i)`` inputs; the value reduced is the last one), ``epilogue`` (over
    ``("acc", 0)`` and the shared ``("x", i)`` extra inputs) and stored dtype, as in
    ``ReduceKernel``.  ``post``/``post_outputs``: the member's elementwise pass over the
    iteration shape after the group's reduction, as ``ReduceKernel.post`` but reading
    ``("in", i)`` from the kernel's shared inputs (no split)."""

    kind: str
    prologue: tuple[Instr, ...]
    epilogue: tuple[Instr, ...] = ()
    out_dtype: DType | None = None
    post: tuple[Instr, ...] = ()
    post_outputs: tuple[int, ...] = ()


@dataclass(frozen=True)
class MultiReduceKernel:
    """Several reductions of one iteration ``shape`` over the same ``axes`` in one dispatch
    (sibling reductions: a norm's gradient sums ``sum(dy)``, ``sum(dy * x̂)``): each reduced
    element's coordinates are computed and every input loaded once, then every member's
    prologue folds it into its own accumulator.  ``split`` as in ``ReduceKernel`` (partial
    mode: no epilogues, outputs ``(split, *out)`` in the accumulator dtype).  Bindings:
    inputs, extra, then per member its contiguous output followed by its post outputs
    (contiguous over ``shape``)."""

    shape: tuple[int, ...]
    axes: tuple[int, ...]
    inputs: tuple[Strided, ...]
    members: tuple[ReduceMember, ...]
    extra: tuple[Strided, ...] = ()
    split: int = 1
    name: str = "multi_reduce"


@dataclass(frozen=True)
class MatmulKernel:
    """C[b, m, n] = sum_k A[b, m, k] * B[b, k, n] (+ epilogue).  ``a`` and ``b`` are Strided
    views of rank 3 (batch, rows, cols) *after* transposes, so transposed operands are read in
    place via strides; batch broadcast = stride 0.  ``epilogue`` instrs see ``("acc", 0)`` as the
    dot product, ``("t", j)`` earlier epilogue results and ``("x", i)`` the ``extra`` inputs
    (Strided over (batch, M, N): bias, residual); the stored value is the last epilogue instr
    (none: the dot product).  Output contiguous (batch, M, N).  Bindings: a, b, extra…, out."""

    batch: int
    m: int
    n: int
    k: int
    a: Strided
    b: Strided
    extra: tuple[Strided, ...] = ()
    epilogue: tuple[Instr, ...] = ()
    out_dtype: DType | None = None
    name: str = "matmul"
    # Force a codegen variant ("gemv" | "tiled64" | "tiled128" | "tiled64v" | "tiled128v" |
    # "sgmat64" | "sgmat128"); empty: chosen by shape (codegen.matmul.choose_variant).
    variant: str = ""
    # "fast": operands rounded to f16, f32 accumulation, on tensor cores where the device has
    # f16 subgroup matrices; elsewhere (and always for "strict") the f32 kernels.
    precision: str = "strict"
    # Tuning configuration (``kernels.matmul.Cfg``: kind, tile, per-thread block, K step, …),
    # set by the matmul family's ``candidates`` hook / the tuner; overrides ``variant``.  Empty:
    # the heuristic default (``kernels.matmul.choose_config``).
    config: tuple = ()
    # False: stays on the f32 kernels under precision "fast" (the convolutions rewritten as
    # matmuls, ops/conv.py: like every convolution they keep f32; their batch-norm gradients
    # are too ill-conditioned for f16 operands)
    tensor_cores: bool = True
    # A split-K partial batch (``batch`` K chunks) of a GEMM with this K; 0: not one.  The
    # heuristic picks the partials' tile knowing the whole GEMM (``matmul.partials_config``).
    split_of: int = 0


@dataclass(frozen=True)
class OneHotKernel:
    labels: Strided
    num_classes: int
    out_dtype: DType
    name: str = "one_hot"


@dataclass(frozen=True)
class KernelSpec:
    """What the runtime needs to create a pipeline and dispatch it."""

    name: str
    wgsl: str
    n_bindings: int
    workgroups: tuple[int, int, int]
    entry: str = "main"
    meta: dict = field(default_factory=dict, compare=False)
