"""Memory: where every value of a schedule lives, and the ``Plan`` handed to the runtime.

``make_plan`` schedules a program (``schedule.py``), rewrites its kernel list
(``rewrites.py``) and then places every value the kernels bind:
  * parameter groups (``find_leaf_groups``): persistent tensors the program concatenates as
    one flat vector (the optimizer's) stored back to back in one buffer, so the concat is the
    buffer itself and a concat of neighbours (fused q/k/v weights) is a range of it;
  * in-place updates: a new parameter/state value (or a group's whole new vector) computed
    straight into the persistent buffer when no later kernel reads the old one;
  * the temp arena: values whose lifetimes (kernel indices, from liveness) do not overlap
    share memory; offsets by first or best fit, whichever gives the smaller arena;
  * pinned tensors (inputs, parameters, states, constants) and fetched results ("out").

The result is plain data (``KernelOp``/``CopyOp`` over ``Loc`` byte ranges): the runtime
decides nothing.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..dtypes import DType
from ..graph import Graph, TensorType, Value
from ..kernels import ir
from ..kernels.archetypes import archetype_of
from ..ops.lowering import View
from ..program import Program
from .executable import Loc
from .rewrites import rewrite_kernels
from .schedule import ALIGN, MAX_BINDINGS, LoweredKernel, Schedule, schedule

# -- the plan ---------------------------------------------------------------------------------


@dataclass
class KernelOp:
    """A dispatch: a kernels.ir description and the byte ranges it binds."""

    desc: object  # a kernels.ir kernel description
    binds: list[Loc]  # inputs then outputs, in the kernel's binding order
    label: str = ""
    n_in: int | None = None  # how many of ``binds`` are inputs (None: not known)


@dataclass
class CopyOp:
    """A buffer copy at the end of a step (an update that was not computed in place)."""

    src: Loc
    dst: Loc




class Pinned(NamedTuple):
    kind: str  # "param", "state", "input" or "constant"
    type: TensorType


class Fetched(NamedTuple):
    loc: Loc  # where the result lies at the end of the step
    type: TensorType


@dataclass
class Plan:
    kernels: list = field(default_factory=list)  # KernelOp | CopyOp, in order
    arena_bytes: int = 0
    pinned: dict[str, Pinned] = field(default_factory=dict)
    fetch: dict[str, Fetched] = field(default_factory=dict)
    naive_bytes: int = 0
    dispatches_unfused: int = 0
    aliased: int = 0  # values computed straight into their concat slot

    @property
    def dispatch_count(self) -> int:
        return sum(isinstance(k, KernelOp) for k in self.kernels)


def _nbytes(t: TensorType) -> int:
    return max(t.size, 1) * t.dtype.gpu_itemsize


def _align(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


# -- parameter groups -------------------------------------------------------------------------


class GroupSpec(NamedTuple):
    dtype: DType
    elements: int
    concat_id: int  # the concat value that is the group's buffer


class Home(NamedTuple):
    group: str
    offset: int  # elements


@dataclass(frozen=True)
class LeafGroups:
    """Persistent tensors stored back to back in one buffer, because the program concatenates
    them as flat vectors (the optimizer's per-group parameter vector): the concat is then the
    buffer itself, and an update of the whole vector can be written in place."""

    home: dict[str, Home]  # leaf name -> (group name, element offset)
    groups: dict[str, GroupSpec]  # group name -> (dtype, elements, id of the concat value)

    def loc(self, name: str, nbytes: int) -> Loc | None:
        if name not in self.home:
            return None
        gname, off = self.home[name]
        return Loc("group", gname, off * self.groups[gname].dtype.gpu_itemsize, nbytes)

    def own_range_aligned(self, name: str, align: int) -> bool:
        """The tensor's range of its group starts at a multiple of ``align`` bytes (so it can
        be bound as a buffer of its own)."""
        gname, off = self.home[name]
        return (off * self.groups[gname].dtype.gpu_itemsize) % align == 0


NO_GROUPS = LeafGroups({}, {})


def find_leaf_groups(graph: Graph, any_rank: bool = False) -> LeafGroups:
    """Groups of persistent tensors stored back to back because the program concatenates them
    along axis 0: the optimizer's flat vectors (1-D concats) in training programs; with
    ``any_rank`` (inference programs, which have no flat vectors) also concats of parameters
    of any rank, e.g. fused q/k/v or gate/up weights, which then cost no kernel per run."""
    home, groups = {}, {}
    for node in graph.nodes:
        if node.op != "concat" or node.attrs["axis"] != 0 or \
                (node.out.ndim != 1 and not any_rank):
            continue
        members = _group_members(graph, node, home)
        if not members:
            continue
        gname = f"group{len(groups)}:{members[0][0]}"
        groups[gname] = GroupSpec(node.out.dtype, sum(n for _, _, n in members), node.out.id)
        for name, o, _ in members:
            home[name] = Home(gname, o)
    return LeafGroups(home, groups)


def _group_members(graph: Graph, node, taken) -> list[tuple[str, int, int]] | None:
    """(name, element offset, elements) of the parameters/states a flat concat stores, or None
    when some input is not a distinct 4-byte persistent tensor of its dtype (outside any
    other group)."""
    members, off = [], 0
    for x in node.inputs:
        leaf_v = x.node.inputs[0] if x.node.op == "reshape" else x
        lf = graph.leaf_of(leaf_v)
        if lf is None or lf.kind not in ("param", "state") or lf.name in taken or \
                lf.value.dtype != node.out.dtype or lf.value.dtype.gpu_itemsize != 4 or \
                lf.name in (m for m, _, _ in members):
            return None
        members.append((lf.name, off, lf.value.size))
        off += lf.value.size
    return members


def _concat_ranges(graph: Graph, groups: LeafGroups, align: int = ALIGN) -> dict:
    """Concats along axis 0 of parameters stored consecutively, in order, in one group, starting
    at an aligned offset: value id -> (group, element offset, value)."""
    out = {}
    concat_ids = {g.concat_id for g in groups.groups.values()}
    for node in graph.nodes:
        if node.op != "concat" or node.attrs["axis"] != 0 or node.outputs[0].id in concat_ids:
            continue
        span = []
        for x in node.inputs:
            lf = graph.leaf_of(x)
            if lf is None or lf.name not in groups.home or lf.value is not x:
                break
            span.append((*groups.home[lf.name], x.size))
        else:
            (g0, start, _), v = span[0], node.outputs[0]
            pos, ok = start, True
            for g, off, n in span:
                ok = ok and g == g0 and off == pos
                pos = off + n
            if ok and v.dtype == groups.groups[g0].dtype and \
                    (start * v.dtype.gpu_itemsize) % align == 0:
                out[v.id] = (g0, start, v)
    return out


# -- in-place updates -------------------------------------------------------------------------


def _producers_readers(kernels: list[LoweredKernel]):
    """value id -> index of the kernel writing it, and value id -> indices of its readers."""
    producer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for i, k in enumerate(kernels):
        for o in k.outs:
            producer[o.id] = i
        for x in k.ins:
            readers.setdefault(x.id, []).append(i)
    return producer, readers


def _in_place_updates(kernels, updates, graph, fetched_leaves) -> dict[str, int]:
    """Updates a pointwise kernel can write into the persistent tensor's own buffer: the kernel
    produces exactly that value, reads the old tensor (if at all) only at each thread's own
    element, and no later kernel (nor a fetched output) reads the old tensor.  The two
    bindings of that buffer are then merged into one by the runtime (read, then write, per
    element).  Archetype kernels with an in-place variant are swapped for it in ``kernels``."""
    producer, readers = _producers_readers(kernels)
    chosen: dict[str, int] = {}
    for name, v in updates.items():
        k = producer.get(v.id)
        if k is None or name in fetched_leaves:
            continue
        kern = kernels[k]
        old = graph.leaves[name].value
        if len(kern.outs) != 1 or kern.outs[0] is not v or \
                any(r > k for r in readers.get(old.id, [])):
            continue
        arch = archetype_of(kern.desc)
        if arch is not None and arch.in_place is not None:
            # e.g. a KV cache: input 0 is the cache itself (the hook checks its layout)
            variant = arch.in_place(kern.desc) if kern.ins and kern.ins[0] is old else None
            if variant is not None and all(x is not old for x in kern.ins[1:]):
                kernels[k] = dataclasses.replace(kern, desc=variant,
                                                 label=kern.label + " [in place]")
                chosen[name] = k
        elif _reads_elementwise(kern, old):
            chosen[name] = k
    return chosen


def _reads_elementwise(kern: LoweredKernel, old: Value) -> bool:
    """A pointwise kernel over ``old``'s shape reading ``old`` (if at all) at its own element."""
    desc = kern.desc
    if not isinstance(desc, ir.PointwiseKernel):
        return False
    ident = ir.Strided.contiguous(old.dtype, old.shape)
    return all(s.shape == ident.shape and s.strides == ident.strides and s.offset == 0
               for x, s in zip(kern.ins, desc.inputs) if x is old) and desc.shape == old.shape


