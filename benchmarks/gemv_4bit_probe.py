"""Why the engine's dot-based 4-bit kernel is slow (issue #22): one suspect removed at a time.

The engine's kernel (`kernels/gemv_4bit.py`, dequantise in registers, `tl.dot` on the tensor
cores) took 180 us for Qwen3-4B's q/k/v at one row and 259 us at 64 rows on an H100, nearly
independent of the rows: about 11.5 ns per thousand weights, against 12 us for bitsandbytes'
kernel and 14.6 us for bf16 cuBLAS (BENCHMARKS.md, 2026-12-06). Compiled for sm_90 on CPU, its
loop is about 18 instructions per weight, issue time for ~10 us: the rest is stalls, and the SASS
shows three suspects (Triton 3.6, 2026-12-07):

- the code lookup is a gather from global memory, which the pipeliner turns into 4-byte
  `cp.async`s waited on (`DEPBAR.LE SB0, 0x0`) at the top of every iteration;
- x's even and odd columns are strided loads (`LDG.E.U16`), synchronous, inside the loop;
- the nested scale is a chain of two dependent loads a step (absmax code, then code2[q]).

The probe found the first two (H100, BENCHMARKS.md "eighteenth session"), and the engine's kernel
has since taken both fixes: its row below is the kernel as it is now, and the "global, strided"
variants are its loop as it was.

Each variant below is the engine's loop (non-nested or nested NF4, one matrix, the engine's own
`block_scale`) with one of them changed: `lookup` global (as the engine) / register (`tl.gather`
over the code held in registers: warp shuffles on sm_90) / none (the nibble itself as the
weight: wrong values, timing only); `x` strided (as the engine) / whole (one contiguous load
split in registers); pipeline stages.
Timed from CUDA-graph replays cycling 8 weight copies (split-K partials summed, as a consumer
would), beside the engine's kernel and bitsandbytes' op; each variant that computes real weights
is checked against bitsandbytes' dequantised weight (relative error printed).

    python benchmarks/gemv_4bit_probe.py [--rows 1,64] [--nested 0,1] [--stages 1,2,4]
"""
import argparse
import functools
import itertools
import logging
import sys

import bitsandbytes as bnb
import torch
import triton
import triton.language as tl
from gemv_sweep import graph_us_cycling

from flexrollout.kernels import gemv_4bit
from flexrollout.kernels.gemv_4bit_jit import block_scale

COPIES = 8
logger = logging.getLogger(__name__)


