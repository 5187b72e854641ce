"""What compilation hands to the runtime: plain data, no GPU objects and no graph.

The runtime builds buffers, pipelines and bind groups from an ``Executable`` and encodes its
streams; nothing in here needs the compiler again, so an Executable can be serialised and
run elsewhere (export)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtypes import DType
from ..graph import TensorType
from ..kernels.ir import KernelSpec


@dataclass(frozen=True)
class Loc:
    """A tensor's home: pool ("temp" arena, "group" parameter group, or
    "param"/"state"/"input"/"const"/"out" by name) plus a byte range."""

    pool: str
    name: str  # buffer name (pinned) or "" for the arena
    offset: int  # bytes
    nbytes: int


@dataclass(frozen=True)
class Dispatch:
    """One compute dispatch: its WGSL program and the buffer range of each binding slot (after
    de-duplication: one range per slot, in binding order)."""

    label: str
    spec: KernelSpec
    binds: tuple[Loc, ...]

    @property
    def variant(self) -> str:
        """The kernel variant that ran (``sgmat*`` on tensor cores) for reports."""
        return self.spec.meta.get("variant") or self.spec.meta.get("archetype", "?")

    @property
    def flops(self) -> int:
        """Floating-point operations of one dispatch, from the kernel description (matmul,
        conv and attention emitters count them; elementwise kernels count as 0: memory-bound)."""
        return int(self.spec.meta.get("flops", 0))

    @property
    def bytes(self) -> int:
        """Compulsory memory traffic of one dispatch: every bound range read or written once
        (a lower bound on DRAM bytes; tiles re-read through caches are not counted)."""
        return sum(loc.nbytes for loc in set(self.binds))

    @property
    def tensor_cores(self) -> bool:
        return self.variant.startswith("sgmat")


@dataclass(frozen=True)
class Copy:
    """A buffer-to-buffer copy inside the stream (a contiguous view of a result, an update)."""

    src: Loc
    dst: Loc
    nbytes: int


@dataclass(frozen=True)
class Fetch:
    """A result read back after the stream: copied from ``loc`` to ``offset`` of the
    step's readback buffer."""

    name: str
    loc: Loc
    type: TensorType
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Stream:
    """One fixed command stream (a training step or an inference run): encoded the same way
    at every call, then the fetched results are copied to a readback buffer."""

    tag: str
    ops: tuple[Dispatch | Copy, ...]
    arena_bytes: int
    out_buffers: dict[str, int]  # result buffers ("out" pool): name -> bytes
    fetch: tuple[Fetch, ...]
    naive_bytes: int  # one buffer per value, for reports
    dispatches_unfused: int

    @property
    def dispatches(self) -> list[Dispatch]:
        return [op for op in self.ops if isinstance(op, Dispatch)]

    @property
    def fetch_bytes(self) -> int:
        return sum(f.nbytes for f in self.fetch)


@dataclass(frozen=True)
class PinnedTensor:
    """A tensor with its own buffer for the session's lifetime (input, parameter, state or
    constant; ``data`` only for constants)."""

    name: str
    kind: str
    type: TensorType
    data: np.ndarray | None = None


@dataclass(frozen=True)
class GroupBuffer:
    """A parameter group: persistent tensors stored back to back in one buffer."""

    name: str
    dtype: DType
    elements: int


@dataclass(frozen=True)
class Executable:
    """Everything the runtime needs to build and run a compiled program."""

    precision: str
    leaves: dict[str, PinnedTensor]  # every leaf of the lowered graph, by name
    groups: tuple[GroupBuffer, ...]
    group_home: dict[str, tuple[str, int]]  # leaf name -> (group name, byte offset)
    train: Stream | None
    infer: Stream | None
    compile_seconds: float = 0.0  # graph → Executable, for reports

    def home(self, name: str) -> tuple[str, int]:
        """(buffer name, byte offset) where a persistent tensor lives."""
        return self.group_home.get(name, (name, 0))
