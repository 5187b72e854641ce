"""Scaled dot-product attention (flash-attention style): ``attention`` and its backward
``attention_grad``.

Shapes: q (B, Hq, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv); out (B, Hq, Sq, Dv).
Grouped-query attention when Hkv divides Hq: query head h reads kv head ``h // (Hq // Hkv)``.

Semantics (identical in the numpy reference and the GPU kernels):

* score[i, j] = scale · q_i·k_j + mask[i, j]  (scale defaults to 1/sqrt(D); the optional mask is
  an additive float tensor broadcastable to (B, Hq, Sq, Skv), e.g. built from positions for
  KV-cache decoding);
* key j is *hidden* from query i when ``causal`` and j > q_offset + i, when ``window`` is given and
  j <= q_offset + i - window, or when its score is -inf (an -inf mask entry).  Large finite
  negative masks (e.g. ``torch.finfo(float32).min``) are ordinary scores, exactly as in PyTorch;
* a query row with no visible key outputs zeros, has lse = -inf and passes no gradient — the
  same as PyTorch's ``scaled_dot_product_attention`` (≥ 2.5) for rows masked by -inf or a
  boolean mask;
* NaN scores propagate (NaN outputs), as in PyTorch.

The op ``attention`` has two outputs: ``out`` and ``lse`` (per-row log-sum-exp of the visible
scores, (B, Hq, Sq), -inf for empty rows).  Its VJP calls ``attention_grad(q, k, v, [mask], dout,
lse, out, delta_out=True) -> dq, dk, dv`` (``delta = rowsum(dout · out)`` is computed where the
expansion decides: a fused reduce kernel, or inside the dK/dV kernel of short problems; when the
lse has a gradient too the VJP passes ``delta - glse`` itself), which recomputes the
probabilities from q, k and lse (no Sq×Skv tensor is kept between forward and backward).
On the GPU ``attention_grad`` expands (``grad_plan``) into ``attention_grad_dkdv`` (loops over
query blocks and the query heads of a kv group), which for short loops, and long ones without
causal/window rules, also writes dQ's partial sums per key block (summed by a reduce), or else
into that kernel and ``attention_grad_dq`` (loops over key blocks) — deterministic, no atomics.
Short problems (``_short_plan``) end with one ``attention_grad_sum`` kernel for all the partial
sums: two backward dispatches.

The gradient with respect to a mask that depends on parameters is computed from ordinary graph
ops (it materializes the (B, Hq, Sq, Skv) score gradient); it is only built into the compiled
program when the mask needs a gradient (dead code otherwise).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import DTypeError, GraphBuildError, ShapeError
from ..graph import Value
from . import elementwise as E
from . import reduce as R
from . import shape as S
from ._common import TensorType, broadcast_shapes, build_error, defop, register_builder
from .lowering import Composite, Kernel
from .matmul import matmul

__all__ = ["attention", "attention_with_lse", "visible_mask"]

# attention_grad's dK/dV kernel works per (batch, kv head, 16-key block); with fewer such items
# than this it works per query head and sums the group afterwards (more parallel work).
SPLIT_HEADS_BELOW = 128

# Split-K (see kernels/attention_combine.py): with fewer (batch, kv head, 32-row block) work
# items than SPLIT_ITEMS, the forward splits the keys (the dK/dV kernel the query positions)
# into chunks of at least SPLIT_MIN_CHUNK, aiming at SPLIT_TARGET work items; only for
# loops of at least SPLIT_MIN_LEN keys when decoding (at most DECODE_ROWS query rows per kv
# head), SPLIT_MIN_LEN_FULL otherwise (short ones are launch-bound: the extra kernel and the
# partials, n times the output, cost more than they gain).
SPLIT_ITEMS = 512
SPLIT_TARGET = 1024
# the encoder forward (not decoding) aims higher: Whisper (282 items) 4 chunks 214 µs, 6 chunks
# 209 µs with the (16, 8, 4, 4) tiles the kernel then prefers (H200, 2026-12-01)
SPLIT_TARGET_FWD = 1536
SPLIT_MIN_CHUNK = 64
SPLIT_MIN_LEN = 256
SPLIT_MIN_LEN_FULL = 1024
SPLIT_MAX = 64
DECODE_ROWS = 64

# dQ without its own kernel (``dq_fused_block``): the dK/dV kernel also writes dQ's partial
# sum per block of keys (a reduce kernel adds them in order)
FUSED_DQ_LONG = 512
FUSED_DQ_MAX_BYTES = 128 << 20  # WebGPU's default storage-binding limit
FUSED_DQ_MAX_D = 64
# the separate dQ kernel splits its keys like the forward (split_count; partials summed)
DQ_SPLIT = True

# short problems (``_short_plan``): one ``attention_grad_sum`` kernel for every sum of the
# fused backward when its flat partials are at most GRAD_SUM_MAX_BYTES (Whisper's 127 MB keep
# the reduces), the query positions then split into chunks of at least SHORT_SPLIT_ROWS
# aiming at SHORT_SPLIT_TARGET dK/dV workgroups (0: no such split); δ from the dK/dV kernel
# for loops shorter than FUSED_DQ_LONG.  False / 0 restore the previous plan (before/after
# timings in one process: bench/attention_bench.py --short)
GRAD_SUM = True
GRAD_SUM_MAX_BYTES = 16 << 20
SHORT_SPLIT_TARGET = 256
SHORT_SPLIT_ROWS = 32
DELTA_IN_KERNEL = True


def split_count(items: int, length: int, min_len: int = SPLIT_MIN_LEN,
                target: int = SPLIT_TARGET) -> int:
    """Chunks to split a loop of ``length`` into, given ``items`` parallel work items."""
    if items >= SPLIT_ITEMS or length < min_len:
        return 1
    n = min(-(-target // max(items, 1)), length // SPLIT_MIN_CHUNK, SPLIT_MAX)
    n = max(n, 1)
    return -(-length // -(-length // n))  # no empty chunks

# ------------------------------------------------------------------ helpers


def visible_mask(sq: int, skv: int, causal: bool, window: int, q_offset: int) -> np.ndarray:
    """(Sq, Skv) bool: key j is visible from query i by the causal/window rules alone."""
    p = q_offset + np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    vis = np.ones((sq, skv), dtype=bool)
    if causal:
        vis &= j <= p
    if window:
        vis &= j > p - window
    return vis


def _dims(q, k, v):
    B, Hq, Sq, D = q.shape
    _, Hkv, Skv, _ = k.shape
    return B, Hq, Hkv, Hq // Hkv, Sq, Skv, D, v.shape[-1]


def _check_types(types, attrs, n_extra: int = 0):
    q, k, v = types[:3]
    has_mask = attrs["has_mask"]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ShapeError(f"{name} must be (batch, heads, seq, dim), got shape {t.shape}")
    if len({q.dtype, k.dtype, v.dtype}) != 1 or not q.dtype.is_float:
        raise DTypeError(f"q, k, v must share a floating dtype, got {q.dtype.name}, "
                         f"{k.dtype.name}, {v.dtype.name}")
    B, Hq, Sq, D = q.shape
    Bk, Hkv, Skv, Dk = k.shape
    Bv, Hv, Sv, _ = v.shape
    if Bk != B or Bv != B:
        raise ShapeError(f"batch sizes differ: q {B}, k {Bk}, v {Bv}")
    if Dk != D:
        raise ShapeError(f"q and k head dims differ ({D} vs {Dk})")
    if (Hv, Sv) != (Hkv, Skv):
        raise ShapeError(f"k and v differ in heads/length: k {k.shape}, v {v.shape}")
    if Hkv == 0 or Hq % Hkv:
        raise ShapeError(f"kv heads ({Hkv}) must divide query heads ({Hq}) for grouped-query "
                         "attention")
    if has_mask:
        m = types[3]
        if m.dtype != q.dtype:
            raise DTypeError(f"mask must be an additive {q.dtype.name} mask, got {m.dtype.name} "
                             "(turn a bool mask into 0/-inf with where first)")
        try:
            ok = m.ndim <= 4 and broadcast_shapes(m.shape, (B, Hq, Sq, Skv)) == (B, Hq, Sq, Skv)
        except ShapeError:
            ok = False
        if not ok:
            raise ShapeError(f"mask shape {m.shape} does not broadcast to (batch, heads, q_len, "
                             f"kv_len) = {(B, Hq, Sq, Skv)}")
    if attrs["window"] < 0:
        raise ShapeError(f"window must be a positive int, got {attrs['window']}")
    if len(types) != 3 + int(has_mask) + n_extra:
        raise GraphBuildError(f"expected {3 + int(has_mask) + n_extra} operands, got {len(types)}")
    return B, Hq, Hkv, Sq, Skv, D, v.shape[-1]


# ------------------------------------------------------------------ numpy reference


def _scores(q, k, mask, a):
    """Scores (B, Hq, Sq, Skv) with hidden keys at -inf."""
    B, Hq, Hkv, G, Sq, Skv, D, _ = _dims(q, k, k)
    qg = q.reshape(B, Hkv, G, Sq, D)
    s = np.einsum("bhgid,bhjd->bhgij", qg, k).reshape(B, Hq, Sq, Skv) * q.dtype.type(a["scale"])
    if mask is not None:
        s = s + mask
    vis = visible_mask(Sq, Skv, a["causal"], a["window"], a["q_offset"])
    return np.where(vis, s, -np.inf).astype(q.dtype)


def _pv(p, v, G):
    B, Hq, Sq, Skv = p.shape
    Hkv = v.shape[1]
    pg = p.reshape(B, Hkv, G, Sq, Skv)
    return np.einsum("bhgij,bhjd->bhgid", pg, v).reshape(B, Hq, Sq, v.shape[-1])


def _attention_ref(xs, a):
    q, k, v = xs[:3]
    mask = xs[3] if a["has_mask"] else None
    G = q.shape[1] // k.shape[1]
    s = _scores(q, k, mask, a)
    m = np.max(s, axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    ok = m > -np.inf  # rows with a visible key (NaN rows stay NaN below)
    ok = ok | np.isnan(m)
    ms = np.where(ok, m, 0.0).astype(q.dtype)
    p = np.exp(s - ms)
    l_ = np.sum(p, axis=-1, keepdims=True)
    out = _pv(p, v, G) / np.where(ok, l_, 1.0)
    out = np.where(ok, out, 0.0)
    lse = np.where(ok, ms + np.log(np.where(ok, l_, 1.0)), -np.inf)[..., 0]
    return [out.astype(q.dtype), lse.astype(q.dtype)]


def _fwd_chunk(a, Skv: int) -> int:
    """Keys per chunk of a split forward: ``chunk_keys`` (uneven chunks, the last one short)
    or an even split; ShapeError where ``chunk_keys`` does not give exactly ``splits``
    chunks (kernels/attention.py ``chunk_len`` checks the kernel description the same way)."""
    n, ck = a.get("splits", 1), a.get("chunk_keys", 0)
    if ck and not (n > 1 and ck * (n - 1) < Skv <= ck * n):
        raise ShapeError(f"attention_fwd: chunk_keys={ck} does not split {Skv} keys into {n} "
                         "chunks")
    return ck or -(-Skv // n)


def _split_fwd_ref(xs, a):
    """Per key chunk: the chunk's normalized output and lse, stacked as (n·B, ·)."""
    n = a.get("splits", 1)
    if n == 1:
        return _attention_ref(xs, a)
    q, k = xs[:2]
    B, Hq, Sq, Skv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    ch = _fwd_chunk(a, Skv)
    base = xs[3] if a["has_mask"] else np.zeros((), q.dtype)
    outs, lses = [], []
    for c in range(n):
        hide = np.full(Skv, -np.inf, q.dtype)
        hide[c * ch:(c + 1) * ch] = 0.0
        m = np.broadcast_to(base + hide, (B, Hq, Sq, Skv)).astype(q.dtype)
        o, lse = _attention_ref(list(xs[:3]) + [m], {**a, "has_mask": True})
        outs.append(o)
        lses.append(lse)
    return [np.concatenate(outs), np.concatenate(lses)]


