"""Mixture-of-experts blocks: routers, and experts over stacked 3-D parameters read in place.

Experts run through `torch.nn.functional.grouped_mm`: the (token, expert) pairs are sorted by
expert, each expert's rows multiply its own matrix, and the outputs are weighted and summed back
per token, as transformers' own grouped_mm path does. Offsets are computed on the device, so the
step stays one CUDA graph. The whole expert computation is one custom op: compiled regions treat
it as opaque (inductor accepts grouped_mm only for bf16, and the engine's fp32 parity runs need
it too), and a faster small-batch kernel can replace its inside without touching the layers.

Expert LoRA (PEFT `target_parameters`, one adapter): per expert e, A_e (r, in) and B_e (out, r)
read from PEFT's lora_A (E*r, in) and lora_B (out, r*E) in place; the delta B_e (A_e x) is two
more grouped products over the same sorted rows. A step with `LoRARequest` rows adds each
adapter's delta under its row mask and the live adapter's under the mask of the other rows
(`lora.batch`): the down adapter then reads the activations its own rows' gate/up produced.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..kernels import custom_op, expert_gemv
from .linear import Kernels, Linear, linear

# The gated activations of expert MLPs.
SILU, GELU_TANH, GPT_OSS = "silu", "gelu_tanh", "gpt_oss"


def route_softmax_topk(h: torch.Tensor, router: Linear, top_k: int, renormalize: bool,
                       kernels: Kernels):
    """Qwen3-MoE's router: fp32 softmax over the experts, top-k, optionally renormalised, cast
    back. Returns (weights (T, k), expert ids (T, k)). The router's projection runs as every
    other does (`linear`: the GEMV in small CUDA batches, where cuBLAS was a launch of its own)."""
    return softmax_topk(linear(h, router, kernels), top_k, renormalize)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool):
    """`route_softmax_topk` from the router's logits (T, experts)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_topk_softmax(h: torch.Tensor, router: Linear, top_k: int, kernels: Kernels):
    """gpt-oss's router: top-k of the raw logits, then a softmax over those k."""
    logits = linear(h, router, kernels)
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), ids


@dataclass(frozen=True)
class ExpertLora:
    """One adapter on a stacked expert parameter, as PEFT stores it."""

    lora_a: torch.Tensor        # (E * r, in)
    lora_b: torch.Tensor        # (out, r * E)
    scaling: float


@dataclass(frozen=True)
class Experts:
    """The stacked expert parameters of one layer (the model's own tensors)."""

    gate_up: torch.Tensor                 # (E, 2I, H), or (E, H, 2I) when `transposed`
    down: torch.Tensor                    # (E, H, I), or (E, I, H) when `transposed`
    gate_up_bias: torch.Tensor | None = None      # (E, 2I)
    down_bias: torch.Tensor | None = None         # (E, H)
    transposed: bool = False              # stored [in, out] per expert (gpt-oss)
    interleaved: bool = False             # gate/up columns alternate (gpt-oss), else [gate; up]
    act: str = SILU
    limit: float = 7.0                    # gpt-oss's clamp
    alpha: float = 1.702                  # gpt-oss's sigmoid slope
    gate_up_lora: ExpertLora | None = None
    down_lora: ExpertLora | None = None
    # LoRARequest adapters of this step, (A, B, scaling, row mask (T, 1)) each, on gate_up and
    # on down; their rows take them instead of the live adapters, which apply under `live_mask`.
    row_gate_up: tuple = ()
    row_down: tuple = ()
    live_mask: torch.Tensor | None = None

    def with_rows(self, row_gate_up: tuple, row_down: tuple, live_mask: torch.Tensor) -> Experts:
        return replace(self, row_gate_up=row_gate_up, row_down=row_down, live_mask=live_mask)


def _terms(live: ExpertLora | None, live_mask, rows: tuple) -> tuple[list, list, list, list]:
    """The adapters of one stack as the custom op takes them: lists of A, B, scaling, mask."""
    terms = ([] if live is None else [(live.lora_a, live.lora_b, live.scaling, live_mask)]) + list(rows)
    return ([t[0] for t in terms], [t[1] for t in terms], [float(t[2]) for t in terms],
            [t[3] for t in terms])


