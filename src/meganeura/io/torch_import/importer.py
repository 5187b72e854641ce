"""torch.export → a meganeura graph: export, decompose to core ATen, check every op, build.

The steps, each a plain function:
1. ``export_program``: the module (wrapped with its loss) through ``torch.export.export`` and
   ``run_decompositions`` (core ATen; ``scaled_dot_product_attention`` is kept whole, since
   our attention kernel does what its decomposition would spell out op by op).
2. ``static_nodes``: nodes computable at import time (they depend only on constants: masks,
   position ids, rotary tables, index grids).  PyTorch evaluates them; the graph gets their
   values as constants, so e.g. ``arange``/``cumsum`` over constants need no op of ours.
3. ``unsupported``: every remaining op without a converter (or with a feature its converter
   refuses), with counts and the user's source lines.  All are reported in one error before
   anything is built: never a partial graph.
4. ``build_graph``: one walk over the fx graph; parameters, persistent buffers (states) and
   user inputs become leaves, each op its converter's values; buffer mutations (batch-norm
   running statistics) become ``Graph.set_update``s.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from ... import ops
from ...errors import GraphBuildError
from ...graph import Graph, Value
from . import convert_nn, convert_pointwise, convert_shape  # noqa: F401  (registration)
from .convert import CONVERTERS, Ctx, mn_dtype, op_name

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_KEEP = ("scaled_dot_product_attention.default",)  # not decomposed (see step 1)
_GETITEM = "_operator.getitem"


class UnsupportedOpsError(GraphBuildError):
    """The module uses ATen ops (or features of them) the importer cannot convert.
    ``.ops`` maps each ``op`` (with the feature, if any) to the user source lines using it."""

    def __init__(self, found: dict[str, list[str]]):
        self.ops = dict(found)
        total = sum(len(v) for v in found.values())
        lines = [f"from_torch: {len(found)} unsupported op kind(s), {total} use(s) in all; "
                 "nothing was built:"]
        for name, where in sorted(found.items(), key=lambda kv: -len(kv[1])):
            shown = sorted(set(where))
            more = f" (+{len(shown) - 4} more)" if len(shown) > 4 else ""
            lines.append(f"  {name}  ×{len(where)}  at " + "; ".join(shown[:4]) + more)
        super().__init__("\n".join(lines))


# ------------------------------------------------------------------ 1. export


class _WithLoss(torch.nn.Module):
    """The user's module and its loss as one module, so one export holds both."""

    def __init__(self, model: torch.nn.Module, loss, n_model_inputs: int):
        super().__init__()
        self.model = model
        self.loss = loss  # a Module registers as a submodule (its parameters are imported)
        self.n = n_model_inputs

    def forward(self, *args):
        out = self.model(*args[:self.n])
        return out, self.loss(out, *args[self.n:])


def export_program(module, args: tuple, loss=None, n_model: int | None = None):
    """The decomposed ExportedProgram of ``module`` (and ``loss``) for ``args``."""
    wrapped = module if loss is None else _WithLoss(module, loss, n_model)
    try:
        ep = torch.export.export(wrapped, tuple(args), strict=False)
    except Exception as e:  # torch's own message says what in the module could not be traced
        raise GraphBuildError(f"from_torch: torch.export.export failed: "
                              f"{type(e).__name__}: {e}") from e
    # getattr, never OpOverloadPacket.__getattr__ called directly: that builds a second
    # OpOverload object and installs it on the packet, after which export no longer recognised
    # SDPA as kept and decomposed it into bmm + softmax (our fused attention was never used)
    keep = {getattr(getattr(torch.ops.aten, n.split(".")[0]), n.split(".")[1]) for n in _KEEP}
    table = {k: v for k, v in torch.export.default_decompositions().items() if k not in keep}
    return ep.run_decompositions(table)


# ------------------------------------------------------------------ 2. static nodes


