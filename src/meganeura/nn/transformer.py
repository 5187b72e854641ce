"""Transformer layers built from ops: Embedding, RMSNorm, LayerNorm, RoPE, multi-head attention
with grouped KV heads, SwiGLU and GELU MLPs.

Parameter names and layouts are Hugging Face's (``{name}.weight`` of shape ``(out, in)``,
``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``gate_proj``/``up_proj``/``down_proj``,
``fc1``/``fc2``), so HF checkpoints load without transposes.  Norms, RoPE and the MLPs are
compositions of primitive ops: their exact gradients come from autodiff.

Tensor layout inside attention is ``(batch, heads, seq, head_dim)``; layers take and return
``(batch, seq, hidden)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import ops
from ..dtypes import f32
from ..errors import GraphBuildError, ShapeError
from ..graph import Graph, Value
from ..init import fan_in_uniform, kaiming_uniform, normal, ones, zeros
from ..ops.nn import one_hot

__all__ = [
    "Embedding", "RMSNorm", "LayerNorm", "RoPE", "Attention", "SwiGLU", "GeluMLP",
    "attention", "composite_attention", "embed", "rotate_half", "apply_rope",
    "causal_mask", "sinusoids", "dense", "fused_dense",
]

NEG_INF = float("-inf")


# ------------------------------------------------------------------------------ impl choice


def op_for(name: str, impl: str):
    """The registered op ``name`` for ``impl`` "auto"/"op", or None for "composite"."""
    if impl not in ("auto", "op", "composite"):
        raise GraphBuildError(f"impl must be 'auto', 'op' or 'composite', got {impl!r}")
    fn = getattr(ops, name, None)
    if impl == "op" and fn is None:
        raise GraphBuildError(f"impl='op': the op {name!r} is not registered")
    return None if impl == "composite" else fn


# ------------------------------------------------------------------------------ embedding


def embed(ids: Value, table: Value, impl: str = "auto") -> Value:
    """Rows of ``table`` (V, D) at integer ``ids`` (any shape) -> ids.shape + (D,).

    ``impl``: "auto"/"op" use the ``embedding`` op (gather forward, deterministic scatter-add
    backward); "composite" computes ``one_hot(ids) @ table`` (same values and gradient, V times
    the FLOPs) from primitive ops."""
    fn = op_for("embedding", impl)
    if fn is not None:
        return fn(ids, table)
    oh = one_hot(ids, table.shape[0], table.dtype)
    return ops.matmul(oh, table)


@dataclass
class Embedding:
    """A lookup table ``{name}.weight`` of shape (num_embeddings, dim)."""

    num_embeddings: int
    dim: int
    name: str = "embed_tokens"
    init_std: float = 1.0  # PyTorch's nn.Embedding default N(0, 1); HF models use 0.02
    impl: str = "auto"

    def weight(self, g: Graph) -> Value:
        """The table (declared on first use; later calls return the same parameter, e.g. for
        a tied output projection)."""
        key = f"{self.name}.weight"
        if key in g.leaves:
            return g.leaves[key].value
        return g.param(key, (self.num_embeddings, self.dim), init=normal(self.init_std))

    def __call__(self, g: Graph, ids: Value) -> Value:
        return embed(ids, self.weight(g), self.impl)


# ------------------------------------------------------------------------------ projections


def _linear_params(g: Graph, name: str, n_in: int, n_out: int, bias: bool):
    """``{name}.weight`` (n_out, n_in) and ``{name}.bias`` with nn.Linear's initializers."""
    w = g.param(f"{name}.weight", (n_out, n_in), init=kaiming_uniform())
    b = g.param(f"{name}.bias", (n_out,), init=fan_in_uniform(n_in)) if bias else None
    return w, b