def experts_forward(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ex: Experts,
                    small_rows: int = 0) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(h[t]) for every token t: (T, H), with the live
    expert adapters and this step's LoRARequest adapters, each on its rows. Steps of at most
    `small_rows` (token, expert) rows without expert LoRA run the grouped GEMV kernel on CUDA."""
    return moe_experts(h, weights, ids, ex.gate_up, ex.down, ex.gate_up_bias, ex.down_bias,
                       ex.transposed, ex.interleaved, ex.act, ex.limit, ex.alpha,
                       *_terms(ex.gate_up_lora, ex.live_mask, ex.row_gate_up),
                       *_terms(ex.down_lora, ex.live_mask, ex.row_down), small_rows)


@custom_op("moe_experts")
def moe_experts(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                transposed: bool, interleaved: bool, act: str, limit: float, alpha: float,
                gu_lora_a: list[torch.Tensor], gu_lora_b: list[torch.Tensor], gu_scaling: list[float],
                gu_mask: list[torch.Tensor | None], down_lora_a: list[torch.Tensor],
                down_lora_b: list[torch.Tensor], down_scaling: list[float],
                down_mask: list[torch.Tensor | None], small_rows: int) -> torch.Tensor:
    tokens, top_k = ids.shape
    if (tokens * top_k <= min(small_rows, expert_gemv.MAX_ROWS) and len(gu_lora_a) == 0
            and len(down_lora_a) == 0 and expert_gemv.supported(h, gate_up, down)):
        return expert_gemv.experts_small(h, ids, weights, gate_up, down, gate_up_bias, down_bias,
                                         transposed, interleaved, act, limit, alpha)
    num_experts = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)         # (token, choice) pairs grouped by expert
    groups = _Groups(flat, order, top_k, tokens, num_experts)
    x = h[groups.token]
    proj = _grouped(x, gate_up if transposed else gate_up.transpose(-2, -1), groups)
    if gate_up_bias is not None:
        proj = proj + gate_up_bias[groups.expert]
    for a, b, scaling, mask in zip(gu_lora_a, gu_lora_b, gu_scaling, gu_mask):
        proj = proj + _grouped_lora(x, a, b, scaling, mask, groups)
    act_out = _gated(proj, interleaved, act, limit, alpha)
    out = _grouped(act_out, down if transposed else down.transpose(-2, -1), groups)
    if down_bias is not None:
        out = out + down_bias[groups.expert]
    for a, b, scaling, mask in zip(down_lora_a, down_lora_b, down_scaling, down_mask):
        out = out + _grouped_lora(act_out, a, b, scaling, mask, groups)
    out = out * weights.reshape(-1)[order, None].to(out.dtype)
    # Back to (token, choice) order; the k outputs of a token sum.
    unsorted = torch.empty_like(out).index_copy_(0, order, out)
    return unsorted.view(tokens, top_k, -1).sum(dim=1).to(h.dtype)


@moe_experts.register_fake
def _(h, weights, ids, gate_up, down, gate_up_bias, down_bias, transposed, interleaved, act, limit,
      alpha, gu_lora_a, gu_lora_b, gu_scaling, gu_mask, down_lora_a, down_lora_b, down_scaling,
      down_mask, small_rows):
    return torch.empty_like(h)


class _Groups:
    """The (token, choice) rows of one step sorted by expert: each row's expert and token, and
    the int32 end offset of every expert's rows, all on the device."""

    def __init__(self, flat_ids: torch.Tensor, order: torch.Tensor, top_k: int, tokens: int,
                 num_experts: int):
        self.expert = flat_ids[order]
        self.token = order // top_k
        self.tokens, self.num_experts = tokens, num_experts
        counts = torch.zeros(num_experts, dtype=torch.int32, device=flat_ids.device)
        counts.scatter_add_(0, flat_ids.to(torch.int64), torch.ones_like(flat_ids, dtype=torch.int32))
        self.offs = counts.cumsum(0, dtype=torch.int32)
        # grouped_mm has a CUDA kernel for bf16 only; its fallback for other dtypes copies the
        # offsets to the host, which a CUDA graph cannot capture (the fp32 parity runs do).
        self.capturing = flat_ids.is_cuda and torch.cuda.is_current_stream_capturing()


