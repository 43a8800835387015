"""Adapters given by `LoRARequest`: a saved PEFT directory or in-memory tensors.

An adapter becomes {(layer index, target name): (A, B, scaling)} on the engine's device and
dtype. A target is a projection ("q_proj", ...) with A (r, in) and B (out, r), or a stacked
expert parameter ("experts.gate_up_proj", PEFT's `target_parameters`) with A (E*r, in) and
B (out, r*E) as PEFT stores them. Rows of a batch that name an adapter run the base model plus
that adapter, instead of the model's live PEFT adapters; rows of one batch may use different
adapters or none (`lora.batch`). `BaseModelRequest` names the base model itself. Everything is validated
before any work: a missing or malformed adapter is a clear error, never a silent no-op.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..lora_request import LoRARequest

logger = logging.getLogger(__name__)

# layers.N.<the projection's path inside its layer>.lora_A|B[.adapter].weight
_KEY = re.compile(r"layers\.(\d+)\.([\w.]+?)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# PEFT nests one ParamWrapper per adapted expert parameter; each level adds a `base_layer.`.
# (Gemma-4 keeps its experts beside the MLP, `layers.N.experts`, not under it.)
_EXPERT_KEY = re.compile(r"layers\.(\d+)\.(?:mlp\.)?experts\.((?:base_layer\.)*)lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class Targets:
    """What an adapter may adapt in a model: (out, in) per projection name, and (experts, out,
    in) per stacked expert parameter, listed in the experts module's parameter order (PEFT wraps
    them in that order, the first innermost)."""

    linear: dict[str, tuple[int, int]]
    experts: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    # (layer, projection name) -> (out, in) where a layer's projection differs from `linear`
    # (Gemma-4's full-attention layers have a wider head; its KV-sharing layers a wider MLP).
    layers: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    # A projection's module path inside its decoder layer -> its name here ("self_attn.q_proj" ->
    # "q_proj", Qwen3.5-MoE's "mlp.shared_expert.gate_proj" -> "shared_gate_proj").
    paths: dict[str, str] = field(default_factory=dict)


@dataclass
class Adapter:
    lora_int_id: int
    name: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


class BaseModelRequest(LoRARequest):
    """Rows that run the base model: no adapter, and the live ones masked off as for any request
    (the Unsloth plugin's `lora_request=None`: vLLM's engine holds only the base weights)."""

    def __init__(self) -> None:
        super().__init__("base_model", 1, lora_tensors={}, lora_config={})


# An adapter with no tensors. Its id, -1, is no request's (ids are > 0) nor the live rows' (0),
# so base rows neither share a prefill with live rows nor take their slot.
BASE_MODEL = Adapter(-1, "base_model", {})


def _config_dict(config) -> dict:
    if config is None:
        raise ValueError("lora_config is required with lora_tensors")
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return vars(config)


def _parsed_config(cfg: dict, where: str) -> dict:
    """The adapter config as PEFT reads it (its defaults, e.g. lora_alpha=8 when absent, and its
    checks) when peft is installed; the raw dict otherwise. Keys this PEFT does not know (a newer
    release's) are left out rather than refused."""
    try:
        from peft import LoraConfig
    except ImportError:
        return cfg
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    try:
        config = LoraConfig(**{k: v for k, v in cfg.items() if k in known})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: the adapter config is not a valid LoRA config: {err}") from None
    return config.to_dict()


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


def read_adapter_dir(path: str, param: str = "lora_path") -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter config, tensors) of a saved PEFT adapter directory (safetensors only); errors name
    `param`, the caller's argument that holds `path`."""
    config_file = os.path.join(path, "adapter_config.json")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isdir(path):
        raise ValueError(f"{param} {path!r} is not a directory")
    if not os.path.isfile(config_file) or not os.path.isfile(weights_file):
        raise ValueError(f"{param} {path!r} needs adapter_config.json and adapter_model.safetensors "
                         f"(pickled .bin adapters are never loaded)")
    from safetensors.torch import load_file

    with open(config_file) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{param} {path!r}: adapter_config.json is not valid JSON: {err}") from None
    return cfg, load_file(weights_file)