def _combine_ref(xs, a):
    po, pl = (np.asarray(x, np.float64) for x in xs)
    n = a["splits"]
    po = po.reshape((n, -1) + po.shape[1:])
    pl = pl.reshape((n, -1) + pl.shape[1:])
    m = pl.max(0)
    empty = ~(m > -np.inf)
    w = np.exp(pl - np.where(empty, 0.0, m))
    s = w.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(empty[..., None], 0.0, (w[..., None] * po).sum(0) / s[..., None])
        lse = np.where(empty, -np.inf, m + np.log(s))
    dt = xs[0].dtype
    return [out.astype(dt), lse.astype(dt)]


def _probs(q, k, mask, lse, a):
    s = _scores(q, k, mask, a)
    ok = (lse > -np.inf)[..., None]
    return np.where(ok & (s > -np.inf), np.exp(s - np.where(ok, lse[..., None], 0.0)), 0.0)


def _grad_parts(xs, a):
    q, k, v = xs[:3]
    i = 3 + int(a["has_mask"])
    mask = xs[3] if a["has_mask"] else None
    dout, lse, delta = xs[i:i + 3]
    if a.get("delta_out"):  # the operand is the forward's output O: δ = rowsum(dO·O)
        delta = np.sum(dout * delta, axis=-1)
    B, Hq, Hkv, G, Sq, Skv, D, Dv = _dims(q, k, v)
    p = _probs(q, k, mask, lse, a).astype(q.dtype)
    pg = p.reshape(B, Hkv, G, Sq, Skv)
    dog = dout.reshape(B, Hkv, G, Sq, Dv)
    dp = np.einsum("bhgid,bhjd->bhgij", dog, v)
    ds = pg * (dp - delta.reshape(B, Hkv, G, Sq, 1))
    scale = q.dtype.type(a["scale"])
    dq = (np.einsum("bhgij,bhjd->bhgid", ds, k) * scale).reshape(q.shape)
    if a.get("split_heads"):  # per query head (summed over the group by the caller)
        dk = (np.einsum("bhgij,bhgid->bhgjd", ds, q.reshape(B, Hkv, G, Sq, D)) * scale).reshape(
            B, Hq, Skv, D)
        dv = np.einsum("bhgij,bhgid->bhgjd", pg, dog).reshape(B, Hq, Skv, Dv)
    else:
        dk = np.einsum("bhgij,bhgid->bhjd", ds, q.reshape(B, Hkv, G, Sq, D)) * scale
        dv = np.einsum("bhgij,bhgid->bhjd", pg, dog)
    return dq.astype(q.dtype), dk.astype(q.dtype), dv.astype(q.dtype)


