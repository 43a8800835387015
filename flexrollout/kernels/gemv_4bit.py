"""Small-batch projections over bitsandbytes 4-bit weights: a Triton split-K GEMV that reads the
packed nibbles and the per-block absmax and dequantises in registers.

The layout is bitsandbytes 0.50's (its reference `quantize_4bit` / `dequantize_4bit` in
`bitsandbytes/backends/default/ops.py`): the (N, K) weight is flattened row-major and element
`i` is byte `i // 2`'s high nibble when `i` is even, its low nibble when odd; each nibble indexes
the 16-entry code (nf4 or fp4), scaled by `absmax[i // blocksize]` in fp32 and rounded to the
quant state's dtype. Blocks follow the flat index, so with K not a multiple of the block size a
block straddles two rows. Double quantisation stores absmax as uint8 codes:
`absmax = code2[q] * absmax2[j // blocksize2] + offset` (fp32), as `dequantize_blockwise` does.

A decode step multiplies a few rows by the weight, so the bytes read are what counts: about a
quarter of the 16-bit weight's (plus absmax), and no dequantised weight is ever written. Results
come back as fp32 partials (split, M, N) summed by the caller, like `small_linear`.

Not routed by the engine: measured on an H200 (benchmarks/gemv_4bit_sweep.py, 2026-12-04) it
takes 375-1,690 us per Qwen3-4B projection, 8-40x bitsandbytes' own ops (its fused GEMV at one
row, dequantise + matmul above), so `layers/quant.py` runs those. The likely cost is three
gathers per weight element (code, absmax, nested absmax) at small_linear's untuned tiling;
per-block scales and a register code table are the next step, measured with that sweep.
"""
from __future__ import annotations

import functools
import os

import torch

# Largest row count this kernel serves (one 16-row tile: the matrix units' smallest operand).
MAX_ROWS = 16
BLOCK_N = 64
BLOCK_K = 128
# Split K until there are this many programs (the H200 has 132 SMs), as small_linear does.
MIN_PROGRAMS = 256
MAX_SPLIT = 8

_TL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def supported(x: torch.Tensor, quant_state) -> bool:
    """Whether this kernel can run x @ W^T for a weight with this quant state: a 2-D CUDA
    batch of at most MAX_ROWS 16/32-bit rows, an even input width (each row starts on a byte).
    Under Triton's interpreter (TRITON_INTERPRET=1, tests) CPU batches run it too."""
    on_device = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (on_device and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1
            and x.dtype in _TL_DTYPES and quant_state.dtype in _TL_DTYPES
            and quant_state.shape[1] % 2 == 0 and quant_state.quant_type in ("nf4", "fp4"))


