"""`flexrollout bench`: throughput against the memory-bandwidth roofline, on random weights at real
sizes (the presets) or on a real model (`--model`, on CPU the embedded SmolLM2-135M by default).

Decode is memory-bound: a step reads every weight once plus the KV of every running sequence,
so roofline tok/s = batch x bandwidth / (weight bytes + KV bytes read per step). The bandwidth
is measured in the same process (a large copy on the same device, bytes read + written).
With `--quantization` (bitsandbytes 4-bit) the weight bytes are the packed nibbles plus their
quant states: what a step reads when every projection runs a 4-bit GEMV (batches of more than
one row also write and read a transient dequantised weight per projection, bitsandbytes' path).
"""
from __future__ import annotations

import json
import logging
import time

import torch

from .models.gemma4_presets import GEMMA4_PRESETS, experts_per_token, gemma4_config, rows_only_weights
from .weights import weight_bytes as _weight_bytes

logger = logging.getLogger(__name__)

# Real sizes (each model's config.json on the Hugging Face hub). rope: (theta, llama3 scaling factor or None).
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
    # Qwen3.5 hybrids: 3 GatedDeltaNet layers to 1 gated full-attention layer (full_every).
    "qwen3.5-4b": dict(arch="qwen3_5", hidden=2560, inter=9216, layers=32, heads=16, kv=4, hd=256, vocab=248320, theta=1e7, tie=True, lin_k_heads=16, lin_v_heads=32, lin_hd=128, full_every=4),
    "qwen3.6-35b-a3b": dict(arch="qwen3_5_moe", hidden=2048, moe_inter=512, shared_inter=512, experts=256, top_k=8, layers=40, heads=16, kv=2, hd=256, vocab=248320, theta=1e7, tie=False, lin_k_heads=16, lin_v_heads=32, lin_hd=128, full_every=4),
    **GEMMA4_PRESETS,
}


def preset_config(name: str, max_position_embeddings: int = 8192, num_layers: int | None = None):
    """A transformers config with the preset's real sizes (`num_layers`: fewer layers, same widths)."""
    from transformers import LlamaConfig, Qwen3Config

    if PRESETS[name]["arch"] == "gemma4":
        return gemma4_config(PRESETS[name], max_position_embeddings, num_layers)
    p = dict(PRESETS[name], **({"layers": num_layers} if num_layers else {}))
    if p["arch"] in ("qwen3_moe", "gpt_oss"):
        return _moe_config(p, max_position_embeddings)
    if p["arch"] in ("qwen3_5", "qwen3_5_moe"):
        return _qwen35_config(p, max_position_embeddings)
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


def _qwen35_config(p: dict, max_position_embeddings: int):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    common = dict(hidden_size=p["hidden"], num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                  num_key_value_heads=p["kv"], head_dim=p["hd"], vocab_size=p["vocab"],
                  tie_word_embeddings=p["tie"], max_position_embeddings=max_position_embeddings,
                  bos_token_id=0, eos_token_id=1, linear_num_key_heads=p["lin_k_heads"],
                  linear_num_value_heads=p["lin_v_heads"], linear_key_head_dim=p["lin_hd"],
                  linear_value_head_dim=p["lin_hd"], full_attention_interval=p["full_every"],
                  rope_parameters={"rope_type": "default", "rope_theta": p["theta"],
                                   "partial_rotary_factor": 0.25})
    if p["arch"] == "qwen3_5":
        return Qwen3_5TextConfig(intermediate_size=p["inter"], **common)
    return Qwen3_5MoeTextConfig(moe_intermediate_size=p["moe_inter"],
                                shared_expert_intermediate_size=p["shared_inter"], num_experts=p["experts"],
                                num_experts_per_tok=p["top_k"], **common)


