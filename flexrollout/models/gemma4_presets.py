"""Gemma-4 benchmark presets at real sizes (for random-weight runs of `flexrollout bench`), the
transformers config of each, and what the decode roofline must know about them.

Sizes are those of the released text models: E2B (35 layers, (4 sliding + 1 full) x 7, the last
20 layers reading the KV of earlier ones, per-layer inputs of 256, double-wide MLPs on the
shared layers), 31B dense and 26B-A4B (dense MLP 2112 plus 128 experts of 704, top-8), both with
(5 sliding + 1 full) layers and `attention_k_eq_v` on the full ones.
"""
from __future__ import annotations

import torch

# The same keys as bench.PRESETS' entries, plus Gemma-4's own.
GEMMA4_PRESETS = {
    "gemma-4-e2b": dict(arch="gemma4", hidden=1536, inter=6144, layers=35, heads=8, kv=1, hd=256,
                        global_hd=512, global_kv=None, vocab=262144, theta=1e4, tie=True, window=512,
                        sliding_per_full=4, shared=20, ple=256, double_wide=True, softcap=30.0),
    "gemma-4-31b": dict(arch="gemma4", hidden=5376, inter=21504, layers=60, heads=32, kv=16, hd=256,
                        global_hd=512, global_kv=4, vocab=262144, theta=1e4, tie=True, window=1024,
                        sliding_per_full=5, softcap=30.0),
    "gemma-4-26b-a4b": dict(arch="gemma4", hidden=2816, inter=2112, moe_inter=704, experts=128, top_k=8,
                            layers=30, heads=16, kv=8, hd=256, global_hd=512, global_kv=2, vocab=262144,
                            theta=1e4, tie=True, window=1024, sliding_per_full=5, softcap=30.0),
    # E2B's layout (every layer kind: sliding / full, shared KV, double-wide MLPs, per-layer
    # inputs) at tiny widths, for CPU runs such as benchmarks/compile_count.py.
    "tiny-gemma4": dict(arch="gemma4", hidden=64, inter=128, layers=10, heads=4, kv=1, hd=16,
                        global_hd=32, global_kv=None, vocab=512, theta=1e4, tie=True, window=16,
                        sliding_per_full=4, shared=4, ple=8, double_wide=True, softcap=30.0),
}


def layer_types(num_layers: int, sliding_per_full: int) -> list[str]:
    """`sliding_per_full` sliding layers then one full, repeated; the last layer is full."""
    period = sliding_per_full + 1
    types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers)]
    types[-1] = "full_attention"
    return types


def gemma4_config(p: dict, max_position_embeddings: int = 8192, num_layers: int | None = None):
    """A Gemma4TextConfig with preset `p`'s sizes. `num_layers`: fewer layers, same widths; the
    KV-sharing layers shrink in proportion, keeping one full period of computing layers ahead."""
    from transformers import Gemma4TextConfig

    layers = num_layers or p["layers"]
    shared = round(p.get("shared", 0) * layers / p["layers"])
    shared = max(0, min(shared, layers - p["sliding_per_full"] - 1))
    extra = {}
    if p.get("global_kv"):           # transformers reads the full layers' KV heads only with k_eq_v
        extra.update(attention_k_eq_v=True, num_global_key_value_heads=p["global_kv"])
    if p.get("experts"):
        extra.update(enable_moe_block=True, num_experts=p["experts"], top_k_experts=p["top_k"],
                     moe_intermediate_size=p["moe_inter"])
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": p["theta"]},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6}}
    return Gemma4TextConfig(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["inter"],
        num_hidden_layers=layers, num_attention_heads=p["heads"], num_key_value_heads=p["kv"],
        head_dim=p["hd"], global_head_dim=p["global_hd"], sliding_window=p["window"],
        layer_types=layer_types(layers, p["sliding_per_full"]), rope_parameters=rope,
        hidden_size_per_layer_input=p.get("ple", 0), vocab_size_per_layer_input=p["vocab"],
        num_kv_shared_layers=shared, use_double_wide_mlp=p.get("double_wide", False),
        final_logit_softcapping=p.get("softcap"), tie_word_embeddings=p["tie"],
        max_position_embeddings=max_position_embeddings, bos_token_id=0, eos_token_id=1, pad_token_id=0,
        **extra)


def rows_only_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """Tables a decode step reads only at the batch's token rows: Gemma-4's per-layer input
    embedding (E2B: 262144 x 35·256, 4.7 GB in bf16, more than the rest of the model)."""
    from .base import text_model

    table = getattr(text_model(model), "embed_tokens_per_layer", None)
    return [table.weight] if table is not None else []


def experts_per_token(config) -> int:
    """Experts each token runs (Gemma-4 names it `top_k_experts`)."""
    return int(getattr(config, "num_experts_per_tok", 0) or getattr(config, "top_k_experts", 0) or 0)
