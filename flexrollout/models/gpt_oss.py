"""gpt-oss: biased q/k/v/o attention with learned per-head sinks, sliding windows on alternate
layers (`layer_types`), YaRN RoPE, RMSNorms applied in fp32, and a MoE block in every layer.

Router: top-k of the biased logits, softmax over those k. Experts are stored transposed,
`gate_up_proj` (E, H, 2I) with gate/up interleaved (gate = [..., ::2], up = [..., 1::2]) and
biases, `down_proj` (E, I, H) + bias; activation (up + 1) * gate * sigmoid(1.702 gate) after
clamping gate <= 7 and |up| <= 7.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..layers.linear import Kernels, Linear, linear
from ..layers.moe import (
    GPT_OSS,
    Experts,
    experts_forward,
    read_experts,
    route_topk_softmax,
    unwrap_param_wrappers,
)
from ..layers.norm import FP32, rms_norm
from ..spec import LayerSpec
from .base import LayerFns, Step
from .llama import LlamaForward


def attention_out_routed(attn: torch.Tensor, residual: torch.Tensor, o: Linear, ln_w: torch.Tensor,
                         router: Linear, experts: Experts, top_k: int, eps: float, norm_style: str,
                         kernels: Kernels) -> torch.Tensor:
    """o_proj + residual -> post-attention norm -> top-k-then-softmax routed experts + residual."""
    hidden = residual + linear(attn, o, kernels)
    h = rms_norm(hidden, ln_w, eps, norm_style)
    weights, ids = route_topk_softmax(h, router, top_k, kernels)
    return hidden + experts_forward(h, weights, ids, experts, kernels.expert_rows)


class GptOssForward(LlamaForward):
    NORM = FP32

    def window(self, index: int) -> int | None:
        sliding = self.config.layer_types[index] == "sliding_attention"
        return self.config.sliding_window if sliding else None

    def ffn_kind(self, index: int) -> str:
        return "moe"

    def layer_spec(self, index: int) -> LayerSpec:
        return replace(super().layer_spec(index), sinks=True)

    def sinks(self, index: int) -> torch.Tensor:
        return self.body.layers[index].self_attn.sinks

    def layer_fns(self, index: int) -> LayerFns:
        return LayerFns(pre=super().layer_fns(index).pre, post=attention_out_routed)

    def read_experts(self, index: int) -> Experts:
        module = self.body.layers[index].mlp.experts
        inner, _ = unwrap_param_wrappers(module)     # HF keeps the clamp and slope on it
        return read_experts(module, self.merged, transposed=True, interleaved=True, act=GPT_OSS,
                            limit=float(inner.limit), alpha=float(inner.alpha))

    def post_args(self, index: int, step: Step) -> tuple:
        layer = self.body.layers[index]
        router = layer.mlp.router
        return (self.linear(index, "o_proj", step), layer.post_attention_layernorm.weight,
                Linear(router.weight, router.bias), self.layer_experts(index, step), self.config.num_experts_per_tok,
                self.eps, self.NORM, step.kernels)
