"""Llama-3, Qwen2 and Qwen3 (q/k RMSNorm) over the user's HF parameters.

A layer is `attention_inputs` (input norm, q/k/v, Qwen3's q/k norm, RoPE, K/V store), paged
attention, then `attention_out_mlp` (o_proj + residual, post-attention norm, SwiGLU MLP +
residual). Other families reuse this file's attention half and swap the feed-forward block.
"""
from __future__ import annotations

import torch

from ..layers.attention import attention_inputs
from ..layers.linear import Kernels, Linear, linear
from ..layers.mlp import activation, gated_mlp
from ..layers.norm import LLAMA, rms_norm
from ..spec import LayerSpec, ModelSpec
from .base import DecoderForward, LayerFns, Step


def attention_out_mlp(attn: torch.Tensor, residual: torch.Tensor, o: Linear, ln_w: torch.Tensor,
                      gate: Linear, up: Linear, down: Linear, act, eps: float, norm_style: str,
                      kernels: Kernels) -> torch.Tensor:
    """o_proj + residual -> post-attention norm -> gated MLP + residual.

    (A one-kernel o_proj sum + residual + norm, one program per row, measured slower at batch 1
    than inductor's two kernels, whose split sum runs over many programs: BENCHMARKS.md.)"""
    hidden = residual + linear(attn, o, kernels)
    h = rms_norm(hidden, ln_w, eps, norm_style)
    return hidden + gated_mlp(h, gate, up, down, act, kernels)


class LlamaForward(DecoderForward):
    """Reads `model.model.layers[i].self_attn.q_proj` etc. directly; holds no weight copies."""

    LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    NORM = LLAMA

    def __init__(self, hf_model: torch.nn.Module, dtype: torch.dtype, merged=None) -> None:
        self.body = hf_model.model
        self.config = hf_model.config
        self.eps = self.config.rms_norm_eps
        self.qk_norm = hasattr(self.body.layers[0].self_attn, "q_norm")
        self.act = activation(getattr(self.config, "hidden_act", "silu"))
        super().__init__(hf_model, dtype, merged)

    # -- the engine's view -------------------------------------------------------------------
    def build_spec(self) -> ModelSpec:
        cfg = self.config
        return ModelSpec(
            layers=[self.layer_spec(i) for i in range(len(self.body.layers))],
            vocab_size=self.hf.lm_head.weight.shape[0],
            hidden_size=cfg.hidden_size,
            max_position_embeddings=cfg.max_position_embeddings)

    def layer_spec(self, index: int) -> LayerSpec:
        cfg = self.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return LayerSpec(num_heads=heads, num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                         window=self.window(index), ffn=self.ffn_kind(index))

    def window(self, index: int) -> int | None:
        return None

    def ffn_kind(self, index: int) -> str:
        return "mlp"

    def layer_fns(self, index: int) -> LayerFns:
        return LayerFns(pre=attention_inputs, post=attention_out_mlp)

    def projections(self, index: int) -> dict[str, torch.nn.Module]:
        layer = self.body.layers[index]
        attn, mlp = layer.self_attn, layer.mlp
        modules = {"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj,
                   "o_proj": attn.o_proj}
        if self.spec.layers[index].ffn == "mlp":
            modules.update(gate_proj=mlp.gate_proj, up_proj=mlp.up_proj, down_proj=mlp.down_proj)
        return modules

    # -- arguments of the layer functions ----------------------------------------------------
    def pre_args(self, index: int, step: Step) -> tuple:
        layer, spec = self.body.layers[index], self.spec.layers[index]
        attn, lin = layer.self_attn, self.linear
        cos, sin = step.rope[self.rope_key(index)]
        return (layer.input_layernorm.weight, lin(index, "q_proj", step), lin(index, "k_proj", step),
                lin(index, "v_proj", step), attn.q_norm.weight if self.qk_norm else None,
                attn.k_norm.weight if self.qk_norm else None, cos, sin,
                step.cache.k[index], step.cache.v[index], step.meta.slot_mapping, self.eps,
                spec.num_heads, spec.num_kv_heads, spec.head_dim, self.NORM, step.kernels,
                step.meta.decode)

    def post_args(self, index: int, step: Step) -> tuple:
        layer, lin = self.body.layers[index], self.linear
        return (lin(index, "o_proj", step), layer.post_attention_layernorm.weight,
                lin(index, "gate_proj", step), lin(index, "up_proj", step),
                lin(index, "down_proj", step), self.act, self.eps, self.NORM, step.kernels)

    def rope_key(self, index: int) -> str:
        return "default"

