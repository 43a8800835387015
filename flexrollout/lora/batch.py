"""Per-row adapter deltas for one step: rows of a batch may use different adapters or none."""
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

    @staticmethod
    def build(token_adapters: list[Adapter | None], device: torch.device) -> "LoraBatch | None":
        return LoraBatch(token_adapters, device) if any(token_adapters) else None

    def terms(self, layer: int, proj: str) -> tuple:
        """(A, B, scaling, rows) of each adapter of this step that adapts this projection."""
        terms = []
        for adapter, rows in self.groups:
            weights = adapter.weights.get((layer, proj))
            if weights is not None:
                terms.append((*weights, rows))
        return tuple(terms)
