"""Per-row adapters for one step: rows of a batch may use different adapters or none.

vLLM's rule: a row's `lora_request` chooses its adapter *instead of* the model's live PEFT
adapters; rows without one run the model as the user holds it (live adapters on, or the merged
weights of lora_mode="merged").

Each row gets a slot: 0 is the model as held, 1..n the step's distinct adapters. Every adapter
term is computed over all rows and multiplied by its slot's 0/1 row mask at the rank-r
intermediate (T x r, cheap), so the shapes depend on the batch size and the number of adapters
only, never on which row uses which: no gathers by row lists, no host branching on the mix.
"""
from __future__ import annotations

import torch

from .adapters import Adapter


class LoraBatch:
    compiles = False        # the layers run eagerly over it (see `DecoderForward._eager`)

    def __init__(self, token_adapters: list[Adapter | None], device: torch.device) -> None:
        slots: dict[int, int] = {}                    # lora_int_id -> slot
        self.adapters: list[Adapter] = []
        row_slots = []
        for adapter in token_adapters:
            if adapter is not None and adapter.lora_int_id not in slots:
                slots[adapter.lora_int_id] = len(self.adapters) + 1
                self.adapters.append(adapter)
            row_slots.append(0 if adapter is None else slots[adapter.lora_int_id])
        self.slots = torch.tensor(row_slots, dtype=torch.long, device=device)
        # (T, 1) 0/1 masks: the live adapters apply to slot 0, adapter i to slot i + 1.
        self.live_mask = (self.slots == 0).unsqueeze(1)
        self.masks = [(self.slots == i + 1).unsqueeze(1) for i in range(len(self.adapters))]

    @staticmethod
    def build(token_adapters: list[Adapter | None], device: torch.device) -> "LoraBatch | None":
        return LoraBatch(token_adapters, device) if any(a is not None for a in token_adapters) else None

    def terms(self, layer: int, proj: str) -> tuple:
        """(A, B, scaling, row mask) of each adapter of this step that adapts this target."""
        terms = []
        for adapter, mask in zip(self.adapters, self.masks):
            weights = adapter.weights.get((layer, proj))
            if weights is not None:
                terms.append((*weights, mask))
        return tuple(terms)

    def expert_terms(self, layer: int, name: str) -> tuple:
        """(A, B, scaling, row mask) of each adapter of this step on the layer's stacked expert
        parameter `name` ("gate_up_proj" or "down_proj")."""
        return self.terms(layer, f"experts.{name}")
