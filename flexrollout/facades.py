"""The parts of vLLM's engine configuration that clients read (`llm.llm_engine.model_config`,
`.vllm_config.model_config.enable_sleep_mode`, `.vllm_config.lora_config`): plain records; the
engine itself is configured by `EngineConfig`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ModelConfig:
    """The subset of vLLM's ModelConfig that clients read."""

    model: str
    max_model_len: int
    dtype: torch.dtype
    enable_sleep_mode: bool = False
    enable_prefix_caching: bool = True


@dataclass
class VllmConfig:
    model_config: ModelConfig
    lora_config: object | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class LoRAConfig:
    """What vLLM clients read from `llm_engine.vllm_config.lora_config`."""

    max_lora_rank: int = 16
    max_loras: int = 64
