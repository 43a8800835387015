"""4-bit projections at Qwen3-4B's shapes on the GPU: flexrollout's Triton GEMV against
bitsandbytes' own ops (`matmul_4bit`, which takes its fused GEMV for one row, and dequantise +
matmul) and the 16-bit cuBLAS matmul, by row count. Each is timed as the engine runs it: from
CUDA-graph replays (no Python launch cost), cycling over 8 weight copies so that L2 holds none.
Prints which bitsandbytes library loaded (a missing native library makes bitsandbytes fall back
to torch code).

Also the op the engine calls, `torch.ops.bitsandbytes.gemm_4bit` (0.50 on), as bitsandbytes
dispatches it (its per-architecture heuristic picks the fused kernel or dequantise + matmul), and
its fused kernel forced for every row count (`_gemm_4bit_kernel_impl`, a private function of
bitsandbytes' CUDA backend, timed only where it exists): whether the heuristic leaves speed
unused at Qwen3-4B's decode shapes.

    python benchmarks/gemv_4bit_sweep.py [--rows 1,4,8,16,32,64] [--json OUT]
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging

import torch
from gemv_sweep import graph_us_cycling

logger = logging.getLogger(__name__)
SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
COPIES = 8


def _time_us(fn) -> float:
    """Microseconds per call of `fn(i)` over the COPIES weight copies, replayed from a graph."""
    return graph_us_cycling(fn, COPIES)


def main() -> None:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    from flexrollout.layers.quant import state_bytes

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4,8,16,32,64")
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lib = getattr(bnb, "cextension", None)
    logger.info("bitsandbytes %s, native library: %s", bnb.__version__,
                 getattr(getattr(lib, "lib", None), "_name", getattr(lib, "BNB_BACKEND", "?")))
    results = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        quantized = [bf.quantize_4bit(w, quant_type="nf4", compress_statistics=True) for w in weights]
        packed_bytes = quantized[0][0].numel() + state_bytes(quantized[0][1])
        for m in [int(r) for r in args.rows.split(",")]:
            row = _row(name, m, weights, quantized, packed_bytes)
            results.append(row)
            logger.info("%-8s M=%-3d %s  (forced fused kernel's error %.0e)", name, m, "  ".join(
                f"{k[:-3]} {v:7.1f}us" for k, v in row.items() if k.endswith("_us")), row.get("gemm_4bit_fused_err", 0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _row(name, m, weights, quantized, packed_bytes) -> dict:
    """Microseconds and packed-bytes bandwidth of each way to run one projection of m rows."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    from flexrollout.kernels import gemv_4bit
    from flexrollout.kernels.gemv_4bit import Packed4bit
    from flexrollout.layers.quant import _gemm_4bit

    x = torch.randn(m, weights[0].shape[1], device="cuda", dtype=torch.bfloat16)
    row = {"shape": name, "rows": m, "packed_MB": packed_bytes / 1e6}
    if gemv_4bit.supported(x, quantized[0][1]):
        row["flex_us"] = _time_us(lambda i: gemv_4bit.project(x, *quantized[i]))
    row["bnb_matmul_4bit_us"] = _time_us(
        lambda i: bnb.matmul_4bit(x, quantized[i][0].t(), quant_state=quantized[i][1]))
    row["dequant_matmul_us"] = _time_us(
        lambda i: torch.nn.functional.linear(x, bf.dequantize_4bit(*quantized[i])))
    states = [Packed4bit.of(st) for _, st in quantized]
    if all(q.gemm_op for q in states):
        row["gemm_4bit_op_us"] = _time_us(lambda i: _gemm_4bit(x, quantized[i][0], states[i], None))
    fused = getattr(importlib.import_module("bitsandbytes.backends.cuda.ops"), "_gemm_4bit_kernel_impl", None)
    if fused is not None and all(q.nested for q in states):
        def forced(i):
            q = states[i]
            return fused(x, quantized[i][0].view(-1, 1), list(q.shape), q.absmax2, q.blocksize, q.quant_type,
                         absmax_8bit=q.absmax, absmax_code=q.code2, absmax_offset=q.offset)
        ref = x.double() @ bf.dequantize_4bit(*quantized[0]).double().t()
        row["gemm_4bit_fused_err"] = ((forced(0).double() - ref).norm() / ref.norm()).item()
        row["gemm_4bit_fused_us"] = _time_us(forced)
    row["bf16_cublas_us"] = _time_us(lambda i: torch.nn.functional.linear(x, weights[i]))
    for key in [k for k in row if k.endswith("_us")]:
        row[key.replace("_us", "_GBs")] = packed_bytes / row[key] / 1e3
    return row


if __name__ == "__main__":
    main()
