"""Where a decode step's time goes: GPU kernels by category, and host time around replay.

The prefill is taken out: the same prompts are profiled once with one new token, and those
kernel times (and that wall time) are subtracted, leaving steps - 1 decode steps.

    python benchmarks/profile_decode.py --preset qwen3-4b --batch 8 [--lora-rank 32 | --lora-requests 4]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from flexrollout import LLM, SamplingParams
from flexrollout.bench import quantize_4bit, random_model

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _category(name: str) -> str:
    lowered = name.lower()
    for key, label in (("lora_shrink", "LoRA shrink (s A x)"), ("lora_expand", "LoRA expand"),
                       ("expert_gemv", "experts (grouped GEMV)"), ("small_linear_kernel", "gemm"), ("qkv_epilogue", "q/k/v epilogue (sum, norm, RoPE, KV store)"),
                       ("flex", "attention"), ("gemm", "gemm"), ("gemv", "gemm"), ("cutlass", "gemm"),
                       ("nvjet", "gemm"), ("sm90", "gemm"), ("argmax", "sampler"), ("softmax", "sampler"),
                       ("sort", "sampler"), ("triton", "fused elementwise (norms, RoPE, KV store, sums)"),
                       ("index", "index/copy"), ("copy", "index/copy")):
        if key in lowered:
            return label
    return "elementwise/other"


def _kernel_times(llm, prompts, params, rows) -> tuple[dict[str, float], int]:
    """GPU microseconds per kernel name for one generate call, and the number of launches.
    `rows`: each prompt's LoRARequest (None: none), or None."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False, lora_request=rows)
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    launches = 0
    for evt in prof.key_averages():
        cuda_us = getattr(evt, "self_device_time_total", 0) or 0
        if cuda_us > 0:
            times[evt.key] += cuda_us
            launches += evt.count
    return times, launches


def _last_kernels(llm, prompts, params, rows, count: int) -> list[tuple[str, float, float]]:
    """The last `count` GPU kernels of a generate call, in launch order: (name, microseconds,
    idle microseconds before it). They end the last decode step (its last layers, the LM head,
    the sampler): a layer's kernels one after another, gaps included."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False, lora_request=rows)
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)[-count - 1:]
    return [(name, end - start, start - kernels[i][1])
            for i, (start, end, name) in enumerate(kernels[1:])]


def _wall(llm, prompts, params, rows) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=rows)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _replay_ms(llm, batch: int) -> float:
    """One captured decode step replayed with no host work between replays: what the step
    costs on the GPU with its launch gaps, against the wall clock above (which adds host gaps)."""
    # {(bucket, sampler mode, state versions): (graph, outputs)}
    captured = llm.llm_engine.runner.graphs.graphs
    bucket = min(key[0] for key in captured if key[0] >= batch)
    graph = next(g for key, (g, _) in captured.items() if key[0] == bucket)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 20 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-pdl", action="store_true", help="GEMV launches without PDL")
    parser.add_argument("--quantization", choices=("bnb-nf4", "bnb-fp4"), help="4-bit base weights")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="live PEFT LoRA of this rank on all seven projections")
    parser.add_argument("--lora-requests", type=int, default=0,
                        help="rows cycle over no adapter and this many LoRARequest adapters "
                             "(rank 32, every projection), as benchmarks/lora_modes.py mixes them")
    parser.add_argument("--sequence", type=int, default=0,
                        help="also list the step's last this many kernels in order, with gaps")
    args = parser.parse_args()
    model = random_model(args.preset, torch.bfloat16, "cuda", 4096)
    if args.quantization:
        quantize_4bit(model, args.quantization.removeprefix("bnb-"))
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                 target_modules=LORA_TARGETS)).eval()
    llm = LLM(model, max_model_len=2048, max_num_seqs=max(args.batch, 8), gpu_memory_utilization=0.5,
              gemv_pdl=not args.no_pdl)
    prompts = [{"prompt_token_ids": list(range(10 + i, 138 + i))} for i in range(args.batch)]
    rows = None
    if args.lora_requests:
        from lora_modes import random_requests

        mix = [None, *random_requests(model, 32, args.lora_requests)]
        rows = [mix[i % len(mix)] for i in range(args.batch)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.steps, ignore_eos=True)
    prefill_only = SamplingParams(temperature=args.temperature, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False, lora_request=rows)
    steps = args.steps - 1
    wall = _wall(llm, prompts, params, rows) - _wall(llm, prompts, prefill_only, rows)
    (full, full_launches), (prefill, prefill_launches) = (
        _kernel_times(llm, prompts, params, rows), _kernel_times(llm, prompts, prefill_only, rows))
    by_name = {name: us - prefill.get(name, 0.0) for name, us in full.items()}
    by_cat: dict[str, float] = defaultdict(float)
    for name, us in by_name.items():
        by_cat[_category(name)] += us
    print(f"wall per decode step: {wall / steps * 1e3:.2f} ms (batch {args.batch}, prefill excluded)")
    print(f"GPU kernel time per decode step: {sum(by_cat.values()) / steps / 1e3:.2f} ms, "
          f"{(full_launches - prefill_launches) / steps:.0f} kernels")
    for cat, us in sorted(by_cat.items(), key=lambda x: -x[1]):
        print(f"  {cat:20s} {us / steps / 1e3:8.3f} ms/step")
    if llm.llm_engine.runner.graphs is not None:
        print(f"graph replay alone, back to back: {_replay_ms(llm, args.batch):.2f} ms per step")
    print("top kernels:")
    for name, us in sorted(by_name.items(), key=lambda x: -x[1])[:15]:
        print(f"  {us / steps / 1e3:8.3f} ms/step  {name[:110]}")
    if args.sequence:
        print(f"the last {args.sequence} kernels (us, idle us before):")
        for name, us, gap in _last_kernels(llm, prompts, params, rows, args.sequence):
            print(f"  {us:7.1f} {gap:6.1f}  {name[:100]}")


if __name__ == "__main__":
    main()
