"""One dataclass holds every engine setting; `LLM(**kwargs)` fills it."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .kernels.small_linear import LAUNCH_MAX_ROWS as GEMV_LAUNCH_ROWS
from .kernels.small_linear import MAX_ROWS as GEMV_MAX_ROWS

# `static_weight_shapes` values -> which steps trace weight shapes as constants (EngineConfig
# keeps the name on the right).
WEIGHT_SHAPE_MODES = {"always": "always", "decode": "decode", "never": "never", True: "always",
                      False: "never"}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class EngineConfig:
    """Sizes and options of one engine. `None` means "derive a sensible value at start-up"."""

    dtype: str | torch.dtype = "auto"
    seed: int = 0
    # Longest sequence (prompt + generation). Default: the model's max_position_embeddings.
    max_model_len: int | None = None
    # Sequences decoded together; graph buckets are built up to this size.
    max_num_seqs: int = 256
    # Prompt tokens computed in one prefill step; longer prompts are prefilled in chunks.
    max_num_batched_tokens: int | None = None
    # Rows of a prefill that go through o_proj and the MLP together. The MLP's gate/up activations
    # are rows x intermediate_size, the largest tensors of a step (0.48 GB for an 8192-token Qwen3-4B
    # prefill); running the row-wise half of each layer in chunks of this many rows bounds them
    # without shrinking the attention's (or the scheduler's) prefill batch.
    mlp_chunk_tokens: int = 2048
    # Tokens per KV page. 128 on CUDA matches flex_attention's KV block; 16 elsewhere.
    page_size: int | None = None
    # KV pages in the cache (page 0 is reserved for padding). Default: from gpu_memory_utilization
    # on CUDA, from max_model_len x min(max_num_seqs, 8) capped at cpu_kv_cache_tokens on CPU.
    num_kv_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_tokens: int = 8192
    # No CUDA graphs (vLLM's meaning). Compilation of the layer math is separate: compile_layers.
    enforce_eager: bool = False
    # flex_attention kernel options for decode (e.g. {"num_warps": 8, "BLOCK_N": 64}); prefill adds
    # FORCE_USE_FLEX_ATTENTION. None: flex's defaults. Never ROWS_GUARANTEED_SAFE (padding rows).
    flex_kernel_options: dict | None = None
    # PEFT LoRA layers: "live" reads A/B every step (no copy; an optimizer step is seen at once);
    # "merged" keeps merged copies of the adapted matrices, refreshed before a generate that
    # follows a change (faster decode, one extra matrix per adapted projection).
    lora_mode: str = "live"
    # torch.compile the per-layer norm/RoPE/MLP math on CUDA (fuses ~30 small kernels per layer).
    compile_layers: bool = True
    # Triton split-K GEMV kernels for the projections of small batches (CUDA, bf16/fp16/fp32):
    # q/k/v in one launch, gate/up with SiLU-mul in one launch, for batches of at most
    # small_batch_max_rows (<= 32) rows. Larger batches use cuBLAS.
    small_batch_kernels: bool = True
    small_batch_max_rows: int = 32
    # MoE steps of at most this many (token, expert) rows (batch x top-k) run a Triton grouped
    # GEMV that reads only the chosen experts; larger ones run grouped_mm. 0, or
    # small_batch_kernels=False: always grouped_mm.
    moe_small_batch_max_rows: int = 64
    # Launch the GEMV kernel with programmatic dependent launch (Hopper on); off only to measure it.
    gemv_pdl: bool = True
    # Decode's q/k/v epilogue kernel (partial sums, bias, q/k norm, RoPE, K/V store in one launch);
    # off only to measure the compiled path it replaces.
    qkv_epilogue: bool = True
    # Gemma-4's decode runs the same epilogue kernel (fp32-style q/k norms, weightless v norm, V
    # from k_proj on its full layers) instead of several compiled kernels. Its GPU tests pass
    # (H100: the kernel's Gemma cases, k_proj-as-V at head_dim 512 included, and E2B's fp32
    # greedy parity with HF); E2B decode measured +2.6% at batch 1 (H100, 2026-12-07).
    gemma_qkv_epilogue: bool = True
    # Qwen3.5's GatedDeltaNet decode step through flash-linear-attention's recurrent kernel,
    # updating each state in its pool slot in one pass (fla >= 0.6, CUDA, 16-bit), where the torch
    # step gathers, updates and scatters a copy: Qwen3.5-4B decode 1.03x / 1.27x at batch 8 / 64
    # (H100, 2026-12-07). Without fla (or on CPU) the torch step runs.
    fla_decode: bool = True
    # Small decode batches stream input widths off the GEMV's 128-wide K step (multiples of 64:
    # 26B-A4B's 2,112-wide dense down_proj, gpt-oss's 2,880-wide q/k/v, router and LM head)
    # through the GEMV with masked K tails, live adapters folded in, where they ran cuBLAS.
    # On since 2026-12-07 (its GPU tests pass on an H100): gpt-oss-20b decodes 1.08x / 1.03x at
    # batch 1 / 8 (its q/k/v read 2.35 TB/s against cuBLAS's 1.25); 26B-A4B 1.00x / 1.00x.
    ragged_gemv: bool = True
    # LoRARequest adapters one decode step can mix while replaying from the CUDA graph (slots of
    # the adapter table, `lora/table.py`; vLLM's name). A step mixing more runs eagerly. The
    # table is allocated as adapters are used: r x (in + out) per adapted projection and slot.
    max_loras: int = 4
    # Decode steps of at most 32 rows with LoRARequest rows fold a projection's one row-masked
    # adapter term (the adapter table's, or a live adapter off the request rows) into the shrink
    # and the GEMV, instead of four unfused launches per projection. Past 32 rows the unfused
    # table stays: there the fold would take cuBLAS + expand, which measured slower (H100,
    # benchmarks/lora_modes.py, 4 adapters r=32: bs 8 1,222 vs 947 tok/s, bs 64 4,105 vs 5,694).
    lora_request_kernels: bool = True
    # Live LoRA in decode steps of up to 32 rows: the GEMV launch of each projection group
    # computes its adapters' s A x in its own first programs, instead of after a separate
    # shrink launch (four launches fewer per layer); off only to measure it.
    lora_fused_shrink: bool = True
    # Decode steps of up to this many rows run live-LoRA projections through the GEMV with the
    # adapter folded in (at most 64, one row tile); larger steps run cuBLAS, a shrink and an
    # expand launch per projection. At 64 rows (Qwen3-4B, r=32, H100, one run) the GEMV decodes
    # 8,522 tok/s against 7,680 for cuBLAS + expand, 0.84 against 0.75 of the base model.
    lora_gemv_max_rows: int = 64
    # Projections over bitsandbytes 4-bit weights, in batches of at most 64 rows (decode), run
    # flexrollout's Triton 4-bit GEMV (kernels/gemv_4bit.py: packed nibbles and absmax read in
    # place, dequantised in registers) instead of bitsandbytes' own ops. Off: it measured 8-25x
    # slower than them per projection (H100, benchmarks/gemv_4bit_sweep.py, 2026-12-06).
    quant_kernels: bool = False
    # A 4-bit model's layer functions compile around bitsandbytes' own forward op (`gemm_4bit`,
    # which has a fake implementation), as a 16-bit model's do; off: they run uncompiled around
    # it (decode still replays CUDA graphs). On: Qwen3-4B NF4 decode measured 1.31 / 1.13 / 1.13x
    # the uncompiled layers' tok/s at batch 1 / 8 / 64 (H100, same run, 2026-12-06).
    compile_4bit: bool = True
    # Which layer functions trace the weights' shapes as constants (dynamo's default), so each
    # layer kind of another width compiles apart: "always", "decode" (prefill traces them as
    # symbols), "never" (True / False mean "always" / "never"). Symbols let one compile serve
    # layers of different widths (Gemma-4's head dims of 256 and 512, its double-wide MLPs):
    # E2B at 10 layers compiles 11 times instead of 20 (CPU count, benchmarks/compile_count.py).
    # H100, E2B from empty caches, "never" against "always": start-up 45.1 s -> 28.5 s, decode
    # 6% slower at batch 8 and 64 (BENCHMARKS.md, eighth session). Decode steps replay for hours,
    # so they keep constant shapes; a prefill's projections are cuBLAS calls either way, and
    # start-up (its first prefill) is where compile time shows.
    static_weight_shapes: bool | str = "decode"
    # vLLM's names: with enable_lora, the KV cache leaves room for a full adapter table
    # (max_loras slots of rank max_lora_rank); an adapter of a larger rank still runs.
    enable_lora: bool = False
    max_lora_rank: int = 16
    # LoRARequest adapters kept loaded (least recently used dropped, reloaded when asked again);
    # None: max_loras. vLLM's name, though ours are kept on the engine's device.
    max_cpu_loras: int | None = None
    # Launch decode step t+1 before reading step t's tokens back (they are fed device to device),
    # so host work (scheduling, stop checks, detokenizing) overlaps the GPU. Stops are found a step
    # late (that extra token is discarded). Prefills and preemptions still run synchronously.
    # False: read every step back first.
    async_decode: bool = True
    # Share the KV pages of identical prompts inside one generate call (GRPO groups).
    enable_prefix_caching: bool = True
    device: str | torch.device | None = None
    # "flex": flex_attention kernels (compiled on CUDA, unfused elsewhere); "reference": the same
    # masks evaluated densely (fast on CPU); "auto": flex on CUDA, reference elsewhere.
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "small_batch_max_rows", "mlp_chunk_tokens", "max_loras", "max_lora_rank",
                     "lora_gemv_max_rows"):
            _check_positive_int(name, getattr(self, name))
        rows = self.moe_small_batch_max_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"moe_small_batch_max_rows must be an int >= 0 (0: off), got {rows!r}")
        if self.small_batch_max_rows > GEMV_MAX_ROWS:
            raise ValueError(f"small_batch_max_rows must be <= {GEMV_MAX_ROWS} (the GEMV kernel's "
                             f"largest row tile), got {self.small_batch_max_rows}")
        if self.lora_gemv_max_rows > GEMV_LAUNCH_ROWS:
            raise ValueError(f"lora_gemv_max_rows must be <= {GEMV_LAUNCH_ROWS} (the GEMV kernel's "
                             f"largest row tile), got {self.lora_gemv_max_rows}")
        for name in ("max_model_len", "max_num_batched_tokens", "page_size", "num_kv_pages", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None:
                _check_positive_int(name, value)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.flex_kernel_options is not None:
            if not isinstance(self.flex_kernel_options, dict):
                raise TypeError("flex_kernel_options must be a dict, got "
                                f"{type(self.flex_kernel_options).__name__}")
            if self.flex_kernel_options.get("ROWS_GUARANTEED_SAFE"):
                raise ValueError("flex_kernel_options: ROWS_GUARANTEED_SAFE gives NaNs on the padding "
                                 "rows of graph buckets; it cannot be used")
        if self.lora_mode not in ("live", "merged"):
            raise ValueError(f"lora_mode must be 'live' or 'merged', got {self.lora_mode!r}")
        if self.attention_backend not in ("auto", "flex", "reference"):
            raise ValueError("attention_backend must be 'auto', 'flex' or 'reference', "
                             f"got {self.attention_backend!r}")
        if not isinstance(self.static_weight_shapes, (bool, str)) or \
                self.static_weight_shapes not in WEIGHT_SHAPE_MODES:
            raise ValueError("static_weight_shapes must be 'always', 'decode', 'never', True or "
                             f"False, got {self.static_weight_shapes!r}")
        self.static_weight_shapes = WEIGHT_SHAPE_MODES[self.static_weight_shapes]
        if self.num_kv_pages is not None and self.num_kv_pages < 2:
            raise ValueError("num_kv_pages must be >= 2 (page 0 is reserved for padding)")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def resolve_dtype(dtype: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """vLLM's `dtype` argument: "auto" keeps the weights' dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str or torch.dtype, got {type(dtype).__name__}")
    if dtype == "auto":
        return model_dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
