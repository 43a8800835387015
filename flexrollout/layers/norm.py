"""RMSNorm in the variants the supported families use, each rounding where HF's code rounds."""
from __future__ import annotations

import torch

# How the weight is applied after x / rms(x) (computed in fp32):
LLAMA = "llama"      # cast x̂ to the input dtype, then weight * x̂ (Llama, Qwen2/3, Qwen3-MoE)
FP32 = "fp32"        # (x̂ * weight) in fp32, then cast (gpt-oss, Gemma-4)
OFFSET = "offset"    # (x̂ * (1 + weight)) in fp32, then cast (Qwen3.5)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: str = LLAMA) -> torch.Tensor:
    """RMSNorm over the last axis; `weight=None` normalises only (Gemma-4's v_norm, its router)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return x32.to(dtype)
    if style == LLAMA:
        return weight * x32.to(dtype)
    if style == FP32:
        return (x32 * weight.float()).to(dtype)
    if style == OFFSET:
        return (x32 * (1.0 + weight.float())).to(dtype)
    raise ValueError(f"unknown RMSNorm style {style!r}")
