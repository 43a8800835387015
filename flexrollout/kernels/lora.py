"""The live-LoRA shrink: s * (A x) for the adapters of projections that read one input, in one
launch, over PEFT's own A tensors (fp32 as PEFT keeps them, or any float dtype: converted in
registers, never copied or cast per step).

A LoRA'd projection computes W x + s B (A x). The base part streams W through the GEMV kernel
(`small_linear`), which also takes the low-rank intermediate computed here and adds B (s A x)
to its fp32 sums before its epilogue (q/k/v partials, SiLU-mul): so a live adapter costs one
extra launch per group of projections (q/k/v, gate/up, o, down) and reads each adapter's bytes
once, and the fused epilogues still apply.

`lora_expand` is the kernel for batches past the GEMV's row limit (prefill, large decode batches):
cuBLAS for W x, then base + B (s A x), read in place (B in its own dtype), rounded once to the
base's dtype (PEFT's order).

The shrink's result is fp32 partial sums (split, M, slots * R): K is cut into `split` slices so that
enough programs stream the A matrices (each is only r x K), and the consumer sums the slices
(a few (M, R) tiles). Slot i (columns [i R, (i + 1) R)) holds matrix i's adapter, R being the
largest rank rounded up to a power of two (>= 16, the smallest dot tile); columns past a
matrix's rank, and slots without an adapter, are zeros.

Numerics follow PEFT (x cast to the adapter's fp32, fp32 products): the dots run in IEEE fp32
for fp32 models and in TF32 on the tensor cores for 16-bit ones, where TF32's 2^-11 relative
error on the (small) delta is far below the output's own rounding.

Hand-written because nothing maintained fits without a new dependency: vLLM's punica Triton
kernels (lora_shrink / lora_expand) are the known alternative, but vLLM is not a dependency.
Off CUDA (tests, CPU) the op computes the same partials with torch; Triton's interpreter runs
the kernel on CPU tensors in tests.
"""
from __future__ import annotations

import functools

import torch

# The shrink's K tile is the GEMV's K step: the fused shrink (`small_linear`) cuts K the same way.
from . import custom_op
from .small_linear import BLOCK_K, rank_block, row_block, shrink_parts

# K slices per shrink at one row block: enough programs to stream the A matrices (at 1-32 rows,
# 32 slices take 2.4-4.4 us per Qwen3-4B group against 3.4-9.5 at 8; H100, lora_sweep.py). More
# row blocks need fewer slices, and every slice is a partial tile each consumer program re-reads.
MAX_SPLIT = 32
# Largest adapter rank the fused kernels take (the GEMV's (rows, R) and (BLOCK_N, R) fp32 tiles
# sit beside its pipelined weight tiles); larger ranks run the unfused path.
MAX_RANK = 64
# Largest row-masked term they take (`Kernels.lora_rows`): the adapter table's stacked term is
# slots x rank wide (4 adapters of r = 32: 128). At R = 128 every variant compiles for Hopper
# within its shared memory (tests/test_lora_kernels.py); its speed is not yet measured.
MAX_MASKED_RANK = 128


# Largest batch whose row-masked adapter terms (`Kernels.lora_rows`: LoRARequest rows) fold into
# the GEMV; live adapters fold up to EngineConfig.lora_gemv_max_rows (64). The 64-row tiles that
# overflowed shared memory on 2026-12-04 now launch with a shallower pipeline
# (`small_linear.launch_fitting`), and pass their bf16 GPU test at 33 and 64 rows (H100).
MAX_ROWS = 32


def k_slice(k: int, m: int, max_split: int = MAX_SPLIT) -> int:
    """Input columns per shrink program for m rows: a multiple of BLOCK_K, at most `max_split`
    slices over all row blocks (prefill's many row blocks stream A unsplit)."""
    return shrink_parts(k, _max_parts(m, max_split))[0]


def split_of(k: int, m: int, max_split: int = MAX_SPLIT) -> int:
    return shrink_parts(k, _max_parts(m, max_split))[1]


