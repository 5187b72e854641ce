"""Layers built from ops, with HF/PyTorch-compatible parameter names (``{name}.weight``…)."""

from .layers import MLP, Linear  # noqa: F401
from .transformer import (  # noqa: F401
    Attention,
    Embedding,
    GeluMLP,
    LayerNorm,
    RMSNorm,
    RoPE,
    SwiGLU,
)