def split_k(n: int, k: int) -> int:
    blocks, split = -(-n // BLOCK_N), 1
    while blocks * split < MIN_PROGRAMS and split < MAX_SPLIT and k >= 2 * split * BLOCK_K:
        split *= 2
    return split


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (importing flexrollout never needs Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_4bit_kernel(x_ptr, packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr,
                         offset_ptr, out_ptr, M, N, K, K_PER,
                         stride_xm, stride_split, stride_om,
                         BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                         NESTED: tl.constexpr, W_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        # The dot runs on fp32 operands holding 16-bit values, which tf32 represents exactly
        # (products exact, fp32 sums, as a bf16/fp16 dot): one code path for every dtype, and
        # the same on Triton's interpreter, whose bf16 dot multiplies the raw bits as integers.
        precision: tl.constexpr = "ieee" if X_DTYPE == tl.float32 else "tf32"
        k_start = pid_k * K_PER
        k_end = tl.minimum(k_start + K_PER, K)
        # Row starts are byte-aligned (K even): row r's bytes are [r * K / 2, (r + 1) * K / 2).
        half_k = K // 2
        byte_cols = tl.arange(0, BLOCK_K // 2)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0).to(tl.float32)
            # Contiguous bytes per row (vector loads); high nibble = the even element.
            b_cols = k0 // 2 + byte_cols
            b_mask = (rows[:, None] < N) & (b_cols[None, :] < k_end // 2)
            packed = tl.load(packed_ptr + rows[:, None] * half_k + b_cols[None, :],
                             mask=b_mask, other=0).to(tl.int32)
            nibbles = tl.interleave(packed >> 4, packed & 0xF)          # (BLOCK_N, BLOCK_K)
            flat = rows[:, None].to(tl.int64) * K + offs_k[None, :]
            w_mask = (rows[:, None] < N) & k_mask[None, :]
            block = flat // BLOCKSIZE          # constexpr: a shift for powers of two
            if NESTED:
                q = tl.load(absmax_ptr + block, mask=w_mask, other=0)
                scale2 = tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=w_mask, other=0.0)
                scale = tl.load(code2_ptr + q.to(tl.int32)) * scale2 + tl.load(offset_ptr)
            else:
                scale = tl.load(absmax_ptr + block, mask=w_mask, other=0.0)
            w = tl.load(code_ptr + nibbles) * scale
            # Rounded as bitsandbytes' dequantised weight is (to its dtype), then to x's, kept
            # in fp32. bf16 by bit arithmetic (nearest even): Triton 3.6's interpreter truncates
            # fp32 -> bf16 casts, so CPU tests would otherwise not see the GPU's rounding.
            w = tl.where(w_mask, w, 0.0)
            if W_DTYPE == tl.float16:
                w = w.to(tl.float16).to(tl.float32)
            if W_DTYPE == tl.bfloat16 or X_DTYPE == tl.bfloat16:
                bits = w.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                w = bits.to(tl.float32, bitcast=True)
            if X_DTYPE == tl.float16:
                w = w.to(tl.float16).to(tl.float32)
            acc += tl.dot(w, tl.trans(x), input_precision=precision)
        out = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + rows[:, None]
        tl.store(out, acc, mask=(offs_m[None, :] < M) & (rows[:, None] < N))

    return gemv_4bit_kernel


def launch(x: torch.Tensor, packed: torch.Tensor, quant_state, split: int | None = None) -> torch.Tensor:
    """fp32 partials (split, M, N) of x @ dequant(W)^T (CUDA, or Triton's interpreter on CPU
    tensors in tests). Reads `packed` and the quant state's tensors where they are."""
    import triton
    import triton.language as tl

    m, k = x.shape
    n = quant_state.shape[0]
    if tuple(quant_state.shape) != (n, k) or k % 2:
        raise ValueError(f"4-bit weight of shape {tuple(quant_state.shape)} for input width {k}: "
                         "the kernel needs an even input width matching the weight's")
    split = split or split_k(n, k)
    k_per = triton.cdiv(triton.cdiv(k, split), BLOCK_K) * BLOCK_K
    split = triton.cdiv(k, k_per)
    out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    nested = bool(quant_state.nested)
    state2 = quant_state.state2 if nested else None
    absmax = quant_state.absmax
    code = quant_state.code.to(device=x.device, dtype=torch.float32)
    _kernel()[(triton.cdiv(n, BLOCK_N), split)](
        x, packed, absmax, code,
        state2.absmax if nested else absmax, state2.code if nested else code,
        quant_state.offset if nested else absmax,
        out, m, n, k, k_per, x.stride(0), out.stride(0), out.stride(1),
        BLOCKSIZE=quant_state.blocksize, BLOCKSIZE2=state2.blocksize if nested else 1,
        NESTED=nested, W_DTYPE=getattr(tl, _TL_DTYPES[quant_state.dtype]),
        X_DTYPE=getattr(tl, _TL_DTYPES[x.dtype]), BLOCK_M=16, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def project(x: torch.Tensor, packed: torch.Tensor, quant_state,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(W)^T + b in x's dtype, for a batch `supported` accepts."""
    out = launch(x, packed, quant_state).sum(0).to(x.dtype)
    return out if bias is None else out + bias
