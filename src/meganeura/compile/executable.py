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


def round4(n: int) -> int:
    """Buffer sizes and copy lengths are multiples of 4 bytes in WebGPU."""
    return (n + 3) // 4 * 4


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
    # slots (indices into ``binds``) that are read and written: an input and an output of the
    # kernel bound to one range (an in-place update); their bytes move twice
    inplace: tuple[int, ...] = ()
    # (slot, bytes) of ranges written only through strided output views (a concat's buffer
    # bound whole for the slots this kernel fills): the bytes those views write
    written: tuple[tuple[int, int], ...] = ()

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
        """Compulsory memory traffic of one dispatch: every bound range read or written once,
        an in-place range read and written (a lower bound on DRAM bytes; tiles re-read through
        caches are not counted)."""
        partial = dict(self.written)
        ranges = {loc: partial.get(i, loc.nbytes) for i, loc in enumerate(self.binds)}
        return (sum(ranges.values())
                + sum(self.binds[i].nbytes for i in set(self.inplace)))

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


# ---------------------------------------------------------------------------- serialisation
# The Executable as JSON-able data plus its distinct WGSL texts (``to_manifest``) and back
# (``from_manifest``): the exported artifact's format (runtime/artifact.py), also read by the
# browser runtime (web/meganeura.js).  Constants travel with the weights, not in the JSON.

FORMAT_VERSION = 1


def _loc(loc: Loc) -> list:
    return [loc.pool, loc.name, loc.offset, loc.nbytes]


def _type(t: TensorType) -> dict:
    return {"shape": list(t.shape), "dtype": t.dtype.name}


def _stream_dict(s: Stream, module_index: dict[str, int]) -> dict:
    ops = []
    for op in s.ops:
        if isinstance(op, Copy):
            ops.append({"copy": [_loc(op.src), _loc(op.dst), op.nbytes]})
            continue
        idx = module_index.setdefault(op.spec.wgsl, len(module_index))
        ops.append({"label": op.label, "module": idx, "entry": op.spec.entry,
                    "bindings": [_loc(b) for b in op.binds],
                    "inplace": list(op.inplace),
                    "written": [list(w) for w in op.written],
                    "workgroups": list(op.spec.workgroups),
                    "meta": {k: v for k, v in op.spec.meta.items()
                             if k in ("variant", "archetype", "flops")}})
    return {"tag": s.tag, "ops": ops, "arena_bytes": s.arena_bytes,
            "out_buffers": s.out_buffers, "naive_bytes": s.naive_bytes,
            "dispatches_unfused": s.dispatches_unfused,
            "fetch": [{"name": f.name, "loc": _loc(f.loc), **_type(f.type), "offset": f.offset,
                       "nbytes": f.nbytes} for f in s.fetch]}


def to_manifest(exe: Executable) -> tuple[dict, list[str]]:
    """(JSON-able manifest, WGSL module texts referenced by index from the manifest)."""
    modules: dict[str, int] = {}
    streams = {tag: _stream_dict(s, modules) for tag, s in (("train", exe.train),
                                                           ("infer", exe.infer)) if s}
    manifest = {
        "format": "meganeura-executable", "version": FORMAT_VERSION,
        "precision": exe.precision,
        "leaves": {n: {"kind": lf.kind, **_type(lf.type)} for n, lf in exe.leaves.items()},
        "groups": [{"name": g.name, "dtype": g.dtype.name, "elements": g.elements}
                   for g in exe.groups],
        "group_home": {n: list(h) for n, h in exe.group_home.items()},
        "streams": streams,
    }
    return manifest, sorted(modules, key=modules.__getitem__)


def tensor_type(d: dict) -> TensorType:
    """A TensorType from its manifest form ``{\"shape\": [...], \"dtype\": name}``."""
    from ..dtypes import as_dtype

    return TensorType(tuple(int(n) for n in d["shape"]), as_dtype(d["dtype"]))


def _stream_from(d: dict, modules: list[str]) -> Stream:
    ops: list[Dispatch | Copy] = []
    for op in d["ops"]:
        if "copy" in op:
            src, dst, n = op["copy"]
            ops.append(Copy(Loc(*src), Loc(*dst), int(n)))
            continue
        binds = tuple(Loc(*b) for b in op["bindings"])
        spec = KernelSpec(op["label"], modules[op["module"]], len(binds),
                          tuple(op["workgroups"]), op.get("entry", "main"),
                          dict(op.get("meta", {})))
        ops.append(Dispatch(op["label"], spec, binds,
                            tuple(int(i) for i in op.get("inplace", ())),
                            tuple((int(j), int(n)) for j, n in op.get("written", ()))))
    fetch = tuple(Fetch(f["name"], Loc(*f["loc"]), tensor_type(f), f["offset"], f["nbytes"])
                  for f in d["fetch"])
    return Stream(d["tag"], tuple(ops), d["arena_bytes"], dict(d["out_buffers"]), fetch,
                  d.get("naive_bytes", 0), d.get("dispatches_unfused", 0))


def from_manifest(manifest: dict, modules: list[str],
                  constants: dict[str, np.ndarray]) -> Executable:
    """The Executable a manifest describes (``constants``: the constant leaves' data)."""
    from ..dtypes import as_dtype

    if manifest.get("format") != "meganeura-executable":
        raise ValueError("not a meganeura executable manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"executable format version {manifest.get('version')} is not "
                         f"supported (this meganeura reads version {FORMAT_VERSION})")
    leaves = {n: PinnedTensor(n, d["kind"], tensor_type(d),
                              constants.get(n) if d["kind"] == "constant" else None)
              for n, d in manifest["leaves"].items()}
    groups = tuple(GroupBuffer(g["name"], as_dtype(g["dtype"]), int(g["elements"]))
                   for g in manifest["groups"])
    home = {n: (h[0], int(h[1])) for n, h in manifest["group_home"].items()}
    streams = {tag: _stream_from(s, modules) for tag, s in manifest["streams"].items()}
    return Executable(manifest["precision"], leaves, groups, home, streams.get("train"),
                      streams.get("infer"))
