"""`flexrollout bench`: throughput against the HBM roofline, on random weights at real sizes.

Decode is memory-bound: a step reads every weight once plus the KV of every running sequence,
so roofline tok/s = batch x bandwidth / (weight bytes + KV bytes read per step). The bandwidth
is measured in the same process (a large device-to-device copy, bytes read + written).
"""
from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from .weights import weight_bytes as _weight_bytes

logger = logging.getLogger(__name__)

# Real sizes (DESIGN.md §4). rope: (theta, llama3 scaling factor or None).
PRESETS = {
    "qwen3-0.6b": dict(arch="qwen3", hidden=1024, inter=3072, layers=28, heads=16, kv=8, hd=128, vocab=151936, theta=1e6, tie=True),
    "qwen3-4b": dict(arch="qwen3", hidden=2560, inter=9728, layers=36, heads=32, kv=8, hd=128, vocab=151936, theta=1e6, tie=True),
    "qwen3-8b": dict(arch="qwen3", hidden=4096, inter=12288, layers=36, heads=32, kv=8, hd=128, vocab=151936, theta=1e6, tie=False),
    "llama-3.2-1b": dict(arch="llama", hidden=2048, inter=8192, layers=16, heads=32, kv=8, hd=64, vocab=128256, theta=5e5, tie=True, llama3=32.0),
    "llama-3.2-3b": dict(arch="llama", hidden=3072, inter=8192, layers=28, heads=24, kv=8, hd=128, vocab=128256, theta=5e5, tie=True, llama3=32.0),
    "llama-3.1-8b": dict(arch="llama", hidden=4096, inter=14336, layers=32, heads=32, kv=8, hd=128, vocab=128256, theta=5e5, tie=False, llama3=8.0),
    "qwen3-30b-a3b": dict(arch="qwen3_moe", hidden=2048, inter=6144, moe_inter=768, experts=128, top_k=8, layers=48, heads=32, kv=4, hd=128, vocab=151936, theta=1e6, tie=False),
    "gpt-oss-20b": dict(arch="gpt_oss", hidden=2880, inter=2880, experts=32, top_k=4, layers=24, heads=64, kv=8, hd=64, vocab=201088, theta=150000.0, tie=False, window=128),
    "tiny-llama": dict(arch="llama", hidden=64, inter=128, layers=2, heads=4, kv=2, hd=16, vocab=512, theta=1e4, tie=False, llama3=8.0),
    "tiny-qwen3": dict(arch="qwen3", hidden=64, inter=128, layers=2, heads=4, kv=2, hd=16, vocab=512, theta=1e6, tie=True),
}


