"""Sleep/wake on the GPU: memory freed, wake and re-capture times, tokens identical over cycles.

    python benchmarks/sleep_wake.py --preset qwen3-4b --cycles 100
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from flexrollout import LLM, SamplingParams
from flexrollout.bench import random_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--check-every", type=int, default=25)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args()
    model = random_model(args.preset, torch.bfloat16, "cuda", 4096)
    llm = LLM(model, max_model_len=1024, max_num_seqs=16, enable_sleep_mode=True,
              gpu_memory_utilization=args.gpu_memory_utilization)
    prompts = [{"prompt_token_ids": list(range(10 + i, 100 + i))} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = tokens()
    kv_bytes = llm.llm_engine.cache_bytes
    free_awake = torch.cuda.mem_get_info()[0]
    sleep_s, wake_s, first_gen_s, freed, free_after_wake = [], [], [], [], []
    identical = True
    for cycle in range(args.cycles):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.sleep(level=1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        freed.append(torch.cuda.mem_get_info()[0] - free_awake)
        llm.wake_up(tags=["weights"])
        llm.wake_up(tags=["kv_cache"])
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        sleep_s.append(t1 - t0)
        wake_s.append(t2 - t1)
        free_after_wake.append(torch.cuda.mem_get_info()[0])
        if cycle % args.check_every == 0 or cycle == args.cycles - 1:
            t3 = time.perf_counter()
            identical &= tokens() == reference
            first_gen_s.append(time.perf_counter() - t3)
    result = {
        "preset": args.preset, "cycles": args.cycles, "kv_cache_GB": kv_bytes / 1e9,
        "freed_GB_min": min(freed) / 1e9, "freed_fraction_of_kv": min(freed) / kv_bytes,
        "sleep_ms_mean": 1e3 * sum(sleep_s) / len(sleep_s), "wake_ms_mean": 1e3 * sum(wake_s) / len(wake_s),
        "generate_after_wake_s (graph re-capture included)": first_gen_s,
        "free_after_wake_GB_first_last": [free_after_wake[0] / 1e9, free_after_wake[-1] / 1e9],
        "tokens_identical": identical,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
