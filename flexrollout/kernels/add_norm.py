"""o_proj's GEMV partials summed, bias and residual added, and the post-attention RMSNorm, as
one kernel: `hidden = residual + sum(partials) + bias`, `h = weight * rms_norm(hidden)`.

Compiled by inductor this is two kernels per layer at decode (the sum over the GEMV's K splits
is a reduction along another axis than the norm's, so it is realised first): 2 us each at
batch 1 on an H200. One program here handles one row, reading every split of it once.

Rounding follows HF's order: the projection output, the bias add and the residual add round to
the model dtype, the norm computes in fp32 and rounds before and after its weight.
"""
from __future__ import annotations

import functools

import torch

from .qkv_epilogue import tl_dtype


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(parts, stride_split, bias, residual, weight, hidden_out, h_out, n, eps,
                            SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                            DTYPE: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(parts + s * stride_split + row * n + cols, mask=mask, other=0.0)
        x = acc.to(DTYPE).to(tl.float32)
        if HAS_BIAS:
            x = (x + tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)).to(DTYPE).to(tl.float32)
        x = x + tl.load(residual + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(DTYPE).to(tl.float32)
        tl.store(hidden_out + row * n + cols, x.to(DTYPE), mask=mask)
        inv = tl.rsqrt(tl.sum(x * x) / n + eps)
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x * inv).to(DTYPE).to(tl.float32) * w
        tl.store(h_out + row * n + cols, h.to(DTYPE), mask=mask)

    return add_rms_norm_kernel


@torch.library.custom_op("flexrollout::add_rms_norm", mutates_args=())
def add_rms_norm(parts: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                 weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`parts`: (split, M, N) fp32 partial sums (contiguous); `residual`: (M, N) in the model
    dtype. Returns (hidden, normed), both (M, N) in the residual's dtype."""
    import triton

    split, rows, n = parts.shape
    if not parts.is_contiguous() or not residual.is_contiguous() or residual.shape != (rows, n):
        raise ValueError("add_rms_norm needs contiguous (split, M, N) partials and an (M, N) residual")
    hidden, normed = torch.empty_like(residual), torch.empty_like(residual)
    block = triton.next_power_of_2(n)
    _kernel()[(rows,)](parts, parts.stride(0), bias if bias is not None else weight, residual,
                       weight, hidden, normed, n, eps, SPLIT=split, BLOCK=block,
                       HAS_BIAS=bias is not None, DTYPE=tl_dtype(residual.dtype),
                       num_warps=8 if block >= 2048 else 4)
    return hidden, normed


@add_rms_norm.register_fake
def _(parts, bias, residual, weight, eps):
    return torch.empty_like(residual), torch.empty_like(residual)
