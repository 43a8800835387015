"""Weight access for clients that push weights (TRL's full fine-tuning sync, vLLM's load_weights).

The engine runs over the user's own parameters, so `load_weights` copies into those very
tensors (in place: addresses, and therefore captured CUDA graphs, stay valid).
"""
from __future__ import annotations

import torch

from .layers.quant import quant_state_bytes
from .models import unwrap_peft

_PREFIXES = ("base_model.model.",)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct parameter storages (tied weights counted once), with the
    quant states of bitsandbytes 4-bit weights (absmax and codes, which are not parameters)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size() + quant_state_bytes(p)
    return sum(seen.values())


def _clean(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace(".base_layer.", ".")


class WeightLoader:
    """`model_runner.model` as vLLM clients see it: `load_weights(iterable of (hf_name, tensor))`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def _parameters(self) -> dict[str, torch.Tensor]:
        """HF names (PEFT prefixes and `.base_layer` removed) -> the live tensors."""
        named = dict(unwrap_peft(self.model).named_parameters())
        named.update(dict(unwrap_peft(self.model).named_buffers()))
        return {_clean(name): tensor for name, tensor in named.items() if "lora_" not in name}

    @torch.no_grad()
    def load_weights(self, weights) -> set[str]:
        params = self._parameters()
        loaded = set()
        for name, tensor in weights:
            key = _clean(name)
            if key not in params:
                raise KeyError(f"load_weights: no parameter named {name!r} in the model")
            target = params[key]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model's is {tuple(target.shape)}")
            if target.data_ptr() != tensor.data_ptr():
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            loaded.add(key)
        return loaded


class _ModelRunner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = WeightLoader(model)


class _Worker:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = _ModelRunner(model)


class ModelExecutor:
    """`llm_engine.model_executor.driver_worker.model_runner.model.load_weights(...)`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.driver_worker = _Worker(model)
