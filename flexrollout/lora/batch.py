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

    def add(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + scaling * B(A x) for the rows of each adapter that adapts this projection."""
        for adapter, rows in self.groups:
            weights = adapter.weights.get((layer, proj))
            if weights is None:
                continue
            a, b, scaling = weights
            delta = (x.index_select(0, rows).to(a.dtype) @ a.T) @ b.T
            out = out.index_add(0, rows, (delta * scaling).to(out.dtype))
        return out
