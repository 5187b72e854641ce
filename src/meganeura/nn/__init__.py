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
from .vision import (  # noqa: F401
    BatchNorm2d,
    Conv1d,
    Conv2d,
    GroupNorm,
    avg_pool2d,
    fold_batchnorm,
    fold_conv_bn_params,
    global_avg_pool2d,
    max_pool2d,
    upsample_nearest2d,
)