def bytes_per_step(llm, model, batch: int, context: float) -> float:
    """HBM bytes one decode step must read: every weight once, except that an untied input
    embedding table is read only at the batch's rows and a MoE layer reads only the experts its
    tokens chose (with random routing E * (1 - (1 - k/E)^B) distinct of E), plus each layer's
    KV of every sequence (a sliding layer's window at most; a KV-sharing layer reads its source's)
    and each linear-attention layer's recurrent state, read and written."""
    forward = llm.llm_engine.forward
    total = float(_weight_bytes(model))
    embed = model.get_input_embeddings().weight
    if embed.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        total -= embed.numel() * embed.element_size() * (1 - batch / embed.shape[0])
    for table in rows_only_weights(model):      # Gemma-4's per-layer input embedding
        total -= table.numel() * table.element_size() * (1 - batch / table.shape[0])
    top_k = experts_per_token(model.config)
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
        if spec.mixer == "attention":          # a KV-sharing layer reads its source's pages
            tokens = context if spec.window is None else min(context, spec.window)
            total += batch * tokens * 2 * spec.num_kv_heads * spec.head_dim * elem
        for state in spec.states:              # a linear-attention layer reads and writes its state
            total += 2 * batch * torch.Size(state.shape).numel() * torch.empty((), dtype=state.dtype).element_size()
    return total


# --quantization: bitsandbytes' 4-bit formats (every architecture: the engine runs each decoder
# nn.Linear over Linear4bit; stacked experts stay 16-bit, as bitsandbytes leaves them).
QUANTIZATIONS = {"bnb-nf4": "nf4", "bnb-fp4": "fp4"}
QUANT_EXTRA_HINT = ("--quantization needs bitsandbytes: install flexrollout with its [quant] extra "
                    "(pip install '.[quant]' in the repository)")


def quantize_4bit(model, quant_type: str, double_quant: bool = True):
    """Replace every nn.Linear of the decoder layers by a bitsandbytes Linear4bit holding its
    weight quantised in place on its device, with the model's dtype as compute dtype: what a
    QLoRA load (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=double_quant))
    leaves, without a hub checkpoint. Embeddings and the LM head stay 16-bit, as they do there.
    Each layer's 16-bit weight is freed as it is replaced."""
    import bitsandbytes as bnb

    from .models.base import text_model

    for layer in text_model(model).layers:
        for parent in list(layer.modules()):
            for name, linear in list(parent.named_children()):
                if type(linear) is not torch.nn.Linear:
                    continue
                weight = linear.weight
                q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      compute_dtype=weight.dtype, quant_type=quant_type,
                                      compress_statistics=double_quant, device="meta")
                q.weight = bnb.nn.Params4bit(weight.data, requires_grad=False, quant_type=quant_type,
                                             compress_statistics=double_quant)
                q.bias = linear.bias
                q = q.to(weight.device)              # quantises
                # On CPU bitsandbytes' forward (the HF baseline) would otherwise repack the
                # weight in place into a layout only its own kernel reads.
                q.support_avx512bf16_for_cpu = False
                setattr(parent, name, q)
    return model


def parameter_count(model) -> int:
    """Parameters of the model as trained (a packed 4-bit byte holds two)."""
    from .layers.quant import quant_state_of

    seen = {p.data_ptr(): p.numel() * (2 if quant_state_of(p) is not None else 1) for p in model.parameters()}
    return sum(seen.values())


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


def sampling_options(name: str, vocab: int) -> dict:
    """SamplingParams fields of a `--sampling-options` set. "penalties" turns on every logits
    processor that keeps per-slot state: the three penalties, a logit_bias of a few tokens, and
    min_tokens=8 before a stop id (the last id, which random weights rarely draw). "bad_words":
    four multi-token words (2 to 4 tokens), spelled in `word_tokenizer`'s words "t{id}" (a random
    preset's tokenizer); the step checks each row's recent tokens against them whether or not
    they ever match."""
    if name == "none":
        return {}
    if name == "bad_words":
        words = [[7, 9], [11, 13, 17], [19, 23], [29, 31, 37, 41]]
        return {"bad_words": [" ".join(f"t{t % vocab}" for t in word) for word in words]}
    return {"repetition_penalty": 1.1, "frequency_penalty": 0.1, "presence_penalty": 0.1,
            "logit_bias": {2: 0.5, 3: -0.5, 5: 1.0}, "min_tokens": 8, "stop_token_ids": [vocab - 1]}


SAMPLING_OPTION_SETS = ("none", "penalties", "bad_words")


