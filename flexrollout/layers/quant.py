"""bitsandbytes 4-bit base weights (NF4 / FP4, QLoRA), read where the model keeps them.

A `Linear4bit` layer's weight is a `Params4bit`: packed uint8 nibbles with a `quant_state`
(per-block absmax, nested when double-quantised, the 16-entry code, the original shape and
compute dtype). Projections on CUDA run bitsandbytes' own forward op, as its `Linear4bit` does
(`matmul_4bit` -> `gemm_4bit`): its fused kernel reads the packed weight and the nested absmax in
place for the row counts its per-architecture heuristic picks, and above them it dequantises
into a transient and multiplies. We call that op (`torch.ops.bitsandbytes.gemm_4bit`, 0.50 on)
ourselves: it has a fake implementation, so the layer functions around it can compile like a
16-bit model's (`EngineConfig.compile_4bit`, on by default). Elsewhere (CPU in another
dtype, or older bitsandbytes) the weight is dequantised into a transient.
Nothing is stored beside the packed weights, and a transient lives only for its projection.
None of these ops reads anything back to the host, so a decode step over 4-bit weights is
captured as a CUDA graph like any other. bitsandbytes is imported only when such a model arrives.

The Triton kernel of `kernels/gemv_4bit.py` serves batches of up to 64 rows only with
`EngineConfig.quant_kernels` (off by default): its rewrite measured 8-25x slower than
bitsandbytes' op per Qwen3-4B projection on an H100 (benchmarks/gemv_4bit_sweep.py, 2026-12-06).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import gemv_4bit
from ..kernels.gemv_4bit import Packed4bit


def _gemm_4bit(x: torch.Tensor, weight: torch.Tensor, quant: Packed4bit,
               bias: torch.Tensor | None) -> torch.Tensor:
    """bitsandbytes' forward op, called as its `matmul_4bit` calls it without autograd (the
    same kernels: its fused one for the rows its heuristic picks, the nested absmax read in
    place, else dequantise + matmul), but traceable by torch.compile: the op has a fake
    implementation, and the shape and block size come from tensor sizes and a string, not
    ints read off Python objects (see `Packed4bit.blocksizes`). On CPU it dequantises into
    x's dtype, so it serves only where that is the quant state's own."""
    k = x.shape[-1]
    shape = [weight.numel() * 2 // k, k]
    blocksize = gemv_4bit.block_sizes(quant.blocksizes)[0]
    packed = weight.view(-1, 1)
    if quant.nested:
        return torch.ops.bitsandbytes.gemm_4bit.default(
            x, packed, shape, quant.absmax2, blocksize, quant.quant_type, bias,
            absmax_8bit=quant.absmax, absmax_code=quant.code2, absmax_offset=quant.offset)
    return torch.ops.bitsandbytes.gemm_4bit.default(x, packed, shape, quant.absmax, blocksize,
                                                    quant.quant_type, bias)


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


def packed_4bit(weight: torch.Tensor) -> Packed4bit | None:
    """A 4-bit weight's quant state as the engine's projections read it, or None."""
    state = quant_state_of(weight)
    return None if state is None else Packed4bit.of(state)


def project_4bit(x: torch.Tensor, weight: torch.Tensor, quant: Packed4bit,
                 bias: torch.Tensor | None = None, triton_gemv: bool = False) -> torch.Tensor:
    """x @ W^T + b for a packed 4-bit weight, in x's dtype. `triton_gemv` (the step runs where
    Triton does, `EngineConfig.quant_kernels`): our GEMV kernel where it takes the batch, the
    one path compiled code may take; else bitsandbytes' ops."""
    if triton_gemv and gemv_4bit.takes(x, quant):
        return gemv_4bit.project(x, weight, quant, bias)
    if quant.gemm_op and (x.is_cuda or x.dtype == quant.dtype):
        return _gemm_4bit(x, weight, quant, bias)
    if x.is_cuda:
        import bitsandbytes as bnb

        return bnb.matmul_4bit(x, weight.t(), quant_state=quant.state, bias=bias)
    return F.linear(x, dequantize_4bit(weight, quant.state, x.dtype), bias)


def quant_state_bytes(weight: torch.Tensor) -> int:
    """Bytes of a 4-bit weight's quant state, read with its packed bytes by every projection:
    absmax (uint8 codes when nested, with the second level's fp32 absmax, code and offset) and
    the 16-entry code. 0 for an ordinary tensor."""
    state = quant_state_of(weight)
    return 0 if state is None else state_bytes(state)


def state_bytes(state) -> int:
    """Bytes of one bitsandbytes QuantState's tensors (see `quant_state_bytes`)."""
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.state2.absmax, state.state2.code, state.offset]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def logical_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """A weight's (out, in) shape: the quant state's for a packed 4-bit weight."""
    state = quant_state_of(weight)
    return tuple(state.shape) if state is not None else tuple(weight.shape)
