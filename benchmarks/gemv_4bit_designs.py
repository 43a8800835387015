"""Research bench for the 4-bit GEMV (issue #22): designs that look the code up in registers
against the engine's kernel (`kernels/gemv_4bit.py`), bitsandbytes' `matmul_4bit` and bf16 cuBLAS,
at Qwen3-4B's q/k/v and down shapes (gate/up on request), NF4 with double quantisation, 1 / 4 / 8 rows.

History. On an H100 (2026-12-06) the engine's kernel took 180 us for q/k/v at one row against
bitsandbytes' 12 us. A design without dots (products summed in registers, the code gathered from
global memory per nibble) took 19.7 us on an H200. Compiled for sm_90 on CPU, that design's loop
spends about 20 instructions per weight: two 64-bit address computations and a global load per
code lookup, and a rounding convert per weight (to match bitsandbytes' bf16 weight bit for bit).
At Hopper's issue rate that alone is ~10 us for q/k/v.

The design here (`gemv_4bit_lut`) spends about 7:
- The code never comes from memory. It is held as fp16 in eight registers (its low and high
  bytes as two planes of 16 bytes), and `prmt` (byte permute) looks up four nibbles at once: per
  packed 32-bit word (8 weights), 16 `prmt`s and 7 logic ops give eight fp16 values, which
  `cvt.f32.f16` (HADD2.F32, on the FP pipe) widens.
- The absmax scale is applied once per (row, word), after the word's eight products are summed.
- The weight each product sees is code (in fp16, 2^-11 relative) x absmax (fp32), not rounded
  to bf16 as bitsandbytes' weight is (2^-9): the error is below bitsandbytes' own, not equal to it.
On an H100 (2026-12-06) it was right (2.3e-3 against bitsandbytes' 3.5e-3) and beat bitsandbytes
at 4 rows, but not at 1 (15.7 against 12.2 us for q/k/v) or 8: its loop is integer-bound (4.6 of
the 7 are integer instructions, which Hopper issues at half rate).

So each tiling also runs with the code looked up by warp shuffle (`SHFL`): lane i holds
code[i % 16] in fp32, and one `shfl.sync.idx` per weight reads it, after one shift of the word
(about 2.2 integer instructions per weight, compiled for sm_90 on CPU; not yet timed).
Each tiling is checked against float64 over bitsandbytes' dequantised weight, and timed from
CUDA-graph replays over 8 weight copies; the best four print per row count, then each lookup's
best with its kernel alone (split-K partials unsummed, as the engine's consumers take them).

    python benchmarks/gemv_4bit_designs.py [--rows 1,4,8] [--shapes qkv,gate_up,down]
"""
import argparse
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


def _half(c: str, s: str, out: int) -> str:
    """PTX: four nibbles (selector `c`: their low three bits; `s`: which half-table each reads)
    of one 16-bit half of the word -> outputs out..out + 3 as fp32."""
    return (f"prmt.b32 la, $9, $10, {c};\nprmt.b32 lb, $11, $12, {c};\nprmt.b32 lo, la, lb, {s};\n"
            f"prmt.b32 la, $13, $14, {c};\nprmt.b32 lb, $15, $16, {c};\nprmt.b32 hi, la, lb, {s};\n"
            # [lo, hi] byte pairs: fp16 of the nibbles at bits 3:0 / 7:4 (qa) and 11:8 / 15:12 (qb),
            # i.e. elements (2j + 1, 2j) of bytes j and j + 1
            "prmt.b32 qa, lo, hi, 0x5140;\nprmt.b32 qb, lo, hi, 0x7362;\n"
            f"mov.b32 {{h0, h1}}, qa;\ncvt.f32.f16 ${out}, h1;\ncvt.f32.f16 ${out + 1}, h0;\n"
            f"mov.b32 {{h0, h1}}, qb;\ncvt.f32.f16 ${out + 2}, h1;\ncvt.f32.f16 ${out + 3}, h0;\n")


# One packed word $8 (bytes j = 0-3; element 2j is byte j's high nibble, 2j + 1 its low one) ->
# its 8 weights' code values $0-$7 in fp32. The code in fp16 as two byte planes: low bytes in
# $9-$12, high bytes in $13-$16, four entries a register. `prmt` picks a byte of 8 by a 3-bit
# selector, so each plane is looked up in entries 0-7 and 8-15, then bit 3 of each nibble picks.
LOOKUP_ASM = tl.constexpr(
    "{\n.reg .b32 cL, cH, sL, sH, la, lb, lo, hi, qa, qb;\n.reg .b16 h0, h1;\n"
    "and.b32 cL, $8, 0x7777;\nshr.u32 cH, $8, 16;\nand.b32 cH, cH, 0x7777;\n"
    "shr.u32 sL, $8, 1;\nand.b32 sL, sL, 0x4444;\nor.b32 sL, sL, 0x3210;\n"
    "shr.u32 sH, $8, 17;\nand.b32 sH, sH, 0x4444;\nor.b32 sH, sH, 0x3210;\n"
    + _half("cL", "sL", 0) + _half("cH", "sH", 4) + "}")