def word_tokenizer(vocab_size: int, eos_token_id: int | None = None):
    """A word-level fast tokenizer for random weights: id i <-> the word "t{i}", except the specials
    "<pad>" = 0, "<s>" = 1 and "</s>" = `eos_token_id` (default: the last id). Adds no special
    tokens, so `tok("t5 t9").input_ids == [5, 9]`. (Specials are matched anywhere in a text, so
    they must not look like "t{i}": a special "t1" would split "t17".)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = vocab_size - 1 if eos_token_id is None else eos_token_id
    specials = {0: "<pad>", 1: "<s>", eos: "</s>"}
    backend = Tokenizer(models.WordLevel(vocab={specials.get(i, f"t{i}"): i for i in range(vocab_size)},
                                         unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")      # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<pad>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")


def run_decode(llm, batch: int, prompt_len: int, max_tokens: int, vocab: int,
               repeat: int = 1, options: dict | None = None, lora_requests: list | None = None) -> list[float]:
    """tok/s of `repeat` timed runs (same prompts), after a warm-up that captures the graphs;
    `options`: extra SamplingParams fields of both (see `sampling_options`); `lora_requests`:
    the rows' requests, cycled over the batch (None: the model as held)."""
    from . import SamplingParams

    options = options or {}
    rows = None if lora_requests is None else [lora_requests[i % len(lora_requests)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **options)
    warm_tokens = max(4, options.get("min_tokens", 0))
    llm.generate(_prompts(batch, prompt_len, vocab, 1), SamplingParams(
        temperature=0.0, max_tokens=warm_tokens, ignore_eos=True, **options), use_tqdm=False,
        lora_request=rows)                                                                    # graphs
    prompts = _prompts(batch, prompt_len, vocab, 2)
    rates = []
    for _ in range(repeat):
        outs, elapsed = _timed_generate(llm, prompts, params, rows)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    return rates


def _timed_generate(llm, prompts, params, lora_request=None) -> tuple[list, float]:
    """`llm.generate` and its wall time, the device drained before and after."""
    device = llm.llm_engine.device.type
    _sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
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
    mask = torch.ones_like(ids)       # no padding; passed so transformers does not guess one
    model.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2, do_sample=False)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False)
    _sync(device)
    return (out.shape[1] - prompt_len) * batch / (time.perf_counter() - start)


# Defaults that depend on the device: a GPU benchmark at real sizes, a CPU one that ends in
# about a minute on a laptop (SmolLM2-135M's real weights, fp32, small batches).
DEVICE_DEFAULTS = {
    "cuda": dict(preset="qwen3-4b", dtype="bfloat16", batch_sizes="1,8,64", prompt_len=128, max_tokens=256),
    "cpu": dict(model="embedded", dtype="float32", batch_sizes="1,8", prompt_len=32, max_tokens=64),
}
GRPO_MAX_TOKENS = 512
GRPO_PROMPT_LEN = 256


def resolve_defaults(args) -> str:
    """Fill the flags left at None with the device's defaults; returns the device."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    defaults = dict(DEVICE_DEFAULTS["cuda" if device.startswith("cuda") else "cpu"])
    args.grpo_max_tokens = args.max_tokens or GRPO_MAX_TOKENS
    if args.preset or args.model:
        defaults.pop("preset", None)
        defaults.pop("model", None)
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.hf_max_tokens is None:
        args.hf_max_tokens = 64 if device.startswith("cuda") else args.max_tokens
    return device


def model_length(args) -> int:
    """max_model_len for the run: room for the decode rows and for the GRPO shape's 256-token
    prompts plus all their tokens (until 2026-12-04 the GRPO shape stopped at the model length,
    400 tokens into its 512)."""
    grpo_len = GRPO_PROMPT_LEN + args.grpo_max_tokens if "grpo" in args.workload else 0
    return max(args.prompt_len + max(args.max_tokens, 512), grpo_len) + 16


def _load_model(args, dtype: torch.dtype, device: str, model_len: int):
    """(model, tokenizer or None, name): a preset's random weights or a real model."""
    if args.preset:
        return random_model(args.preset, dtype, device, max(model_len, 8192)), None, args.preset
    from .model_files import default_cache_dir, default_model, load_hf

    model, gguf_file = default_model() if args.model == "embedded" else (args.model, args.gguf_file)
    hf, tokenizer = load_hf(model, gguf_file, dtype, device, default_cache_dir())
    name = "SmolLM2-135M-Instruct" if args.model == "embedded" else args.model
    return hf, tokenizer, name


