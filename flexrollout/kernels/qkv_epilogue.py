"""What follows the q/k/v projections, as one kernel: the projections' partial sums (and bias),
the per-head q/k RMSNorm (Qwen3's, or Gemma-4's in fp32 with a weightless norm of V), NeoX RoPE,
and the K/V store into the paged cache.

Compiled by inductor this is six kernels per layer (two norms, q RoPE, k RoPE, k store, v store:
the norms reduce over heads of different counts and each cache write is its own scatter), a few
microseconds each at decode. Here one program handles one (token, head): it reads that head's
columns of every partial, so nothing between the projection and attention touches memory twice.

Rounding follows HF's order where HF rounds to the model dtype: after the projection, after the
bias, after the norm (Llama style: before its weight and after it; fp32 style: once, after the
weight); RoPE is computed in fp32 and rounded once.

Columns of the projection output are q heads, then k heads, then v heads, `head_dim` each: the
layout of the GEMV's q/k/v launch (`small_linear(h, wq, wk, wv)`) and of three separate
projections alike (`q_src`, `k_src`, `v_src` are column views with their own row strides).
The engine calls it in decode on CUDA only: in prefill (thousands of tokens per layer) the
one-warp programs made Llama-3.2-3B's 64 x 512 prefill 31% slower on an H200, and off CUDA the
model's torch path runs. Triton's interpreter runs it on CPU tensors in tests.
"""
from __future__ import annotations

import functools

import torch

from . import custom_op


