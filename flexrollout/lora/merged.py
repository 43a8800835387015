"""Merged LoRA mode: W_merged = W_base + sum(scaling * B @ A), for the adapted matrices only.

Opt-in (`LLM(..., lora_mode="merged")`) for speed: the decode step then runs the plain fused
path and CUDA graphs with one GEMM per projection instead of three. The merged tensors are
refreshed in place from the frozen base weights (never by unmerging, so no rounding drift
accumulates) before any generate that follows a change: a change is seen through the tensors'
version counters, which every in-place update (an optimizer step, `copy_`) increments.
Cost: one extra matrix per adapted projection (per adapted expert stack for PEFT's
`target_parameters` on MoE experts).
"""
from __future__ import annotations

import logging

import torch

from .live import active_adapters, lora_layers

logger = logging.getLogger(__name__)


def base_tensor(module: torch.nn.Module) -> torch.Tensor:
    """The tensor a LoRA layer adapts: a Linear's weight, or a ParamWrapper's stacked parameter."""
    if hasattr(module, "parameter_name"):
        return module.get_param()
    return module.base_layer.weight


def delta(module: torch.nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """scaling * B A in fp32, in the layout of `base_tensor(module)`. For a stacked (E, d1, d2)
    expert parameter PEFT's A is (E*r, in), B (out, r*E); the parameter is (E, in, out) when the
    experts are stored transposed (gpt-oss), else (E, out, in)."""
    if not hasattr(module, "parameter_name"):
        return lora_b.float() @ lora_a.float() * scaling
    experts = base_tensor(module).shape[0]
    a = lora_a.float().reshape(experts, -1, lora_a.shape[-1])          # (E, r, in)
    b = lora_b.float().reshape(lora_b.shape[0], -1, experts)           # (out, r, E)
    layout = "e i o" if getattr(module.get_base_layer(), "is_transposed", False) else "e o i"
    return torch.einsum(f"o r e, e r i -> {layout}", b, a) * scaling


class MergedLora:
    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = dict(lora_layers(model))
        quantized = [name for name, m in self.modules.items() if base_tensor(m).dtype == torch.uint8]
        if quantized:
            raise ValueError(
                f"lora_mode='merged' needs 16/32-bit base weights, and {quantized[0]} is 4-bit: a "
                f"merged copy would be a dequantised copy of the model. Use lora_mode='live' (QLoRA)")
        self.merged: dict[int, torch.Tensor] = {
            id(m): torch.empty_like(base_tensor(m)) for m in self.modules.values()}
        self._versions: dict[int, tuple] = {}

    @property
    def expert_stacks(self) -> list[str]:
        """Names of the merged stacked expert parameters (PEFT ParamWrappers)."""
        return [name for name, m in self.modules.items() if hasattr(m, "parameter_name")]

    def has(self, module: torch.nn.Module) -> bool:
        return id(module) in self.merged

    def weight(self, module: torch.nn.Module) -> torch.Tensor:
        """The tensor to multiply by: merged for adapted modules, the plain one otherwise."""
        merged = self.merged.get(id(module))
        return merged if merged is not None else module.weight

    @staticmethod
    def _state(module) -> tuple:
        tensors = [base_tensor(module)]
        for name in module.active_adapters:
            if name in module.lora_A:
                tensors += [module.lora_A[name].weight, module.lora_B[name].weight]
        return tuple((t.data_ptr(), t._version) for t in tensors) + (tuple(module.active_adapters),
                                                                      bool(module.disable_adapters))

    @torch.no_grad()
    def refresh(self) -> int:
        """Re-merge every module whose base or adapter tensors changed; returns how many."""
        count = 0
        for module in self.modules.values():
            state = self._state(module)
            if self._versions.get(id(module)) == state:
                continue
            if getattr(module, "merged", False):
                raise RuntimeError("lora_mode='merged' needs PEFT's own merge undone (unmerge_adapter())")
            target = self.merged[id(module)]
            target.copy_(base_tensor(module))
            for a, b, scaling in active_adapters(module):
                target.add_(delta(module, a, b, scaling).to(target.dtype))
            self._versions[id(module)] = state
            count += 1
        if count:
            logger.debug("re-merged %d LoRA matrices", count)
        return count
