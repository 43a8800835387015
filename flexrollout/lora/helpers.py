"""Unsloth's `model.save_lora` / `model.load_lora`, as plain functions over a PEFT model."""
from __future__ import annotations

import os
import uuid

from ..lora_request import LoRARequest
from .adapters import read_adapter_dir


def fresh_lora_id() -> int:
    """A positive `lora_int_id` no other request in this process holds (engines cache adapters by
    id, so a repeat would serve stale weights). 62 random bits instead of a process-wide counter:
    no shared state, and a repeat is as likely as guessing a 62-bit number."""
    return (uuid.uuid4().int >> 66) + 1


def save_lora(model, save_directory: str) -> None:
    """Save only the LoRA tensors (and the adapter config) with PEFT's own writer."""
    if not hasattr(model, "peft_config"):
        raise TypeError("save_lora needs a PEFT model (with LoRA adapters)")
    model.save_pretrained(save_directory)


def load_lora(model, save_directory: str, load_tensors: bool = False) -> LoRARequest:
    """A LoRARequest for a saved adapter, with a fresh lora_int_id on every call (Unsloth's
    semantics: each call may carry new weights). With load_tensors, the tensors are read now
    and passed in memory together with the adapter config."""
    if not os.path.isdir(save_directory):
        raise ValueError(f"save_directory {save_directory!r} does not exist")
    lora_id = fresh_lora_id()
    name = f"{os.path.basename(os.path.normpath(save_directory))}_{lora_id}"
    if not load_tensors:
        return LoRARequest(name, lora_id, save_directory)
    config, tensors = read_adapter_dir(save_directory, "save_directory")
    return LoRARequest(name, lora_id, lora_tensors=tensors, lora_config=config)
