"""Unsloth's fast_inference=True on flexrollout (issue 8), end to end on a GPU.

    UNSLOTH_FAST_INFERENCE=1 python benchmarks/unsloth_grpo.py [--preset qwen3-0.6b] [--steps 2]

Saves a random-weight Qwen3 (real size, bf16) with a word-level tokenizer to a local directory
(no hub), imports unsloth (the installed flexrollout-unsloth.pth hook patches it; without the
hook the script falls back to `import flexrollout.unsloth` and says so), loads through
FastLanguageModel.from_pretrained(fast_inference=True, load_in_4bit=False), generates with
model.fast_generate (tok/s), adds LoRA with get_peft_model, runs Unsloth's GRPOTrainer for a few
steps with a length reward, and prints one JSON line: versions, engine type, tok/s, step times,
peak memory, whether the adapter moved and whether the rollouts ran on the flexrollout engine.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ACTIVATION = "pth" if "_flexrollout_unsloth" in sys.modules else "explicit"
if os.environ.get("UNSLOTH_FAST_INFERENCE") != "1":
    sys.exit("run with UNSLOTH_FAST_INFERENCE=1 in the environment")
if ACTIVATION == "explicit":
    print("flexrollout-unsloth.pth did not run (flexrollout not installed as a package?); "
          "activating with `import flexrollout.unsloth`", file=sys.stderr)
    import flexrollout.unsloth  # noqa: F401,E402

import unsloth  # noqa: E402,F401  (before transformers / trl / peft, as Unsloth asks)
from unsloth import FastLanguageModel  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from conftest import make_tiny_tokenizer  # noqa: E402

from flexrollout.bench import random_model  # noqa: E402

PACKAGES = ("unsloth", "unsloth_zoo", "trl", "transformers", "torch", "peft", "datasets",
            "accelerate", "triton")


def versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def save_random_model(preset: str, directory: str, max_len: int) -> None:
    if os.path.isfile(os.path.join(directory, "config.json")):
        return
    model = random_model(preset, torch.bfloat16, "cpu", max_len)
    vocab = model.config.vocab_size
    tok = make_tiny_tokenizer(vocab, vocab - 1)
    model.config.eos_token_id = model.generation_config.eos_token_id = vocab - 1
    model.config.pad_token_id = model.generation_config.pad_token_id = 0
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    del model


def prompts(count: int, words: int, vocab: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"t{int(t)}" for t in torch.randint(4, vocab - 1, (words,), generator=g))
            for _ in range(count)]


def reward_len(completions, **kwargs):
    return [-abs(len(c) - 400) / 400 for c in completions]


def timed_generate(model, texts, max_tokens: int) -> dict:
    from vllm import SamplingParams      # flexrollout's, through the plugin (no vLLM installed)

    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True,
                            seed=0)
    # Warm at the same batch (builds the engine, compiles, captures this batch's graph bucket),
    # so the timed call is steady-state decode, as `flexrollout bench` measures it.
    warm = time.perf_counter()
    model.fast_generate(texts, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=0),
                        use_tqdm=False)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = model.fast_generate(texts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"batch": len(texts), "tokens": tokens, "s": round(elapsed, 3),
            "tok_s": round(tokens / elapsed, 1), "warm_s": round(warm_s, 2)}


def lora_b_norm(model) -> float:
    return float(sum(p.detach().float().norm() for n, p in model.named_parameters() if "lora_B" in n))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--dir", default="/tmp/unsloth_random_qwen3")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, default=128)
    opts = parser.parse_args()

    max_len = 1024
    save_random_model(opts.preset, opts.dir, max_len)
    # The engine is used before the trainer exists, so size it for the GRPO run up front (the
    # rule is per_device_train_batch_size x steps_per_generation x num_generations).
    need = opts.batch * 1 * opts.num_generations
    start = time.perf_counter()
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=opts.dir, max_seq_length=max_len, load_in_4bit=False, fast_inference=True,
        max_lora_rank=16, gpu_memory_utilization=0.5, max_batch_size=need, dtype=torch.bfloat16)
    load_s = time.perf_counter() - start
    engine = model.vllm_engine
    result = {"versions": versions(), "activation": ACTIVATION, "vllm_installed": _real_vllm(),
              "vllm_engine": type(engine).__module__ + "." + type(engine).__name__,
              "engine_built_at_load": engine.built, "load_s": round(load_s, 2)}
    vocab = model.config.vocab_size
    texts = prompts(64, opts.prompt_words, vocab, seed=1)
    result["generate_bs64"] = timed_generate(model, texts, opts.completion)
    result["generate_bs8"] = timed_generate(model, texts[:8], opts.completion)
    llm = engine.engine()
    result["engine"] = type(llm).__module__ + "." + type(llm).__name__
    result["engine_max_num_seqs"] = llm.config.max_num_seqs

    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=32, lora_dropout=0.0, random_state=3407,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_gradient_checkpointing="unsloth")
    result["peft_engine_same"] = model.vllm_engine is engine
    result["lora_b_norm_before"] = lora_b_norm(model)
    result.update(train(model, tokenizer, opts, llm))
    result["lora_b_norm_after"] = lora_b_norm(model)
    live = model.fast_generate(texts[:4], _sampling(64), use_tqdm=False,
                               lora_request=model.load_lora("grpo_lora", load_tensors=True))
    model.save_lora("/tmp/unsloth_grpo_lora")
    saved = model.fast_generate(texts[:4], _sampling(64), use_tqdm=False,
                                lora_request=model.load_lora("/tmp/unsloth_grpo_lora"))
    # Random bf16 logits are nearly tied, so greedy paths may part on rounding: report, not assert.
    pairs = [(a, b) for x, y in zip(live, saved)
             for a, b in zip(x.outputs[0].token_ids, y.outputs[0].token_ids)]
    result["saved_vs_live_token_agreement"] = round(sum(a == b for a, b in pairs) / len(pairs), 3)
    result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(result))


def _sampling(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _real_vllm() -> bool:
    mod = sys.modules.get("vllm")
    return mod is not None and not getattr(mod, "__flexrollout__", False)


def train(model, tokenizer, opts, llm) -> dict:
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    vocab = model.config.vocab_size
    dataset = datasets.Dataset.from_dict({"prompt": prompts(256, opts.prompt_words, vocab, 2)})
    args = GRPOConfig(
        output_dir="/tmp/unsloth_grpo_out", report_to="none", save_strategy="no", logging_steps=1,
        bf16=True, seed=0, per_device_train_batch_size=opts.batch, gradient_accumulation_steps=1,
        num_generations=opts.num_generations, max_completion_length=opts.completion,
        max_steps=opts.steps, learning_rate=5e-5, temperature=1.0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward_len],
                          args=args, train_dataset=dataset)
    vg = getattr(trainer, "vllm_generation", None)
    steps_before = llm.llm_engine.stats.decode_steps
    torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.train()
    torch.cuda.synchronize()
    history = [e for e in trainer.state.log_history if "loss" in e or "step_time" in e]
    return {
        "trainer": type(trainer).__module__ + "." + type(trainer).__name__,
        "trainer_llm_is_model_engine": getattr(vg, "llm", None) is model.vllm_engine,
        "train_s": round(time.perf_counter() - start, 2),
        "step_time_s": [round(e["step_time"], 3) for e in history if "step_time" in e],
        "engine_decode_steps_in_train": llm.llm_engine.stats.decode_steps - steps_before,
        "completion_mean_len": [e.get("completions/mean_length") for e in history],
        "logp_diff_max": [e.get("sampling/sampling_logp_difference/max") for e in history],
        "reward": [e.get("reward") for e in history],
    }


if __name__ == "__main__":
    main()