def bench(args) -> dict:
    """Builds the engine over the chosen model and runs the asked workloads: the result's header
    (machine, model, start-up, memory) and one row per decode batch / sampling set, GRPO, prefill."""
    from . import LLM, SamplingParams

    device = args.device          # resolved by check_args
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    result = _machine(args, device)
    model_len = model_length(args)
    t0 = time.perf_counter()
    model, tokenizer, set_defaults = _prepared_model(args, dtype, device, model_len, result)
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
    llm = LLM(model, tokenizer=tokenizer, max_model_len=model_len, max_num_seqs=max_seqs,
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
    workloads = args.workload.split(",")
    option_sets = args.sampling_options.split(",")
    progress = _progress(len(batch_sizes) * len(option_sets) * ("decode" in workloads)
                         + ("grpo" in workloads) + ("prefill" in workloads))
    rows, engine_peak = [], 0
    if "decode" in workloads:
        rows, engine_peak = _decode_rows(args, llm, model, batch_sizes, option_sets, set_defaults,
                                         result, progress)
    if "grpo" in workloads:
        rows.append(_grpo_row(args, llm, vocab, progress))
    if "prefill" in workloads:
        rows.append(_prefill_row(llm, model, vocab, device, progress))
    progress.close()
    result["rows"] = rows
    graphs = llm.llm_engine.runner.graphs
    result["graph_capture_s"] = graphs.capture_seconds if graphs is not None else 0.0
    if device == "cuda":
        result.update(_memory_figures(llm, engine_peak, model_bytes, weights))
        if args.memory_snapshot:
            torch.cuda.memory._dump_snapshot(args.memory_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
    return result


def _machine(args, device: str) -> dict:
    """The result's header: what runs where, and the copy bandwidth the roofline divides."""
    result: dict = {"preset": args.preset, "model": args.model, "device": device, "dtype": args.dtype,
                    "torch": torch.__version__, "kernel_options": args.kernel_options,
                    "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        result["bandwidth_GBs"] = measure_bandwidth(device) / 1e9
    else:
        result["cpu_threads"] = torch.get_num_threads()
        # Far beyond any CPU cache, small enough for a laptop's memory.
        result["bandwidth_GBs"] = measure_bandwidth(device, gib=0.5) / 1e9
    return result


def _prepared_model(args, dtype: torch.dtype, device: str, model_len: int, result: dict):
    """(model, tokenizer, sampling defaults): the chosen model, quantised to 4 bits and wrapped
    in a PEFT adapter when asked (noted in `result`)."""
    model, tokenizer, result["name"] = _load_model(args, dtype, device, model_len)
    # Bad words are text: a random preset gets word_tokenizer to spell them. Its text is never
    # read, so no set detokenizes (the sets stay comparable, and as before without a tokenizer).
    set_defaults = {}
    if tokenizer is None and "bad_words" in args.sampling_options.split(","):
        tokenizer, set_defaults = word_tokenizer(model.config.vocab_size), {"detokenize": False}
    if args.quantization:
        model = quantize_4bit(model, QUANTIZATIONS[args.quantization])
        result["quantization"] = args.quantization
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                 target_modules=targets)).eval()
        result["lora"] = {"rank": args.lora_rank, "mode": args.lora_mode}
    return model, tokenizer, set_defaults


def _decode_rows(args, llm, model, batch_sizes: list[int], option_sets: list[str], set_defaults: dict,
                 result: dict, progress) -> tuple[list[dict], int]:
    """A row per (batch, sampling set): best tok/s of the repeats, against the roofline and
    (--compare hf) HF generate; and the engine's peak bytes, HF's own left out."""
    vocab = model.config.vocab_size
    rows, engine_peak = [], 0
    for batch, name in [(batch, name) for batch in batch_sizes for name in option_sets]:
        progress.set_description(f"decode, batch {batch}, sampling {name}")
        rates = run_decode(llm, batch, args.prompt_len, args.max_tokens, vocab, args.repeat,
                           {**set_defaults, **sampling_options(name, vocab)})
        tok_s = max(rates)
        ctx = args.prompt_len + args.max_tokens / 2
        row = {"workload": "decode", "batch": batch, "tok_s": tok_s, **_spread(rates)}
        if option_sets != ["none"]:
            row["sampling"] = name
        if "bandwidth_GBs" in result:
            roof = batch * result["bandwidth_GBs"] * 1e9 / bytes_per_step(llm, model, batch, ctx)
            row.update(roofline_tok_s=roof, roofline_pct=100 * tok_s / roof)
        if args.compare == "hf":
            engine_peak = max(engine_peak, _peak_bytes(args.device))
            row["hf_tok_s"] = run_hf(model, batch, args.prompt_len, args.hf_max_tokens, vocab, args.device)
            row["x_hf"] = tok_s / row["hf_tok_s"]
            _peak_bytes(args.device)  # drop HF's own peak
        rows.append(row)
        progress.update()
        logger.info("%s", format_row(row))
    return rows, engine_peak


def _grpo_row(args, llm, vocab: int, progress) -> dict:
    """The GRPO shape: 8 prompts x n=8 sampled at temperature 1 with logprobs, best of the repeats."""
    from . import SamplingParams

    progress.set_description("GRPO shape")
    params = SamplingParams(n=8, temperature=1.0, max_tokens=args.grpo_max_tokens, logprobs=0, seed=None)
    prompts = _prompts(8, GRPO_PROMPT_LEN, vocab, 3)
    llm.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=8, logprobs=0), use_tqdm=False)
    runs = []
    for _ in range(args.repeat):
        outs, elapsed = _timed_generate(llm, prompts, params)
        generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
        runs.append({"tok_s": generated / elapsed, "generated": generated, "seconds": elapsed})
    best = max(runs, key=lambda run: run["tok_s"])
    row = {"workload": "grpo", "batch": 64, "max_tokens": args.grpo_max_tokens, **best,
           **_spread([run["tok_s"] for run in runs])}
    progress.update()
    logger.info("%s", format_row(row))
    return row


