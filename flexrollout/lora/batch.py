"""Per-row adapters for one step: rows of a batch may use different adapters or none.

vLLM's rule: a row's `lora_request` chooses its adapter *instead of* the model's live PEFT
adapters; rows without one run the model as the user holds it (live adapters on)."""
from __future__ import annotations

import torch

from .adapters import Adapter


class LoraBatch:
    def __init__(self, token_adapters: list[Adapter | None], device: torch.device) -> None:
        by_id: dict[int, tuple[Adapter, list[int]]] = {}
        for row, adapter in enumerate(token_adapters):
            if adapter is not None:
                by_id.setdefault(adapter.lora_int_id, (adapter, []))[1].append(row)
        self.groups = [(adapter, torch.tensor(rows, device=device)) for adapter, rows in by_id.values()]
        # Rows that named no adapter: the model's live adapters apply to these only.
        self.live_rows = torch.tensor([row for row, a in enumerate(token_adapters) if a is None],
                                      dtype=torch.long, device=device)

    @staticmethod
    def build(token_adapters: list[Adapter | None], device: torch.device) -> "LoraBatch | None":
        return LoraBatch(token_adapters, device) if any(token_adapters) else None

    def terms(self, layer: int, proj: str) -> tuple:
        """(A, B, scaling, rows) of each adapter of this step that adapts this target."""
        terms = []
        for adapter, rows in self.groups:
            weights = adapter.weights.get((layer, proj))
            if weights is not None:
                terms.append((*weights, rows))
        return tuple(terms)

    def expert_terms(self, layer: int) -> tuple:
        """(gate_up (A, B, scaling) or None, down (...) or None, rows) of each adapter group of
        this step, adapting the layer's experts or not (its rows still leave the live ones)."""
        return tuple((adapter.weights.get((layer, "experts.gate_up_proj")),
                      adapter.weights.get((layer, "experts.down_proj")), rows)
                     for adapter, rows in self.groups)