def _target_of(key: str, cfg: dict, targets: Targets, num_layers: int, where: str) -> tuple[int, str, str]:
    """(layer, target name, "A" or "B") of an adapter tensor's key."""
    match = _EXPERT_KEY.search(key)
    if match is not None:
        layer, depth, which = int(match.group(1)), match.group(2).count("base_layer."), match.group(3)
        adapted = {p.rsplit(".", 1)[-1] for p in cfg.get("target_parameters") or []}
        nesting = [name for name in targets.experts if name.split(".", 1)[1] in adapted]
        if depth >= len(nesting):
            raise ValueError(f"{where}: tensor {key!r} names no expert parameter of this model "
                             f"(target_parameters: {sorted(adapted)})")
        name = nesting[len(nesting) - 1 - depth]        # depth 0 is the outermost wrapper
    else:
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"{where}: unexpected tensor {key!r} (only LoRA A/B of "
                             f"{sorted(targets.linear) + sorted(targets.experts)})")
        layer, name, which = int(match.group(1)), targets.paths.get(match.group(2)), match.group(3)
        if name not in targets.linear:
            raise ValueError(f"{where}: tensor {key!r} names no projection of this model")
    if layer >= num_layers:
        raise ValueError(f"{where}: tensor {key!r} names layer {layer}; the model has {num_layers}")
    return layer, name, which


def _expected_shapes(targets: Targets, name: str, rank: int, layer: int) -> tuple[tuple, tuple]:
    if name in targets.experts:
        experts, out_features, in_features = targets.experts[name]
        return (experts * rank, in_features), (out_features, rank * experts)
    out_features, in_features = targets.layers.get((layer, name), targets.linear[name])
    return (rank, in_features), (out_features, rank)


def load_adapter(request: LoRARequest, num_layers: int, targets: Targets,
                 device: torch.device, dtype: torch.dtype) -> Adapter:
    """Read and check an adapter against what the model has (`targets`)."""
    where = f"LoRARequest({request.lora_name!r}, {request.lora_int_id})"
    if request.lora_tensors is not None:
        cfg, tensors = _config_dict(request.lora_config), request.lora_tensors
    else:
        cfg, tensors = read_adapter_dir(request.lora_path)
    _check_config(cfg, where)
    cfg = _parsed_config(cfg, where)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, name, which = _target_of(key, cfg, targets, num_layers, where)
        pairs.setdefault((layer, name), {})[which] = tensor
    if not pairs:
        raise ValueError(f"{where}: the adapter has no LoRA tensors")
    weights = {}
    for (layer, name), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {name} lacks lora_{'B' if 'A' in ab else 'A'}")
        rank, scaling = _scaling(cfg, name.rsplit(".", 1)[-1])
        a, b = ab["A"], ab["B"]
        shape_a, shape_b = _expected_shapes(targets, name, rank, layer)
        if a.shape != shape_a or b.shape != shape_b:
            raise ValueError(f"{where}: layer {layer} {name} has A {tuple(a.shape)} / B {tuple(b.shape)}, "
                             f"expected {shape_a} / {shape_b}")
        weights[(layer, name)] = (a.to(device, dtype), b.to(device, dtype), scaling)
    return Adapter(request.lora_int_id, request.lora_name, weights)


class AdapterRegistry:
    """Loaded adapters, cached by lora_int_id (vLLM's contract: an id names one adapter), at most
    `capacity` of them: the least recently used is dropped, and `on_evict` told its id (a later
    request reloads it). Unsloth's `load_lora` makes a fresh id per call, so an unbounded cache
    would hold every adapter ever loaded on the GPU. Sequences keep the Adapter they started with,
    so dropping one in use costs nothing but a reload."""

    def __init__(self, num_layers: int, targets: Targets, device, dtype, capacity: int,
                 on_evict: Callable[[int], None] = lambda lora_int_id: None) -> None:
        self.num_layers, self.targets, self.device, self.dtype = num_layers, targets, device, dtype
        self.capacity, self.on_evict = capacity, on_evict
        self.adapters: OrderedDict[int, Adapter] = OrderedDict()

    def get(self, request: LoRARequest) -> Adapter:
        if isinstance(request, BaseModelRequest):
            return BASE_MODEL
        lora_id = request.lora_int_id
        if lora_id in self.adapters:
            self.adapters.move_to_end(lora_id)
            return self.adapters[lora_id]
        adapter = load_adapter(request, self.num_layers, self.targets, self.device, self.dtype)
        self.adapters[lora_id] = adapter
        while len(self.adapters) > self.capacity:
            evicted, _ = self.adapters.popitem(last=False)
            logger.info("LoRA adapter %d dropped from the cache (max_cpu_loras=%d)", evicted, self.capacity)
            self.on_evict(evicted)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        return self.adapters.pop(lora_int_id, None) is not None
