"""Projections of small decode batches: a Triton split-K GEMV over the model's own weights.

At decode a projection multiplies a few rows by a large matrix, so it is a pass over the weight
bytes. cuBLAS reaches 2.1-3.5 TB/s on Qwen3-4B's shapes at M <= 8 on an H200, and only
0.35-0.86 TB/s on the 5 MB k/v projections; this kernel reaches 2.4-4.0 and 1.2 TB/s
(benchmarks/gemv_sweep.py, BENCHMARKS.md). It also removes launches: q, k and v (up to three
matrices reading the same input) are one launch, and gate/up are one launch whose epilogue is
SiLU(gate) * up. Nothing is concatenated or copied: each matrix is read where the user's
model keeps it.

Live LoRA: given the low-rank intermediate s * A x of each matrix's adapter (`kernels.lora`'s
shrink, fp32 partials) and the adapters' B matrices (PEFT's own, fp32 or any float dtype), the
kernel adds B (s A x) to its fp32 sums before its epilogue: the adapted projections keep the
one-launch q/k/v and SiLU-mul paths, with no separate expand or add kernel.

`small_linear(x, w0, w1, w2, silu_mul)` returns fp32 partial sums of shape (split, M, N) with
N = the output widths side by side; callers add them (`sum_partials`), which torch.compile fuses
into whatever consumes the result. With `silu_mul` (SiLU, or GELU-tanh with `act`) there is one
partial, already in x's dtype:
it feeds the down projection's kernel directly, with no cast kernel in between. It is a torch
custom op, so compiled code treats it as one opaque kernel. Off CUDA (tests, CPU) it computes
the same partials with torch.

On Hopper and later the kernel is launched with programmatic dependent launch (PDL): it may
start while the kernel before it drains, and waits (griddepcontrol.wait) before its first load:
0.4-0.5 us less per (elementwise kernel -> projection) pair on an H200 (benchmarks/gemv_sweep.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..compile import deepest_fitting
from . import custom_op

# Largest batch the engine gives the kernel for plain projections (row tiles of 16 or 32); larger
# ones go to cuBLAS, which is on par from M = 64 on. The engine's threshold is
# EngineConfig.small_batch_max_rows.
MAX_ROWS = 32
# Largest batch one launch takes (a 64-row tile): live-LoRA projections up to
# EngineConfig.lora_gemv_max_rows, where the adapter folded into the launch saves cuBLAS's
# separate shrink and expand launches.
LAUNCH_MAX_ROWS = 64
# Every supported weight's input width is a multiple of this (the smallest K step used).
BLOCK_K = 128
# Input widths the kernel takes: multiples of 64 (row starts stay 128-byte aligned). Widths off
# the 128-wide K step (26B-A4B's 2,112-wide down_proj, gpt-oss's 2,880-wide inputs) run slices
# of whole K steps whose loads past K are masked.
K_ALIGN = 64
BLOCK_N = 64
# Enough programs to keep the H200's 132 SMs streaming: split K until blocks x split >= this.
# (o_proj, 40 blocks: split 8 reads 2.84 TB/s at M = 1, split 2 2.72; benchmarks/gemv_sweep.py.)
MIN_PROGRAMS = 256
MAX_SPLIT = 8
# Long-K tiles with fewer programs than this leave the GPU's SMs idle (see _long_k_tiling).
LONG_K_MIN_PROGRAMS = 64
# K slices per adapter in the fused shrink (each a program; the GEMV's slice-0 programs sum them).
SHRINK_SPLIT = 16


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (HF's `gelu_pytorch_tanh`). A function, not a
    `functools.partial`: the layers choose the fused gate/up launch by `act is GELU_TANH`, and
    torch.compile compared a partial argument as unequal to that very partial, so Gemma's
    compiled decode ran gate and up as two launches and a third for the product."""
    return F.gelu(x, approximate="tanh")