def _grad_ref(xs, a):
    return list(_grad_parts(xs, a))


def _key_range(xs, a, lo: int, hi: int):
    """Operands and attrs with the keys outside [lo, hi) hidden by an added -inf mask (the
    given lse is kept: the probabilities of the visible keys do not change)."""
    q, k = xs[:2]
    B, Hq, Sq, Skv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    hide = np.full(Skv, -np.inf, q.dtype)
    hide[lo:hi] = 0.0
    base = xs[3] if a["has_mask"] else np.zeros((), q.dtype)
    m = np.broadcast_to(base + hide, (B, Hq, Sq, Skv)).astype(q.dtype)
    return list(xs[:3]) + [m] + list(xs[3 + int(a["has_mask"]):]), {**a, "has_mask": True}


def _dq_chunks(xs, a, ch: int):
    """dQ's partial sums over consecutive key chunks of ``ch`` keys, stacked as (n·B, ·)."""
    Skv = xs[1].shape[2]
    return np.concatenate([_grad_parts(*_key_range(xs, a, lo, lo + ch))[0]
                           for lo in range(0, Skv, ch)])


def _dq_ref(xs, a):
    """dQ; with ``splits`` the partial sums of each chunk of the keys, stacked."""
    n = a.get("splits", 1)
    if n == 1:
        return [_grad_parts(xs, a)[0]]
    return [_dq_chunks(xs, a, -(-xs[1].shape[2] // n))]


def _dkdv_ref(xs, a):
    """dK, dV; with ``splits`` the partial sums of each chunk of query positions, stacked;
    with ``dq_block`` one flat tensor: dK, dV and dQ's partial sums per block of that many
    keys, each flattened, in that order."""
    res = _dkdv_only_ref(xs, a)
    if not a.get("dq_block"):
        return res
    parts = res + [_dq_chunks(xs, a, a["dq_block"])]
    return [np.concatenate([p.reshape(-1) for p in parts])]


def _dkdv_only_ref(xs, a):
    n = a.get("splits", 1)
    if n == 1:
        return list(_grad_parts(xs, a)[1:])
    i = 3 + int(a["has_mask"])
    Sq = xs[0].shape[2]
    ch = -(-Sq // n)
    dks, dvs = [], []
    for c in range(n):
        keep = np.zeros(Sq, bool)
        keep[c * ch:(c + 1) * ch] = True
        lse = np.where(keep, xs[i + 1], -np.inf).astype(xs[i + 1].dtype)  # other rows: P = 0
        _, dk, dv = _grad_parts(list(xs[:i + 1]) + [lse] + list(xs[i + 2:]), a)
        dks.append(dk)
        dvs.append(dv)
    return [np.concatenate(dks), np.concatenate(dvs)]


# ------------------------------------------------------------------ type rules


def _attention_infer(types, a):
    B, Hq, Hkv, Sq, Skv, D, Dv = _check_types(types, a)
    dt = types[0].dtype
    n = a.get("splits", 1)
    _fwd_chunk(a, Skv)
    return [TensorType((n * B, Hq, Sq, Dv), dt), TensorType((n * B, Hq, Sq), dt)]


def _combine_infer(types, a):
    po, pl = types
    n = a["splits"]
    if po.ndim != 4 or po.shape[0] % n or pl.shape != po.shape[:3] or po.dtype != pl.dtype:
        raise ShapeError(f"attention_combine: partials {po.shape}, {pl.shape} do not split into "
                         f"{n} chunks")
    B = po.shape[0] // n
    return [TensorType((B,) + po.shape[1:], po.dtype), TensorType((B,) + pl.shape[1:], po.dtype)]


def _grad_operands(types, a):
    B, Hq, Hkv, Sq, Skv, D, Dv = _check_types(types, a, 3)
    dout, lse, delta = types[-3:]
    dt = types[0].dtype
    if dout.shape != (B, Hq, Sq, Dv) or dout.dtype != dt:
        raise ShapeError(f"dout must be {dt.name}{(B, Hq, Sq, Dv)}, got {dout}")
    want = {"lse": (B, Hq, Sq), "delta": (B, Hq, Sq) + ((Dv,) if a.get("delta_out") else ())}
    for name, t in (("lse", lse), ("delta", delta)):
        if t.shape != want[name] or t.dtype != dt:
            what = "out (delta_out)" if name == "delta" and a.get("delta_out") else name
            raise ShapeError(f"{what} must be {dt.name}{want[name]}, got {t}")
    return types[0], types[1], types[2]


def _grad_infer(types, a):
    return list(_grad_operands(types, a))


def _dq_infer(types, a):
    q = _grad_operands(types, a)[0]
    return [TensorType((a.get("splits", 1) * q.shape[0],) + q.shape[1:], q.dtype)]


def _dkdv_infer(types, a):
    q, k, v = _grad_operands(types, a)
    B, Hq = q.shape[:2]
    n = a.get("splits", 1)
    H = Hq if a.get("split_heads") else k.shape[1]
    res = [TensorType((n * B, H) + k.shape[2:], k.dtype),
           TensorType((n * B, H) + v.shape[2:], v.dtype)]
    if a.get("dq_block"):
        nkb = -(-k.shape[2] // a["dq_block"])
        res.append(TensorType((nkb * B,) + q.shape[1:], q.dtype))
        return [TensorType((sum(t.size for t in res),), q.dtype)]
    return res


def _grad_sum_sizes(a) -> tuple[int, int, int]:
    B, Hq, Hkv, Sq, Skv, D, Dv = a["dims"]
    lead = max(1, a["splits"]) * B * (Hq if a["split_heads"] else Hkv) * Skv
    return lead * D, lead * Dv, -(-Skv // a["dq_block"]) * B * Hq * Sq * D


def _grad_sum_infer(types, a):
    (flat,) = types
    B, Hq, Hkv, Sq, Skv, D, Dv = a["dims"]
    if flat.shape != (sum(_grad_sum_sizes(a)),):
        raise ShapeError(f"attention_grad_sum: partials {flat.shape} are not the flat dK/dV "
                         f"output of dims {a['dims']} ({sum(_grad_sum_sizes(a))} elements)")
    return [TensorType((B, Hq, Sq, D), flat.dtype), TensorType((B, Hkv, Skv, D), flat.dtype),
            TensorType((B, Hkv, Skv, Dv), flat.dtype)]


def _grad_sum_ref(xs, a):
    """dQ, dK, dV from the flat output of a dK/dV kernel with ``dq_block``: the key blocks'
    dQ partials summed, dK/dV summed over the query chunks (and the group's heads)."""
    B, Hq, Hkv, Sq, Skv, D, Dv = a["dims"]
    parts = np.split(xs[0], np.cumsum(_grad_sum_sizes(a))[:2])
    lead = (max(1, a["splits"]), B, Hkv, Hq // Hkv if a["split_heads"] else 1)
    dk = parts[0].reshape(lead + (Skv, D)).sum((0, 3))
    dv = parts[1].reshape(lead + (Skv, Dv)).sum((0, 3))
    dq = parts[2].reshape((-1, B, Hq, Sq, D)).sum(0)
    return [x.astype(xs[0].dtype) for x in (dq, dk, dv)]


# ------------------------------------------------------------------ VJPs


def _attention_vjp(n, c):
    q, k, v = n.inputs[:3]
    mask = n.inputs[3] if n.attrs["has_mask"] else None
    out, lse = n.outputs
    gout, glse = c
    if gout is None:
        gout = E.zeros_like(out)
    extra = (mask,) if mask is not None else ()
    delta = None
    if glse is None:  # δ = rowsum(dO·O): where the expansion computes it (maybe in dK/dV)
        dq, dk, dv = n.out.graph.apply("attention_grad", q, k, v, *extra, gout, lse, out,
                                       **n.attrs, delta_out=True)
    else:
        delta = R.sum(gout * out, -1) - glse
        dq, dk, dv = n.out.graph.apply("attention_grad", q, k, v, *extra, gout, lse, delta,
                                       **n.attrs)
    res = [dq, dk, dv]
    if mask is not None:
        delta = R.sum(gout * out, -1) if delta is None else delta
        res.append(_mask_grad(q, k, v, mask, gout, lse, delta, n.attrs))
    return res


def _mask_grad(q, k, v, mask, gout, lse, delta, a):
    """d loss / d mask = P · (dP - delta), summed to the mask's shape (graph ops; O(Sq·Skv))."""
    g = q.graph
    B, Hq, Hkv, G, Sq, Skv, D, Dv = _dims(q, k, v)
    qg = S.reshape(q, (B, Hkv, G, Sq, D))
    kg = S.unsqueeze(k, 2)
    vg = S.unsqueeze(v, 2)
    s = S.reshape(matmul(qg, kg, transpose_b=True), (B, Hq, Sq, Skv))
    s = s * a["scale"] + mask
    vis = g.const(visible_mask(Sq, Skv, a["causal"], a["window"], a["q_offset"]))
    lse4 = S.unsqueeze(lse, -1)
    ok = E.logical_and(E.logical_and(vis, s > -math.inf), lse4 > -math.inf)
    p = E.where(ok, E.exp(E.where(ok, s - lse4, 0.0)), 0.0)
    dog = S.reshape(gout, (B, Hkv, G, Sq, Dv))
    dp = matmul(dog, vg, transpose_b=True)
    ds = p * (S.reshape(dp, (B, Hq, Sq, Skv)) - S.unsqueeze(delta, -1))
    return R.sum_to(ds, mask.shape)


# ------------------------------------------------------------------ lowering of the backward


def dq_fused_block(B: int, Hq: int, Sq: int, Skv: int, D: int, causal: bool,
                   window: int) -> int:
    """Key block of the dK/dV kernel that also writes dQ's partial sums (0: a separate dQ
    kernel).  Short key loops (< FUSED_DQ_LONG) take 16-key blocks whatever the rules (the
    kernel writes zero partials for rows a block is hidden from); long ones 32-key blocks and
    only without causal/window rules (there the dQ kernel skips hidden tiles, the fused one
    would write zeros: not measured); the partials (one dQ per block; ``grad_plan`` also counts
    dK/dV's) must stay within FUSED_DQ_MAX_BYTES, and head dims within FUSED_DQ_MAX_D (a
    32-key block of larger heads fits no 32 KiB workgroup storage).  H200: Whisper's backward
    818 → 585 µs (dQ 393 + dK/dV 410 + sums → fused 509 + sums), SmolLM2's 39 → 31 µs
    (2026-12-01)."""
    if D > FUSED_DQ_MAX_D:
        return 0
    if Skv < FUSED_DQ_LONG:
        blk = 16
    elif causal or window:
        return 0
    else:
        blk = 32
    return blk if -(-Skv // blk) * B * Hq * Sq * D * 4 <= FUSED_DQ_MAX_BYTES else 0


def _packed_bytes(B, Hq, Hkv, Sq, Skv, D, Dv, plan) -> int:
    """Bytes of the fused dK/dV kernel's one output (dK, dV partials and dQ's partials)."""
    lead = plan["splits"] * B * (Hq if plan["split_heads"] else Hkv) * Skv
    return 4 * (lead * (D + Dv) + -(-Skv // plan["dq_block"]) * B * Hq * Sq * D)


def grad_plan(B: int, Hq: int, Hkv: int, Sq: int, Skv: int, D: int, causal: bool,
              window: int, Dv: int | None = None) -> dict:
    """How ``attention_grad`` is computed: ``dq_block`` (dK/dV also writes dQ's partials per
    block of that many keys; 0: a separate dQ kernel over ``dq_splits`` key chunks),
    ``split_heads`` (dK/dV per query head, summed over the group) and ``splits`` (dK/dV over
    that many chunks of query positions, summed) — too few (batch, kv head, key block) work
    items fill no GPU, hence the splits and their deterministic sums; ``grad_sum`` (one
    ``attention_grad_sum`` kernel does every sum) and ``delta_in_kernel`` (the dK/dV kernel
    computes δ = rowsum(dO·O) itself) for short problems (``_short_plan``)."""
    G = Hq // Hkv
    dv = D if Dv is None else Dv
    heads = G > 1 and B * Hkv * -(-Skv // 16) < SPLIT_HEADS_BELOW
    n = split_count(B * (Hq if heads else Hkv) * -(-Skv // 32), Sq, SPLIT_MIN_LEN_FULL)
    plan = {"dq_block": dq_fused_block(B, Hq, Sq, Skv, D, causal, window), "dq_splits": 1,
            "split_heads": heads, "splits": n, "grad_sum": False, "delta_in_kernel": False}
    if plan["dq_block"] and _packed_bytes(B, Hq, Hkv, Sq, Skv, D, dv, plan) > FUSED_DQ_MAX_BYTES:
        plan["dq_block"] = 0
    if plan["dq_block"]:
        _short_plan(plan, B, Hq, Hkv, Sq, Skv, D, dv)
    if DQ_SPLIT and not plan["dq_block"]:
        plan["dq_splits"] = split_count(B * Hkv * -(-G * Sq // 32), Skv, SPLIT_MIN_LEN_FULL)
    return plan


def _short_plan(plan: dict, B, Hq, Hkv, Sq, Skv, D, Dv) -> None:
    """A fused-dQ backward whose partials are small (≤ GRAD_SUM_MAX_BYTES) is bound by its
    dispatches, not its arithmetic (SmolLM2, 128 positions: ~8 µs per dispatch in a profiled
    H200 step, the kernels themselves a few µs): one ``attention_grad_sum`` kernel replaces the
    dQ partial sum and the head/chunk sums, so splitting the query positions into chunks of
    ≥ SHORT_SPLIT_ROWS (more workgroups, a shorter serial loop each, aiming at
    SHORT_SPLIT_TARGET of them) costs no extra dispatch; a short loop (< FUSED_DQ_LONG keys)
    also takes δ from the dK/dV kernel (no reduce kernel)."""
    plan["delta_in_kernel"] = DELTA_IN_KERNEL and Skv < FUSED_DQ_LONG
    if not GRAD_SUM:
        return
    n = plan["splits"]
    if n == 1 and SHORT_SPLIT_TARGET:
        blocks = B * (Hq if plan["split_heads"] else Hkv) * -(-Skv // plan["dq_block"])
        n = max(1, min(-(-SHORT_SPLIT_TARGET // blocks), Sq // SHORT_SPLIT_ROWS))
        n = -(-Sq // -(-Sq // n))  # no empty chunk
    for m in dict.fromkeys((n, plan["splits"])):
        if _packed_bytes(B, Hq, Hkv, Sq, Skv, D, Dv, {**plan, "splits": m}) <= GRAD_SUM_MAX_BYTES:
            plan.update(splits=m, grad_sum=True)
            return


def _expand_grad(graph, node):
    a = dict(node.attrs)
    ins = list(node.inputs)
    q, k, v = ins[:3]
    B, Hq, Hkv, G, Sq, Skv, D, Dv = _dims(q, k, v)
    plan = grad_plan(B, Hq, Hkv, Sq, Skv, D, a["causal"], a["window"], Dv)
    blk, nq, heads, n = (plan[x] for x in ("dq_block", "dq_splits", "split_heads", "splits"))
    extra = ({"split_heads": True} if heads else {}) | ({"splits": n} if n > 1 else {})
    if a.pop("delta_out", False):  # the last operand is O
        if blk and plan["delta_in_kernel"]:
            extra["delta_out"] = True
        else:
            ins[-1] = R.sum(ins[-3] * ins[-1], -1)
    if blk and plan["grad_sum"]:  # one flat output, one kernel for every sum
        flat = graph.apply("attention_grad_dkdv", *ins, **a, **extra, dq_block=blk)
        return list(graph.apply("attention_grad_sum", flat, dims=(B, Hq, Hkv, Sq, Skv, D, Dv),
                                splits=n, split_heads=heads, dq_block=blk))
    if blk:  # one flat output: dK, dV, dQ's partials (views of it, no copies)
        flat = graph.apply("attention_grad_dkdv", *ins, **a, **extra, dq_block=blk)
        lead = max(n, 1) * B * (Hq if heads else Hkv) * Skv
        ends = np.cumsum([lead * D, lead * Dv, -(-Skv // blk) * B * Hq * Sq * D]).tolist()
        dkh = S.reshape(S.slice_(flat, 0, 0, ends[0]), (max(n, 1) * B, -1, Skv, D))
        dvh = S.reshape(S.slice_(flat, 0, ends[0], ends[1]), (max(n, 1) * B, -1, Skv, Dv))
        dqp = S.slice_(flat, 0, ends[1], ends[2])
        dq = R.sum(S.reshape(dqp, (-(-Skv // blk), B, Hq, Sq, D)), (0,))
    elif nq > 1:
        dqp = graph.apply("attention_grad_dq", *ins, **a, splits=nq)
        dq = R.sum(S.reshape(dqp, (nq, B, Hq, Sq, D)), (0,))
    else:
        dq = graph.apply("attention_grad_dq", *ins, **a)
    if not blk:
        dkh, dvh = graph.apply("attention_grad_dkdv", *ins, **a, **extra)
    if not heads and n == 1:
        return [dq, dkh, dvh]
    lead = ((n,) if n > 1 else ()) + (B, Hkv) + ((G,) if heads else ())
    axes = ((0,) if n > 1 else ()) + ((len(lead) - 1,) if heads else ())
    dk = R.sum(S.reshape(dkh, lead + (Skv, D)), axes)
    dv = R.sum(S.reshape(dvh, lead + (Skv, Dv)), axes)
    return [dq, dk, dv]


def fwd_splits(B: int, Hq: int, Hkv: int, Sq: int, Skv: int) -> int:
    """Key chunks of the forward (1: no split-K); decoding (a few query rows over a long
    cache) and batch-1 encoders split."""
    rows = Hq // Hkv * Sq
    items = B * Hkv * -(-rows // 32)
    if rows <= DECODE_ROWS:
        return split_count(items, Skv, SPLIT_MIN_LEN)
    return split_count(items, Skv, SPLIT_MIN_LEN_FULL, SPLIT_TARGET_FWD)


def _expand_fwd(graph, node):
    """The forward kernel (split into key chunks where ``fwd_splits`` says so, or as many as
    the ``fwd_chunks`` attribute asks, of ``fwd_chunk_keys`` keys each when set: compile sets
    them where the tensor-core forward of precision "fast" wants other chunks than the strict
    kernel) and the chunks' combine."""
    q, k, v = node.inputs[:3]
    B, Hq, Hkv, G, Sq, Skv, D, Dv = _dims(q, k, v)
    attrs = {a: x for a, x in node.attrs.items() if a not in ("fwd_chunks", "fwd_chunk_keys")}
    n = node.attrs.get("fwd_chunks") or fwd_splits(B, Hq, Hkv, Sq, Skv)
    if n == 1:
        return list(graph.apply("attention_fwd", *node.inputs, **attrs))
    if node.attrs.get("fwd_chunk_keys"):  # uneven chunks (attention_fast.fast_split)
        attrs["chunk_keys"] = node.attrs["fwd_chunk_keys"]
    po, pl = graph.apply("attention_fwd", *node.inputs, **attrs, splits=n)
    return list(graph.apply("attention_combine", po, pl, splits=n))


defop("attention", _attention_infer, _attention_ref, _attention_vjp, Composite(_expand_fwd))
defop("attention_fwd", _attention_infer, _split_fwd_ref, None, Kernel("attention_fwd"))
defop("attention_combine", _combine_infer, _combine_ref, None, Kernel("attention_combine"))
defop("attention_grad", _grad_infer, _grad_ref, None, Composite(_expand_grad))
defop("attention_grad_dq", _dq_infer, _dq_ref, None, Kernel("attention_grad_dq"))
defop("attention_grad_dkdv", _dkdv_infer, _dkdv_ref, None, Kernel("attention_grad_dkdv"))
defop("attention_grad_sum", _grad_sum_infer, _grad_sum_ref, None, Kernel("attention_grad_sum"))


# ------------------------------------------------------------------ builders


def _attrs(q, k, v, causal, scale, window, mask, q_offset):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Value):
            raise build_error(GraphBuildError, "attention", f"{name} must be a graph Value",
                              q, k, v)
    if mask is not None and not isinstance(mask, Value):
        raise build_error(GraphBuildError, "attention", "mask must be a graph Value (an additive "
                          "float mask) or None", q, k, v, mask)
    if q.ndim != 4:
        raise build_error(ShapeError, "attention", "q must be (batch, heads, seq, dim)", q, k, v)
    if window is not None and (int(window) != window or window < 1):
        raise build_error(ShapeError, "attention", f"window must be an int >= 1, got {window!r}",
                          q, k, v)
    if isinstance(q_offset, Value) or int(q_offset) != q_offset:
        raise build_error(GraphBuildError, "attention", "q_offset must be a Python int (use an "
                          "additive mask for runtime positions)", q, k, v)
    D = q.shape[-1]
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return dict(causal=bool(causal), scale=sc, window=int(window or 0), q_offset=int(q_offset),
                has_mask=mask is not None)


def attention_with_lse(q: Value, k: Value, v: Value, causal: bool = False,
                       scale: float | None = None, window: int | None = None,
                       mask: Value | None = None, q_offset: int = 0) -> tuple[Value, Value]:
    """``attention`` returning also the per-row log-sum-exp (B, Hq, Sq) of the visible scores."""
    a = _attrs(q, k, v, causal, scale, window, mask, q_offset)
    extra = (mask,) if mask is not None else ()
    return q.graph.apply("attention", q, k, v, *extra, **a)


@register_builder("attention")
def attention(q: Value, k: Value, v: Value, causal: bool = False, scale: float | None = None,
              window: int | None = None, mask: Value | None = None, q_offset: int = 0) -> Value:
    """softmax(scale · q kᵀ + mask) v with flash-attention kernels (see the module docstring).

    q (B, Hq, Sq, D); k (B, Hkv, Skv, D); v (B, Hkv, Skv, Dv); Hkv divides Hq (grouped-query).
    ``causal``: query i (absolute position q_offset + i) sees keys j <= q_offset + i.
    ``window``: sliding window; keys j > q_offset + i - window are also required.
    ``mask``: additive float mask broadcastable to (B, Hq, Sq, Skv); -inf hides a key.
    Returns (B, Hq, Sq, Dv)."""
    return attention_with_lse(q, k, v, causal, scale, window, mask, q_offset)[0]
