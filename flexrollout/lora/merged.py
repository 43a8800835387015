"""Merged LoRA mode: W_merged = W_base + sum(scaling * B @ A), for the adapted matrices only.

Opt-in (`LLM(..., lora_mode="merged")`) for speed: the decode step then runs the plain fused
path and CUDA graphs with one GEMM per projection instead of three. The merged tensors are
refreshed in place from the frozen base weights (never by unmerging, so no rounding drift
accumulates) before any generate that follows a change: a change is seen through the tensors'
version counters, which every in-place update (an optimizer step, `copy_`) increments.
Cost: one extra matrix per adapted projection.
"""
from __future__ import annotations

import logging

import torch

from .live import active_adapters, is_lora_layer

logger = logging.getLogger(__name__)


def _lora_modules(model: torch.nn.Module):
    for name, module in model.named_modules():
        if is_lora_layer(module):
            yield name, module


class MergedLora:
    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = dict(_lora_modules(model))
        self.merged: dict[int, torch.Tensor] = {
            id(m): torch.empty_like(m.base_layer.weight) for m in self.modules.values()}
        self._versions: dict[int, tuple] = {}

    def has(self, module: torch.nn.Module) -> bool:
        return id(module) in self.merged

    def weight(self, module: torch.nn.Module) -> torch.Tensor:
        """The weight to multiply by: merged for adapted modules, the plain one otherwise."""
        merged = self.merged.get(id(module))
        return merged if merged is not None else module.weight

    @staticmethod
    def _state(module) -> tuple:
        tensors = [module.base_layer.weight]
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
            target.copy_(module.base_layer.weight)
            for a, b, scaling in active_adapters(module):
                target.add_((b.float() @ a.float() * scaling).to(target.dtype))
            self._versions[id(module)] = state
            count += 1
        if count:
            logger.debug("re-merged %d LoRA matrices", count)
        return count