def preset_config(name: str, max_position_embeddings: int = 8192, num_layers: int | None = None):
    """A transformers config with the preset's real sizes (`num_layers`: fewer layers, same widths)."""
    from transformers import LlamaConfig, Qwen3Config

    p = dict(PRESETS[name], **({"layers": num_layers} if num_layers else {}))
    if p["arch"] in ("qwen3_moe", "gpt_oss"):
        return _moe_config(p, max_position_embeddings)
    common = dict(hidden_size=p["hidden"], intermediate_size=p["inter"], num_hidden_layers=p["layers"],
                  num_attention_heads=p["heads"], num_key_value_heads=p["kv"], head_dim=p["hd"],
                  vocab_size=p["vocab"], tie_word_embeddings=p["tie"],
                  max_position_embeddings=max_position_embeddings, bos_token_id=0, eos_token_id=1)
    rope = {"rope_type": "default", "rope_theta": p["theta"]}
    if p.get("llama3"):
        rope = {"rope_type": "llama3", "rope_theta": p["theta"], "factor": p["llama3"],
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
    cls = Qwen3Config if p["arch"] == "qwen3" else LlamaConfig
    return cls(rope_parameters=rope, **common)


def _moe_config(p: dict, max_position_embeddings: int):
    from transformers import GptOssConfig, Qwen3MoeConfig

    common = dict(hidden_size=p["hidden"], num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                  num_key_value_heads=p["kv"], head_dim=p["hd"], vocab_size=p["vocab"],
                  tie_word_embeddings=p["tie"], max_position_embeddings=max_position_embeddings,
                  bos_token_id=0, eos_token_id=1)
    if p["arch"] == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=p["inter"], moe_intermediate_size=p["moe_inter"],
                              num_experts=p["experts"], num_experts_per_tok=p["top_k"], norm_topk_prob=True,
                              rope_parameters={"rope_type": "default", "rope_theta": p["theta"]}, **common)
    # gpt-oss-20b's YaRN: factor 32 over 4096 original positions (its config.json).
    rope = {"rope_type": "yarn", "rope_theta": p["theta"], "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}
    return GptOssConfig(intermediate_size=p["inter"], num_local_experts=p["experts"],
                        num_experts_per_tok=p["top_k"], sliding_window=p["window"], rope_parameters=rope,
                        **common)


def bytes_per_step(llm, model, batch: int, context: float) -> float:
    """HBM bytes one decode step must read: every weight once, except that an untied input
    embedding table is read only at the batch's rows and a MoE layer reads only the experts its
    tokens chose (with random routing E * (1 - (1 - k/E)^B) distinct of E), plus each layer's
    KV of every sequence (a sliding layer's window at most; a KV-sharing layer none of its own)."""
    forward = llm.llm_engine.forward
    total = float(_weight_bytes(model))
    embed = model.get_input_embeddings().weight
    if embed.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        total -= embed.numel() * embed.element_size() * (1 - batch / embed.shape[0])
    config = model.config
    top_k = getattr(config, "num_experts_per_tok", 0)
    for experts in forward.experts:
        if experts is None:
            continue
        stacks = [experts.gate_up, experts.down, experts.gate_up_bias, experts.down_bias]
        stack_bytes = sum(t.numel() * t.element_size() for t in stacks if t is not None)
        count = experts.gate_up.shape[0]
        touched = count * (1 - (1 - top_k / count) ** batch)
        total -= stack_bytes * (1 - touched / count)
    elem = torch.empty((), dtype=llm.llm_engine.model_config.dtype).element_size()
    for spec in llm.llm_engine.spec.layers:
        if spec.owns_kv:
            tokens = context if spec.window is None else min(context, spec.window)
            total += batch * tokens * 2 * spec.num_kv_heads * spec.head_dim * elem
    return total


def random_model(name: str, dtype: torch.dtype, device: str, max_position_embeddings: int = 8192,
                 num_layers: int | None = None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = preset_config(name, max_position_embeddings, num_layers)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def measure_bandwidth(device: str, gib: float = 2.0) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    reps = 10
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    elapsed = time.perf_counter() - start
    del src, dst
    return 2 * gib * 2**30 * reps / elapsed


def measure_matmul(device: str, n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 2 * n**3 * 10 / (time.perf_counter() - start)


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, length), generator=g)
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def run_decode(llm, batch: int, prompt_len: int, max_tokens: int, vocab: int,
               repeat: int = 1) -> list[float]:
    """tok/s of `repeat` timed runs (same prompts), after a warm-up that captures the graphs."""
    from . import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(_prompts(batch, prompt_len, vocab, 1), SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)        # warm-up, graphs
    prompts = _prompts(batch, prompt_len, vocab, 2)
    rates = []
    for _ in range(repeat):
        outs, elapsed = _timed_generate(llm, prompts, params)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    return rates


def _timed_generate(llm, prompts, params) -> tuple[list, float]:
    """`llm.generate` and its wall time, the device drained before and after."""
    device = llm.llm_engine.device.type
    _sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    return outs, time.perf_counter() - start


def _spread(rates: list[float]) -> dict:
    """Every run's tok/s and the spread as % of the best, when there was more than one run."""
    if len(rates) < 2:
        return {}
    return {"tok_s_runs": rates, "spread_pct": 100 * (max(rates) - min(rates)) / max(rates)}


def _compile_seconds() -> dict[str, float]:
    """torch.compile's own timers so far (dynamo tracing, inductor, kernel compiles), summed."""
    import torch._dynamo.utils as dynamo_utils

    table = dynamo_utils.compile_times(repr="csv", aggregate=True)
    if not table:
        return {}
    headers, values = table
    return {name: round(float(value), 3) for name, value in zip(headers, values)}


def run_hf(model, batch: int, prompt_len: int, max_tokens: int, vocab: int, device: str) -> float:
    ids = torch.tensor([p["prompt_token_ids"] for p in _prompts(batch, prompt_len, vocab, 2)], device=device)
    model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    _sync(device)
    return (out.shape[1] - prompt_len) * batch / (time.perf_counter() - start)


def bench(args) -> dict:
    from . import LLM, SamplingParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    result: dict = {"preset": args.preset, "device": device, "dtype": args.dtype,
                    "torch": torch.__version__, "kernel_options": args.kernel_options,
                    "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        result["bandwidth_GBs"] = measure_bandwidth(device) / 1e9
    model_len = args.prompt_len + max(args.max_tokens, 512) + 16
    t0 = time.perf_counter()
    model = random_model(args.preset, dtype, device, max(model_len, 8192))
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                 target_modules=targets)).eval()
        result["lora"] = {"rank": args.lora_rank, "mode": args.lora_mode}
    weights = _weight_bytes(model)
    result["weight_GB"] = weights / 1e9
    vocab = model.config.vocab_size
    max_seqs = max(batch_sizes + ([64] if "grpo" in args.workload else []))
    engine_args = json.loads(args.engine_args) if args.engine_args else {}
    result["engine_args"] = engine_args
    if device == "cuda":
        torch.cuda.empty_cache()  # model init's cached blocks are not the engine's reserved memory
    _peak_bytes(device)  # the engine's peak starts here: not the bandwidth probe's or model init's
    # The trainer's model as the allocator holds it (blocks round up): the base of the overhead.
    model_bytes = torch.cuda.memory_allocated() if device == "cuda" else weights
    if args.memory_snapshot and device == "cuda":
        # Every allocation from here on, with its Python stack: benchmarks/memory_peak.py names
        # what is live at the peak.
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    t1 = time.perf_counter()
    llm = LLM(model, tokenizer=None, max_model_len=model_len, max_num_seqs=max_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              lora_mode=args.lora_mode,
              flex_kernel_options=json.loads(args.kernel_options) if args.kernel_options else None,
              **engine_args)
    llm.generate(_prompts(1, args.prompt_len, vocab, 0), SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    _sync(device)
    result["startup_s"] = time.perf_counter() - t1
    result["startup_compile_s"] = _compile_seconds()
    result["model_init_s"] = t1 - t0
    rows = []
    engine_peak = 0  # the HF baseline's own KV cache must not count as the engine's peak
    workloads = args.workload.split(",")
    if "decode" in workloads:
        for batch in batch_sizes:
            rates = run_decode(llm, batch, args.prompt_len, args.max_tokens, vocab, args.repeat)
            tok_s = max(rates)
            ctx = args.prompt_len + args.max_tokens / 2
            row = {"workload": "decode", "batch": batch, "tok_s": tok_s, **_spread(rates)}
            if "bandwidth_GBs" in result:
                roof = batch * result["bandwidth_GBs"] * 1e9 / bytes_per_step(llm, model, batch, ctx)
                row.update(roofline_tok_s=roof, roofline_pct=100 * tok_s / roof)
            if args.compare == "hf":
                engine_peak = max(engine_peak, _peak_bytes(device))
                row["hf_tok_s"] = run_hf(model, batch, args.prompt_len, args.hf_max_tokens, vocab, device)
                row["x_hf"] = tok_s / row["hf_tok_s"]
                _peak_bytes(device)  # drop HF's own peak
            rows.append(row)
            logger.warning("%s", row)
    if "grpo" in workloads:
        params = SamplingParams(n=8, temperature=1.0, max_tokens=512, logprobs=0, seed=None)
        prompts = _prompts(8, 256, vocab, 3)
        llm.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=8, logprobs=0), use_tqdm=False)
        runs = []
        for _ in range(args.repeat):
            outs, elapsed = _timed_generate(llm, prompts, params)
            generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
            runs.append({"tok_s": generated / elapsed, "generated": generated, "seconds": elapsed})
        best = max(runs, key=lambda run: run["tok_s"])
        rows.append({"workload": "grpo", "batch": 64, **best,
                     **_spread([run["tok_s"] for run in runs])})
    if "prefill" in workloads:
        flops = measure_matmul(device) if device == "cuda" else None
        prompts = _prompts(64, 512, vocab, 4)
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        _, elapsed = _timed_generate(llm, prompts, SamplingParams(temperature=0, max_tokens=1))
        tokens_s = 64 * 512 / elapsed
        row = {"workload": "prefill", "prefill_tok_s": tokens_s}
        if flops:
            params_count = weights / torch.empty((), dtype=dtype).element_size()
            row.update(matmul_TFLOPs=flops / 1e12, mfu_pct=100 * tokens_s * 2 * params_count / flops)
        rows.append(row)
    result["rows"] = rows
    graphs = llm.llm_engine.runner.graphs
    result["graph_capture_s"] = graphs.capture_seconds if graphs is not None else 0.0
    if device == "cuda":
        peak = max(engine_peak, torch.cuda.max_memory_allocated())
        cache = llm.llm_engine.cache_bytes
        result["peak_GB"] = peak / 1e9
        result["kv_cache_GB"] = cache / 1e9
        result["model_allocated_GB"] = model_bytes / 1e9
        # Graph pools keep their blocks reserved while idle (a replay reuses them unseen by the
        # allocated counter), so the idle part adds to any peak outside a replay.
        pool_idle = _graph_pool_idle_bytes()
        result["graph_pool_idle_GB"] = pool_idle / 1e9
        # What the engine adds beyond the model and its KV cache (graph pools, cuBLAS
        # workspaces, activations, logits; merged LoRA copies), as a fraction of the weights.
        overhead = peak + pool_idle - model_bytes - cache
        result["overhead_GB"] = overhead / 1e9
        result["overhead_pct_of_weights"] = 100 * overhead / weights
        # Of that overhead, what stays between steps (graph pools, workspaces, rope tables,
        # static buffers); the rest is one step's transient activations.
        resident = torch.cuda.memory_allocated() + pool_idle - model_bytes - cache
        result["resident_overhead_GB"] = resident / 1e9
        # What the allocator held from the driver at most, cached free blocks included (those
        # serve the trainer's next allocations in the same process).
        result["reserved_overhead_GB"] = (torch.cuda.max_memory_reserved() - model_bytes - cache) / 1e9
        if args.memory_snapshot:
            torch.cuda.memory._dump_snapshot(args.memory_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
    return result


def _graph_pool_idle_bytes() -> int:
    """Reserved but unallocated bytes of the CUDA graph pools (segments outside pool (0, 0))."""
    return sum(seg["total_size"] - seg["allocated_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))


def _peak_bytes(device: str) -> int:
    """Peak allocated bytes since the last call (the counter is reset), 0 off CUDA."""
    if device != "cuda":
        return 0
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return peak


def print_table(result: dict) -> None:
    head = {k: v for k, v in result.items() if k != "rows"}
    print(json.dumps(head, default=str))
    for row in result["rows"]:
        print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


def plot(result: dict, path: str) -> None:
    """tok/s against batch size, with the roofline and (when measured) HF generate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["workload"] == "decode"]
    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [r["tok_s"] for r in rows], "o-", label="flexrollout")
    if rows and "roofline_tok_s" in rows[0]:
        ax.plot(batches, [r["roofline_tok_s"] for r in rows], "k--", label="HBM roofline")
    if rows and "hf_tok_s" in rows[0]:
        ax.plot(batches, [r["hf_tok_s"] for r in rows], "s-", label="HF generate")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens / s",
           title=f"{result['preset']} {result['dtype']} decode, {result.get('gpu', result['device'])}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _main(args) -> int:
    result = bench(args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    if args.plot:
        plot(result, args.plot)
    return 0


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="throughput on random weights at real sizes")
    p.add_argument("--preset", default="qwen3-4b", choices=sorted(PRESETS))
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--workload", default="decode",
                   help="decode, grpo, prefill, or a comma list of them (one model, one engine)")
    p.add_argument("--compare", choices=["hf"], default=None)
    p.add_argument("--repeat", type=int, default=1,
                   help="timed runs per decode batch and GRPO shape: the best is reported, the spread kept")
    p.add_argument("--hf-max-tokens", type=int, default=64, help="new tokens for the HF baseline")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--lora-rank", type=int, default=0, help="wrap the model in PEFT LoRA of this rank")
    p.add_argument("--lora-mode", default="live", choices=["live", "merged"])
    p.add_argument("--kernel-options", default=None,
                   help='flex decode kernel options as JSON, e.g. \'{"num_warps": 8}\'')
    p.add_argument("--engine-args", default=None,
                   help='EngineConfig fields as JSON, e.g. \'{"small_batch_kernels": false}\'')
    p.add_argument("--json", default=None)
    p.add_argument("--memory-snapshot", default=None, metavar="PATH",
                   help="CUDA: write torch's allocation history (a pickle) for benchmarks/memory_peak.py")
    p.add_argument("--plot", default=None, help="PNG of tok/s against batch size")
    p.set_defaults(func=_main)