def _is_random(node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def static_nodes(ep) -> set[str]:
    """Names of the nodes whose value is known at import time."""
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    mutated = set(ep.graph_signature.buffers_to_mutate.values())
    out: set[str] = set()
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            s = specs[node.name]
            if s.kind is InputKind.CONSTANT_TENSOR or (
                    s.kind is InputKind.BUFFER and not s.persistent and s.target not in mutated):
                out.add(node.name)
        elif node.op == "call_function" and not _is_random(node):
            if all(n.name in out for n in node.all_input_nodes):
                out.add(node.name)
    return out


# ------------------------------------------------------------------ 3. unsupported ops


def source_line(node) -> str:
    """``file.py:LINE in fn: code`` of the innermost user frame of the node's stack trace
    (frames inside torch are skipped); the module path when there is no trace."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n[ \t]*(.*)', trace)
    frames = [f for f in frames if not os.path.abspath(f[0]).startswith(_TORCH_DIR)]
    if frames:
        file, line, fn, code = frames[-1]
        return f"{os.path.basename(file)}:{line} in {fn}: {code.strip()}"
    stack = node.meta.get("nn_module_stack") or {}
    return f"module {list(stack.values())[-1][0]}" if stack else f"node {node.name}"


def _dtype_problem(node) -> str | None:
    vals = node.meta.get("val")
    for v in (vals if isinstance(vals, (tuple, list)) else (vals,)):
        if isinstance(v, torch.Tensor):
            try:
                mn_dtype(v.dtype)
            except GraphBuildError:
                return f"on {v.dtype}"
    return None


def unsupported(ep, static: set[str]) -> dict[str, list[str]]:
    """Every op (and feature) of the program the converters cannot handle, with the source
    lines using it."""
    found: dict[str, list[str]] = defaultdict(list)
    for s in ep.graph_signature.input_specs:
        if s.kind not in (InputKind.USER_INPUT, InputKind.PARAMETER, InputKind.BUFFER,
                          InputKind.CONSTANT_TENSOR):
            found[f"input of kind {s.kind.name}"].append(s.arg.name)
    for s in ep.graph_signature.output_specs:
        if s.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION):
            found[f"output of kind {s.kind.name}"].append(s.arg.name)
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.name in static:
            continue
        name = op_name(node)
        if name == _GETITEM:
            continue
        conv = CONVERTERS.get(name)
        problem = "" if conv is not None else None
        if conv is not None:
            problem = (conv.check(node) if conv.check else None) or _dtype_problem(node) or ""
        if problem is None or problem:
            found[f"{name} ({problem})" if problem else name].append(source_line(node))
    return dict(found)


# ------------------------------------------------------------------ 4. build


@dataclass
class Built:
    graph: Graph
    inputs: dict[str, Value]
    outputs: dict[str, Value]
    loss: Value | None
    params: dict[str, np.ndarray] = field(default_factory=dict)
    states: dict[str, np.ndarray] = field(default_factory=dict)
    tied: dict[int, Value] = field(default_factory=dict)  # id(tensor) -> its leaf


def _clean(target: str, wrapped: bool) -> str:
    """State-dict name of the user's module (the loss wrapper's ``model.`` prefix dropped)."""
    return target[len("model."):] if wrapped and target.startswith("model.") else target


def _tensor_of(ep, target: str) -> torch.Tensor:
    t = ep.state_dict.get(target)
    return ep.constants[target] if t is None else t


def _leaf(g, ep, node, spec, names, wrapped, built: Built):
    """The leaf (input, parameter, state) or constant tensor of one placeholder."""
    val = node.meta["val"]
    if spec.kind is InputKind.USER_INPUT:
        name = names.pop(0)
        v = g.input(name, tuple(val.shape), mn_dtype(val.dtype, f"input {name!r}"))
        built.inputs[name] = v
        return v
    t = _tensor_of(ep, spec.target)
    if id(t) in built.tied:  # one tensor under several names (tied embeddings): one leaf
        return built.tied[id(t)]
    name = _clean(spec.target, wrapped)
    dt = mn_dtype(t.dtype, name)
    arr = t.detach().cpu().numpy().astype(dt.np)
    if spec.kind is InputKind.PARAMETER:
        built.params[name] = arr
        v = g.param(name, arr.shape, dt)
    else:
        built.states[name] = arr
        v = g.state(name, arr.shape, dt)
    built.tied[id(t)] = v
    return v


def _call(cx: Ctx, node, env: dict, static: set[str]):
    args, kwargs = pytree.tree_map(lambda a: env[a.name] if hasattr(a, "op") else a,
                                   (node.args, node.kwargs))
    if node.name in static:
        return node.target(*args, **kwargs)
    if op_name(node) == _GETITEM:
        return args[0][args[1]]
    cx.node = node
    first = len(cx.graph.nodes)
    out = CONVERTERS[op_name(node)].fn(cx, *args, **kwargs)
    _check_result(node, out)
    where = source_line(node)
    for n in cx.graph.nodes[first:]:  # graph dumps and build errors name the PyTorch line
        n.loc = where
    return out


def _check_result(node, out) -> None:
    """A converter's values have the shapes the export recorded (an importer bug otherwise,
    reported with the op and the user's line rather than surfacing as a later shape error)."""
    vals = node.meta.get("val")
    pairs = zip(out, vals) if isinstance(out, tuple) else [(out, vals)]
    for got, want in pairs:
        if isinstance(got, Value) and isinstance(want, torch.Tensor) and want.numel() and \
                got.shape != tuple(want.shape):
            raise GraphBuildError(f"from_torch: {op_name(node)} gave {got.shape}, the export "
                                  f"says {tuple(want.shape)} (at {source_line(node)})")


