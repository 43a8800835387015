"""Logit soft-capping: cap * tanh(x / cap), which bounds logits to (-cap, cap) smoothly
(Gemma-2/3/4's `final_logit_softcapping`)."""
from __future__ import annotations

import torch


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) in x's dtype; `cap=None` leaves x as it is."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap
