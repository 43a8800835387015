"""The attention half of a decoder layer: input norm, q/k/v projections, per-head norms, RoPE and
the K/V store (`attention_inputs`), then paged attention (`attention.flex.paged_attention`).

In decode on CUDA everything after the projections can be one kernel (`qkv_epilogue`: partial
sums, bias, Llama-style q/k norm, full-head RoPE, K/V store); in prefill it cost more than it saved
(Llama-3.2-3B, 64 x 512 tokens on an H200: 39.2k tok/s with it, 56.6k without).
"""
from __future__ import annotations

import torch

from ..attention.kv_cache import store_kv
from ..kernels import qkv_epilogue as epilogue
from .linear import Kernels, Linear, finish_group, project_group
from .norm import FP32, LLAMA, rms_norm
from .rope import apply_rope


def attention_inputs(x: torch.Tensor, ln_w: torch.Tensor, q: Linear, k: Linear, v: Linear,
                     qn_w: torch.Tensor | None, kn_w: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int,
                     head_dim: int, norm_style: str, kernels: Kernels, decode: bool) -> torch.Tensor:
    """input norm -> q/k/v -> (optional) per-head q/k RMSNorm -> RoPE -> K/V stored. Returns the
    queries (T, num_heads, head_dim)."""
    h = rms_norm(x, ln_w, eps, norm_style)
    projections = [q, k, v]
    outputs = project_group(h, projections, kernels)
    if decode and epilogue_fits(h, outputs, projections, qn_w, norm_style, head_dim, k_cache, kernels):
        return run_epilogue(outputs, projections, qn_w, kn_w, cos, sin, k_cache, v_cache, slot_mapping,
                            eps, num_heads, num_kv_heads)
    qs, ks, vs = finish_group(outputs, projections, h.dtype)
    tokens = h.shape[0]
    qs = qs.reshape(tokens, num_heads, head_dim)
    ks = ks.reshape(tokens, num_kv_heads, head_dim)
    vs = vs.reshape(tokens, num_kv_heads, head_dim)
    if qn_w is not None:
        qs, ks = rms_norm(qs, qn_w, eps, norm_style), rms_norm(ks, kn_w, eps, norm_style)
    qs, ks = apply_rope(qs, cos, sin), apply_rope(ks, cos, sin)
    store_kv(k_cache, v_cache, ks, vs, slot_mapping)
    return qs


def run_epilogue(outputs, projections, qn_w, kn_w, cos, sin, k_cache, v_cache, slot_mapping,
                 eps: float, num_heads: int, num_kv_heads: int, gemma: bool = False) -> torch.Tensor:
    """The q/k/v epilogue kernel over `project_group`'s outputs, adding the biases where they
    are partials (a full output has its own); `gemma`: fp32-style q/k norms and a weightless
    v norm. Returns the queries."""
    partials = outputs[0].dim() == 3
    biases = [p.bias if partials else None for p in projections]
    return epilogue.qkv_epilogue(*outputs, *biases, qn_w, kn_w, cos, sin, k_cache, v_cache,
                                 slot_mapping, eps, num_heads, num_kv_heads, norm_fp32=gemma,
                                 v_norm=gemma)


def epilogue_fits(h, outputs, projections, qn_w, norm_style: str, head_dim: int,
                  k_cache: torch.Tensor, kernels: Kernels) -> bool:
    """The epilogue kernel computes this layer's math: it adds all three biases or none, and
    its q/k norm rounds as Llama's or in fp32 (Gemma-4's)."""
    if not (h.is_cuda and kernels.epilogue and epilogue.supported(head_dim, k_cache)):
        return False
    if qn_w is not None and norm_style not in (LLAMA, FP32):
        return False
    with_bias = [p.bias is not None and out.dim() == 3 for p, out in zip(projections, outputs)]
    return len(set(with_bias)) == 1
