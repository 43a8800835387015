"""Research bench for the 4-bit GEMV (issue #22): a tensor-core-free design against the engine's
kernel (`kernels/gemv_4bit.py`), bitsandbytes' `matmul_4bit` and bf16 cuBLAS, at Qwen3-4B's q/k/v
and down shapes, NF4 with double quantisation, 1 / 4 / 8 rows, on the GPU.

Why: on an H100 (2026-12-06) the engine's kernel took 180 us for q/k/v at one row against
bitsandbytes' 12 us; dequantising hi and lo nibbles apart with two quantisation blocks per step
took 52 us, still 4x slower. The design here drops the dots (no operand conversions): products
are summed in registers (one row: a 2-D accumulator reduced once at the end), and the code
lookup is either a gather from the 16-entry code or one gather per byte from a 256-entry table of
(hi, lo) fp32 pairs. Each tiling is checked against float64 over bitsandbytes' dequantised
weight and timed from CUDA-graph replays over 8 weight copies; the best five print per row count.

On an H200 (2026-12-06) the best tiling took 19.7 us for q/k/v at one row against bitsandbytes'
12.2, and the pair table never won. That timing includes the split-K partials' sum and cast, two
more kernels of a few us each. So the sweep now also runs the design the way bitsandbytes' fused
kernel is laid out: a few output rows per program, one to four warps, the whole K in one program,
and the output written in x's dtype by the one kernel.

    python benchmarks/gemv_4bit_designs.py
"""
import itertools
import logging
import sys

import bitsandbytes as bnb
import bitsandbytes.functional as bf
import torch
import triton
import triton.language as tl
from gemv_sweep import graph_us_cycling

from flexrollout.kernels import gemv_4bit

COPIES = 8
logger = logging.getLogger(__name__)


@triton.jit
def gemv_4bit_fma(x_ptr, out_ptr, packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, pair_ptr,
             M, N, K, K_PER, stride_xm, stride_split, stride_om,
             BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, KB: tl.constexpr, PAIR: tl.constexpr):
    """fp32 partials (split, M, N) of x @ dequant(W)^T without dots: each step dequantises a
    (BLOCK_N, KB blocks) tile, hi and lo nibbles apart, and multiplies it into x in registers."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    HALF: tl.constexpr = BLOCKSIZE // 2
    BB: tl.constexpr = KB * HALF
    BK: tl.constexpr = KB * BLOCKSIZE
    bytes_ = tl.arange(0, BB)
    kb = tl.arange(0, KB)
    row_bytes = rows64[:, None] * (K // 2)
    row_blocks = rows64 * (K // BLOCKSIZE)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    k_start = pid_k * K_PER
    k_end = tl.minimum(k_start + K_PER, K)
    off = tl.load(offset_ptr)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BB), dtype=tl.float32)
    for k0 in range(k_start, k_end, BK):
        packed = tl.load(packed_ptr + row_bytes + (k0 // 2 + bytes_)[None, :],
                         mask=row_ok[:, None], other=0).to(tl.int32)
        block = row_blocks[:, None] + k0 // BLOCKSIZE + kb[None, :]
        q = tl.load(absmax_ptr + block, mask=row_ok[:, None], other=0).to(tl.int32)
        s2 = tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=row_ok[:, None], other=0.0)
        scale = tl.load(code2_ptr + q) * s2 + off
        if KB == 1:
            scale_b = scale
        else:
            scale_b = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, KB, HALF)), (BLOCK_N, BB))
        if PAIR:
            pair = tl.load(pair_ptr + packed)
            c_hi = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            c_lo = pair.to(tl.int32).to(tl.float32, bitcast=True)
        else:
            c_hi = tl.load(code_ptr + (packed >> 4))
            c_lo = tl.load(code_ptr + (packed & 0xF))
        hi = (c_hi * scale_b).to(tl.bfloat16).to(tl.float32)
        lo = (c_lo * scale_b).to(tl.bfloat16).to(tl.float32)
        x_even = tl.load(x_rows + (k0 + 2 * bytes_)[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        x_odd = tl.load(x_rows + (k0 + 2 * bytes_ + 1)[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            acc2 += hi * x_even + lo * x_odd
        else:
            acc += tl.sum(hi[:, None, :] * x_even[None, :, :] + lo[:, None, :] * x_odd[None, :, :], axis=2)
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[:, None]
    out = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + rows[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & row_ok[:, None])


def pair_table(code):
    """(hi, lo) code values of every byte as one int64: fp32 bits of code[byte >> 4] high, code[byte & 15] low."""
    c = code.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    idx = torch.arange(256, device=code.device)
    return (c[idx >> 4] << 32) | c[idx & 15]


def launch(x, packed, st, pairs, block_n, kb, warps, use_pair, min_programs):
    """x @ dequant(W)^T in x's dtype: `kb` quantisation blocks per step, K split until
    `min_programs` programs (at most 16 slices) into fp32 partials summed after; 0: K unsplit,
    the one kernel writes the output in x's dtype."""
    m, k = x.shape
    n = st.shape[0]
    bk = kb * st.blocksize
    if k % bk:                    # the kernel reads whole steps: no mask along K
        raise ValueError(f"K={k} is not a multiple of {kb} blocks of {st.blocksize}")
    blocks, split = triton.cdiv(n, block_n), 1
    while blocks * split < min_programs and split < 16 and k >= 2 * split * bk:
        split *= 2
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per)
    out = torch.empty(split, m, n, device=x.device, dtype=torch.float32 if min_programs else x.dtype)
    gemv_4bit_fma[(blocks, split)](x, out, packed, st.absmax, st.code, st.state2.absmax, st.state2.code, st.offset, pairs,
                              m, n, k, k_per, x.stride(0), out.stride(0), out.stride(1),
                              BLOCKSIZE=st.blocksize, BLOCKSIZE2=st.state2.blocksize,
                              BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, KB=kb, PAIR=use_pair,
                              num_warps=warps, num_stages=3)
    return out.sum(0).to(x.dtype) if min_programs else out[0]


