"""Feed-forward blocks: the dense gated MLP, and the output projection + residual that precede it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.small_linear import GELU_TANH
from .linear import Kernels, Linear, gated_act, linear

# HF `hidden_act` names -> the activation of a gated MLP.
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": GELU_TANH,
    "gelu": F.gelu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise NotImplementedError(f"hidden_act {name!r} is not supported yet; supported: "
                                  f"{sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def gated_mlp(h: torch.Tensor, gate: Linear, up: Linear, down: Linear, act,
              kernels: Kernels) -> torch.Tensor:
    """down(act(gate(h)) * up(h))."""
    return linear(gated_act(h, gate, up, act, kernels), down, kernels)