def _max_parts(m: int, max_split: int) -> int:
    """K slices per row block for m rows: `max_split` over all row blocks, at least one."""
    return max(1, max_split // -(-m // row_block(m)))


def _ranks(a0, a1, a2) -> list[int]:
    return [0 if a is None else a.shape[0] for a in (a0, a1, a2)]


def slot_count(a0, a1, a2) -> int:
    """Slots in the result: up to the last matrix given (a group's matrices keep their index)."""
    return max(i + 1 for i, a in enumerate((a0, a1, a2)) if a is not None)


@functools.cache
def _kernel():
    """The shrink kernel (its module imports Triton: only when a kernel first runs)."""
    from .small_linear_jit import lora_shrink_kernel

    return lora_shrink_kernel


@functools.cache
def _expand_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def lora_expand_kernel(base_ptr, la_ptr, b_ptr, out_ptr, M, N, rank, slot, stride_bm,
                           stride_om, stride_la_split, stride_la_m,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr,
                           LA_SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, R)
        precision: tl.constexpr = "ieee" if IEEE else "tf32"
        if PDL:
            tl.extra.cuda.gdc_wait()
        la_mask = (offs_m[:, None] < M) & (offs_r[None, :] < rank)
        la = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for s in tl.static_range(LA_SPLIT):
            la += tl.load(la_ptr + s * stride_la_split + offs_m[:, None] * stride_la_m
                          + slot * R + offs_r[None, :], mask=la_mask, other=0.0)
        b = tl.load(b_ptr + offs_n[:, None] * rank + offs_r[None, :],
                    mask=(offs_n[:, None] < N) & (offs_r[None, :] < rank), other=0.0)
        delta = tl.dot(la, tl.trans(b.to(tl.float32)), input_precision=precision)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        base = tl.load(base_ptr + offs_m[:, None] * stride_bm + offs_n[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)

    return lora_expand_kernel


@functools.cache
def _pdl_ok(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@custom_op("lora_shrink")
def lora_shrink(x: torch.Tensor, a0: torch.Tensor | None, a1: torch.Tensor | None,
                a2: torch.Tensor | None, s0: float, s1: float, s2: float,
                pdl: bool = True) -> torch.Tensor:
    """fp32 partials (split, M, slots * R) of s_i * x A_i^T, slot i for adapter A_i (rank, K)
    (None: no adapter on matrix i; its slot is zeros)."""
    if not x.is_cuda:
        return _reference(x, a0, a1, a2, (s0, s1, s2))
    return launch(x, a0, a1, a2, (s0, s1, s2), pdl=pdl and _pdl_ok(x.device.index or 0))


@lora_shrink.register_fake
def _(x, a0, a1, a2, s0, s1, s2, pdl=True):
    return x.new_empty(split_of(x.shape[1], x.shape[0]), x.shape[0],
                       slot_count(a0, a1, a2) * rank_block(_ranks(a0, a1, a2)), dtype=torch.float32)


def launch(x, a0, a1, a2, scales, pdl: bool = False, max_split: int = MAX_SPLIT) -> torch.Tensor:
    """Run the Triton kernel (CUDA, or Triton's interpreter on CPU tensors in tests).
    `max_split`: K slices at most (benchmarks/lora_sweep.py weighs others)."""
    import triton

    m, k = x.shape
    ranks, slots = _ranks(a0, a1, a2), slot_count(a0, a1, a2)
    r_block, k_per = rank_block(ranks), k_slice(k, m, max_split)
    split = -(-k // k_per)
    out = torch.empty(split, m, slots * r_block, device=x.device, dtype=torch.float32)
    block_m = row_block(m)
    dummy = next(a for a in (a0, a1, a2) if a is not None)
    adapters = [dummy if a is None else a for a in (a0, a1, a2)]
    extra = {"launch_pdl": True} if pdl else {}
    _kernel()[(slots, split, triton.cdiv(m, block_m))](
        x, *adapters, out, m, k, k_per, *ranks, *(float(s) for s in scales), x.stride(0),
        out.stride(0), out.stride(1), BLOCK_M=block_m, BLOCK_K=BLOCK_K, R=r_block,
        IEEE=x.dtype == torch.float32, PDL=pdl, num_warps=4, num_stages=2, **extra)
    return out


@custom_op("lora_expand")
def lora_expand(base: torch.Tensor, low_rank: torch.Tensor, b: torch.Tensor, slot: int,
                r_block: int, pdl: bool = True) -> torch.Tensor:
    """base + B (s A x) rounded once to base's dtype: `base` (M, N) a projection's output,
    `low_rank` the shrink's partials, `b` (N, rank) the adapter of its slot `slot`."""
    if not base.is_cuda:
        delta = low_rank_sum(low_rank, slot, b.shape[1], r_block) @ b.float().T
        return (base.float() + delta).to(base.dtype)
    return launch_expand(base, low_rank, b, slot, r_block,
                         pdl=pdl and _pdl_ok(base.device.index or 0))


@lora_expand.register_fake
def _(base, low_rank, b, slot, r_block, pdl=True):
    return torch.empty_like(base)


def launch_expand(base, low_rank, b, slot: int, r_block: int, pdl: bool = False) -> torch.Tensor:
    """Run the expand kernel (CUDA, or Triton's interpreter on CPU tensors in tests)."""
    import triton

    m, n = base.shape
    if base.stride(1) != 1 or not b.is_contiguous():
        raise ValueError("lora_expand needs unit column stride in base and a contiguous B")
    out = torch.empty(m, n, device=base.device, dtype=base.dtype)
    block_m = row_block(m)
    extra = {"launch_pdl": True} if pdl else {}
    _expand_kernel()[(triton.cdiv(n, 128), triton.cdiv(m, block_m))](
        base, low_rank, b, out, m, n, b.shape[1], slot, base.stride(0), out.stride(0),
        low_rank.stride(0), low_rank.stride(1), BLOCK_M=block_m, BLOCK_N=128, R=r_block,
        LA_SPLIT=low_rank.shape[0], IEEE=base.dtype == torch.float32, PDL=pdl,
        num_warps=4, num_stages=1, **extra)
    return out


def _reference(x, a0, a1, a2, scales) -> torch.Tensor:
    """The kernel's contract in plain torch (fp32): the K axis cut into the kernel's slices."""
    ranks, slots = _ranks(a0, a1, a2), slot_count(a0, a1, a2)
    r_block, k_per = rank_block(ranks), k_slice(*x.shape[::-1])
    split = split_of(*x.shape[::-1])
    out = x.new_zeros(split, x.shape[0], slots * r_block, dtype=torch.float32)
    x32 = x.float()
    for i, (a, scale) in enumerate(zip((a0, a1, a2), scales)):
        if a is None:
            continue
        for s in range(split):
            cols = slice(s * k_per, (s + 1) * k_per)
            out[s, :, i * r_block:i * r_block + a.shape[0]] = x32[:, cols] @ a.float()[:, cols].T * scale
    return out


def low_rank_sum(partials: torch.Tensor, slot: int, rank: int, r_block: int) -> torch.Tensor:
    """Slot `slot`'s s * A x (M, rank) in fp32, the shrink's slices summed (torch references)."""
    return partials.sum(0)[:, slot * r_block:slot * r_block + rank]
