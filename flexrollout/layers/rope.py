"""Rotary position embeddings: cos/sin tables from the model's own rotary module, and NeoX
rotate-half application (every supported family rotates the two halves of the head)."""
from __future__ import annotations

import torch

# Rope types whose inv_freq and attention scaling are fixed at load (no dynamic update).
STATIC_ROPE_TYPES = {"default", "llama3", "linear", "yarn", "proportional"}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE. x: (T, heads, head_dim); cos/sin: (T, head_dim) in x's dtype."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


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