def _fused_matmul(g: Graph, x: Value, n_in: int, parts: Sequence[tuple[str, int, bool]]):
    """(*x.shape[:-1], Σ n_out) = x2 @ concat(W)ᵀ + concat(b), x2 being x with leading dims
    flattened.  The product is viewed back at x's leading shape *before* the bias is added:
    the compiler fuses a matmul → reshape → elementwise chain (bias, activation, residual)
    into the GEMM's epilogue, but a reshape between two elementwise ops ends the chain (the
    bias sum would be stored and the activation run as a dispatch of its own)."""
    x2 = ops.reshape(x, (-1, n_in)) if x.ndim != 2 else x
    ws, bs = zip(*(_linear_params(g, name, n_in, n, bias) for name, n, bias in parts),
                 strict=True)
    w = ops.concat(list(ws), 0) if len(ws) > 1 else ws[0]
    y = ops.matmul(x2, w, transpose_b=True)
    if x.ndim != 2:
        y = ops.reshape(y, x.shape[:-1] + (y.shape[-1],))
    if any(b is not None for b in bs):
        full = [b if b is not None else g.full((n,), 0.0, x.dtype)
                for b, (_, n, _) in zip(bs, parts, strict=True)]
        y = y + (ops.concat(full, 0) if len(full) > 1 else full[0])
    return y


def fused_dense(g: Graph, x: Value, n_in: int, parts: Sequence[tuple[str, int, bool]],
                fuse: bool = True) -> tuple[Value, ...]:
    """Several linear layers ``(name, n_out, bias)`` on the same input.  ``fuse``: as one GEMM
    — the weights are concatenated along their output axis (the parameters stay separate,
    with PyTorch/HF names, layout and init) and the result is split back.  That saves
    dispatches and makes one larger GEMM, at the price of copying the weights every step (a
    trade-off: the model builders fuse in training graphs, not in inference/decode graphs).

    Leading dims of ``x`` are flattened first, so each product is one 2-D GEMM and each weight
    gradient a single matmul over all rows (no batched product reduced afterwards)."""
    if not fuse and len(parts) > 1:
        return tuple(fused_dense(g, x, n_in, [p])[0] for p in parts)
    y = _fused_matmul(g, x, n_in, parts)  # (x's leading dims: split after reshaping)
    return ops.split(y, [n for _, n, _ in parts], -1) if len(parts) > 1 else (y,)


def dense(g: Graph, x: Value, name: str, n_in: int, n_out: int, bias: bool = True) -> Value:
    """``nn.Linear`` (``{name}.weight``/``.bias``, same init) with x's leading dims flattened
    (see :func:`fused_dense`)."""
    return fused_dense(g, x, n_in, [(name, n_out, bias)])[0]


# ------------------------------------------------------------------------------ norms


@dataclass
class RMSNorm:
    """``x * rsqrt(mean(x², -1) + eps) * weight`` (LlamaRMSNorm)."""

    dim: int
    eps: float = 1e-6
    name: str = "norm"

    def __call__(self, g: Graph, x: Value) -> Value:
        w = g.param(f"{self.name}.weight", (self.dim,), init=ones())
        var = ops.mean(ops.square(x), -1, keepdims=True)
        return x * ops.rsqrt(var + self.eps) * w


@dataclass
class LayerNorm:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (biased variance)."""

    dim: int
    eps: float = 1e-5
    name: str = "layer_norm"

    def __call__(self, g: Graph, x: Value) -> Value:
        w = g.param(f"{self.name}.weight", (self.dim,), init=ones())
        b = g.param(f"{self.name}.bias", (self.dim,), init=zeros())
        xc = x - ops.mean(x, -1, keepdims=True)
        var = ops.mean(ops.square(xc), -1, keepdims=True)
        return xc * ops.rsqrt(var + self.eps) * w + b


# ------------------------------------------------------------------------------ RoPE


def rotate_half(x: Value) -> Value:
    """HF's half-split rotation: ``concat(-x[..., D/2:], x[..., :D/2])``."""
    x1, x2 = ops.split(x, 2, -1)
    return ops.concat([-x2, x1], -1)


