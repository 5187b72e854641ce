"""Peak compute and memory bandwidth per adapter: the roofline each kernel is measured against.

A kernel of F flops and B compulsory bytes cannot finish faster than max(F / peak_flops,
B / bandwidth); the profile reports achieved TFLOP/s and GB/s and the percent of that bound.
Peaks are the vendor's dense numbers (no sparsity).  An adapter not listed gets no bound
(achieved rates only) unless ``MEGANEURA_PEAKS="f32=67e12,f16=990e12,bw=4.8e12"`` says."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DevicePeak:
    name: str
    f32_flops: float  # FMA = 2 flops, CUDA cores
    f16_tensor_flops: float  # dense f16/bf16 with f32 accumulation (tensor cores)
    bandwidth: float  # bytes/s, DRAM

    def limits_seconds(self, flops: float, nbytes: float,
                       tensor_cores: bool = False) -> tuple[float, float]:
        """(compute floor, memory floor) in seconds; 0 where the peak is unknown."""
        peak = self.f16_tensor_flops if tensor_cores else self.f32_flops
        return (flops / peak if peak else 0.0,
                nbytes / self.bandwidth if self.bandwidth else 0.0)

    def bound_seconds(self, flops: float, nbytes: float, tensor_cores: bool = False) -> float:
        return max(self.limits_seconds(flops, nbytes, tensor_cores))

    def binding_limit(self, flops: float, nbytes: float, tensor_cores: bool = False) -> str:
        compute, memory = self.limits_seconds(flops, nbytes, tensor_cores)
        return "compute" if compute >= memory else "memory"


# adapter-name substring -> peaks (datasheets; the H200 SXM: 67 TFLOP/s f32, 989 TFLOP/s
# dense f16 tensor, 4.8 TB/s HBM3e)
PEAKS = {
    "H200": DevicePeak("NVIDIA H200", 67e12, 989e12, 4.8e12),
    "H100": DevicePeak("NVIDIA H100 SXM", 67e12, 989e12, 3.35e12),
    "A100": DevicePeak("NVIDIA A100", 19.5e12, 312e12, 2.0e12),
}


def peaks_for(adapter_name: str) -> DevicePeak | None:
    """The peaks of this adapter: ``$MEGANEURA_PEAKS`` first, then the table, else None."""
    env = os.environ.get("MEGANEURA_PEAKS", "").strip()
    if env:
        return _parse_env(env, adapter_name)
    for key, peak in PEAKS.items():
        if key in adapter_name:
            return peak
    return None


def _parse_env(text: str, adapter_name: str) -> DevicePeak:
    vals = {}
    for part in text.split(","):
        key, _, val = part.partition("=")
        if key.strip() not in ("f32", "f16", "bw"):
            raise ValueError(f"MEGANEURA_PEAKS: unknown key {key.strip()!r} (use f32, f16, bw)")
        try:
            vals[key.strip()] = float(val)
        except ValueError:
            raise ValueError(f"MEGANEURA_PEAKS: {key.strip()}={val!r} is not a number") from None
    return DevicePeak(adapter_name, vals.get("f32", 0.0), vals.get("f16", 0.0),
                      vals.get("bw", 0.0))