def supported(head_dim: int, k_cache: torch.Tensor) -> bool:
    """A power-of-two head (the kernel's half-head arange) and a (1, H, S, D) cache whose head
    rows are contiguous (the kernel reads the head stride from the tensor)."""
    return (head_dim >= 16 and head_dim & (head_dim - 1) == 0 and k_cache.dim() == 4
            and k_cache.stride(-1) == 1 and k_cache.stride(-2) == head_dim)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def qkv_epilogue_kernel(q_src, k_src, v_src, stride_split, stride_q, stride_k, stride_v,
                            bq, bk, bv, qn_w, kn_w, cos, sin, stride_rope, q_out, k_cache,
                            v_cache, slots, cache_head_stride, cache_slot_stride, eps,
                            NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                            HALF: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                            HAS_NORM: tl.constexpr, NORM_FP32: tl.constexpr,
                            V_NORM: tl.constexpr, DTYPE: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        offs = tl.arange(0, HALF)
        # Which projection this head belongs to, and its head index within it.
        if head < NUM_HEADS:
            src, row_stride, bias, norm_w, index = q_src, stride_q, bq, qn_w, head
        elif head < NUM_HEADS + NUM_KV_HEADS:
            src, row_stride, bias, norm_w, index = k_src, stride_k, bk, kn_w, head - NUM_HEADS
        else:
            src, row_stride, bias, norm_w, index = v_src, stride_v, bv, kn_w, head - NUM_HEADS - NUM_KV_HEADS
        # The head's two halves (RoPE pairs element i with i + HALF), summed over the split.
        # `.to(DTYPE).to(tl.float32)` rounds to the model dtype where HF's eager code does.
        src = src + token * row_stride + index * 2 * HALF
        x1 = tl.zeros((HALF,), dtype=tl.float32)
        x2 = tl.zeros((HALF,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            x1 += tl.load(src + s * stride_split + offs).to(tl.float32)
            x2 += tl.load(src + s * stride_split + HALF + offs).to(tl.float32)
        x1, x2 = x1.to(DTYPE).to(tl.float32), x2.to(DTYPE).to(tl.float32)
        if HAS_BIAS:
            bias = bias + index * 2 * HALF
            x1 = (x1 + tl.load(bias + offs).to(tl.float32)).to(DTYPE).to(tl.float32)
            x2 = (x2 + tl.load(bias + HALF + offs).to(tl.float32)).to(DTYPE).to(tl.float32)
        if head < NUM_HEADS + NUM_KV_HEADS:
            if HAS_NORM:
                inv = tl.rsqrt((tl.sum(x1 * x1) + tl.sum(x2 * x2)) / (2 * HALF) + eps)
                w1 = tl.load(norm_w + offs).to(tl.float32)
                w2 = tl.load(norm_w + HALF + offs).to(tl.float32)
                if NORM_FP32:           # (x̂ * w) in fp32, rounded once (Gemma-4)
                    x1, x2 = x1 * inv * w1, x2 * inv * w2
                else:                   # x̂ rounded, times w, rounded (Llama, Qwen3)
                    x1 = (x1 * inv).to(DTYPE).to(tl.float32) * w1
                    x2 = (x2 * inv).to(DTYPE).to(tl.float32) * w2
                x1, x2 = x1.to(DTYPE).to(tl.float32), x2.to(DTYPE).to(tl.float32)
            c1 = tl.load(cos + token * stride_rope + offs).to(tl.float32)
            c2 = tl.load(cos + token * stride_rope + HALF + offs).to(tl.float32)
            s1 = tl.load(sin + token * stride_rope + offs).to(tl.float32)
            s2 = tl.load(sin + token * stride_rope + HALF + offs).to(tl.float32)
            x1, x2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
        elif V_NORM:                    # Gemma-4's weightless v_norm
            inv = tl.rsqrt((tl.sum(x1 * x1) + tl.sum(x2 * x2)) / (2 * HALF) + eps)
            x1, x2 = x1 * inv, x2 * inv
        if head < NUM_HEADS:
            out = q_out + (token * NUM_HEADS + head) * 2 * HALF
        else:
            slot = tl.load(slots + token)
            if head < NUM_HEADS + NUM_KV_HEADS:
                out = k_cache + index * cache_head_stride + slot * cache_slot_stride
            else:
                out = v_cache + index * cache_head_stride + slot * cache_slot_stride
        tl.store(out + offs, x1.to(out.dtype.element_ty))
        tl.store(out + HALF + offs, x2.to(out.dtype.element_ty))

    return qkv_epilogue_kernel


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a model dtype (a kernel's rounding target)."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


@custom_op("qkv_epilogue", mutates_args=("k_cache", "v_cache"))
def qkv_epilogue(q_src: torch.Tensor, k_src: torch.Tensor, v_src: torch.Tensor,
                 bq: torch.Tensor | None, bk: torch.Tensor | None, bv: torch.Tensor | None,
                 qn_w: torch.Tensor | None, kn_w: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, eps: float,
                 num_heads: int, num_kv_heads: int, norm_fp32: bool = False,
                 v_norm: bool = False) -> torch.Tensor:
    """q (T, num_heads, head_dim) in cos's dtype; K/V written at `slot_mapping` in the caches.

    `q_src`/`k_src`/`v_src`: (split, T, width) fp32 partials or (T, width) projections, summed
    over the split (`v_src` may be `k_src` itself: Gemma-4's V is k_proj's raw output). `cos`/
    `sin`: (T, head_dim) in the model dtype. Caches: (1, kv_heads, S, D). `norm_fp32`: the q/k
    norms in Gemma-4's style (`layers.norm.FP32`) rather than Llama's; `v_norm`: V normalised
    without a weight before it is stored.
    """
    head_dim = k_cache.shape[-1]
    srcs = [s if s.dim() == 3 else s[None] for s in (q_src, k_src, v_src)]
    split, tokens = srcs[0].shape[0], srcs[0].shape[1]
    if len({s.stride(0) for s in srcs}) != 1 and split > 1:
        raise ValueError("q_src, k_src and v_src must be views of one partials tensor")
    if any(s.stride(-1) != 1 for s in srcs) or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("q/k/v sources and cos/sin need unit column stride (and equal cos/sin strides)")
    q = torch.empty(tokens, num_heads, head_dim, device=cos.device, dtype=cos.dtype)
    has_bias, has_norm = bq is not None, qn_w is not None
    dummy = cos
    _kernel()[(tokens, num_heads + 2 * num_kv_heads)](
        srcs[0], srcs[1], srcs[2], srcs[0].stride(0), srcs[0].stride(1), srcs[1].stride(1),
        srcs[2].stride(1), bq if has_bias else dummy, bk if has_bias else dummy,
        bv if has_bias else dummy, qn_w if has_norm else dummy, kn_w if has_norm else dummy,
        cos, sin, cos.stride(0), q, k_cache, v_cache, slot_mapping, k_cache.stride(1),
        k_cache.stride(2), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, SPLIT=split,
        HAS_BIAS=has_bias, HAS_NORM=has_norm, NORM_FP32=norm_fp32, V_NORM=v_norm,
        DTYPE=tl_dtype(cos.dtype), num_warps=1)
    return q


@qkv_epilogue.register_fake
def _(q_src, k_src, v_src, bq, bk, bv, qn_w, kn_w, cos, sin, k_cache, v_cache, slot_mapping, eps,
      num_heads, num_kv_heads, norm_fp32=False, v_norm=False):
    tokens = q_src.shape[-2]
    return cos.new_empty(tokens, num_heads, k_cache.shape[-1])