def _prefill_row(llm, model, vocab: int, device: str, progress) -> dict:
    """Prefill of 64 prompts of 512 tokens; on CUDA its model FLOP utilisation."""
    from . import SamplingParams

    progress.set_description("prefill")
    flops = measure_matmul(device) if device == "cuda" else None
    prompts = _prompts(64, 512, vocab, 4)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    _, elapsed = _timed_generate(llm, prompts, SamplingParams(temperature=0, max_tokens=1))
    tokens_s = 64 * 512 / elapsed
    row = {"workload": "prefill", "prefill_tok_s": tokens_s}
    if flops:
        params_count = parameter_count(model)
        row.update(matmul_TFLOPs=flops / 1e12, mfu_pct=100 * tokens_s * 2 * params_count / flops)
    progress.update()
    logger.info("%s", format_row(row))
    return row


def _memory_figures(llm, engine_peak: int, model_bytes: int, weights: int) -> dict:
    """CUDA memory of the run: peak, KV cache, and what the engine adds beyond the model and
    its cache (#21's and #22's targets are on that overhead)."""
    peak = max(engine_peak, torch.cuda.max_memory_allocated())
    cache = llm.llm_engine.cache_bytes
    figures = {"peak_GB": peak / 1e9, "kv_cache_GB": cache / 1e9, "model_allocated_GB": model_bytes / 1e9}
    # Graph pools keep their blocks reserved while idle (a replay reuses them unseen by the
    # allocated counter), so the idle part adds to any peak outside a replay.
    pool_idle = _graph_pool_idle_bytes()
    figures["graph_pool_idle_GB"] = pool_idle / 1e9
    # What the engine adds beyond the model and its KV cache (graph pools, cuBLAS
    # workspaces, activations, logits; merged LoRA copies), as a fraction of the weights.
    overhead = peak + pool_idle - model_bytes - cache
    figures["overhead_GB"] = overhead / 1e9
    figures["overhead_pct_of_weights"] = 100 * overhead / weights
    # Of that overhead, what stays between steps (graph pools, workspaces, rope tables,
    # static buffers); the rest is one step's transient activations.
    resident = torch.cuda.memory_allocated() + pool_idle - model_bytes - cache
    figures["resident_overhead_GB"] = resident / 1e9
    # What the allocator held from the driver at most, cached free blocks included (those
    # serve the trainer's next allocations in the same process).
    figures["reserved_overhead_GB"] = (torch.cuda.max_memory_reserved() - model_bytes - cache) / 1e9
    return figures


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


def _progress(total: int):
    from tqdm.auto import tqdm

    # disable=None: drawn on a terminal only, so logs and pipes get the info lines alone.
    return tqdm(total=total, unit="run", dynamic_ncols=True, leave=False, disable=None)