@triton.jit
def _lookup(w, t0, t1, t2, t3, t4, t5, t6, t7):
    return tl.inline_asm_elementwise(LOOKUP_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,r,r,r,r,r",
                                     [w, t0, t1, t2, t3, t4, t5, t6, t7],
                                     dtype=(tl.float32,) * 8, is_pure=True, pack=1)


# The same lookup by warp shuffle: lane i holds code[i % 16] (fp32, exact), and `shfl.sync.idx`
# reads lane b[4:0] of the table register for index b, so a nibble needs only a shift to the
# bottom (bit 4, the next nibble's lowest, selects the table's second copy in lanes 16-31).
SHFL_ASM = tl.constexpr(
    "{\n.reg .b32 t;\n"
    "shfl.sync.idx.b32 $1, $9, $8, 0x1f, 0xffffffff;\n"
    + "".join(f"shr.u32 t, $8, {4 * i};\nshfl.sync.idx.b32 ${i ^ 1}, $9, t, 0x1f, 0xffffffff;\n"
              for i in range(1, 8))
    + "}")


@triton.jit
def _lookup_shfl(w, table):
    return tl.inline_asm_elementwise(SHFL_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r,f", [w, table],
                                     dtype=(tl.float32,) * 8, is_pure=False, pack=1)


@triton.jit
def _lane_table(code_ptr, like):
    """code[lane % 16] in every element of a tensor shaped `like`: the shuffle's table."""
    lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [like], dtype=tl.int32,
                                     is_pure=True, pack=1)
    return tl.load(code_ptr + (lane & 15))


@triton.jit
def _x(x_ptr, offs_m, m_ok, stride_xm, k0, word_offs, j, BLOCK_M: tl.constexpr):
    """x's column k0 + 8 w + j for every word w in fp32: (1, KB, WPB) for one row, else
    (1, BLOCK_M, KB, WPB)."""
    if BLOCK_M == 1:
        x = tl.load(x_ptr + (k0 + 8 * word_offs + j)[None, :, :]).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs_m[None, :, None, None] * stride_xm + (k0 + 8 * word_offs + j)[None, None, :, :],
                    mask=m_ok[None, :, None, None], other=0.0).to(tl.float32)
    return x


@triton.jit
def _products_x_vector(x_ptr, k0, e0, e1, e2, e3, e4, e5, e6, e7, KB: tl.constexpr, WPB: tl.constexpr):
    """One row's sum over each word of its 8 weights times x, with x's step read as one vector
    and split into its 8 columns of each word (fewer address computations than 8 gathers)."""
    xw = tl.reshape(tl.load(x_ptr + k0 + tl.arange(0, KB * WPB * 8)).to(tl.float32), (KB, WPB, 2, 2, 2))
    x_even, x_odd = tl.split(xw)                     # j = 4 a + 2 b + c: split c, then b, then a
    x0, x4 = tl.split(tl.split(x_even)[0])
    x2, x6 = tl.split(tl.split(x_even)[1])
    x1, x5 = tl.split(tl.split(x_odd)[0])
    x3, x7 = tl.split(tl.split(x_odd)[1])
    s = e0 * x0[None] + e1 * x1[None] + e2 * x2[None] + e3 * x3[None]
    return s + e4 * x4[None] + e5 * x5[None] + e6 * x6[None] + e7 * x7[None]


@triton.jit
def _rows(e, BLOCK_M: tl.constexpr):
    """A (BLOCK_N, KB, WPB) tensor of weights, shaped to meet `_x`'s."""
    if BLOCK_M > 1:
        e = e[:, None]
    return e