def _in_place_groups(kernels, updates, fetch_bases, groups: LeafGroups, group_values, graph,
                     ranges=None):
    """A group whose members are all updated from one new flat vector, laid out like the group
    and computed by a pointwise kernel that reads the group only element-wise and is its last
    reader: that vector is computed straight into the group's buffer."""
    producer, readers = _producers_readers(kernels)
    chosen = {}
    for gname, gv in group_values.items():
        members = [n for n, (g, _) in groups.home.items() if g == gname]
        bases = {fetch_bases[n][0].id: fetch_bases[n][0] for n in members if n in updates}
        if len(bases) != 1 or len(members) != sum(1 for n in members if n in updates):
            continue
        (b,) = bases.values()
        if b.shape != gv.shape or any(fetch_bases[n][1].offset != groups.home[n].offset
                                      for n in members):
            continue
        k = producer.get(b.id)
        if k is None:
            continue
        kern = kernels[k]
        if not isinstance(kern.desc, ir.PointwiseKernel) or len(kern.outs) != 1 or \
                kern.outs[0] is not b:
            continue
        member_ids = [graph.leaves[n].value.id for n in members] + (ranges or {}).get(gname, [])
        if any(r > k for x in [gv.id, *member_ids] for r in readers.get(x, [])):
            continue
        ident = ir.Strided.contiguous(gv.dtype, gv.shape)
        if all(s.strides == ident.strides and s.offset == 0 and s.shape == gv.shape
               for x, s in zip(kern.ins, kern.desc.inputs) if x is gv):
            chosen[gname] = b
    return chosen


