"""Small-M linear layers on the GPU: cuBLAS (F.linear) against Triton split-K GEMV configs.

Times each Qwen3-4B projection shape at M = 1, 8, 64 from CUDA-graph replays over 8 weight
copies (so L2 holds none of them) and prints achieved GB/s of weight reads.

    python benchmarks/gemv_sweep.py
"""
from __future__ import annotations

import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_ym,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K_PER, BLOCK_K):
        offs_k = pid_k * K_PER + k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        acc += tl.dot(w, tl.trans(x))
    ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    if SPLIT_K == 1:
        tl.store(ptrs, acc, mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")


def triton_linear(x, w, y, bn, bk, split, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    bm = max(16, triton.next_power_of_2(M))
    if split > 1:
        y.zero_()
    grid = (triton.cdiv(N, bn), split)
    k_per = triton.cdiv(K, split * bk) * bk
    _gemv[grid](x, w, y, M, N, K, k_per, x.stride(0), w.stride(0), y.stride(0),
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)


def graph_time(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[2] * 1e-3


SHAPES = {"gate_up": (19456, 2560), "down": (2560, 9728), "qkv": (6144, 2560), "o": (2560, 4096),
          "kv": (1024, 2560), "lm_head": (151936, 2560)}


def main():
    torch.manual_seed(0)
    dev = "cuda"
    copies = 8
    configs = list(itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4), (4,), (3, 5)))
    results = {}
    for name, (N, K) in SHAPES.items():
        n_copies = 2 if name == "lm_head" else copies
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(n_copies)]
        for M in (1, 8, 64):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())
            gbytes = N * K * 2 / 1e9
            def cublas():
                for w in ws:
                    F.linear(x, w)
            t = graph_time(cublas) / n_copies
            row = {"cublas_GBs": round(gbytes / t, 0)}
            best = (0, None)
            y = torch.zeros(M, N, device=dev, dtype=torch.float32)
            for cfg in configs:
                bn, bk, split, warps, stages = cfg
                if K % (bk * split):
                    continue
                try:
                    triton_linear(x, ws[0], y, *cfg)
                    err = ((y - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        print("BAD", name, M, cfg, err, file=sys.stderr)
                        continue
                    def tri():
                        for w in ws:
                            triton_linear(x, w, y, *cfg)
                    tt = graph_time(tri) / n_copies
                except Exception as exc:    # a config that does not compile is skipped, loudly
                    print("FAIL", name, M, cfg, type(exc).__name__, str(exc)[:200], file=sys.stderr)
                    continue
                if gbytes / tt > best[0]:
                    best = (gbytes / tt, cfg)
            row["triton_GBs"], row["triton_cfg"] = round(best[0], 0), best[1]
            results[f"{name}_M{M}"] = row
            print(name, M, row, flush=True)
        del ws
    json.dump(results, open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gemv.json", "w"), indent=1)


if __name__ == "__main__":
    main()
