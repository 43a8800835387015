"""Architecture registry: HF `model_type` -> forward class."""
from __future__ import annotations

import torch

from .base import DecoderForward, ForwardOptions
from .gemma4 import Gemma4Forward
from .gpt_oss import GptOssForward
from .llama import LlamaForward
from .qwen3_5 import Qwen3_5Forward
from .qwen3_moe import Qwen3MoeForward

_FORWARDS = {
    "llama": LlamaForward,
    "qwen3": LlamaForward,
    "qwen2": LlamaForward,
    "qwen3_moe": Qwen3MoeForward,
    "gpt_oss": GptOssForward,
    "gemma4": Gemma4Forward,
    "gemma4_text": Gemma4Forward,
    "qwen3_5": Qwen3_5Forward,
    "qwen3_5_text": Qwen3_5Forward,
    "qwen3_5_moe": Qwen3_5Forward,
    "qwen3_5_moe_text": Qwen3_5Forward,
}


def unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PeftModel wrapper (LoRA layers stay in place)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def build_forward(model: torch.nn.Module, dtype: torch.dtype, merged=None) -> DecoderForward:
    """The forward for `model`'s architecture; `merged`: a MergedLora (lora_mode="merged")."""
    hf = unwrap_peft(model)
    model_type = getattr(hf.config, "model_type", None)
    if model_type not in _FORWARDS:
        raise NotImplementedError(
            f"model_type {model_type!r} is not supported yet; supported: {sorted(_FORWARDS)}")
    return _FORWARDS[model_type](hf, dtype, merged)


__all__ = ["DecoderForward", "ForwardOptions", "build_forward", "unwrap_peft"]
