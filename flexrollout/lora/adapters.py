"""Adapters given by `LoRARequest`: a saved PEFT directory or in-memory tensors.

An adapter becomes {(layer index, projection name): (A, B, scaling)} on the engine's device and
dtype. Its delta is added to the base projection for the rows of the batch that asked for it;
rows of one batch may use different adapters or none. Everything is validated before any work:
a missing or malformed adapter is a clear error, never a silent no-op.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from ..lora_request import LoRARequest

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class Adapter:
    lora_int_id: int
    name: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


def _config_dict(config) -> dict:
    if config is None:
        raise ValueError("lora_config is required with lora_tensors")
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return vars(config)


def _scaling(cfg: dict, module: str) -> tuple[int, float]:
    rank = int((cfg.get("rank_pattern") or {}).get(module, cfg.get("r", 8)))
    alpha = float((cfg.get("alpha_pattern") or {}).get(module, cfg.get("lora_alpha", rank)))
    return rank, alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _check_config(cfg: dict, where: str) -> None:
    for option, message in (("use_dora", "DoRA adapters"), ("fan_in_fan_out", "fan_in_fan_out adapters")):
        if cfg.get(option):
            raise NotImplementedError(f"{where}: {message} ({option}=True) are not supported yet")
    if cfg.get("modules_to_save"):
        raise NotImplementedError(f"{where}: modules_to_save={cfg['modules_to_save']} is not supported")
    peft_type = str(cfg.get("peft_type", "LORA")).upper().split(".")[-1]
    if peft_type != "LORA":
        raise NotImplementedError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LoRA")


def _read_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    config_file = os.path.join(path, "adapter_config.json")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isdir(path):
        raise ValueError(f"lora_path {path!r} is not a directory")
    if not os.path.isfile(config_file) or not os.path.isfile(weights_file):
        raise ValueError(f"lora_path {path!r} needs adapter_config.json and adapter_model.safetensors "
                         f"(pickled .bin adapters are never loaded)")
    from safetensors.torch import load_file

    with open(config_file) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"lora_path {path!r}: adapter_config.json is not valid JSON: {err}") from None
    return cfg, load_file(weights_file)


def load_adapter(request: LoRARequest, num_layers: int, shapes: dict[str, tuple[int, int]],
                 device: torch.device, dtype: torch.dtype) -> Adapter:
    """Read and check an adapter. `shapes[proj]` is the base projection's (out, in)."""
    where = f"LoRARequest({request.lora_name!r}, {request.lora_int_id})"
    if request.lora_tensors is not None:
        cfg, tensors = _config_dict(request.lora_config), request.lora_tensors
    else:
        cfg, tensors = _read_dir(request.lora_path)
    _check_config(cfg, where)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"{where}: unexpected tensor {key!r} (only LoRA A/B of {PROJECTIONS})")
        layer, proj, which = int(match.group(1)), match.group(2), match.group(3)
        if proj not in PROJECTIONS or layer >= num_layers:
            raise ValueError(f"{where}: tensor {key!r} names no projection of this model")
        pairs.setdefault((layer, proj), {})[which] = tensor
    if not pairs:
        raise ValueError(f"{where}: the adapter has no LoRA tensors")
    weights = {}
    for (layer, proj), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {proj} lacks lora_{'B' if 'A' in ab else 'A'}")
        rank, scaling = _scaling(cfg, proj)
        a, b = ab["A"], ab["B"]
        out_features, in_features = shapes[proj]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise ValueError(f"{where}: layer {layer} {proj} has A {tuple(a.shape)} / B {tuple(b.shape)}, "
                             f"expected ({rank}, {in_features}) / ({out_features}, {rank})")
        weights[(layer, proj)] = (a.to(device, dtype), b.to(device, dtype), scaling)
    return Adapter(request.lora_int_id, request.lora_name, weights)


class AdapterRegistry:
    """Loaded adapters, cached by lora_int_id (vLLM's contract: an id names one adapter)."""

    def __init__(self, num_layers: int, shapes: dict[str, tuple[int, int]], device, dtype) -> None:
        self.num_layers, self.shapes, self.device, self.dtype = num_layers, shapes, device, dtype
        self.adapters: dict[int, Adapter] = {}

    def get(self, request: LoRARequest) -> Adapter:
        if request.lora_int_id not in self.adapters:
            self.adapters[request.lora_int_id] = load_adapter(
                request, self.num_layers, self.shapes, self.device, self.dtype)
        return self.adapters[request.lora_int_id]

    def remove(self, lora_int_id: int) -> bool:
        return self.adapters.pop(lora_int_id, None) is not None
