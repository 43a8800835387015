"""Small-M projections on the GPU: cuBLAS against flexrollout's split-K GEMV, over its tilings.

Times each Qwen3-4B projection at M = 1, 8, 32, 64 from CUDA-graph replays over 8 weight copies
(so L2 holds none of them) and prints GB/s of weight reads for cuBLAS (F.linear), for the tiling
the engine picks today (`small_linear.tiling`), and for the best tiling found. Then, for the
engine's tiling, a chain of 8 (elementwise kernel -> projection) pairs with and without
programmatic dependent launch, as in a decode step where each projection follows a fused norm.

    python benchmarks/gemv_sweep.py [OUT.json] [--shapes qkv,o | e2b | ragged] [--rows 1,8] [--engine-only]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from flexrollout.kernels import small_linear as sl

# name: (output widths of the matrices read by one launch, K, SiLU-mul epilogue)
SHAPES = {"qkv": ([4096, 1024, 1024], 2560, False), "o": ([2560], 4096, False),
          "gate_up": ([9728, 9728], 2560, True), "down": ([2560], 9728, False),
          "lm_head": ([151936], 2560, False)}
# Gemma-4-E2B's (hidden 1536): its matrices are small, so launch and ramp weigh more than bytes
# (`--shapes` names them; "e2b" all of them). `2`: the double-wide MLP of its KV-sharing layers.
E2B_SHAPES = {"e2b_qkv": ([2048, 256, 256], 1536, False), "e2b_o": ([1536], 2048, False),
              "e2b_gate_up": ([6144, 6144], 1536, True), "e2b_gate_up2": ([12288, 12288], 1536, True),
              "e2b_down": ([1536], 6144, False), "e2b_down2": ([1536], 12288, False),
              "e2b_ple_gate": ([256], 1536, False), "e2b_ple_proj": ([1536], 256, False),
              "e2b_lm_head": ([262144], 1536, False)}
# Input widths off the 128-wide K step (masked K tails): 26B-A4B's dense down_proj, gpt-oss's
# q/k/v and router (`--shapes ragged`).
RAGGED_SHAPES = {"a4b_down": ([2816], 2112, False), "oss_qkv": ([4096, 512, 512], 2880, False),
                 "oss_router": ([32], 2880, False)}
GROUPS = {"e2b": E2B_SHAPES, "ragged": RAGGED_SHAPES}
ROWS = (1, 8, 32, 64)


def graph_seconds(fn, reps: int = 10) -> float:
    """Median seconds of one `fn()` replayed from a CUDA graph of `reps` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / reps * 1e-3)
    return sorted(times)[2]


def graph_us_cycling(fn, copies: int) -> float:
    """Microseconds per call of `fn(i)`, i cycling over `copies` weight copies (so that L2 holds
    none of them), replayed from a CUDA graph."""
    state = {"i": 0}

    def step():
        fn(state["i"] % copies)
        state["i"] += 1
    return graph_seconds(step, reps=copies) * 1e6


def candidates(k: int, silu: bool):
    for block_n, block_k, split, stages in itertools.product((32, 64, 128), (128, 256),
                                                             (1, 2, 4, 8), (3, 5)):
        tile = sl.Tiling(block_n=block_n, block_k=block_k, split=split, warps=4, stages=stages)
        # Widths on the K step: tilings that divide it; off it: any `launch` runs (masked tails).
        on_step = k % sl.BLOCK_K == 0
        if (silu and split > 1) or not sl.tile_fits(k, tile) or (on_step and k % (split * block_k)):
            continue
        yield tile


def refinements(best: sl.Tiling):
    for warps, stages in itertools.product((4, 8), (3, 4, 5)):
        yield sl.Tiling(best.block_n, best.block_k, best.split, warps, stages)


def _launch(x, ws: list, silu: bool, tile, pdl=None):
    """The engine's kernel over one launch's matrices (one to three)."""
    return sl.launch(x, *ws, *[None] * (3 - len(ws)), silu, tile, pdl)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="/tmp/gemv.json")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--engine-only", action="store_true",
                        help="time cuBLAS and the engine's tiling only, no search")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    names = [n for name in args.shapes.split(",") for n in GROUPS.get(name, [name])]
    for name in names:
        widths, k, silu = {**SHAPES, **E2B_SHAPES, **RAGGED_SHAPES}[name]
        copies = 2 if name.endswith("lm_head") else 8
        sets = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n in widths]
                for _ in range(copies)]
        gbytes = sum(widths) * k * 2 / 1e9
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = torch.cat([x.float() @ w.float().T for w in sets[0]], dim=1)
            if silu:
                half = widths[0]
                ref = F.silu(ref[:, :half]) * ref[:, half:]

            def run(tile, pdl=None):
                for ws in sets:
                    _launch(x, ws, silu, tile, pdl)

            def cublas():
                for ws in sets:
                    for w in ws:
                        F.linear(x, w)

            def measure(tile):
                out = _launch(x, sets[0], silu, tile)
                err = ((out.float().sum(0) - ref).norm() / ref.norm()).item()
                if not err < 2e-2:
                    raise AssertionError(f"{name} M={m} {tile}: relative error {err}")
                return gbytes / (graph_seconds(lambda: run(tile, pdl=False)) / copies)

            row = {"cublas_GBs": round(gbytes / (graph_seconds(cublas) / copies))}
            engine = sl.tiling(m, sum(widths) if not silu else widths[0], k, silu, x.dtype)
            row["engine_GBs"], row["engine_tiling"] = round(measure(engine)), engine.__dict__
            if args.engine_only:
                results[f"{name}_M{m}"] = row
                print(name, m, json.dumps(row), flush=True)
                continue
            scores = {}

            def score(tiles):
                for tile in tiles:
                    if tile in scores:
                        continue
                    try:
                        scores[tile] = measure(tile)
                    except Exception as exc:    # a tiling that does not fit (shared memory) is skipped, loudly
                        print("skip", name, m, tile, type(exc).__name__, str(exc)[:120], file=sys.stderr)
                return max(scores, key=scores.get)

            best = score(refinements(score(candidates(k, silu))))
            row["best_GBs"], row["best_tiling"] = round(scores[best]), best.__dict__
            if m <= sl.MAX_ROWS:
                try:
                    row["chain_us_pdl_off"], row["chain_us_pdl_on"] = chain(x, sets, silu, engine)
                except RuntimeError as exc:    # PDL under graph capture unsupported here: say so
                    row["chain_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            results[f"{name}_M{m}"] = row
            print(name, m, json.dumps(row), flush=True)
        del sets
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


def chain(x, sets, silu: bool, tile) -> tuple[float, float]:
    """Microseconds per (x.mul_(1) -> projection) pair, PDL off and on."""
    per_pair = []
    for pdl in (False, True):
        def pairs():
            for ws in sets:
                x.mul_(1.0)
                _launch(x, ws, silu, tile, pdl)
        per_pair.append(round(graph_seconds(pairs) / len(sets) * 1e6, 2))
    return per_pair[0], per_pair[1]


if __name__ == "__main__":
    main()