def _grouped(x: torch.Tensor, stack: torch.Tensor, groups: _Groups) -> torch.Tensor:
    """Row s of `x` (sorted by expert) times its expert's matrix: x (S, K) @ stack (E, K, N) ->
    (S, N). Under CUDA-graph capture without grouped_mm's kernel, the rows are scattered into a
    zero-padded (E, tokens, K) batch and multiplied by one bmm: the same sums, no host copy."""
    if groups.capturing and x.dtype != torch.bfloat16:
        batch = x.new_zeros(groups.num_experts, groups.tokens, x.shape[-1])
        batch[groups.expert, groups.token] = x
        return torch.bmm(batch, stack.to(x.dtype))[groups.expert, groups.token]
    return F.grouped_mm(x, stack, offs=groups.offs)


def _grouped_lora(x, lora_a, lora_b, scaling: float, mask: torch.Tensor | None,
                  groups: _Groups) -> torch.Tensor:
    """scaling * B_e (A_e x) for rows grouped by expert, on the tokens `mask` (T, 1) selects when
    given (applied to the rank-r intermediate, as `layers.linear` does).
    A_e = lora_a.reshape(E, r, in)[e] and B_e = lora_b.reshape(out, r, E)[:, :, e] (PEFT's
    layout); the adapter is cast to x's dtype (PEFT keeps it in fp32 over a 16-bit base). B's (E, r, out) stack is a copy of the adapter's
    r * E * out elements: grouped_mm needs a unit stride in each expert's matrix."""
    num_experts = groups.num_experts
    a = lora_a.to(x.dtype).reshape(num_experts, -1, lora_a.shape[-1]).transpose(1, 2)   # (E, in, r)
    b = lora_b.to(x.dtype).reshape(lora_b.shape[0], -1, num_experts).permute(2, 1, 0).contiguous()
    low_rank = _grouped(x, a, groups)
    if mask is not None:
        low_rank = low_rank * mask[groups.token]
    return _grouped(low_rank, b, groups) * scaling


def _gated(proj: torch.Tensor, interleaved: bool, act: str, limit: float, alpha: float) -> torch.Tensor:
    if interleaved:
        gate, up = proj[..., ::2], proj[..., 1::2]
    else:
        gate, up = proj.chunk(2, dim=-1)
    if act == SILU:
        return F.silu(gate) * up
    if act == GELU_TANH:
        return F.gelu(gate, approximate="tanh") * up
    if act == GPT_OSS:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"unknown expert activation {act!r}")


def expert_lora_of(wrapper: torch.nn.Module) -> ExpertLora | None:
    """The active adapter of a PEFT ParamWrapper, or None when it has none (or is merged or
    disabled). More than one active adapter on an expert stack is not supported."""
    from ..lora.live import active_adapters

    terms = active_adapters(wrapper)
    if not terms:
        return None
    if len(terms) > 1:
        raise NotImplementedError("more than one active LoRA adapter on stacked experts")
    lora_a, lora_b, scaling = terms[0]
    return ExpertLora(lora_a, lora_b, scaling)


def unwrap_param_wrappers(module: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    """(the experts module under PEFT's nested ParamWrappers, {parameter name: its wrapper})."""
    wrappers = {}
    while hasattr(module, "parameter_name") and hasattr(module, "base_layer"):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    return module, wrappers


def read_experts(module: torch.nn.Module, merged=None, **layout) -> Experts:
    """The stacked experts under `module` (PEFT ParamWrappers unwrapped), with their live expert
    adapters, or the merged stacks of lora_mode="merged". `layout`: Experts' format fields."""
    experts, wrappers = unwrap_param_wrappers(module)
    stacks, adapters = {}, {}
    for name in ("gate_up_proj", "down_proj"):
        wrapper = wrappers.get(name)
        if wrapper is not None and merged is not None and merged.has(wrapper):
            stacks[name], adapters[name] = merged.weight(wrapper), None
        else:
            stacks[name] = getattr(experts, name)
            adapters[name] = expert_lora_of(wrapper) if wrapper is not None else None
    return Experts(stacks["gate_up_proj"], stacks["down_proj"],
                   getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None),
                   gate_up_lora=adapters["gate_up_proj"], down_lora=adapters["down_proj"], **layout)