# (column title, row key, format) of the results table.
COLUMNS = [("workload", "workload", "{}"), ("sampling", "sampling", "{}"), ("batch", "batch", "{}"),
           ("tok/s", "tok_s", "{:,.1f}"),
           ("roofline tok/s", "roofline_tok_s", "{:,.1f}"), ("% roofline", "roofline_pct", "{:.1f}"),
           ("HF tok/s", "hf_tok_s", "{:,.1f}"), ("x HF", "x_hf", "{:.2f}"),
           ("spread %", "spread_pct", "{:.1f}"), ("prefill tok/s", "prefill_tok_s", "{:,.0f}"),
           ("MFU %", "mfu_pct", "{:.1f}")]


def format_row(row: dict) -> str:
    """One row as `title value` pairs, for progress logs."""
    return ", ".join(f"{title} {fmt.format(row[key])}" for title, key, fmt in COLUMNS if key in row)


def table_lines(result: dict) -> list[str]:
    """The header (what ran, where) and a table with only the columns some row has."""
    threads = result.get("cpu_threads")
    where = result.get("gpu") or f"CPU, {threads} thread{'' if threads == 1 else 's'}"
    quant = f" ({result['quantization']})" if result.get("quantization") else ""
    head = [f"{result['name']} {result['dtype']}{quant} on {where}, torch {result['torch']}: "
            f"weights {result['weight_GB']:.2f} GB, copy bandwidth {result['bandwidth_GBs']:.1f} GB/s, "
            f"start-up {result['startup_s']:.1f} s",
            f"prompt {result['prompt_len']} tokens, {result['max_tokens']} new (greedy, EOS ignored)"
            + _memory_note(result)]
    columns = [c for c in COLUMNS if any(c[1] in row for row in result["rows"])]
    cells = [[title for title, _, _ in columns]]
    for row in result["rows"]:
        cells.append([fmt.format(row[key]) if key in row else "" for _, key, fmt in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    body = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]
    return head + [""] + body


def _memory_note(result: dict) -> str:
    """The engine's memory beyond the model and its KV cache (CUDA runs measure it; #21 and #22
    set targets on it), on the line every gpu_session.sh part keeps of the table."""
    if "overhead_GB" not in result:
        return ""
    return (f"; engine memory beyond weights + KV {result['overhead_GB']:.2f} GB "
            f"({result['overhead_pct_of_weights']:.1f}% of the weights)")


def print_table(result: dict) -> None:
    print("\n".join(table_lines(result)))


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
        ax.plot(batches, [r["roofline_tok_s"] for r in rows], "k--", label="bandwidth roofline")
    if rows and "hf_tok_s" in rows[0]:
        ax.plot(batches, [r["hf_tok_s"] for r in rows], "s-", label="HF generate")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens / s",
           title=f"{result['name']} {result['dtype']} decode, {result.get('gpu', result['device'])}")
    # The measured batch sizes as tick labels (a log axis would label 2x10^0 and so on).
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xticks(batches, labels=[str(b) for b in batches])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def check_args(args) -> None:
    """Everything that can be refused before a model is built."""
    from .model_files import DEMO_EXTRA_HINT, UserError, check_device, check_model_path, check_modules

    if args.preset and args.model:
        raise UserError("pass --preset or --model, not both")
    if args.device:
        check_device(args.device)
    args.device = resolve_defaults(args)
    if args.model == "embedded":
        from .model_files import default_model

        default_model()         # raises with the install line when the wheel is missing
    if args.plot:
        check_modules(["matplotlib"], "--plot needs matplotlib: install flexrollout with its [bench] "
                      "extra (pip install '.[bench]' in the repository)")
    if args.compare == "hf" or args.model is not None:
        check_modules(["accelerate"], DEMO_EXTRA_HINT)
    if args.model == "embedded" or args.gguf_file:
        check_modules(["gguf"], DEMO_EXTRA_HINT)
    if args.quantization:
        check_modules(["bitsandbytes"], QUANT_EXTRA_HINT)
    if args.model not in (None, "embedded"):
        check_model_path(args.model, args.gguf_file)
    for name in ("prompt_len", "max_tokens", "repeat", "hf_max_tokens", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.batch_sizes is not None:
        try:
            sizes = [int(b) for b in args.batch_sizes.split(",")]
        except ValueError:
            raise UserError(f"--batch-sizes {args.batch_sizes}: expected a comma list of integers") from None
        if min(sizes) < 1:
            raise UserError(f"--batch-sizes {args.batch_sizes}: sizes must be at least 1")
    unknown_sets = set(args.sampling_options.split(",")) - set(SAMPLING_OPTION_SETS)
    if unknown_sets:
        raise UserError(f"--sampling-options: unknown {', '.join(sorted(unknown_sets))} "
                        f"({', '.join(SAMPLING_OPTION_SETS)})")
    held = sampling_options("penalties", vocab=1)["min_tokens"]
    if "penalties" in args.sampling_options.split(",") and args.max_tokens is not None and args.max_tokens < held:
        raise UserError(f"--sampling-options penalties sets min_tokens={held}: --max-tokens must be at least {held}")
    unknown = set(args.workload.split(",")) - {"decode", "grpo", "prefill"}
    if unknown:
        raise UserError(f"--workload: unknown {', '.join(sorted(unknown))} (decode, grpo, prefill)")
    for name in ("kernel_options", "engine_args"):
        _check_json(name, getattr(args, name))


def _check_json(name: str, text: str | None) -> None:
    from .model_files import UserError

    if text is None:
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"--{name.replace('_', '-')}: not JSON ({error})") from None
    if not isinstance(value, dict):
        raise UserError(f"--{name.replace('_', '-')}: expected a JSON object")