@triton.jit
def probe_kernel(x_ptr, out_ptr, packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                 M, N, K, K_PER, stride_xm, stride_split, stride_om,
                 BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                 LOOKUP: tl.constexpr, X_WHOLE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    HALF: tl.constexpr = BLOCKSIZE // 2
    pairs = tl.arange(0, HALF)
    cols = tl.arange(0, BLOCKSIZE)
    row_bytes = rows64[:, None] * (K // 2)
    row_blocks = rows64 * (K // BLOCKSIZE)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    code = tl.broadcast_to(tl.load(code_ptr + tl.arange(0, 16))[None, :], (BLOCK_N, 16))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(pid_k * K_PER, tl.minimum(pid_k * K_PER + K_PER, K), BLOCKSIZE):
        packed = tl.load(packed_ptr + row_bytes + (k0 // 2 + pairs)[None, :],
                         mask=row_ok[:, None], other=0).to(tl.int32)
        block = row_blocks + k0 // BLOCKSIZE
        scale = block_scale(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, row_ok,
                            BLOCKSIZE2, NESTED, EMULATE)
        hi, lo = packed >> 4, packed & 0xF
        if LOOKUP == 0:          # the engine's until 2026-12-07: a gather from global memory
            w_even, w_odd = tl.load(code_ptr + hi), tl.load(code_ptr + lo)
        elif LOOKUP == 1:        # the code in registers
            w_even, w_odd = tl.gather(code, hi, axis=1), tl.gather(code, lo, axis=1)
        else:                    # no lookup (timing only)
            w_even, w_odd = hi.to(tl.float32), lo.to(tl.float32)
        w_even = (w_even * scale[:, None]).to(x_ptr.dtype.element_ty)
        w_odd = (w_odd * scale[:, None]).to(x_ptr.dtype.element_ty)
        if X_WHOLE:
            x_block = tl.load(x_rows + (k0 + cols)[None, :], mask=m_ok[:, None], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(x_block, (BLOCK_M, HALF, 2)))
        else:
            x_even = tl.load(x_rows + (k0 + 2 * pairs)[None, :], mask=m_ok[:, None], other=0.0)
            x_odd = tl.load(x_rows + (k0 + 2 * pairs + 1)[None, :], mask=m_ok[:, None], other=0.0)
        acc += tl.dot(w_even, tl.trans(x_even))
        acc += tl.dot(w_odd, tl.trans(x_odd))
    out = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + rows[:, None]
    tl.store(out, acc, mask=m_ok[None, :] & row_ok[:, None])


def probe(x, packed, q: gemv_4bit.Packed4bit, lookup: int, x_whole: bool, stages: int):
    m, k = x.shape
    n = q.shape[0]
    split, k_per = gemv_4bit.k_slices(n, k, q.blocksize)
    out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    probe_kernel[(triton.cdiv(n, gemv_4bit.BLOCK_N), split)](
        x, out, packed, q.absmax, q.code, q.absmax2, q.code2, q.offset, m, n, k, k_per,
        x.stride(0), out.stride(0), out.stride(1), BLOCKSIZE=q.blocksize, BLOCKSIZE2=q.blocksize2,
        NESTED=q.nested, LOOKUP=lookup, X_WHOLE=x_whole, BLOCK_M=gemv_4bit.row_block(m),
        BLOCK_N=gemv_4bit.BLOCK_N, EMULATE=not x.is_cuda, num_warps=4, num_stages=stages)
    return out


def _report(label: str, fn, value: torch.Tensor, ref: torch.Tensor) -> None:
    err = ((value.float() - ref).norm() / ref.norm()).item()
    logger.info("| %s | %.1f | %.1e |", label, graph_us_cycling(fn, COPIES), err)


def _probe_rows(nested: bool, m: int, weights: list, packs: list, stage_counts: list[int]) -> None:
    """Every variant, the engine's kernel and bitsandbytes' op at m rows, one table row each."""
    x = torch.randn(m, weights[0][1].shape[1], device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ bnb.functional.dequantize_4bit(*weights[0]).float().t()
    runs = {"engine kernel": lambda i: gemv_4bit.launch(x, *packs[i]).sum(0)}
    runs["bitsandbytes matmul_4bit"] = lambda i: bnb.matmul_4bit(x, weights[i][0].t(), quant_state=weights[i][1])
    for lookup, x_whole, stages in itertools.product((0, 1, 2), (False, True), stage_counts):
        # lookup "none" computes wrong weights on purpose: its error is not a check.
        name = f"{('global', 'register', 'none')[lookup]}, {'whole' if x_whole else 'strided'}, {stages}"
        runs[name] = functools.partial(lambda i, a: probe(x, *packs[i], *a).sum(0), a=(lookup, x_whole, stages))
    for name, fn in runs.items():
        _report(f"{nested} | {m} | {name}", fn, fn(0), ref)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--nested", default="1,0")
    parser.add_argument("--stages", default="1,2,4", help="pipeline depths to try")
    parser.add_argument("--shape", default="6144,2560", help="out,in (Qwen3-4B's q/k/v)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    n, k = (int(v) for v in args.shape.split(","))
    torch.manual_seed(0)
    logger.info("| nested | rows | variant (lookup, x, stages) | us | rel. error |")
    logger.info("|---|---:|---|---:|---:|")
    for nested in (bool(int(v)) for v in args.nested.split(",")):
        weights = [bnb.functional.quantize_4bit(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,
                                                blocksize=64, quant_type="nf4", compress_statistics=nested)
                   for _ in range(COPIES)]
        packs = [(p, gemv_4bit.Packed4bit.of(s)) for p, s in weights]
        for m in (int(r) for r in args.rows.split(",")):
            _probe_rows(nested, m, weights, packs, [int(v) for v in args.stages.split(",")])

if __name__ == "__main__":
    main()
