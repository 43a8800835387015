"""Rotary position embeddings: cos/sin tables from the model's own rotary module, and NeoX
rotate-half application (every supported family rotates the two halves of the head)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Rope types whose inv_freq and attention scaling are fixed at load (no dynamic update).
STATIC_ROPE_TYPES = {"default", "llama3", "linear", "yarn", "proportional"}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE on the first `cos.shape[-1]` dims of each head (all of them for
    most families, a quarter for Qwen3.5); the rest pass through. x: (T, heads, head_dim);
    cos / sin: (T, rotary) in x's dtype.

    Written as a roll and selects over the whole head rather than slices and `torch.cat`:
    Inductor fuses a roll into the kernel that reads x, where a cat made it materialise x in
    kernels of its own (Gemma-4's q / k / v after the projections: 8 kernels with the cat, 3
    without, counted by Inductor's Triton scheduler; with decode's ints constant, E2B decode +4%
    at batch 1, H100)."""
    dim, rotary = x.shape[-1], cos.shape[-1]
    half = rotary // 2
    # rotate_half: dim i of the rotated part reads its partner i ± half, negated in the first half.
    if rotary == dim:
        partner = x.roll(half, -1)
    else:
        partner = F.pad(x[..., :rotary].roll(half, -1), (0, dim - rotary))
        cos, sin = (F.pad(t, (0, dim - rotary)) for t in (cos, sin))
    index = torch.arange(dim, device=x.device)
    partner = torch.where(index < half, -partner, partner)
    out = x * cos[:, None, :] + partner * sin[:, None, :]
    return out if rotary == dim else torch.where(index < rotary, out, x)


def rope_tables(inv_freq: torch.Tensor, scaling: float, max_len: int, dtype: torch.dtype):
    """cos/sin for every position, computed in fp32 as HF does (attention scaling folded in,
    as YaRN wants), then cast once."""
    positions = torch.arange(max_len, device=inv_freq.device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def tables_from_rotary(rotary: torch.nn.Module, device: torch.device, max_len: int,
                       dtype: torch.dtype, prefix: str = ""):
    """cos/sin tables from an HF rotary-embedding module's `{prefix}inv_freq` buffer and its
    `{prefix}attention_scaling` (Gemma-4 keeps one pair per layer type), on `device`: Unsloth's
    rotary embedding keeps inv_freq on the CPU."""
    rope_type = getattr(rotary, "rope_type", "default")
    kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    unsupported = set(kinds) - STATIC_ROPE_TYPES
    if unsupported:
        raise NotImplementedError(f"rope_type {sorted(unsupported)} is not supported yet")
    inv_freq = getattr(rotary, f"{prefix}inv_freq").to(device)
    scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
    return rope_tables(inv_freq, scaling, max_len, dtype)
