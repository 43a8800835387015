"""Gemma-4 (`gemma4_text`, and the text model of the multimodal `gemma4` wrapper): E2B / E4B
with per-layer inputs and shared KV, the dense 31B, and 26B-A4B with a dense MLP plus experts.

Per layer: sliding (window, head_dim 256, rope θ 1e4) or full attention (`global_head_dim` 512,
"proportional" rope rotating a quarter of it), q_norm / k_norm with weights and a weightless
v_norm before RoPE, softmax scale 1.0; with `attention_k_eq_v` the full layers have no v_proj
(V is k_proj's raw output). Sandwich norms: the attention and feed-forward outputs are normed
before their residual adds; RMSNorms are `x̂·w` in fp32. Every layer ends with the per-layer
input block (when the model has one) and a multiply of the whole residual by `layer_scalar`.
The last `num_kv_shared_layers` layers compute only queries and read the KV of the last
earlier layer of their type (`LayerSpec.kv_source`: they own no cache). With
`enable_moe_block`, the feed-forward is the dense MLP plus experts routed from the residual,
each output normed, then summed. Embeddings × √H; logits soft-capped when configured.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention.kv_cache import store_kv
from ..layers.attention import epilogue_fits, run_epilogue
from ..layers.linear import (
    Kernels,
    Linear,
    finish_group,
    linear,
    project_group,
    read_linear,
)
from ..layers.mlp import activation, gated_mlp
from ..layers.moe import GELU_TANH, Experts, experts_forward, read_experts, softmax_topk
from ..layers.norm import FP32, rms_norm
from ..layers.per_layer_input import (
    PerLayerInputBlock,
    per_layer_input_residual,
    per_layer_inputs,
)
from ..layers.rope import apply_rope, tables_from_rotary
from ..layers.softcap import softcap
from ..spec import LayerSpec, ModelSpec
from .base import DecoderForward, LayerFns, PerToken, Step, text_model

logger = logging.getLogger(__name__)

SLIDING = "sliding_attention"
ACT_GELU_TANH = activation("gelu_pytorch_tanh")     # what the stacked experts compute


# -- layer functions --------------------------------------------------------------------------
def attention_inputs(x: torch.Tensor, ln_w: torch.Tensor, q: Linear, k: Linear, v: Linear | None,
                     qn_w: torch.Tensor, kn_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
                     kernels: Kernels, epilogue: bool = False) -> torch.Tensor:
    """input norm -> q/k/v (`v=None`: V is k_proj's raw output) -> q/k norms, weightless v norm
    -> RoPE on q and k -> K/V stored. Returns the queries (T, heads, head_dim). `epilogue` (decode
    steps, `EngineConfig.gemma_qkv_epilogue`): on CUDA all after the projections is the q/k/v
    epilogue kernel (`kernels.qkv_epilogue`)."""
    h = rms_norm(x, ln_w, eps, FP32)
    projections = [q, k] if v is None else [q, k, v]
    outputs = project_group(h, projections, kernels)
    if epilogue:
        # Without v_proj, V is k_proj's output: the epilogue takes it as a third source.
        sources, source_projections = ((outputs, projections) if v is not None
                                       else ([*outputs, outputs[1]], [q, k, k]))
        if epilogue_fits(h, sources, source_projections, qn_w, FP32, head_dim, k_cache, kernels):
            return run_epilogue(sources, source_projections, qn_w, kn_w, cos, sin, k_cache, v_cache,
                                slot_mapping, eps, num_heads, num_kv_heads, gemma=True)
    outputs = finish_group(outputs, projections, h.dtype)
    tokens = h.shape[0]
    ks = outputs[1].reshape(tokens, num_kv_heads, head_dim)
    vs = outputs[-1].reshape(tokens, num_kv_heads, head_dim)      # v_proj's, else k_proj's
    ks = apply_rope(rms_norm(ks, kn_w, eps, FP32), cos, sin)
    store_kv(k_cache, v_cache, ks, rms_norm(vs, None, eps), slot_mapping)
    return apply_rope(rms_norm(outputs[0].reshape(tokens, num_heads, head_dim), qn_w, eps, FP32), cos, sin)


def shared_kv_queries(x: torch.Tensor, ln_w: torch.Tensor, q: Linear, qn_w: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, eps: float, num_heads: int,
                      head_dim: int, kernels: Kernels) -> torch.Tensor:
    """A KV-sharing layer's `pre`: input norm -> q -> q norm -> RoPE; nothing is stored."""
    h = rms_norm(x, ln_w, eps, FP32)
    qs = linear(h, q, kernels).reshape(h.shape[0], num_heads, head_dim)
    return apply_rope(rms_norm(qs, qn_w, eps, FP32), cos, sin)


@dataclass(frozen=True)
class Router:
    """Gemma-4's router over the residual: weightless RMSNorm × scale × hidden^-1/2 -> proj ->
    fp32 softmax -> top-k -> renormalised -> × per_expert_scale of the chosen experts."""

    proj: Linear                        # hidden -> E (a 4-bit model may quantise it too)
    scale: torch.Tensor                 # (hidden,)
    per_expert_scale: torch.Tensor      # (E,)
    top_k: int


def route(hidden: torch.Tensor, router: Router, eps: float, kernels: Kernels):
    h = rms_norm(hidden, None, eps) * router.scale * hidden.shape[-1] ** -0.5
    weights, ids = softmax_topk(linear(h, router.proj, kernels), router.top_k, renormalize=True)
    return weights * router.per_expert_scale[ids], ids


def _ffn_out(hidden, ffn, post_ff_w, ple: PerLayerInputBlock | None, ple_rows, layer_scalar,
             act, eps: float, kernels: Kernels) -> torch.Tensor:
    """Feed-forward output normed + residual -> per-layer input block -> × layer_scalar."""
    hidden = hidden + rms_norm(ffn, post_ff_w, eps, FP32)
    if ple is not None:
        hidden = per_layer_input_residual(hidden, ple_rows, ple, act, eps, FP32, kernels)
    return hidden * layer_scalar


def attention_out_mlp(attn, residual, o: Linear, post_attn_w, pre_ff_w, gate: Linear, up: Linear,
                      down: Linear, post_ff_w, ple, ple_rows, layer_scalar, act, eps: float,
                      kernels: Kernels) -> torch.Tensor:
    """o_proj -> norm + residual -> norm -> gated MLP -> the layer's end (`_ffn_out`)."""
    hidden = residual + rms_norm(linear(attn, o, kernels), post_attn_w, eps, FP32)
    ffn = gated_mlp(rms_norm(hidden, pre_ff_w, eps, FP32), gate, up, down, act, kernels)
    return _ffn_out(hidden, ffn, post_ff_w, ple, ple_rows, layer_scalar, act, eps, kernels)


def attention_out_mlp_moe(attn, residual, o: Linear, post_attn_w, pre_ff_w, gate: Linear,
                          up: Linear, down: Linear, post_ff_w, ple, ple_rows, layer_scalar, act,
                          eps: float, kernels: Kernels, router: Router, experts: Experts,
                          pre_moe_w, post_mlp_w, post_moe_w) -> torch.Tensor:
    """As `attention_out_mlp`, the feed-forward being norm(MLP) + norm(experts), the experts
    routed from the residual and reading their own pre-norm of it."""
    hidden = residual + rms_norm(linear(attn, o, kernels), post_attn_w, eps, FP32)
    mlp = gated_mlp(rms_norm(hidden, pre_ff_w, eps, FP32), gate, up, down, act, kernels)
    weights, ids = route(hidden, router, eps, kernels)
    moe = experts_forward(rms_norm(hidden, pre_moe_w, eps, FP32), weights, ids, experts,
                          kernels.expert_rows)
    ffn = rms_norm(mlp, post_mlp_w, eps, FP32) + rms_norm(moe, post_moe_w, eps, FP32)
    return _ffn_out(hidden, ffn, post_ff_w, ple, ple_rows, layer_scalar, act, eps, kernels)


# -- the architecture -------------------------------------------------------------------------
def kv_sources(layer_types: list[str], num_shared: int) -> list[int | None]:
    """Per layer, the layer whose KV it reads (None: its own). The last `num_shared` layers read
    the last earlier non-shared layer of the same type, as transformers' Gemma-4 does."""
    first_shared = len(layer_types) - num_shared
    sources: list[int | None] = []
    for index, kind in enumerate(layer_types):
        if num_shared <= 0 or index < first_shared:
            sources.append(None)
            continue
        earlier = [j for j in range(first_shared) if layer_types[j] == kind]
        if not earlier:
            raise ValueError(f"layer {index} ({kind}) shares KV but no earlier layer of that type "
                             f"computes it (num_kv_shared_layers={num_shared})")
        sources.append(earlier[-1])
    return sources


class Gemma4Forward(DecoderForward):
    LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, hf_model: torch.nn.Module, dtype: torch.dtype, merged=None) -> None:
        self.text = text_model(hf_model)
        self.config = self.text.config
        cfg = self.config
        if getattr(cfg, "use_bidirectional_attention", None) == "all":
            raise NotImplementedError("Gemma-4 with use_bidirectional_attention='all' is not a "
                                      "causal LM; flexrollout generates causally only")
        self.eps = cfg.rms_norm_eps
        self.act = activation(cfg.hidden_activation)
        self.ple = bool(cfg.hidden_size_per_layer_input)
        # The multimodal wrapper's placeholder tokens (images, video, audio) need its encoders.
        wrapper = hf_model.config
        names = ("image_token_id", "video_token_id", "audio_token_id") if wrapper is not cfg else ()
        self.placeholders = [getattr(wrapper, n) for n in names if getattr(wrapper, n, None) is not None]
        super().__init__(hf_model, dtype, merged)

    # -- the engine's view -------------------------------------------------------------------
    def build_spec(self) -> ModelSpec:
        cfg = self.config
        sources = kv_sources(cfg.layer_types, getattr(cfg, "num_kv_shared_layers", 0) or 0)
        layers = []
        for index, kind in enumerate(cfg.layer_types):
            attn = self.text.layers[index].self_attn     # its head_dim and GQA group are its own
            heads = cfg.num_attention_heads
            layers.append(LayerSpec(
                num_heads=heads, num_kv_heads=heads // attn.num_key_value_groups,
                head_dim=attn.head_dim, window=cfg.sliding_window if kind == SLIDING else None,
                scale=1.0, kv_source=sources[index],
                ffn="mlp+moe" if cfg.enable_moe_block else "mlp"))
        shared = sum(s is not None for s in sources)
        if shared:
            logger.info("Gemma-4: %d of %d layers read another layer's KV and own no cache",
                        shared, len(layers))
        return ModelSpec(layers=layers, vocab_size=self.hf.lm_head.weight.shape[0],
                         hidden_size=cfg.hidden_size,
                         max_position_embeddings=cfg.max_position_embeddings)

    def layer_fns(self, index: int) -> LayerFns:
        spec = self.spec.layers[index]
        pre = attention_inputs if spec.kv_source is None else shared_kv_queries
        post = attention_out_mlp_moe if spec.ffn == "mlp+moe" else attention_out_mlp
        return LayerFns(pre=pre, post=post)

    def projections(self, index: int) -> dict[str, torch.nn.Module]:
        layer = self.text.layers[index]
        attn, mlp = layer.self_attn, layer.mlp
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        modules = {name: getattr(attn, name) for name in names if getattr(attn, name, None) is not None}
        modules.update(gate_proj=mlp.gate_proj, up_proj=mlp.up_proj, down_proj=mlp.down_proj)
        if self.spec.layers[index].ffn == "mlp+moe":
            modules["router_proj"] = layer.router.proj
        if self.ple:
            modules.update(per_layer_input_gate=layer.per_layer_input_gate,
                           per_layer_projection=layer.per_layer_projection)
        return modules

    def read_experts(self, index: int) -> Experts | None:
        if self.spec.layers[index].ffn != "mlp+moe":
            return None
        if self.act is not ACT_GELU_TANH:
            raise NotImplementedError(f"Gemma-4 experts with hidden_activation "
                                      f"{self.config.hidden_activation!r} are not supported yet")
        return read_experts(self.text.layers[index].experts, self.merged, act=GELU_TANH)

    # -- arguments of the layer functions ----------------------------------------------------
    def pre_args(self, index: int, step: Step) -> tuple:
        layer, spec, lin = self.text.layers[index], self.spec.layers[index], self.linear
        attn = layer.self_attn
        cos, sin = step.rope[self.config.layer_types[index]]
        if spec.kv_source is not None:
            return (layer.input_layernorm.weight, lin(index, "q_proj", step), attn.q_norm.weight,
                    cos, sin, self.eps, spec.num_heads, spec.head_dim, step.kernels)
        v = lin(index, "v_proj", step) if "v_proj" in self._linears[index] else None
        return (layer.input_layernorm.weight, lin(index, "q_proj", step), lin(index, "k_proj", step),
                v, attn.q_norm.weight, attn.k_norm.weight, cos, sin, step.cache.k[index],
                step.cache.v[index], step.meta.slot_mapping, self.eps, spec.num_heads,
                spec.num_kv_heads, spec.head_dim, step.kernels,
                step.meta.decode and self.options.gemma_qkv_epilogue)

    def post_args(self, index: int, step: Step) -> tuple:
        layer, lin = self.text.layers[index], self.linear
        ple, ple_rows = None, None
        if self.ple:
            ple = PerLayerInputBlock(lin(index, "per_layer_input_gate", step),
                                     lin(index, "per_layer_projection", step),
                                     layer.post_per_layer_input_norm.weight)
            ple_rows = PerToken(step.extra["per_layer_inputs"][:, index])
        args = (lin(index, "o_proj", step), layer.post_attention_layernorm.weight,
                layer.pre_feedforward_layernorm.weight, lin(index, "gate_proj", step),
                lin(index, "up_proj", step), lin(index, "down_proj", step),
                layer.post_feedforward_layernorm.weight, ple, ple_rows, layer.layer_scalar,
                self.act, self.eps, step.kernels)
        if self.spec.layers[index].ffn != "mlp+moe":
            return args
        router = layer.router
        routing = Router(lin(index, "router_proj", step), router.scale, router.per_expert_scale,
                         self.config.top_k_experts)
        return args + (routing, self.layer_experts(index, step), layer.pre_feedforward_layernorm_2.weight,
                       layer.post_feedforward_layernorm_1.weight, layer.post_feedforward_layernorm_2.weight)

    def rope_tables(self, max_len: int) -> dict:
        device = self.text.embed_tokens.weight.device
        return {kind: tables_from_rotary(self.text.rotary_emb, device, max_len, self.dtype, f"{kind}_")
                for kind in sorted(set(self.config.layer_types))}

    def embed(self, input_ids: torch.Tensor, step: Step) -> torch.Tensor:
        if self.placeholders and not step.meta.decode:
            self._refuse_multimodal(input_ids)
        table = self.text.embed_tokens      # × √H, rounded to the table's dtype as HF does
        scale = table.embed_scale.to(table.weight.dtype)
        embeds = (F.embedding(input_ids, table.weight) * scale).to(self.dtype)
        if self.ple:
            text = self.text
            step.extra["per_layer_inputs"] = per_layer_inputs(
                input_ids, embeds, text.embed_tokens_per_layer.weight,
                text.embed_tokens_per_layer.embed_scale,
                read_linear(text.per_layer_model_projection, self.merged),
                self.config.hidden_size ** -0.5, text.per_layer_projection_norm.weight,
                len(self.spec.layers), self.eps, FP32, step.kernels)
        return embeds

    def _refuse_multimodal(self, input_ids: torch.Tensor) -> None:
        """Prefill only (one host sync per prefill step, none in decode)."""
        ids = torch.tensor(self.placeholders, device=input_ids.device)
        if bool(torch.isin(input_ids, ids).any()):
            raise NotImplementedError(
                f"prompt holds image / video / audio placeholder tokens {self.placeholders}: "
                f"flexrollout runs Gemma-4's text model only (text prompts)")

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.text.norm.weight, self.eps, FP32)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(super().logits(hidden), self.config.final_logit_softcapping)