# -- arena placement --------------------------------------------------------------------------


def _place(todo, fit, align: int = ALIGN) -> tuple[dict[int, int], int]:
    """Arena offsets for values ``(id, bytes, first use, last use)`` (by first use) with the
    gap policy ``fit``, and the arena size."""
    live: list[tuple[int, int]] = []  # (offset, size) of blocks still live, by offset
    expiry: list[tuple[int, int, int]] = []  # heap of (last use, offset, size)
    offsets, cursor = {}, 0
    for vid, nbytes, start, end in todo:
        while expiry and expiry[0][0] < start:  # uses are in order: gone for good
            _, o, sz = heapq.heappop(expiry)
            live.pop(bisect.bisect_left(live, (o, sz)))
        size = _align(nbytes, align)
        off = fit(live, size)
        bisect.insort(live, (off, size))
        heapq.heappush(expiry, (end, off, size))
        offsets[vid] = off
        cursor = max(cursor, off + size)
    return offsets, cursor


def _first_fit(live: list[tuple[int, int]], size: int) -> int:
    """The lowest offset where ``size`` bytes fit between the live blocks (sorted by offset;
    they never overlap, so each block's end is the running end)."""
    off = 0
    for o, s in live:
        if off + size <= o:
            break
        off = o + s
    return off


def _best_fit(live: list[tuple[int, int]], size: int) -> int:
    """Offset for a block of ``size`` bytes among the live blocks ``(offset, size)`` (sorted,
    never overlapping): the smallest gap it fits in, else the end.  Less sensitive to placement
    order than first fit (fewer small holes left in front of big blocks)."""
    best, best_gap, end = None, None, 0
    for o, s in live:
        gap = o - end
        if gap >= size and (best_gap is None or gap < best_gap):
            best, best_gap = end, gap
        end = o + s
    return end if best is None else best


def _arena_offsets(todo, plan_memory: bool, align: int) -> tuple[dict[int, int], int]:
    """Offsets of the arena values ``todo`` and the arena size: the smaller of first and best
    fit when planning memory (both are cheap), else every value its own range."""
    if plan_memory:
        return min((_place(todo, fit, align) for fit in (_first_fit, _best_fit)),
                   key=lambda r: r[1])
    offsets, cursor = {}, 0
    for vid, nbytes, _, _ in todo:
        offsets[vid] = cursor
        cursor += _align(nbytes, align)
    return offsets, cursor


# -- liveness ---------------------------------------------------------------------------------