def tilings(m: int):
    """(block_n, blocks per step, warps, pair table, programs): split K over 16-64-row tiles, and
    bitsandbytes' layout (2-16 rows a program, K whole, one kernel). The pair table, which never
    won on the H200, is kept for one row only."""
    for block_n, kb, warps in itertools.product((16, 32, 64), (1, 2, 4), (4, 8)):
        if not (m > 1 and block_n == 64 and kb == 4):           # registers: (64, m, 128) products
            yield block_n, kb, warps, False, 1024
    if m == 1:
        yield from ((32, 2, 4, True, 1024), (64, 1, 4, True, 1024))
    for block_n, kb, warps in itertools.product((2, 4, 8, 16), (2, 4, 8), (1, 2, 4)):
        if block_n * kb * 32 >= warps * 32 * 4:                 # at least 4 bytes a thread a step
            yield block_n, kb, warps, False, 0


def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shapes = {"qkv": (6144, 2560), "down": (2560, 9728)}
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        qs = [bf.quantize_4bit(w, quant_type="nf4", compress_statistics=True) for w in ws]
        mb = qs[0][0].numel() / 1e6
        logger.info("== %s %dx%d: packed %.1f MB, %.1f us at 3.35 TB/s", name, n, k, mb, mb / 3.35e6 * 1e6)
        for m in (1, 4, 8):
            _row(m, ws, qs, pair_table(qs[0][1].code))


def _row(m: int, ws: list, qs: list, pairs: torch.Tensor) -> None:
    """One row count: the engine's kernel, bitsandbytes, cuBLAS, then every tiling of the design."""
    x = torch.randn(m, ws[0].shape[1], device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ bf.dequantize_4bit(*qs[0]).double().t()
    cur_err = ((gemv_4bit.project(x, *qs[0]).double() - ref).norm() / ref.norm()).item()
    cur = graph_us_cycling(lambda i: gemv_4bit.project(x, *qs[i]), COPIES)
    bnb_us = graph_us_cycling(lambda i: bnb.matmul_4bit(x, qs[i][0].t(), quant_state=qs[i][1]), COPIES)
    bf16 = graph_us_cycling(lambda i: torch.nn.functional.linear(x, ws[i]), COPIES)
    best = []
    for cfg in tilings(m):
        if x.shape[1] % (cfg[1] * qs[0][1].blocksize):
            continue
        try:
            got = launch(x, qs[0][0], qs[0][1], pairs, *cfg).double()
            err = ((got - ref).norm() / ref.norm()).item()
            us = graph_us_cycling(lambda i, cfg=cfg: launch(x, qs[i][0], qs[i][1], pairs, *cfg), COPIES)
            best.append((us, cfg, err))
        except triton.runtime.errors.OutOfResources as e:      # a tiling past shared memory
            logger.info("  fail %s %s", cfg, str(e)[:100])
    best.sort()
    logger.info("M=%-2d engine kernel %6.1f us (err %.0e)  bitsandbytes %5.1f  bf16 %5.1f | best "
                "(block_n, blocks per step, warps, pair table, programs): %s", m, cur, cur_err, bnb_us, bf16,
                "  ".join(f"{c}: {u:.1f} us err {e:.0e}" for u, c, e in best[:5]))
    one_kernel = [b for b in best if not b[1][4]]
    us, cfg, err = one_kernel[0]
    logger.info("      best with K whole, one kernel: %s: %.1f us err %.0e", cfg, us, err)


if __name__ == "__main__":
    sys.exit(main())
