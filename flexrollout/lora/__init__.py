"""LoRA adapters named by `LoRARequest`, and Unsloth-style save/load helpers."""
from .adapters import Adapter, AdapterRegistry, BaseModelRequest, load_adapter
from .helpers import load_lora, save_lora

__all__ = ["Adapter", "AdapterRegistry", "BaseModelRequest", "load_adapter", "load_lora", "save_lora"]