def _liveness(kernels: list[LoweredKernel]):
    """First and last kernel index using each bound value, and the values by id."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    values: dict[int, Value] = {}
    for i, k in enumerate(kernels):
        for v in k.outs:
            first.setdefault(v.id, i)
            last[v.id] = max(last.get(v.id, i), i)
            values[v.id] = v
        for v in k.ins:
            last[v.id] = max(last.get(v.id, i), i)
            values[v.id] = v
    return first, last, values


def _outermost_slots(alias: dict[int, tuple[Value, int]]) -> dict[int, tuple[Value, int]]:
    """value id -> (buffer value, element offset): a slot may itself lie in an outer concat's
    slot; follow to the outermost buffer."""

    def outermost(vid: int) -> tuple[Value, int]:
        cv, off = alias[vid]
        while cv.id in alias:
            outer, more = alias[cv.id]
            cv, off = outer, off + more
        return cv, off

    return {vid: outermost(vid) for vid in alias}


def _slot_loc(container: Loc, cv: Value, off: int, v: Value, strided: dict) -> Loc:
    """Where value ``v`` lies in its (outermost) concat ``cv``'s buffer ``container``: its
    own bytes at element ``off``, or for one written through a strided view
    (``Schedule.strided``) the whole range of the concat it is a slot of."""
    sized = strided.get(v.id, v)
    return Loc(container.pool, container.name, container.offset + off * cv.dtype.gpu_itemsize,
               _nbytes(sized.type))


# -- make_plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Request:
    """What a plan is asked for (the arguments of ``make_plan``)."""

    program: Program
    inference: bool
    fuse: bool
    plan_memory: bool
    groups: LeafGroups
    align: int
    max_bindings: int = MAX_BINDINGS

    @property
    def graph(self) -> Graph:
        return self.program.graph

    @functools.cached_property
    def updates(self) -> dict[str, Value]:
        return {} if self.inference else dict(self.graph.updates)

    @functools.cached_property
    def fetch_values(self) -> dict[str, Value]:
        return dict(self.program.outputs) if self.inference else self.program.step_fetch()

    def leaf_loc(self, v: Value) -> Loc | None:
        lf = self.graph.leaf_of(v)
        if lf is None:
            return None
        return self.groups.loc(lf.name, _nbytes(v.type)) or \
            Loc(lf.kind, lf.name, 0, _nbytes(v.type))


@dataclass
class _Candidate:
    """A schedule whose values are placed everywhere except in the arena."""

    req: _Request
    own_ranges: bool  # grouped parameters bound as their own range of the group buffer
    sched: Schedule
    kernels: list[LoweredKernel]  # after the rewrites
    concat_ranges: dict  # concat value id -> (group, element offset, value): a group range
    fetch_bases: dict[str, tuple[Value, ir.Strided]]  # result/update name -> (base, view)
    placed: dict[int, Loc] = field(default_factory=dict)  # groups and in-place updates


def make_plan(program: Program, inference: bool, fuse: bool = True,
              plan_memory: bool = True, groups: LeafGroups = NO_GROUPS,
              align: int = ALIGN, max_bindings: int = MAX_BINDINGS) -> Plan:
    """Schedule, fuse and place every tensor of ``program`` (training step or inference run).
    ``groups``: persistent tensors stored together (``find_leaf_groups``), shared by every plan
    of a session.  ``align``: the device's storage-buffer offset alignment in bytes (every
    binding starts at a multiple of it; the default suits every adapter).  ``max_bindings``:
    the device's storage buffers per shader stage, which caps how many sibling reductions
    share one dispatch (``siblings.py``); the default (8) is WebGPU's guaranteed limit.

    Parameters of a group are bound as their own range of the group's buffer where their
    offset allows (``align``), so kernels reading them carry no parameter offset and identical
    layers share one pipeline (SmolLM2's training step: 51 distinct pipelines instead of 298).
    A kernel that would bind a parameter and its whole group at once (overlapping writable
    ranges, which WebGPU forbids; ``binds_overlapping_group_ranges``) makes the plan read
    parameters as views into the group instead.

    Computing values straight into their concat slot saves the copy but keeps the whole
    concat buffer alive from the first such value on; when that raises the peak (gradients
    produced while activations are still live), the plan without it is kept
    (``_smaller_arena``)."""
    req = _Request(program, inference, fuse, plan_memory, groups, align,
                   max(MAX_BINDINGS, int(max_bindings)))
    candidates = _candidates(req, own_ranges=True)
    if any(binds_overlapping_group_ranges(c) for c in candidates):
        candidates = _candidates(req, own_ranges=False)
    return _smaller_arena([_finish(c) for c in candidates])


def _candidates(req: _Request, own_ranges: bool) -> list[_Candidate]:
    """The schedule computing values into their concat slots and, when it does so for any
    value, the schedule without."""
    with_slots = _candidate(req, own_ranges, alias=True)
    if not with_slots.sched.slots:
        return [with_slots]
    return [with_slots, _candidate(req, own_ranges, alias=False)]


def _smaller_arena(plans: list[Plan]) -> Plan:
    """The plan with the smallest arena (the first one on a tie)."""
    return min(plans, key=lambda p: p.arena_bytes)


def binds_overlapping_group_ranges(c: _Candidate) -> bool:
    """Would some kernel bind two different, overlapping byte ranges of one group buffer (a
    parameter's own range together with its whole group, say)?"""
    slots = _outermost_slots(c.sched.slots)
    return any(overlapping_ranges(_group_binds(c, k, slots)) for k in c.kernels)


def overlapping_ranges(locs: Iterable[Loc]) -> bool:
    """Two distinct ranges of one group buffer among ``locs`` share bytes (identical ranges do
    not count: the runtime binds them once).  Other pools are not looked at."""
    spans = sorted({(b.pool, b.name, b.offset, b.nbytes) for b in locs if b.pool == "group"})
    return any((p1, n1) == (p2, n2) and o2 < o1 + s1
               for (p1, n1, o1, s1), (p2, n2, o2, _) in zip(spans, spans[1:], strict=False))


def _group_binds(c: _Candidate, k: LoweredKernel, slots: dict) -> list[Loc]:
    """The ranges of group buffers kernel ``k`` binds (all other locations are decided
    later, in the arena or by name, and never lie in a group)."""
    out = []
    for v in k.ins + k.outs:
        loc = c.req.leaf_loc(v)
        if loc is None and v.id in slots:
            cv, off = slots[v.id]
            container = c.placed.get(cv.id)
            loc = (_slot_loc(container, cv, off, v, c.sched.strided) if container is not None
                   else None)
        elif loc is None:
            loc = c.placed.get(v.id)
        if loc is not None and loc.pool == "group":
            out.append(loc)
    return out


def _candidate(req: _Request, own_ranges: bool, alias: bool) -> _Candidate:
    """Schedule and rewrite the program's kernels, then place what lives in groups and the
    updates computed in place."""
    graph, groups = req.graph, req.groups
    homes = {graph.leaves[name].value.id: home for name, home in groups.home.items()
             if not (own_ranges and groups.own_range_aligned(name, req.align))}
    # concats of parameters that lie back to back in a group (fused q/k/v or gate/up weights):
    # the concat is that range of the group buffer; no kernel
    concat_ranges = _concat_ranges(graph, groups, req.align) if own_ranges else {}
    roots_out = list(req.fetch_values.values()) + list(req.updates.values())
    sched = schedule(req.program, req.program.roots(req.inference), req.fuse,
                     alias_ok=req.plan_memory and alias, align=req.align,
                     groups=groups.groups, homes=homes, no_kernel=concat_ranges,
                     contiguous=roots_out)
    base_id = {v.id: sched.resolve(v)[0].id for v in roots_out}
    kernels = rewrite_kernels(sched.kernels, post_passes=req.fuse,
                              merges=req.fuse and not req.inference,
                              updated={base_id[v.id] for v in req.updates.values()},
                              keep=set(base_id.values()), max_bindings=req.max_bindings)
    fetch_bases = {name: sched.resolve(v)
                   for name, v in list(req.fetch_values.items()) + list(req.updates.items())}
    c = _Candidate(req, own_ranges, sched, kernels, concat_ranges, fetch_bases)
    _place_groups(c)
    if req.plan_memory:
        _place_in_place_updates(c)
    return c


def _place_groups(c: _Candidate) -> None:
    """Group buffers, concats that are a range of one, and (when planning memory) new flat
    vectors computed straight into their group."""
    for gname, gv in c.sched.group_values.items():
        c.placed[gv.id] = Loc("group", gname, 0, _nbytes(gv.type))
    for cid, (gname, off, v) in c.concat_ranges.items():
        c.placed[cid] = Loc("group", gname, off * v.dtype.gpu_itemsize, _nbytes(v.type))
    if not c.req.plan_memory:
        return
    ranges = {}  # concats that are a range of a group read that group too
    for cid, (gname, _, _) in c.concat_ranges.items():
        ranges.setdefault(gname, []).append(cid)
    req = c.req
    for gname, b in _in_place_groups(c.kernels, req.updates, c.fetch_bases, req.groups,
                                     c.sched.group_values, req.graph, ranges).items():
        c.placed[b.id] = Loc("group", gname, 0, _nbytes(b.type))


def _place_in_place_updates(c: _Candidate) -> None:
    """Updates computed straight into their tensor's buffer (no temp, no copy)."""
    req, graph = c.req, c.req.graph
    fetched_leaves = {lf.name for n in req.fetch_values
                      if (lf := graph.leaf_of(c.fetch_bases[n][0])) is not None}
    for name in _in_place_updates(c.kernels, req.updates, graph, fetched_leaves):
        if name in req.groups.home:
            continue
        v = req.updates[name]
        c.placed[v.id] = Loc(graph.leaves[name].kind, name, 0, _nbytes(v.type))


def _finish(c: _Candidate) -> Plan:
    """Liveness, arena placement and the plan of a candidate."""
    req, graph = c.req, c.req.graph
    first, last, values = _liveness(c.kernels)
    slots = _outermost_slots(c.sched.slots)
    # a value computed into its slot of a concat makes the concat's buffer live from then on
    for vid in c.sched.slots:
        cv = slots[vid][0]
        if vid in first:
            first[cv.id] = min(first.get(cv.id, first[vid]), first[vid])
            last[cv.id] = max(last.get(cv.id, first[vid]), last.get(vid, first[vid]))
            values[cv.id] = cv
    for v in list(req.fetch_values.values()) + list(req.updates.values()):
        base = c.sched.resolve(v)[0]
        if graph.leaf_of(base) is None:
            last[base.id] = len(c.kernels)  # alive until the step's end (copies, read back)
    placed = dict(c.placed)
    # fetched results get pinned "out" buffers; the rest share the arena
    out_values = {c.fetch_bases[n][0].id for n in req.fetch_values}
    todo = []  # arena values in order of first use: (id, bytes, first, last)
    for vid in sorted(first, key=lambda vid: first[vid]):
        v = values[vid]
        if graph.leaf_of(v) is not None or vid in placed or vid in c.sched.slots:
            continue
        if vid in out_values:
            placed[vid] = Loc("out", f"%{vid}", 0, _nbytes(v.type))
            continue
        todo.append((vid, _nbytes(v.type), first[vid], last[vid]))
    offsets, arena_bytes = _arena_offsets(todo, req.plan_memory, req.align)
    for vid, nbytes, _, _ in todo:
        placed[vid] = Loc("temp", "", offsets[vid], nbytes)
    for vid, (cv, off) in slots.items():
        if vid in values:
            placed[vid] = _slot_loc(placed[cv.id], cv, off, values[vid], c.sched.strided)
    plan = _assemble(c, placed)
    plan.arena_bytes = arena_bytes
    return plan


def _assemble(c: _Candidate, placed: dict[int, Loc]) -> Plan:
    """The plan's kernels, end-of-step copies, fetched results and statistics."""
    req, graph = c.req, c.req.graph

    def loc_of(v: Value) -> Loc:
        return req.leaf_loc(v) or placed[v.id]

    def view_loc(name: str, v: Value) -> Loc:
        base, s = c.fetch_bases[name]
        bl = loc_of(base)
        return Loc(bl.pool, bl.name, bl.offset + s.offset * v.dtype.gpu_itemsize,
                   _nbytes(v.type))

    plan = Plan(aliased=len(c.sched.slots))
    needed = c.sched.needed
    plan.naive_bytes = sum(_nbytes(v.type) for n in graph.nodes if not n.opdef.leaf
                           and n.id in needed for v in n.outputs)
    for name, lf in graph.leaves.items():
        if lf.kind in ("param", "state", "input", "constant"):
            plan.pinned[name] = Pinned(lf.kind, lf.value.type)
    for k in c.kernels:
        plan.kernels.append(KernelOp(k.desc, [loc_of(v) for v in k.ins + k.outs], k.label,
                                     len(k.ins)))
    for name, v in req.fetch_values.items():
        plan.fetch[name] = Fetched(view_loc(name, v), v.type)
    for name, v in req.updates.items():
        src = view_loc(name, v)
        dst = req.groups.loc(name, _nbytes(v.type)) or \
            Loc(graph.leaves[name].kind, name, 0, _nbytes(v.type))
        if src != dst:
            plan.kernels.append(CopyOp(src, dst))
    plan.dispatches_unfused = sum(1 for n in graph.nodes if n.id in needed and not n.opdef.leaf
                                  and not isinstance(n.opdef.lowering, View)
                                  and n.op != "full")
    return plan
