"""bitsandbytes 4-bit base weights (NF4 / FP4, QLoRA), read where the model keeps them.

A `Linear4bit` layer's weight is a `Params4bit`: packed uint8 nibbles with a `quant_state`
(per-block absmax, nested when double-quantised, the 16-entry code, the original shape and
compute dtype). The projection dequantises the weight with bitsandbytes' own op into a transient
tensor and multiplies, as bitsandbytes' forward does for more than one row: nothing is stored
beside the packed weights, and the transient lives only for that projection. bitsandbytes is
imported only when such a model arrives.
"""
from __future__ import annotations

import torch


def quant_state_of(weight: torch.Tensor):
    """The bitsandbytes QuantState of a 4-bit weight, or None for an ordinary tensor."""
    state = getattr(weight, "quant_state", None) if weight.dtype == torch.uint8 else None
    if state is not None and getattr(state, "packing_format_for_cpu", False):
        # bitsandbytes' own CPU forward (AVX512-BF16 machines) repacks the weight in place into a
        # layout only its CPU kernel reads.
        raise NotImplementedError(
            "this 4-bit weight was repacked for bitsandbytes' CPU kernel by an earlier forward; "
            "flexrollout reads the standard packed layout (run the model on a GPU, or set "
            "support_avx512bf16_for_cpu=False on its Linear4bit layers before any forward)")
    return state


def dequantize_4bit(weight: torch.Tensor, quant_state, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) weight of a packed 4-bit tensor, in `dtype` (the activations')."""
    from bitsandbytes.functional import dequantize_4bit as dequantize

    return dequantize(weight, quant_state).to(dtype)


def logical_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """A weight's (out, in) shape: the quant state's for a packed 4-bit weight."""
    state = quant_state_of(weight)
    return tuple(state.shape) if state is not None else tuple(weight.shape)
