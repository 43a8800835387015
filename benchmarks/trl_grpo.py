"""GRPO step time and peak memory: TRL colocate on flexrollout vs TRL's own HF-generate path.

    python benchmarks/trl_grpo.py flex      # use_vllm=True, vllm_mode="colocate", patched
    python benchmarks/trl_grpo.py hf        # use_vllm=False
    python benchmarks/trl_grpo.py flex cpu  # a tiny smoke run on CPU

Random Qwen3-0.6B-sized model in bf16, LoRA r=16 on all linear layers, 8 prompts x 8 completions
per step, prompt 128 words of a word-level tokenizer, completion up to 256, 4 steps.
"""
from __future__ import annotations

import json
import os
import sys
import time

import datasets
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from conftest import make_tiny_model, make_tiny_tokenizer  # noqa: E402

from flexrollout.bench import random_model  # noqa: E402


def reward_len(completions, **kwargs):
    return [-abs(len(c) - 200) / 200 for c in completions]


def main() -> None:
    mode = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    small = device == "cpu"
    if mode == "flex":
        import flexrollout

        flexrollout.patch_trl()
    import trl
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    if small:
        model, _ = make_tiny_model("qwen3", vocab_size=512)
    else:
        model = random_model("qwen3-0.6b", torch.bfloat16, device, 2048)
    vocab = model.config.vocab_size
    tok = make_tiny_tokenizer(vocab, vocab - 1)
    g = torch.Generator().manual_seed(0)
    words = 16 if small else 128
    dataset = datasets.Dataset.from_dict({"prompt": [
        " ".join(f"t{int(t)}" for t in torch.randint(4, vocab - 1, (words,), generator=g))
        for _ in range(256)]})
    args = GRPOConfig(
        output_dir=f"/tmp/trl_grpo_{mode}", report_to="none", save_strategy="no", logging_steps=1,
        use_cpu=small, bf16=not small, seed=0, disable_tqdm=True, per_device_train_batch_size=8,
        gradient_accumulation_steps=8, num_generations=8, max_completion_length=8 if small else 256,
        max_steps=2 if small else 4, learning_rate=1e-5, use_vllm=mode == "flex",
        vllm_mode="colocate", vllm_max_model_length=1024, vllm_gpu_memory_utilization=0.3)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_len, processing_class=tok, args=args, train_dataset=dataset,
        peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                               target_modules="all-linear"))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    history = [e for e in trainer.state.log_history if "step_time" in e]
    result = {
        "trl": trl.__version__, "mode": mode, "train_s": round(time.perf_counter() - start, 2),
        "step_time_s": [round(e["step_time"], 3) for e in history],
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
        "logp_diff_max": [e.get("sampling/sampling_logp_difference/max") for e in history],
        "completion_mean_len": [e.get("completions/mean_length") for e in history],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
