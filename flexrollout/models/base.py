"""What an architecture tells the engine, and the small ops every forward shares.

An architecture file holds only forward math over the user's own HF parameters. It describes
its layers with `LayerSpec`s so the engine can size the KV cache and build masks without knowing
the architecture: per-layer attention kind, window, KV heads and head_dim, and KV reuse.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels.small_linear import project


@dataclass(frozen=True)
class LayerSpec:
    """The KV-cache needs of one decoder layer."""

    num_kv_heads: int
    head_dim: int
    # "full" or "sliding"; linear-attention layers (no KV pages) will say "linear".
    attention: str = "full"
    # Sliding window in tokens, the current token included (kv > q - window).
    window: int | None = None
    # Index of an earlier layer whose KV this layer reads instead of writing its own.
    kv_source: int | None = None


@dataclass
class ModelSpec:
    """Architecture facts the engine loop needs."""

    layers: list[LayerSpec]
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    eos_token_ids: list[int] = field(default_factory=list)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/Qwen3 RMSNorm: normalise in fp32, cast back, then `weight * x` (HF's order)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE. x: (T, heads, head_dim); cos/sin: (T, head_dim) in x's dtype."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rope_tables(inv_freq: torch.Tensor, scaling: float, max_len: int, dtype: torch.dtype):
    """cos/sin for every position, computed in fp32 as HF does, then cast once."""
    positions = torch.arange(max_len, device=inv_freq.device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def in_row_chunks(fn, chunk: int, x: torch.Tensor, residual: torch.Tensor, *args) -> torch.Tensor:
    """`fn(x, residual, *args)`, `chunk` rows at a time, for a row-wise `fn` (an output row reads
    only the same row of `x` and `residual`). Each chunk's result is written over those rows of
    `residual`, so the activations inside `fn` peak at `chunk` rows' worth, not the prefill's. The
    caller must own `residual` and not read it again.
    """
    rows = x.shape[0]
    if rows <= chunk:
        return fn(x, residual, *args)
    for start in range(0, rows, chunk):
        stop = start + chunk
        residual[start:stop] = fn(x[start:stop], residual[start:stop], *args)
    return residual


def linear(x: torch.Tensor, module: torch.nn.Module, small_rows: int = 0) -> torch.Tensor:
    """`module(x)` computed from its parameters, reading through a PEFT LoRA wrapper live.

    A LoRA layer's output is `W x + b + sum_adapters scaling * B(A x)`, taken from PEFT's own
    tensors so an optimizer step is visible at the next call. Batches of up to `small_rows` rows
    project the (base) weight with the GEMV kernel; 0 keeps them on F.linear.
    """
    base = getattr(module, "base_layer", None)
    if base is None:
        return project(x, module.weight, module.bias, small_rows)
    out = project(x, base.weight, base.bias, small_rows)
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return out
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if module.use_dora.get(name, False):
            raise NotImplementedError("DoRA adapters (use_dora=True) are not supported yet")
        lora_a, lora_b = module.lora_A[name].weight, module.lora_B[name].weight
        if lora_a.dtype != x.dtype:
            # PEFT keeps adapters in fp32 over a bf16 base (autocast_adapter_dtype). Casting the
            # adapter (r x in, out x r) instead of the activations spares a prefill fp32 copies
            # of (tokens, in) and (tokens, out), which made a LoRA step's peak. The GEMMs
            # accumulate in fp32 and round once, as PEFT does; A, B and A x are rounded to bf16.
            lora_a, lora_b = lora_a.to(x.dtype), lora_b.to(x.dtype)
        low_rank = F.linear(x, lora_a)
        if out.dim() == 2 and out.dtype == x.dtype:
            # In place into `out` (ours, just computed): no (tokens, out) delta temporaries.
            out.addmm_(low_rank, lora_b.T, alpha=module.scaling[name])
        else:
            out = out + (F.linear(low_rank, lora_b) * module.scaling[name]).to(out.dtype)
    return out