def _name(parts: list[str]) -> str:
    """``output`` for a lone tensor, ``output0``… for tuple items, field names for dicts and
    HF ``ModelOutput``s (``last_hidden_state``), dotted when nested."""
    name = ".".join(parts)
    if not name:
        return "output"
    return f"output{name}" if name[0].isdigit() else name


def _output_paths(ep, n: int) -> list[list[str]]:
    """The pytree path of each user output, as strings (index, key or attribute name)."""
    tree = pytree.tree_unflatten(list(range(n)), ep.call_spec.out_spec)
    paths: list[list[str]] = [[] for _ in range(n)]
    for path, i in pytree.tree_flatten_with_path(tree)[0]:
        paths[i] = [str(getattr(k, "idx", getattr(k, "key", getattr(k, "name", k))))
                    for k in path]
    return paths


def build_graph(ep, input_names: list[str], has_loss: bool, name: str = "torch") -> Built:
    """The graph of a checked ExportedProgram (see the module docstring, step 4)."""
    g = Graph(name)
    built = Built(g, {}, {}, None)
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    static, env, cx = static_nodes(ep), {}, Ctx(g)
    names = list(input_names)
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            spec = specs[node.name]
            env[node.name] = _tensor_of(ep, spec.target) if node.name in static else \
                _leaf(g, ep, node, spec, names, has_loss, built)
        elif node.op == "call_function":
            env[node.name] = _call(cx, node, env, static)
        elif node.op == "output":
            _outputs(ep, node.args[0], env, cx, has_loss, built)
    return built


def _outputs(ep, args, env, cx: Ctx, has_loss: bool, built: Built) -> None:
    user = []
    for spec, arg in zip(ep.graph_signature.output_specs, args):
        v = env[arg.name] if hasattr(arg, "op") else arg
        if spec.kind is OutputKind.BUFFER_MUTATION:
            name = _clean(spec.target, has_loss)
            state = built.graph.states[name]
            cx.node = arg
            built.graph.set_update(name, ops.cast(ops.stop_gradient(cx.v(v)), state.dtype))
        else:
            user.append(v)
    for path, v in zip(_output_paths(ep, len(user)), user):
        if isinstance(v, torch.Tensor):
            v = cx.v(v)
        if not isinstance(v, Value):
            continue  # None or Python numbers in the output structure
        if has_loss and path[0] == "1":
            built.loss = v
        else:
            built.outputs[_name(path[1:] if has_loss else path)] = v
