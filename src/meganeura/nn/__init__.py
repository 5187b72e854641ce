"""Layers built from ops, with HF/PyTorch-compatible parameter names (``{name}.weight``…)."""

from .layers import MLP, Linear  # noqa: F401