def apply_rope(x: Value, cos: Value, sin: Value) -> Value:
    """``x * cos + rotate_half(x) * sin``; x (B, H, S, D), cos/sin (S, D) or (B, 1, S, D).

    Computed on the halves: with x viewed as (…, 2, D/2), rotate_half is the view with the
    half axis reversed (a negative stride) times (-1, +1), so the whole rotation is one fused
    elementwise kernel (and so is its gradient) instead of split/negate/concat kernels."""
    D = x.shape[-1]
    halves = x.shape[:-1] + (2, D // 2)
    xh = ops.reshape(x, halves)
    sign = x.graph.const(np.array([[-1.0], [1.0]], np.float32), dtype=x.dtype)
    ch = ops.reshape(cos, cos.shape[:-1] + (2, D // 2))
    sh = ops.reshape(sin, sin.shape[:-1] + (2, D // 2))
    out = xh * ch + ops.flip(xh, -2) * sign * sh
    return ops.reshape(out, x.shape)


@dataclass
class RoPE:
    """Rotary position embedding, HF convention (``rotate_half``, frequencies repeated twice)."""

    head_dim: int
    theta: float = 10000.0

    def __post_init__(self):
        if self.head_dim % 2:
            raise ShapeError(f"RoPE needs an even head_dim, got {self.head_dim}")

    def inv_freq(self) -> np.ndarray:
        """``1 / theta^(2i/D)`` rounded the way PyTorch computes it in float32."""
        e = np.arange(0, self.head_dim, 2, dtype=np.float32) / np.float32(self.head_dim)
        return (np.float32(1.0) / np.power(np.float32(self.theta), e)).astype(np.float32)

    def tables_np(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) of shape positions.shape + (D,) in float32 (f32 products, as HF)."""
        pos = np.asarray(positions, dtype=np.float32)
        freqs = pos[..., None] * self.inv_freq()
        emb = np.concatenate([freqs, freqs], -1)
        return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)

    def tables(self, g: Graph, positions, offset: int = 0) -> tuple[Value, Value]:
        """cos/sin tables, shape positions.shape + (D,), for ``positions``: an int n (positions
        offset … offset+n-1), a numpy array (constant tables), or an integer Value of position
        ids (computed in the graph at run time, e.g. a decode position; ``offset`` added).
        Feed the result to :func:`apply_rope`."""
        if isinstance(positions, Value):
            p = positions.cast(f32)
            if offset:
                p = p + float(offset)
            inv = g.const(np.concatenate([self.inv_freq()] * 2))
            freqs = ops.unsqueeze(p, -1) * inv
            return ops.cos(freqs), ops.sin(freqs)
        if isinstance(positions, (int, np.integer)):
            positions = np.arange(int(positions))
        cos, sin = self.tables_np(np.asarray(positions) + offset)
        return g.const(cos), g.const(sin)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper's sinusoidal position table (length, channels): ``[sin | cos]`` halves."""
    if channels % 2:
        raise ShapeError(f"sinusoids need an even channel count, got {channels}")
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = np.exp(-inc * np.arange(channels // 2, dtype=np.float64))
    t = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


# ------------------------------------------------------------------------------ attention


def causal_mask(sq: int, skv: int, q_offset: int = 0) -> np.ndarray:
    """Additive (sq, skv) mask: 0 where key j <= query i + q_offset, -inf elsewhere."""
    i = np.arange(sq)[:, None] + q_offset
    j = np.arange(skv)[None, :]
    return np.where(j <= i, 0.0, NEG_INF).astype(np.float32)


def composite_attention(q: Value, k: Value, v: Value, causal: bool = False,
                        scale: float | None = None, mask: Value | None = None,
                        q_offset: int = 0) -> Value:
    """softmax(q kᵀ · scale + mask) v from matmul/softmax ops (the eager formula); GQA by
    grouping the query heads of each KV head."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q5 = ops.reshape(q, (B, Hkv, G, Sq, D))
    k5 = ops.unsqueeze(k, 2)
    v5 = ops.unsqueeze(v, 2)
    s = ops.matmul(q5, k5, transpose_b=True) * scale  # (B, Hkv, G, Sq, Skv)
    if causal:
        s = s + q.graph.const(causal_mask(Sq, Skv, q_offset))
    if mask is not None:
        m = mask
        if m.ndim == 4:  # (B|1, Hq|1, Sq|1, Skv) -> (B|1, Hkv|1, G|1, Sq|1, Skv)
            b, h = m.shape[:2]
            m = (ops.reshape(m, (b, Hkv, G) + m.shape[2:]) if h == Hq
                 else ops.unsqueeze(m, 2))
        s = s + m
    p = ops.softmax(s, -1)
    return ops.reshape(ops.matmul(p, v5), (B, Hq, Sq, D))


def attention(q: Value, k: Value, v: Value, causal: bool = False, scale: float | None = None,
              mask: Value | None = None, q_offset: int = 0, impl: str = "auto") -> Value:
    """Scaled dot-product attention, q (B, Hq, Sq, D), k/v (B, Hkv, Skv, D).

    ``impl``: "auto"/"op" use the ``attention`` op (flash-style kernels, saved log-sum-exp);
    "composite" builds :func:`composite_attention` from matmul/softmax ops."""
    fn = op_for("attention", impl)
    if fn is None:
        return composite_attention(q, k, v, causal, scale, mask, q_offset)
    return fn(q, k, v, causal=causal, scale=scale, mask=mask, q_offset=q_offset)


def _heads(x: Value, n: int, d: int) -> Value:
    """(B, S, n·d) -> (B, n, S, d)."""
    B, S = x.shape[0], x.shape[1]
    return ops.transpose(ops.reshape(x, (B, S, n, d)), 1, 2)


def _merge_heads(x: Value) -> Value:
    """(B, H, S, d) -> (B, S, H·d)."""
    B, H, S, d = x.shape
    return ops.reshape(ops.transpose(x, 1, 2), (B, S, H * d))


@dataclass
class Attention:
    """Multi-head attention with grouped KV heads (GQA when n_kv_heads < n_heads).

    Self-attention by default; give ``kv_in`` (and a ``kv`` source at call time) for
    cross-attention.  Projections: ``{name}.q_proj``/``k_proj``/``v_proj``/``{out_name}``."""

    hidden: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    name: str = "self_attn"
    kv_in: int | None = None  # input features of k/v projections (default: hidden)
    q_bias: bool = False
    k_bias: bool = False
    v_bias: bool = False
    o_bias: bool = False
    out_name: str = "o_proj"
    scale: float | None = None  # default 1/sqrt(head_dim)
    impl: str = "auto"
    fuse: bool = True  # one GEMM for projections of the same input (see fused_dense)

    def __post_init__(self):
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        self.head_dim = self.head_dim or self.hidden // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ShapeError(f"{self.name}: n_heads {self.n_heads} is not a multiple of "
                             f"n_kv_heads {self.n_kv_heads}")

    def project(self, g: Graph, x: Value, kv: Value | tuple[Value, Value] | None = None,
                rope: tuple[Value, Value] | None = None):
        """q (B, Hq, Sq, D), k and v (B, Hkv, Skv, D).  ``kv``: the source of keys and values
        (cross-attention), or a (key source, value source) pair.  ``rope`` (cos, sin): applied
        to q and k for self-attention, to q only for cross-attention.

        With ``fuse``, projections sharing an input run as one GEMM (q/k/v for self-attention,
        k/v for a single cross source; see :func:`fused_dense`).  Self-attention rotates the
        q and k heads together."""
        hd, hq, hkv = self.head_dim, self.n_heads, self.n_kv_heads
        kv_in = self.kv_in or self.hidden
        q_part = (f"{self.name}.q_proj", hq * hd, self.q_bias)
        k_part = (f"{self.name}.k_proj", hkv * hd, self.k_bias)
        v_part = (f"{self.name}.v_proj", hkv * hd, self.v_bias)
        if kv is None:
            if self.fuse:
                y = _fused_matmul(g, x, self.hidden, [q_part, k_part, v_part])
                # (B, Hq + 2·Hkv, S, D) heads as views of the GEMM result, split by head
                heads = _heads(y, hq + 2 * hkv, hd)
                qk, v = ops.split(heads, [hq + hkv, hkv], 1)
            else:
                q, k, v = fused_dense(g, x, self.hidden, [q_part, k_part, v_part], fuse=False)
                q, k, v = _heads(q, hq, hd), _heads(k, hkv, hd), _heads(v, hkv, hd)
                if rope is None:
                    return q, k, v
                qk = ops.concat([q, k], 1)
            if rope is not None:  # q and k heads side by side: one rotation for both
                qk = apply_rope(qk, *rope)
            q, k = ops.split(qk, [hq, hkv], 1)
            return q, k, v
        (q,) = fused_dense(g, x, self.hidden, [q_part])
        q = _heads(q, hq, hd)
        if rope is not None:
            q = apply_rope(q, *rope)
        if isinstance(kv, tuple):
            (k,) = fused_dense(g, kv[0], kv_in, [k_part])
            (v,) = fused_dense(g, kv[1], kv_in, [v_part])
        else:
            k, v = fused_dense(g, kv, kv_in, [k_part, v_part], fuse=self.fuse)
        return q, _heads(k, hkv, hd), _heads(v, hkv, hd)

    def attend(self, q, k, v, causal=False, mask=None, q_offset=0) -> Value:
        return attention(q, k, v, causal=causal, scale=self.scale, mask=mask, q_offset=q_offset,
                         impl=self.impl)

    def output(self, g: Graph, o: Value) -> Value:
        """(B, Hq, Sq, D) -> (B, Sq, hidden) through the output projection."""
        return dense(g, _merge_heads(o), f"{self.name}.{self.out_name}",
                     self.n_heads * self.head_dim, self.hidden, self.o_bias)

    def __call__(self, g: Graph, x: Value, kv: Value | tuple[Value, Value] | None = None,
                 rope: tuple[Value, Value] | None = None, causal: bool = False,
                 mask: Value | None = None) -> Value:
        """x (B, S, hidden) -> (B, S, hidden).  ``rope``: (cos, sin) applied to q and k
        (self-attention) or to q only (cross-attention, ``kv`` given).  For KV caches use
        :meth:`project`, :meth:`attend` and :meth:`output` directly (see models/llama.py)."""
        q, k, v = self.project(g, x, kv, rope)
        return self.output(g, self.attend(q, k, v, causal=causal, mask=mask))


# ------------------------------------------------------------------------------ MLPs


@dataclass
class SwiGLU:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (Llama MLP, no biases)."""

    hidden: int
    ffn: int
    name: str = "mlp"
    fuse: bool = True  # gate and up projections as one GEMM (see fused_dense)

    def __call__(self, g: Graph, x: Value) -> Value:
        gate, up = fused_dense(g, x, self.hidden, [(f"{self.name}.gate_proj", self.ffn, False),
                                                   (f"{self.name}.up_proj", self.ffn, False)],
                               fuse=self.fuse)
        return dense(g, ops.silu(gate) * up, f"{self.name}.down_proj", self.ffn, self.hidden,
                     bias=False)


@dataclass
class GeluMLP:
    """``fc2(gelu(fc1(x)))`` with biases (Whisper/BERT MLP; erf GELU unless approximate)."""

    hidden: int
    ffn: int
    name: str = ""
    approximate: str = "none"

    def __call__(self, g: Graph, x: Value) -> Value:
        p = f"{self.name}." if self.name else ""
        h = dense(g, x, f"{p}fc1", self.hidden, self.ffn)
        return dense(g, ops.gelu(h, self.approximate), f"{p}fc2", self.ffn, self.hidden)
