"""What live LoRA adds to a projection on the GPU. Up to the GEMV's LoRA rows (32): the shrink
launch (s A x over PEFT's fp32 A) at several K splits, and the GEMV with B (s A x) folded in,
against the plain GEMV. Past them (the engine's expand path): cuBLAS per matrix plus one shrink
and one expand per adapted matrix, against cuBLAS alone, with the shrink at several K splits and
with its partials summed once before the expands (every expand program re-reads all partials),
and, up to 64 rows, the GEMV with its 64-row tiles, plain and with the adapters folded in.
At every row count, the GEMV with the fused shrink (its first programs compute s A x: no shrink
launch) at several K slices, with B's tiles loaded before or after the K loop.

Qwen3-4B's four projection groups (q/k/v, o, gate/up with SiLU-mul, down), rank 32 adapters on
every matrix, each timed from CUDA-graph replays of 8 launches over 8 weight copies (as in
gemv_sweep.py, so L2 holds none of them), PDL on as in the engine. Prints microseconds per launch
and, per row count, the extra time a decoder layer pays (sum over the groups).

    python benchmarks/lora_sweep.py [--rows 1,8,32,64] [--rank 32] [--splits 8,16,32,80]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from gemv_sweep import SHAPES, graph_us_cycling
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from flexrollout.kernels import lora as lk
from flexrollout.kernels import small_linear as sl

GROUPS = ("qkv", "o", "gate_up", "down")
COPIES = 8


def _group(name: str, rows: int, rank: int):
    """Weight copies, adapters (fp32, as PEFT keeps them) and an input for one projection group."""
    widths, k, silu = SHAPES[name]
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for n in widths]
               for _ in range(COPIES)]
    pad = [None] * (3 - len(widths))
    lora_a = [[torch.randn(rank, k, device="cuda") / k ** 0.5 for _ in widths] + pad for _ in range(COPIES)]
    lora_b = [[torch.randn(n, rank, device="cuda") * 0.01 for n in widths] + pad for _ in range(COPIES)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    return weights, lora_a, lora_b, x, silu, pad


def _time(fn) -> float:
    """Microseconds per launch sequence: `fn(i)` over the COPIES weight copies in one graph."""
    return graph_us_cycling(fn, COPIES)


def measure(name: str, rows: int, rank: int, splits: list[int]) -> dict:
    weights, lora_a, lora_b, x, silu, pad = _group(name, rows, rank)
    scales = [2.0, 2.0, 2.0]
    width = sum(w.shape[0] for w in weights[0][: 1 if silu else 3])
    tile = sl.tiling(rows, width, x.shape[1], silu, x.dtype)
    row = {"group": name, "rows": rows, "gemv_split": tile.split}
    row["gemv_us"] = _time(lambda i: sl.launch(x, *(weights[i] + pad), silu, tile, pdl=True))
    for split in splits:
        row[f"shrink{split}_us"] = _time(
            lambda i, s=split: lk.launch(x, *lora_a[i], scales, pdl=True, max_split=s))
    low_rank = lk.launch(x, *lora_a[0], scales, pdl=True)
    row["folded_gemv_us"] = _time(lambda i: sl.launch(x, *(weights[i] + pad), silu, tile, pdl=True,
                                                      lora=(low_rank, *lora_b[i])))
    row["shrink_plus_folded_us"] = _time(lambda i: sl.launch(
        x, *(weights[i] + pad), silu, tile, pdl=True,
        lora=(lk.launch(x, *lora_a[i], scales, pdl=True), *lora_b[i])))
    _fused(row, x, weights, lora_a, lora_b, scales, silu, tile, pad)
    return row


FUSED = {"fused": (sl.SHRINK_SPLIT, True, False), "fused_no_prefetch": (sl.SHRINK_SPLIT, False, False),
         "fused_expand_last": (sl.SHRINK_SPLIT, True, True),
         "fused2": (2, True, False), "fused4": (4, True, False), "fused8": (8, True, False),
         "fused32": (32, True, False)}


def _fused(row, x, weights, lora_a, lora_b, scales, silu, tile, pad) -> None:
    """The GEMV launch computing s A x in its own first programs (no shrink launch), at
    several K slices per adapter, with B's tiles loaded before the K loop or after it, and
    B (s A x) added in the first K slice (the engine's) or the last."""
    for name, (parts, prefetch, last) in FUSED.items():
        try:
            row[f"{name}_us"] = _time(lambda i, p=parts, f=prefetch, e=last: sl.launch(
                x, *(weights[i] + pad), silu, tile, pdl=True, lora=(None, *lora_b[i]),
                lora_a=(*lora_a[i], scales), shrink_split=p, prefetch_b=f, expand_last=e))
        except (OutOfResources, CompilationError) as error:   # a tiling that does not fit
            print(f"{row['group']} {name} at {x.shape[0]} rows failed: {error!r:.200}", flush=True)
            row[f"{name}_us"] = float("nan")


def _expand_path(x, weights, lora_a, lora_b, scales, split: int, summed: bool) -> None:
    """The engine's expand path for one group: one shrink, then cuBLAS + expand per matrix."""
    low_rank = lk.launch(x, *lora_a, scales, pdl=True, max_split=split)
    if summed:
        low_rank = low_rank.sum(0, keepdim=True)
    r_block = lk.rank_block([b.shape[1] for b in lora_b if b is not None])
    for slot, (w, b) in enumerate(zip(weights, lora_b)):
        lk.launch_expand(F.linear(x, w), low_rank, b, slot, r_block, pdl=True)


def measure_expand(name: str, rows: int, rank: int, splits: list[int]) -> dict:
    weights, lora_a, lora_b, x, silu, pad = _group(name, rows, rank)
    scales = [2.0, 2.0, 2.0]
    row = {"group": name, "rows": rows}
    row["cublas_us"] = _time(lambda i: [F.linear(x, w) for w in weights[i]])
    for split in splits:
        row[f"expand{split}_us"] = _time(lambda i, s=split: _expand_path(
            x, weights[i], lora_a[i], lora_b[i], scales, s, summed=False))
    row["expand_summed_us"] = _time(lambda i: _expand_path(
        x, weights[i], lora_a[i], lora_b[i], scales, lk.MAX_SPLIT, summed=True))
    if rows <= 64:      # the GEMV's 64-row tiles (benchmarks only): would the fold beat the expand?
        width = sum(w.shape[0] for w in weights[0][: 1 if silu else 3])
        tile = sl.tiling(rows, width, x.shape[1], silu, x.dtype)
        row["gemv_us"] = _time(lambda i: sl.launch(x, *(weights[i] + pad), silu, tile, pdl=True))
        row["shrink_plus_folded_gemv_us"] = _time(lambda i: sl.launch(
            x, *(weights[i] + pad), silu, tile, pdl=True,
            lora=(lk.launch(x, *lora_a[i], scales, pdl=True), *lora_b[i])))
        _fused(row, x, weights, lora_a, lora_b, scales, silu, tile, pad)
    return row


def _print(results: list[dict], rows: int, rank: int, base: str) -> None:
    keys = [k for k in results[0] if k.endswith("_us")]
    print(f"rows {rows}, rank {rank}: microseconds per launch sequence")
    print(f"{'group':8s}" + "".join(f"{k[:-3]:>22s}" for k in keys))
    for r in results:
        print(f"{r['group']:8s}" + "".join(f"{r[k]:22.2f}" for k in keys))
    for key in keys:
        if key != base:
            extra = sum(r[key] - r[base] for r in results)
            print(f"{key[:-3]} adds {extra:.1f} us per decoder layer at {rows} rows", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--splits", default="8,16,32,80")
    args = parser.parse_args()
    splits = [int(s) for s in args.splits.split(",")]
    for rows in (int(r) for r in args.rows.split(",")):
        if rows <= lk.MAX_ROWS:
            results = [measure(name, rows, args.rank, splits) for name in GROUPS]
            _print(results, rows, args.rank, "gemv_us")
        else:
            results = [measure_expand(name, rows, args.rank, splits) for name in GROUPS]
            _print(results, rows, args.rank, "cublas_us")

if __name__ == "__main__":
    main()
