"""A target-aware graph pass for precision "fast": attention forwards that will run on the
tensor-core kernel get the key-chunk count that kernel wants.

The op (``ops/attention.py``) picks its split-K chunk count from the shapes alone, for the
strict kernel (Whisper's (1, 6, 1500, 64): 6 chunks).  The tensor-core forward is fastest with
fewer (3 there: 106.1 against 127.4 µs on the H200, the combine included), and only compile
knows the precision and whether the device has f16 subgroup matrices.  So, before the
composites are expanded, this pass sets the ``fwd_chunks`` attribute of those ``attention``
nodes (``attention_fast.fast_split``: fewer chunks, and one short last chunk in the first wave's
idle slots, ``fwd_chunk_keys``); the expansion still depends on attributes and types only.
Strict precision, devices without tensor cores and attention the fast kernel does not take
keep the op's choice, so their plans are unchanged."""

from __future__ import annotations

from ..dtypes import f32
from ..kernels import attention_fast
from ..kernels.common import Target
from ..ops.attention import fwd_splits
from ..program import Program
from .passes.rebuild import rebuild


def has_tensor_cores(target: Target) -> bool:
    """The target runs the tensor-core forward (f16 subgroup matrices)."""
    return attention_fast.SG_FEATURE in target.features


def split_for(node) -> dict | None:
    """The split the tensor-core forward wants for ``attention`` node ``node``:
    ``fwd_chunks`` (and ``fwd_chunk_keys`` for uneven chunks, ``attention_fast.fast_split``),
    or None (it does not take this attention, or the op's even split is already the one)."""
    q, k, v = (x.type for x in node.inputs[:3])
    B, Hq, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[3]
    if q.dtype is not f32 or not attention_fast.pays_dims(Hq, Hkv, Sq, Skv, D, Dv):
        return None
    n = fwd_splits(B, Hq, Hkv, Sq, Skv)
    want, keys = attention_fast.fast_split(B, Hq, Hkv, Sq, Skv, n)
    if want == n and not keys:
        return None
    return {"fwd_chunks": want, **({"fwd_chunk_keys": keys} if keys else {})}


def fast_attention_chunks(program: Program, target: Target, precision: str) -> Program:
    """``program`` with ``split_for`` set on the attention nodes the tensor-core forward will
    run (precision "fast" on a target with f16 subgroup matrices); otherwise ``program``."""
    if precision != "fast" or not has_tensor_cores(target):
        return program
    if not any(n.op == "attention" and split_for(n) for n in program.graph.nodes):
        return program

    def rewrite(g, node, ins):
        split = split_for(node) if node.op == "attention" else None
        if split is None:
            return None
        return g._add_node(node.op, ins, dict(node.attrs, **split),
                           [o.type for o in node.outputs], loc=node.loc)

    return rebuild(program, rewrite)
