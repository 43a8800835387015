"""The LoRA adapters PEFT holds on one wrapped layer, read where PEFT keeps them."""
from __future__ import annotations

import torch


def is_lora_layer(module: torch.nn.Module) -> bool:
    """A PEFT LoRA wrapper (`base_layer` plus `lora_A` / `lora_B`)."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def lora_layers(model: torch.nn.Module):
    """(name, module) of every PEFT LoRA wrapper in `model`: projections and expert ParamWrappers."""
    for name, module in model.named_modules():
        if is_lora_layer(module):
            yield name, module


def active_adapters(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(A (r, in), B (out, r), scaling) of every adapter that changes the layer's output now:
    none while PEFT has merged them into the base weight or disabled them. The tensors are
    PEFT's own, so an optimizer step is seen by the next read of their values."""
    if not is_lora_layer(module) or getattr(module, "merged", False) or module.disable_adapters:
        return []
    terms = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if module.use_dora.get(name, False):
            raise NotImplementedError("DoRA adapters (use_dora=True) are not supported yet")
        terms.append((module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]))
    return terms
