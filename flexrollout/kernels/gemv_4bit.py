"""Small-batch projections over bitsandbytes 4-bit weights: a Triton split-K GEMV that reads the
packed nibbles and the per-block absmax where bitsandbytes keeps them and dequantises in registers.

The layout is bitsandbytes 0.50's (its reference `quantize_4bit` / `dequantize_4bit` in
`bitsandbytes/backends/default/ops.py`): the (N, K) weight is flattened row-major and element
`i` is byte `i // 2`'s high nibble when `i` is even, its low nibble when odd; each nibble indexes
the 16-entry code (nf4 or fp4), scaled by `absmax[i // blocksize]` in fp32 and rounded to the
quant state's dtype. Double quantisation stores absmax as uint8 codes:
`absmax = code2[q] * absmax2[j // blocksize2] + offset` (fp32), as `dequantize_blockwise` does.

The kernel serves weights whose rows hold whole quantisation blocks (K a multiple of the block
size: every real model's widths are): each loop step covers whole blocks of K (128 columns
where K allows: two NF4 blocks), so a row's scales are a few values per step (nested or not,
computed per row and block, not per element), and the step's bytes split into the high nibbles
(even elements) and low nibbles (odd elements), which meet x's even and odd columns in two
dots: no interleave and no per-element index arithmetic. What remains per element is one lookup
in the 16-entry code, held in registers for the whole loop (`tl.gather`: a warp shuffle on
sm_90), and the scale. x's columns for the step are one contiguous load, split into its even
and odd columns in registers.

The weight each product sees is bitsandbytes' dequantised weight bit for bit (rounded to its
dtype, then to x's); on CUDA the dots run in x's dtype with fp32 sums. Under Triton's interpreter
(CPU tests) the same values are rounded by bit arithmetic and multiplied in fp32, since the
interpreter truncates fp32 -> bf16 casts and multiplies bf16 dot operands as integers.

Results come back as fp32 partials (split, M, N) summed by the caller, like `small_linear`.

The engine routes to it only with `LLM(quant_kernels=True)` (off by default). Until 2026-12-07
it gathered the code from global memory per weight and loaded x's even and odd columns strided:
180 / 257 us for Qwen3-4B's q/k/v at 1 / 64 rows on an H100, against bitsandbytes' 12.4 / 34.8.
Its loop with the code in registers and x loaded whole took 27 / 33 us
(benchmarks/gemv_4bit_probe.py, H100, 2026-12-07): on par with bitsandbytes at 64 rows, still 2x
behind its fused GEMV at one row, so `layers/quant.py` keeps bitsandbytes' op by default. This
kernel, which carries both changes, has not itself been timed on a GPU. Nor has its loop step
of two NF4 blocks (64 columns before): compiled for sm_90 on CPU, its loop went from 18 to 9
instructions per weight.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from . import custom_op
from .small_linear import rank_block, row_block

# Largest row count this kernel serves: one row tile of 16, 32 or 64 rows (`row_block`), so a
# program dequantises its weight tile once for all of a decode batch's rows. Past 64 rows
# bitsandbytes' dequantise + matmul amortises its transient over enough rows.
MAX_ROWS = 64
BLOCK_N = 64
# Quantisation block sizes it takes: a loop step holds a (BLOCK_N, blocksize / 2) byte tile.
BLOCKSIZES = (32, 64, 128, 256)
# Columns of K a loop step covers at least (whole quantisation blocks): at 64 columns (one NF4
# block) the loop spent 18 instructions per weight, at 128 columns 9 (its SASS for sm_90,
# Triton 3.6, compiled on CPU: the step's fixed costs and the dots' operand shuffles halve).
STEP_COLUMNS = 128
# Split K until there are this many programs (the H200 has 132 SMs), as small_linear does.
MIN_PROGRAMS = 256
MAX_SPLIT = 8

_TL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Packed4bit:
    """What the kernel reads of a bitsandbytes QuantState, flattened: its tensors, where
    bitsandbytes keeps them (the kernel op's inputs), and its constants, which every projection
    of a model shares but the shape, so compiled code serves every layer with one compile.
    `state` is bitsandbytes' own object, for its ops."""

    absmax: torch.Tensor          # fp32 per block; uint8 codes when nested
    code: torch.Tensor            # the 16-entry code (nf4 or fp4), fp32
    absmax2: torch.Tensor         # nested: the second level's fp32 absmax; else `absmax` (unread)
    code2: torch.Tensor           # nested: the second level's code; else `code` (unread)
    offset: torch.Tensor          # nested: added to every absmax; else `absmax` (unread)
    shape: tuple[int, int]        # the weight's (out, in)
    blocksize: int
    blocksize2: int               # 1 when not nested
    nested: bool
    dtype: torch.dtype            # what bitsandbytes dequantises to
    quant_type: str
    state: object
    # "blocksize,blocksize2", as the ops take them: compiled code (dynamic=True) reads ints off
    # this object as symbols, which Inductor's wrapper left unbound (a NameError seen on an H100,
    # 2026-12-06, reproduced on CPU); a string stays a constant.
    blocksizes: str = ""
    # bitsandbytes' `gemm_4bit` op (0.50 on) takes this weight: its forward op, with a fake
    # implementation, so compiled code can call it (nested: second-level blocks of 256 only).
    gemm_op: bool = False

    @staticmethod
    def of(state) -> Packed4bit:
        nested = bool(state.nested)
        code = state.code.to(device=state.absmax.device, dtype=torch.float32)   # 16 values
        return Packed4bit(
            state.absmax, code, state.state2.absmax if nested else state.absmax,
            state.state2.code if nested else code, state.offset if nested else state.absmax,
            tuple(state.shape), state.blocksize, state.state2.blocksize if nested else 1, nested,
            state.dtype, state.quant_type, state,
            f"{state.blocksize},{state.state2.blocksize if nested else 1}",
            _has_gemm_4bit_op() and (not nested or state.state2.blocksize == 256))


def block_sizes(blocksizes: str) -> tuple[int, int]:
    """(blocksize, blocksize2) from `Packed4bit.blocksizes`; constants under torch.compile."""
    blocksize, blocksize2 = blocksizes.split(",")
    return int(blocksize), int(blocksize2)


@functools.cache
def _has_gemm_4bit_op() -> bool:
    """bitsandbytes registered its `gemm_4bit` op (0.50 on); asked once, not per projection read."""
    import bitsandbytes  # noqa: F401 (registers its ops)

    return hasattr(torch.ops.bitsandbytes, "gemm_4bit")


def takes_weight(q: Packed4bit) -> bool:
    """The kernel reads this weight: rows of whole quantisation blocks of a size it tiles."""
    return (q.dtype in _TL_DTYPES and q.blocksize in BLOCKSIZES and q.shape[1] % q.blocksize == 0
            and q.quant_type in ("nf4", "fp4"))


def takes(x: torch.Tensor, q: Packed4bit) -> bool:
    """The kernel computes x @ W^T: a 2-D batch of at most MAX_ROWS 16/32-bit rows over a
    weight it reads (the caller knows the device runs Triton)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1
            and x.dtype in _TL_DTYPES and takes_weight(q))


def supported(x: torch.Tensor, quant_state) -> bool:
    """`takes` on CUDA, or under Triton's interpreter (TRITON_INTERPRET=1, tests) on CPU; for a
    bitsandbytes QuantState or a Packed4bit."""
    on_device = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and takes(x, _packed(quant_state))


def _packed(quant_state) -> Packed4bit:
    return quant_state if isinstance(quant_state, Packed4bit) else Packed4bit.of(quant_state)


def step_columns(blocksize: int) -> int:
    """Columns of K a loop step covers where K allows: STEP_COLUMNS, or one block if larger.
    Slices are whole steps of this size (`k_slices`), whatever K: the op's output shape, which
    its fake computes from symbolic widths, must not depend on K's divisibility."""
    return max(blocksize, STEP_COLUMNS)


def blocks_per_step(k: int, blocksize: int) -> int:
    """Quantisation blocks one loop step covers: a step of `step_columns` where K is a multiple
    of it (every slice is then whole steps and the loop needs no masks), else one block."""
    step = step_columns(blocksize)
    return step // blocksize if k % step == 0 else 1


def pipeline_stages(step: int) -> int:
    """Loads in flight per program for a loop step of `step` columns of K: fewer for longer
    steps, whose tiles would otherwise overflow Hopper's 227 KB of shared memory (Triton 3.6
    for sm_90, 4 warps: at 4 stages a 256-column tile needs 233-449 KB, a 128-column one at most
    179 KB; with these, the most is 205 KB, fp32 rows of 64)."""
    return 4 if step <= 128 else 2


def split_k(n: int, k: int, step: int) -> int:
    blocks, split = -(-n // BLOCK_N), 1
    while blocks * split < MIN_PROGRAMS and split < MAX_SPLIT and k >= 2 * split * step:
        split *= 2
    return split


def k_slices(n: int, k: int, blocksize: int, split: int | None = None) -> tuple[int, int]:
    """(slices, columns per slice): whole loop steps per slice, `split` slices at most."""
    step = step_columns(blocksize)
    split = split or split_k(n, k, step)
    k_per = _cdiv(_cdiv(k, split), step) * step
    return _cdiv(k, k_per), k_per


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernel():
    """The Triton kernel, imported on first use (importing flexrollout never needs Triton)."""
    from .gemv_4bit_jit import gemv_4bit_kernel

    return gemv_4bit_kernel


def launch(x: torch.Tensor, packed: torch.Tensor, quant_state, split: int | None = None) -> torch.Tensor:
    """fp32 partials (split, M, N) of x @ dequant(W)^T (CUDA, or Triton's interpreter on CPU
    tensors in tests), for a bitsandbytes QuantState or a Packed4bit. Reads `packed` and the
    quant state's tensors where they are."""
    return launch_group(x, [(packed, _packed(quant_state))], split)


def launch_group(x: torch.Tensor, weights: list[tuple[torch.Tensor, Packed4bit]],
                 split: int | None = None, lora: tuple | None = None) -> torch.Tensor:
    """fp32 partials (split, M, N0 + N1 + N2) of up to three 4-bit weights of one input, their
    outputs side by side, from one launch. `lora`: (low_rank, b0, b1, b2) as `small_linear`
    takes them, each weight's B (s A x) added to its sums."""
    k = x.shape[1]
    for _, q in weights:
        if q.shape[1] != k or not takes_weight(q):
            raise ValueError(f"4-bit weight of shape {q.shape} and block size {q.blocksize} for input "
                             f"width {k}: the kernel needs whole blocks of {BLOCKSIZES} per row")
    if not groupable([q for _, q in weights]):
        raise ValueError("one launch takes at most three 4-bit weights quantised alike "
                         "(block sizes, nesting, dtype)")
    q0 = weights[0][1]
    tensors = _op_args(weights)
    return _launch(x, *tensors, _widths(tensors[0], k), q0.blocksize, q0.blocksize2, q0.nested,
                   q0.dtype, split, *(lora or (None,) * 4))


def groupable(states: list[Packed4bit]) -> bool:
    """These weights can share a launch: at most three, quantised alike."""
    first = states[0]
    return len(states) <= 3 and all(
        (q.blocksize, q.blocksize2, q.nested, q.dtype) == (first.blocksize, first.blocksize2, first.nested, first.dtype)
        for q in states)


def _op_args(weights: list[tuple[torch.Tensor, Packed4bit]]) -> tuple:
    """The op's per-matrix tensor lists."""
    return ([p for p, _ in weights], [q.absmax for _, q in weights], [q.code for _, q in weights],
            [q.absmax2 for _, q in weights], [q.code2 for _, q in weights],
            [q.offset for _, q in weights])


def _widths(packed: list[torch.Tensor], k: int) -> list:
    """Each weight's output width, from its packed bytes (two weights per byte, k per row)."""
    return [p.numel() * 2 // k for p in packed]


def _launch(x, packed, absmax, code, absmax2, code2, offset, ns: list[int], blocksize: int,
            blocksize2: int, nested: bool, w_dtype: torch.dtype, split: int | None = None,
            low_rank=None, b0=None, b1=None, b2=None) -> torch.Tensor:
    import triton
    import triton.language as tl

    m, k = x.shape
    split, k_per = k_slices(sum(ns), k, blocksize, split)
    per_step = blocks_per_step(k, blocksize)
    out = torch.empty(split, m, sum(ns), device=x.device, dtype=torch.float32)
    pad = 3 - len(ns)              # absent matrices: never read (no program maps to them)
    ns = list(ns) + [0] * pad
    per_matrix = [t + t[:1] * pad for t in (packed, absmax, code, absmax2, code2, offset)]
    blocks = [triton.cdiv(n, BLOCK_N) for n in ns]
    bs = (b0, b1, b2)
    ranks = [0 if b is None else b.shape[1] for b in bs]
    # Without LoRA (or without an adapter on a matrix) the pointers are never read.
    la = out if low_rank is None else low_rank
    b_ptrs = [next((b for b in bs if b is not None), out) if b is None else b for b in bs]
    _kernel()[(sum(blocks), split)](
        x, out, *[t[i] for i in range(3) for t in per_matrix],
        m, *ns, blocks[0], blocks[1], k, k_per, x.stride(0), out.stride(0), out.stride(1),
        la, *b_ptrs, *ranks, la.stride(0), la.stride(1),
        BLOCKSIZE=blocksize, BLOCKSIZE2=blocksize2,
        NESTED=nested, W_DTYPE=getattr(tl, _TL_DTYPES[w_dtype]),
        X_DTYPE=getattr(tl, _TL_DTYPES[x.dtype]), EMULATE=not x.is_cuda,
        BLOCK_M=row_block(m), BLOCK_N=BLOCK_N, LORA=low_rank is not None, R=rank_block(ranks),
        LA_SPLIT=la.shape[0] if low_rank is not None else 1, BLOCKS_PER_STEP=per_step,
        num_stages=pipeline_stages(blocksize * per_step))
    return out


@custom_op("gemv_4bit")
def gemv_4bit(x: torch.Tensor, packed: list[torch.Tensor], absmax: list[torch.Tensor],
              code: list[torch.Tensor], absmax2: list[torch.Tensor], code2: list[torch.Tensor],
              offset: list[torch.Tensor], blocksizes: str, nested: bool, w_dtype: torch.dtype,
              low_rank: torch.Tensor | None = None, b0: torch.Tensor | None = None,
              b1: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel as an op torch.compile traces (a graph input per tensor), like small_linear:
    fp32 partials (split, M, N0 + N1 + N2) of up to three weights quantised alike, with their
    adapters' B (s A x) when `low_rank` is given. `blocksizes`: "blocksize,blocksize2"."""
    blocksize, blocksize2 = block_sizes(blocksizes)
    return _launch(x, packed, absmax, code, absmax2, code2, offset, _widths(packed, x.shape[1]),
                   blocksize, blocksize2, nested, w_dtype, None, low_rank, b0, b1, b2)


@gemv_4bit.register_fake
def _(x, packed, absmax, code, absmax2, code2, offset, blocksizes, nested, w_dtype,
      low_rank=None, b0=None, b1=None, b2=None):
    n = sum(_widths(packed, x.shape[1]))
    blocksize = block_sizes(blocksizes)[0]
    return x.new_empty(k_slices(n, x.shape[1], blocksize)[0], x.shape[0], n, dtype=torch.float32)


def project_partials(x: torch.Tensor, weights: list[tuple[torch.Tensor, Packed4bit]],
                     low_rank: torch.Tensor | None = None, lora_b: list | None = None) -> list[torch.Tensor]:
    """Each weight's fp32 partials (split, M, N_i), from one launch for up to three weights of one
    input quantised alike (`groupable`); with `low_rank` (`kernels.lora`'s shrink) and each
    weight's B (`lora_b`, None: no adapter), the adapters folded in. Traceable by torch.compile."""
    q0 = weights[0][1]
    bs = list(lora_b or []) + [None] * (3 - len(lora_b or []))
    tensors = _op_args(weights)
    parts = gemv_4bit(x, *tensors, q0.blocksizes, q0.nested, q0.dtype, low_rank, *bs[:3])
    return list(parts.split(_widths(tensors[0], x.shape[1]), dim=-1))


def project(x: torch.Tensor, packed: torch.Tensor, quant_state,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(W)^T + b in x's dtype, for a batch the kernel takes."""
    out = project_partials(x, [(packed, _packed(quant_state))])[0].sum(0).to(x.dtype)
    return out if bias is None else out + bias