def _main(args) -> int:
    check_args(args)
    result = bench(args)
    print_table(result)
    if args.json == "-":
        print(json.dumps(result, indent=2, default=str))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    if args.plot:
        plot(result, args.plot)
    return 0


def add_bench_parser(p) -> None:
    """The `bench` subcommand's flags, on the parser the command line made for it."""
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="random weights at a model's real sizes (default: qwen3-4b on CUDA)")
    p.add_argument("--model", default=None,
                   help="a real model: HF hub id, local directory, or 'embedded' for SmolLM2-135M "
                        "(the default on CPU)")
    p.add_argument("--gguf-file", default=None, help="a GGUF file inside --model")
    p.add_argument("--batch-sizes", default=None, help="comma list (default: 1,8,64 on CUDA, 1,8 on CPU)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: 128 on CUDA, 32 on CPU)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per sequence (default: 256 on CUDA, 64 on CPU; the GRPO shape "
                        f"uses {GRPO_MAX_TOKENS} unless this is given)")
    p.add_argument("--workload", default="decode",
                   help="decode, grpo (8 prompts x n=8), prefill (64 x 512 tokens), or a comma list "
                        "of them (one model, one engine)")
    p.add_argument("--sampling-options", default="none",
                   help="decode sampling sets, a comma list: none (plain greedy), penalties (repetition "
                        "1.1, frequency 0.1, presence 0.1, a logit_bias of 3 tokens, min_tokens=8), "
                        "bad_words (4 words of 2-4 tokens; a random preset gets a word-level tokenizer "
                        "to spell them); 'none,penalties' times both on one engine")
    p.add_argument("--compare", choices=["hf"], default=None, help="also time HF generate on the same model")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed runs per decode batch and GRPO shape: the best is reported, the spread kept")
    p.add_argument("--hf-max-tokens", type=int, default=None,
                   help="new tokens for the HF baseline (default: 64 on CUDA, --max-tokens on CPU)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's own choice); 1 gives steadier "
                        "figures on a shared machine")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", default=None, choices=sorted(QUANTIZATIONS),
                   help="quantise the decoder's projections with bitsandbytes 4-bit (NF4 or FP4, "
                        "double quantisation): the roofline counts the packed bytes and their "
                        "quant states, and --compare hf times HF generate on the same 4-bit model")
    p.add_argument("--lora-rank", type=int, default=0, help="wrap the model in PEFT LoRA of this rank")
    p.add_argument("--lora-mode", default="live", choices=["live", "merged"])
    p.add_argument("--kernel-options", default=None,
                   help='flex decode kernel options as JSON, e.g. \'{"num_warps": 8}\'')
    p.add_argument("--engine-args", default=None,
                   help='EngineConfig fields as JSON, e.g. \'{"small_batch_kernels": false}\'')
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write every measurement as JSON to PATH ('-': to stdout, after the table)")
    p.add_argument("--memory-snapshot", default=None, metavar="PATH",
                   help="CUDA: write torch's allocation history (a pickle) for benchmarks/memory_peak.py")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="tok/s against batch size (needs the [bench] extra: matplotlib)")
    p.set_defaults(func=_main)
