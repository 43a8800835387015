"""What each LoRA mode costs: decode tok/s with no adapter, live LoRA and merged LoRA, batches
whose rows cycle over no request and `--requests` LoRARequest adapters (in memory, every
projection; decoded from the adapter table's graphs; unfused, then with `lora_request_kernels`),
and the time of one merged refresh after an in-place adapter update.

    python benchmarks/lora_modes.py --preset qwen3-4b --ranks 16,64 --batch-sizes 8,64
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from flexrollout import LLM, LoRARequest
from flexrollout.bench import random_model, run_decode

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _release(device: str) -> None:
    """Return a deleted engine's KV cache and graph pools to the GPU before the next one sizes its cache."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def random_requests(model, rank: int, count: int) -> list[LoRARequest]:
    """`count` adapters of rank `rank` on every projection in ALL, as PEFT would save them."""
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": ALL}
    requests = []
    for i in range(count):
        g = torch.Generator(device=model.device).manual_seed(i)
        tensors = {}
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ALL and isinstance(module, torch.nn.Linear):
                fan_out, fan_in = module.weight.shape
                tensors[f"base_model.model.{name}.lora_A.weight"] = \
                    torch.randn(rank, fan_in, generator=g, device=model.device) / fan_in ** 0.5
                tensors[f"base_model.model.{name}.lora_B.weight"] = \
                    torch.randn(fan_out, rank, generator=g, device=model.device) * 0.01
        requests.append(LoRARequest(f"random-{i}", i + 1, lora_tensors=tensors, lora_config=config))
    return requests


def main() -> None:
    from peft import LoraConfig, get_peft_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--batch-sizes", default="8,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=4, help="LoRARequest adapters mixed per batch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results = []
    for rank in [int(r) for r in args.ranks.split(",")]:
        model = random_model(args.preset, dtype, args.device, 2048)
        vocab = model.config.vocab_size
        base = LLM(model, max_model_len=1024, max_num_seqs=max(batches), gpu_memory_utilization=0.3)
        rows = {f"base_bs{b}": max(run_decode(base, b, 128, args.max_tokens, vocab)) for b in batches}
        mix = [None, *random_requests(model, rank, args.requests)]
        rows.update({f"requests{args.requests}_bs{b}": max(run_decode(base, b, 128, args.max_tokens, vocab,
                                                                      lora_requests=mix)) for b in batches})
        del base
        _release(args.device)
        # The same mix with the adapter table's terms folded into the LoRA kernels.
        fold = LLM(model, max_model_len=1024, max_num_seqs=max(batches), gpu_memory_utilization=0.3,
                   lora_request_kernels=True)
        rows.update({f"requests{args.requests}_kernels_bs{b}": max(run_decode(
            fold, b, 128, args.max_tokens, vocab, lora_requests=mix)) for b in batches})
        del fold, mix
        _release(args.device)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL))
        for mode in ("live", "merged"):
            llm = LLM(peft_model, max_model_len=1024, max_num_seqs=max(batches),
                      gpu_memory_utilization=0.3, lora_mode=mode)
            rows.update({f"{mode}_bs{b}": max(run_decode(llm, b, 128, args.max_tokens, vocab)) for b in batches})
            if mode == "merged":
                with torch.no_grad():
                    for name, p in peft_model.named_parameters():
                        if "lora_B" in name:
                            p.add_(1e-3)
                _sync(args.device)
                start = time.perf_counter()
                count = llm.llm_engine.forward.merged.refresh()
                _sync(args.device)
                rows["merged_refresh_ms"] = 1e3 * (time.perf_counter() - start)
                rows["merged_matrices"] = count
            del llm
            _release(args.device)
        results.append({"rank": rank, **{k: round(v, 1) if isinstance(v, float) else v for k, v in rows.items()}})
        # Each rank as it finishes: a run cut short by its time limit keeps the ranks it measured.
        print(json.dumps(results[-1]), flush=True)
        del peft_model, model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({"preset": args.preset, "device": args.device, "results": results}, indent=1))


if __name__ == "__main__":
    main()