# The gated products the gate/up launch's epilogue computes, act(gate) * up: Llama / Qwen's SiLU
# and Gemma's GELU-tanh (the layers pass these very functions).
GELU_TANH = gelu_tanh
GATED_ACTS = {"silu": F.silu, "gelu_tanh": GELU_TANH}


@dataclass(frozen=True)
class Tiling:
    """How one launch cuts the work: weight rows per program, K per loop step, K splits."""

    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    split: int = 1
    warps: int = 4
    stages: int = 5


def weight_fits(weight: torch.Tensor) -> bool:
    """A matrix the kernel can stream, its device aside: contiguous rows of a float dtype, input
    width a multiple of K_ALIGN."""
    return (weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weight.shape[1] % K_ALIGN == 0)


def weight_supported(weight: torch.Tensor) -> bool:
    """A CUDA matrix the kernel can stream."""
    return weight.is_cuda and weight_fits(weight)


def fits(x: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """A projection of `x` by `weight` the kernel computes, devices aside."""
    return (x.dim() == 2 and x.shape[0] <= min(max_rows, MAX_ROWS) and x.dtype == weight.dtype
            and weight_fits(weight))


def supported(x: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether a projection of `x` by `weight` takes this path."""
    return x.is_cuda and weight.is_cuda and fits(x, weight, max_rows)


def split_k(n_total: int, k: int, silu_mul: bool) -> int:
    """Split the K loop until there are enough programs (SiLU-mul needs whole sums: no split).
    A width off the K step splits while every slice keeps two K steps, into slices of whole
    steps, none empty (so the count need not be a power of two)."""
    if silu_mul:
        return 1
    blocks, split = -(-n_total // BLOCK_N), 1
    steps, ragged = -(-k // BLOCK_K), k % BLOCK_K != 0

    def halves(split: int) -> bool:
        return steps >= 4 * split if ragged else k % (2 * split * BLOCK_K) == 0

    while blocks * split < MIN_PROGRAMS and split < MAX_SPLIT and halves(split):
        split *= 2
    return -(-steps // -(-steps // split)) if ragged else split


def k_per_split(k: int, tile: Tiling) -> int:
    """Input columns per K slice: whole K steps; past K (a ragged width) the loads are masked."""
    steps = -(-k // tile.block_k)
    return tile.block_k * -(-steps // tile.split)


def tile_fits(k: int, tile: Tiling) -> bool:
    """`launch` can run `tile` over input width k: a multiple of K_ALIGN, cut into `tile.split`
    slices of whole K steps, none of them empty."""
    return k % K_ALIGN == 0 and k_per_split(k, tile) * (tile.split - 1) < k


def tiling(m: int, n_total: int, k: int, silu_mul: bool, dtype: torch.dtype) -> Tiling:
    """The launch shape for one projection, from the H200 sweep (benchmarks/gemv_sweep.py):
    deep pipelines (5 stages) only for unsplit single-matrix loops; split or wide (LM head)
    loops and SiLU-mul, which streams two matrices per stage, run best with 3 (gate/up at
    M = 1: 3.76 TB/s against 3.41 with 5). fp32 tiles are twice the bytes: 3 fits them."""
    if silu_mul:
        # 17..32 rows of 16-bit weights: 128-row blocks and 8 warps (3.56 against 3.25 TB/s).
        # fp32 tiles of that size overflow shared memory.
        # (33..64 rows, live LoRA only: 64-row blocks, whose three-stage tiles fit at 64 rows.)
        wide = 16 < m <= 32 and dtype != torch.float32
        return Tiling(block_n=128 if wide else BLOCK_N, warps=8 if wide else 4, stages=3)
    long_k = _long_k_tiling(m, n_total, k, dtype)
    if long_k is not None:
        return long_k
    split = split_k(n_total, k, silu_mul)
    many = -(-n_total // BLOCK_N) >= 256
    stages = 3 if split > 1 or many or dtype == torch.float32 else 5
    return Tiling(split=split, stages=stages)


def _long_k_tiling(m: int, n_total: int, k: int, dtype: torch.dtype) -> Tiling | None:
    """Down projections (K several times N): fewer programs, each streaming a longer K loop
    through 5 stages, beat the 256-program rule. Qwen3-4B's down (2560 x 9728) at M = 1:
    3.51 TB/s with 256-wide K steps and split 2, against 3.27; at M = 8: 3.46 with 128-row
    blocks and split 4, against 3.22 (gemv_sweep.py's search). 16-bit only: fp32 stages of
    this size overflow shared memory."""
    if dtype == torch.float32 or k < 3 * n_total:
        return None
    # M = 1 is its own compiled specialisation anyway (dynamo specialises size 1), so the split
    # changing there adds no recompile of the regions that sum these partials.
    tile = Tiling(block_k=256, split=2) if m == 1 else Tiling(block_n=128, split=4)
    if -(-n_total // tile.block_n) * tile.split < LONG_K_MIN_PROGRAMS:
        # Narrow outputs (Gemma-4-E2B's down, 1536 x 6144 / 12288, and its per-layer-input gate,
        # 256 x 1536) leave those tiles too few programs: 64-row blocks, 128-wide K steps and
        # split 4 ran 8-10% faster at M = 1 and 8 (H100, BENCHMARKS.md "fifteenth session").
        tile = Tiling(split=4)
    return tile if k % (tile.split * tile.block_k) == 0 else None


@functools.cache
def _pdl_ok(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (so importing flexrollout never needs Triton)."""
    from .small_linear_jit import small_linear_kernel
    return small_linear_kernel


def _out_width(w0, w1, w2, silu_mul: bool) -> int:
    if silu_mul:
        return w0.shape[0]
    return sum(w.shape[0] for w in (w0, w1, w2) if w is not None)


def _out_dtype(x: torch.Tensor, silu_mul: bool) -> torch.dtype:
    return x.dtype if silu_mul else torch.float32


@custom_op("small_linear")
def small_linear(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor | None = None,
                 w2: torch.Tensor | None = None, silu_mul: bool = False,
                 pdl: bool = True, low_rank: torch.Tensor | None = None,
                 b0: torch.Tensor | None = None, b1: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None, act: str = "silu",
                 a0: torch.Tensor | None = None, a1: torch.Tensor | None = None,
                 a2: torch.Tensor | None = None, s0: float = 0.0, s1: float = 0.0,
                 s2: float = 0.0) -> torch.Tensor:
    """fp32 partials (split, M, N) of x @ [w0; w1; w2]^T, or act(x w0^T) * (x w1^T) as
    (1, M, N) in x's dtype (`silu_mul`; `act`: "silu" or "gelu_tanh", Gemma's gated MLP).
    `pdl`: allow programmatic dependent launch (where the GPU has it).

    Live LoRA: `b0`..`b2` are the adapters' B (out, rank) (None: no adapter on that matrix);
    each matrix's B (s A x) is added to its sums (to gate and up before SiLU-mul). s A x comes
    either as `low_rank`, `kernels.lora.lora_shrink`'s partials, or is computed in this launch
    from the adapters' A `a0`..`a2` (rank, K) and scalings `s0`..`s2` (the fused shrink)."""
    tile = _tiling_of(x, w0, w1, w2, silu_mul)
    if act not in GATED_ACTS:
        raise ValueError(f"act must be one of {sorted(GATED_ACTS)}, got {act!r}")
    lora_a = (a0, a1, a2, (s0, s1, s2)) if any(a is not None for a in (a0, a1, a2)) else None
    if lora_a is not None and low_rank is not None:
        raise ValueError("small_linear takes low_rank or the adapters' A (a0..a2), not both")
    lora = None if low_rank is None and lora_a is None else (low_rank, b0, b1, b2)
    if not x.is_cuda:
        if lora_a is not None:
            lora = (_shrink_reference(x, *lora_a), b0, b1, b2)
        return _reference(x, w0, w1, w2, silu_mul, tile, lora, act)
    return launch(x, w0, w1, w2, silu_mul, tile, pdl=pdl and _pdl_ok(x.device.index or 0),
                  lora=lora, act=act, lora_a=lora_a)


def _tiling_of(x, w0, w1, w2, silu_mul: bool) -> Tiling:
    return tiling(x.shape[0], _out_width(w0, w1, w2, silu_mul), x.shape[1], silu_mul, x.dtype)


def launch(x, w0, w1, w2, silu_mul: bool, tile: Tiling, pdl: bool = False,
           lora: tuple | None = None, act: str = "silu", lora_a: tuple | None = None,
           shrink_split: int = SHRINK_SPLIT, prefetch_b: bool = True,
           expand_last: bool = False) -> torch.Tensor:
    """Run the Triton kernel (CUDA, or Triton's interpreter on CPU tensors in tests).
    `pdl`: launch with programmatic dependent launch (Hopper on). `lora`: (low_rank, b0, b1,
    b2) and `act` as `small_linear` takes them; with `lora_a` (a0, a1, a2, scalings) low_rank
    may be None: the launch's first programs compute it, in up to `shrink_split` K slices per
    adapter. `prefetch_b`: load the B tiles before the K loop. `expand_last`: add B (s A x) in
    the last K slice, not the first (benchmarks/lora_sweep.py measures both)."""
    import triton

    m, k = x.shape
    if not tile_fits(k, tile):
        raise ValueError(f"tiling {tile} does not fit the input width {k}")
    k_per = k_per_split(k, tile)
    out = torch.empty(tile.split, m, _out_width(w0, w1, w2, silu_mul), device=x.device,
                      dtype=_out_dtype(x, silu_mul))
    n0 = w0.shape[0]
    n1 = 0 if w1 is None or silu_mul else w1.shape[0]
    n2 = 0 if w2 is None else w2.shape[0]
    blocks = [triton.cdiv(n, tile.block_n) for n in (n0, n1, n2)]
    extra = {"launch_pdl": True} if pdl else {}
    low_rank, bs = (None, (None,) * 3) if lora is None else (lora[0], lora[1:])
    ranks = [0 if b is None else b.shape[1] for b in bs]
    r_block = rank_block(ranks)
    shrink = _FusedShrink(x, lora_a, r_block, shrink_split) if lora_a is not None else None
    if shrink is not None:
        low_rank = shrink.low_rank
    # Without LoRA the pointers are never read (LORA=False): any tensor stands in.
    la = out if low_rank is None else low_rank
    b_ptrs = [next((b for b in bs if b is not None), out) if b is None else b for b in bs]
    a_args = (la,) * 3 + (0.0,) * 3 + (0, la) if shrink is None else shrink.args
    programs = 0 if shrink is None else shrink.programs
    args = (x, w0, w0 if w1 is None else w1, w0 if w2 is None else w2, out, m, k, k_per,
            n0, n1, n2, blocks[0], blocks[1], x.stride(0), out.stride(0), out.stride(1),
            la, *b_ptrs, *ranks, la.stride(0), la.stride(1), *a_args)
    consts = dict(
        BLOCK_M=row_block(m), BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, SILU_MUL=silu_mul, IEEE=x.dtype == torch.float32, PDL=pdl,
        LORA=low_rank is not None, R=r_block, LA_SPLIT=la.shape[0] if low_rank is not None else 1,
        GELU=act == "gelu_tanh", SHRINK_PROGRAMS=programs,
        SLOTS=1 if shrink is None else shrink.slots, PREFETCH_B=prefetch_b and low_rank is not None,
        EXPAND_LAST=expand_last, EVEN_K=k_per * tile.split == k)
    launch_fitting(_kernel(), (programs + sum(blocks), tile.split), args, consts, tile.warps,
                   tile.stages, x.device, **extra)
    return out


# (device, warps, asked depth, constants) -> the pipeline depth that fit the device's shared
# memory. (Tilings with the same constants may ask different depths: the depth is in the key.)
_FITTED_STAGES: dict[tuple, int] = {}


def launch_fitting(kernel, grid, args: tuple, consts: dict, warps: int, stages: int,
                   device: torch.device, **launch_options) -> None:
    """Launch `kernel` with `stages` pipeline stages, or the deepest that fits the GPU's shared
    memory. The tilings come from H200 sweeps; an adapter's tiles (B prefetched, the low-rank
    dot) push some past Hopper's 227 KiB (gate/up at 17-32 rows: 232 KiB at r=16, H100,
    2026-12-06), and smaller GPUs have less. Triton refuses such a variant before it runs, so
    retrying shallower is safe; the depth found is kept per variant."""
    from triton.runtime.errors import OutOfResources

    def run(depth: int) -> None:
        kernel[grid](*args, **consts, num_warps=warps, num_stages=depth, **launch_options)

    deepest_fitting(run, stages, (device, warps, stages, *consts.items()), _FITTED_STAGES,
                    OutOfResources, lambda err: True)


class _FusedShrink:
    """The fused shrink of one launch: `slots` adapters (a matrix without one keeps its slot,
    zeros) x `parts` K slices = `programs` programs ahead of the GEMV's, writing `low_rank`
    (parts, M, slots * R) fp32 partials, with a zeroed pair of counters they and the GEMV's
    slice-0 programs meet at."""

    def __init__(self, x: torch.Tensor, lora_a: tuple, r_block: int, max_parts: int):
        *adapters, scales = lora_a
        m, k = x.shape
        self.slots = max(i + 1 for i, a in enumerate(adapters) if a is not None)
        k_shrink, parts = shrink_parts(k, max_parts)
        self.programs = self.slots * parts
        self.low_rank = torch.empty(parts, m, self.slots * r_block, device=x.device,
                                    dtype=torch.float32)
        dummy = next(a for a in adapters if a is not None)
        if not all(a is None or (a.is_contiguous() and a.shape[1] == k) for a in adapters):
            raise ValueError("the fused shrink needs contiguous adapters A of the input's width")
        self.args = (*(dummy if a is None else a for a in adapters), *(float(s) for s in scales),
                     k_shrink, sync_counters(x.device))


def shrink_parts(k: int, max_parts: int) -> tuple[int, int]:
    """(input columns per shrink program, K slices) for a k-wide input cut into at most
    `max_parts` slices of whole BLOCK_K steps (past K, a ragged width, the loads are masked):
    the fused shrink's, and the separate shrink's per row block (`lora.k_slice`)."""
    steps = -(-k // BLOCK_K)
    k_shrink = BLOCK_K * -(-steps // max_parts)
    return k_shrink, -(-k // k_shrink)


# Per device, two int32 counters the fused shrink's launches use and leave at zero.
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def sync_counters(device: torch.device) -> torch.Tensor:
    """The device's counters, allocated on first use. That first use must not be inside a
    CUDA-graph capture (the engine's warm-up steps run first), or the graph's pool would own
    them."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("small_linear's fused shrink first ran inside a CUDA-graph "
                               "capture; run the step once eagerly before capturing it")
        counters = _COUNTERS[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return counters


def row_block(m: int) -> int:
    """Rows per tile for a batch of m rows (16, 32 or 64: the matrix units' operand sizes)."""
    return 16 if m <= 16 else (32 if m <= 32 else 64)


def rank_block(ranks) -> int:
    """R: the largest adapter rank rounded up to a power of two, at least 16 (the smallest dot
    tile); the GEMV's folded low-rank tile and the LoRA kernels' share it."""
    r = max(16, *ranks)
    return 1 << (r - 1).bit_length()


@small_linear.register_fake
def _(x, w0, w1=None, w2=None, silu_mul=False, pdl=True, low_rank=None, b0=None, b1=None, b2=None,
      act="silu", a0=None, a1=None, a2=None, s0=0.0, s1=0.0, s2=0.0):
    split = _tiling_of(x, w0, w1, w2, silu_mul).split
    return x.new_empty(split, x.shape[0], _out_width(w0, w1, w2, silu_mul),
                       dtype=_out_dtype(x, silu_mul))


def _reference(x, w0, w1, w2, silu_mul: bool, tile: Tiling, lora: tuple | None = None,
               act: str = "silu") -> torch.Tensor:
    """The kernel's contract in plain torch (fp32 sums): the K axis cut into `tile.split`
    partials of `k_per_split` columns (the last may be shorter), the adapters' B (s A x) added
    to the first."""
    x32 = x.float()
    deltas = _low_rank_reference(lora, x.shape[0])
    if silu_mul:
        gate, up = x32 @ w0.float().T + deltas[0], x32 @ w1.float().T + deltas[1]
        return (GATED_ACTS[act](gate) * up)[None].to(x.dtype)
    weights = [w for w in (w0, w1, w2) if w is not None]
    weight = torch.cat([w.float() for w in weights])
    k_per = k_per_split(x.shape[1], tile)
    parts = torch.stack([x32[:, i * k_per:(i + 1) * k_per] @ weight[:, i * k_per:(i + 1) * k_per].T
                         for i in range(tile.split)])
    parts[0] += torch.cat([d.expand(x.shape[0], w.shape[0]) for d, w in zip(deltas, weights)], dim=1)
    return parts


def _shrink_reference(x, a0, a1, a2, scales) -> torch.Tensor:
    """s A x of each adapter as one partial (1, M, slots * R), fp32, zeros where none."""
    adapters = (a0, a1, a2)
    r_block = rank_block([0 if a is None else a.shape[0] for a in adapters])
    slots = max(i + 1 for i, a in enumerate(adapters) if a is not None)
    out = x.new_zeros(1, x.shape[0], slots * r_block, dtype=torch.float32)
    for i, (a, scale) in enumerate(zip(adapters, scales)):
        if a is not None:
            out[0, :, i * r_block:i * r_block + a.shape[0]] = x.float() @ a.float().T * scale
    return out


def _low_rank_reference(lora: tuple | None, rows: int) -> list:
    """Each matrix's B (s A x) (rows, out) in fp32, or 0.0 where it has no adapter."""
    if lora is None:
        return [torch.zeros(())] * 3
    low_rank, bs = lora[0].sum(0), lora[1:]
    r_block = rank_block([0 if b is None else b.shape[1] for b in bs])
    deltas = []
    for slot, b in enumerate(bs):
        if b is None:
            deltas.append(torch.zeros(()))
            continue
        rank = b.shape[1]
        deltas.append(low_rank[:, slot * r_block:slot * r_block + rank] @ b.float().T)
    return deltas


def sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """The split-K partials (split, M, N) added up, as adds of the slices rather than a sum over
    the split axis: adds are element-wise, so Inductor fuses them into the kernel that reads the
    result even where that kernel reduces over the row (a norm), where a sum over the split axis
    kept a kernel of its own (E2B's o_proj before its norm, H100 profile, 2026-12-07). Outside
    torch.compile nothing fuses, so there it stays the sum."""
    if not torch.compiler.is_compiling():
        return partials.sum(0)      # eagerly, one kernel rather than one add per slice
    total = partials[0]
    for part in partials[1:]:
        total = total + part
    return total


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            max_rows: int = MAX_ROWS, pdl: bool = True) -> torch.Tensor:
    """`F.linear` that routes small CUDA batches through the kernel (same dtype out)."""
    if not supported(x, weight, max_rows):
        return F.linear(x, weight, bias)
    out = sum_partials(small_linear(x, weight, pdl=pdl)).to(x.dtype)
    return out if bias is None else out + bias