@triton.jit
def gemv_4bit_lut(x_ptr, out_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                  t0, t1, t2, t3, t4, t5, t6, t7, code_ptr, M, N, K, K_PER, stride_xm, stride_split,
                  stride_om, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, SHFL: tl.constexpr,
                  X_VECTOR: tl.constexpr):
    """(split, M, N) of x @ dequant(W)^T, one K slice per program column: each step reads KB
    quantisation blocks of BLOCK_N rows as 32-bit words, (BLOCK_N, KB, words per block)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    WPB: tl.constexpr = BLOCKSIZE // 8
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    word_offs = tl.arange(0, KB)[:, None] * WPB + tl.arange(0, WPB)[None, :]       # (KB, WPB)
    words = packed_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None, None] * (K // 8)
    row_blocks = rows[:, None] * (K // BLOCKSIZE) + tl.arange(0, KB)[None, :]       # (BLOCK_N, KB)
    k_start = pid_k * K_PER
    k_end = tl.minimum(k_start + K_PER, K)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, KB, WPB), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M, KB, WPB), dtype=tl.float32)
    if SHFL:
        table = _lane_table(code_ptr, tl.zeros((BLOCK_N, KB, WPB), dtype=tl.int32))
    for k0 in range(k_start, k_end, KB * BLOCKSIZE):
        w = tl.load(words + k0 // 8 + word_offs[None, :, :], mask=row_ok[:, None, None], other=0)
        block = row_blocks + k0 // BLOCKSIZE
        if NESTED:
            q = tl.load(absmax_ptr + block, mask=row_ok[:, None], other=0).to(tl.int32)
            scale = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + block // BLOCKSIZE2) + tl.load(offset_ptr)
        else:
            scale = tl.load(absmax_ptr + block, mask=row_ok[:, None], other=0.0)
        if SHFL:
            e0, e1, e2, e3, e4, e5, e6, e7 = _lookup_shfl(w, table)
        else:
            e0, e1, e2, e3, e4, e5, e6, e7 = _lookup(w, t0, t1, t2, t3, t4, t5, t6, t7)
        if X_VECTOR:
            s = _products_x_vector(x_ptr, k0, e0, e1, e2, e3, e4, e5, e6, e7, KB, WPB)
        else:
            s = _rows(e0, BLOCK_M) * _x(x_ptr, offs_m, m_ok, stride_xm, k0, word_offs, 0, BLOCK_M)
            s += _rows(e1, BLOCK_M) * _x(x_ptr, offs_m, m_ok, stride_xm, k0, word_offs, 1, BLOCK_M)
            s += _rows(e2, BLOCK_M) * _x(x_ptr, offs_m, m_ok, stride_xm, k0, word_offs, 2, BLOCK_M)
            s += _rows(e3, BLOCK_M) * _x(x_ptr, offs_m, m_ok, stride_xm, k0, word_offs, 3, BLOCK_M)
            s += _rows(e4, BLOCK_M) * _x(x_ptr, offs_m, m_ok, stride_xm, k0, word_offs, 4, BLOCK_M)
            s += _rows(e5, BLOCK_M) * _x(x_ptr, offs_m, m_ok, stride_xm, k0, word_offs, 5, BLOCK_M)
            s += _rows(e6, BLOCK_M) * _x(x_ptr, offs_m, m_ok, stride_xm, k0, word_offs, 6, BLOCK_M)
            s += _rows(e7, BLOCK_M) * _x(x_ptr, offs_m, m_ok, stride_xm, k0, word_offs, 7, BLOCK_M)
        if BLOCK_M == 1:
            acc += s * scale[:, :, None]
        else:
            acc += s * scale[:, None, :, None]
    if BLOCK_M == 1:
        total = tl.sum(tl.sum(acc, axis=2), axis=1)[:, None]
    else:
        total = tl.sum(tl.sum(acc, axis=3), axis=2)                                 # (BLOCK_N, BLOCK_M)
    out = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + rows[:, None]
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])


def code_planes(code: torch.Tensor) -> list[int]:
    """The 16-entry code in fp16 as the kernel's eight table registers: low bytes of entries
    0-3, 4-7, 8-11, 12-15, then their high bytes (little-endian int32s)."""
    bits = code.float().cpu().half().view(torch.int16).to(torch.int32) & 0xFFFF
    regs = []
    for shift in (0, 8):
        plane = ((bits >> shift) & 0xFF).tolist()
        for r in range(4):
            value = sum(plane[4 * r + i] << (8 * i) for i in range(4))
            regs.append(value - (1 << 32) if value >= 1 << 31 else value)
    return regs


def launch(x, packed, st, planes, block_n, kb, warps, split, shfl, x_vector=False, partials=False):
    """x @ dequant(W)^T in x's dtype: K cut into `split` slices of whole steps (fp32 partials
    summed after, unless `partials`: the engine's consumers sum them in their own kernels), or,
    with `split` 1, the one kernel writes x's dtype. `shfl`: the code looked up by warp shuffle,
    else by `prmt`. `x_vector` (one row only): x's step read as one vector."""
    m, k = x.shape
    n = st.shape[0]
    bk = kb * st.blocksize
    if k % bk:                    # the kernel reads whole steps: no mask along K
        raise ValueError(f"K={k} is not a multiple of {kb} blocks of {st.blocksize}")
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per)
    out = torch.empty(split, m, n, device=x.device, dtype=torch.float32 if split > 1 else x.dtype)
    gemv_4bit_lut[(triton.cdiv(n, block_n), split)](
        x, out, packed, st.absmax, st.state2.absmax, st.state2.code, st.offset, *planes, st.code,
        m, n, k, k_per, x.stride(0), out.stride(0), out.stride(1),
        BLOCKSIZE=st.blocksize, BLOCKSIZE2=st.state2.blocksize, NESTED=True,
        BLOCK_M=max(triton.next_power_of_2(m), 1), BLOCK_N=block_n, KB=kb, SHFL=shfl,
        X_VECTOR=x_vector and m == 1, num_warps=warps, num_stages=3)
    if partials:
        return out
    return out.sum(0).to(x.dtype) if split > 1 else out[0]


def tilings(m: int, k: int):
    """(block_n, blocks per step, warps, K slices, shuffle lookup, x read as one vector)."""
    for block_n, kb, warps, split, shfl, x_vector in itertools.product(
            (32, 64, 128), (1, 2), (4, 8), (4, 8, 16), (True, False), (False, True)):
        if x_vector and not (shfl and m == 1):
            continue
        if block_n * kb * 8 >= warps * 32 and block_n * kb * m <= 1024 and k >= split * kb * 64:
            yield block_n, kb, warps, split, shfl, x_vector


def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--shapes", default="qkv,down", help="of qkv, gate_up, down")
    args = parser.parse_args()
    shapes = {"qkv": (6144, 2560), "gate_up": (19456, 2560), "down": (2560, 9728)}
    for name in args.shapes.split(","):
        n, k = shapes[name]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        qs = [bf.quantize_4bit(w, quant_type="nf4", compress_statistics=True) for w in ws]
        mb = qs[0][0].numel() / 1e6
        logger.info("== %s %dx%d: packed %.1f MB, %.1f us at 3.35 TB/s", name, n, k, mb, mb / 3.35e6 * 1e6)
        planes = code_planes(qs[0][1].code)
        for m in (int(r) for r in args.rows.split(",")):
            _row(m, ws, qs, planes)


def _row(m: int, ws: list, qs: list, planes: list) -> None:
    """One row count: the engine's kernel, bitsandbytes, cuBLAS, then every tiling of the design,
    each with its error against float64 next to bitsandbytes' own."""
    x = torch.randn(m, ws[0].shape[1], device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ bf.dequantize_4bit(qs[0][0], qs[0][1]).double().t()

    def err(got):
        return ((got.double() - ref).norm() / ref.norm()).item()
    bnb_err = err(bnb.matmul_4bit(x, qs[0][0].t(), quant_state=qs[0][1]))
    cur = graph_us_cycling(lambda i: gemv_4bit.project(x, *qs[i]), COPIES)
    bnb_us = graph_us_cycling(lambda i: bnb.matmul_4bit(x, qs[i][0].t(), quant_state=qs[i][1]), COPIES)
    bf16 = graph_us_cycling(lambda i: torch.nn.functional.linear(x, ws[i]), COPIES)
    best = []
    for cfg in tilings(m, x.shape[1]):
        try:
            e = err(launch(x, qs[0][0], qs[0][1], planes, *cfg))
            us = graph_us_cycling(lambda i, cfg=cfg: launch(x, qs[i][0], qs[i][1], planes, *cfg), COPIES)
            best.append((us, cfg, e))
        except triton.runtime.errors.OutOfResources as e:      # a tiling past shared memory
            logger.info("  fail %s %s", cfg, str(e)[:100])
    best.sort()
    logger.info("M=%-2d engine kernel %6.1f us  bitsandbytes %5.1f (err %.1e)  bf16 %5.1f | best "
                "(block_n, blocks per step, warps, K slices, shuffle, x vector): %s", m, cur, bnb_us, bnb_err, bf16,
                "  ".join(f"{c}: {u:.1f} us err {e:.1e}" for u, c, e in best[:4]))
    for shfl in (True, False):
        us, cfg, _ = next(b for b in best if b[1][4] is shfl)
        alone = graph_us_cycling(lambda i, cfg=cfg: launch(x, qs[i][0], qs[i][1], planes, *cfg, partials=True),
                                 COPIES)
        logger.info("      best %s lookup %s: %.1f us, the kernel alone (partials unsummed) %.1f us",
                    "shuffle" if shfl else "prmt", cfg, us, alone)


if __name__ == "__main__":
    sys.exit(main())
