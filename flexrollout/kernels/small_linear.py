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
N = the output widths side by side; callers add them (`.sum(0)`), which torch.compile fuses
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

# Largest batch the engine gives the kernel (row tiles of 16 or 32; `launch` also takes up to 64
# rows, for benchmarks); larger ones go to cuBLAS, which is on par from M = 64 on. The engine's threshold is EngineConfig.small_batch_max_rows.
MAX_ROWS = 32
# Every supported weight's input width is a multiple of this (the smallest K step used).
BLOCK_K = 128
BLOCK_N = 64
# Enough programs to keep the H200's 132 SMs streaming: split K until blocks x split >= this.
# (o_proj, 40 blocks: split 8 reads 2.84 TB/s at M = 1, split 2 2.72; benchmarks/gemv_sweep.py.)
MIN_PROGRAMS = 256
MAX_SPLIT = 8
# The gated products the gate/up launch's epilogue computes, act(gate) * up: Llama / Qwen's SiLU
# and Gemma's GELU-tanh (the layers pass these very functions).
GELU_TANH = functools.partial(F.gelu, approximate="tanh")
GATED_ACTS = {"silu": F.silu, "gelu_tanh": GELU_TANH}
@dataclass(frozen=True)
class Tiling:
    """How one launch cuts the work: weight rows per program, K per loop step, K splits."""

    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    split: int = 1
    warps: int = 4
    stages: int = 5


def weight_supported(weight: torch.Tensor) -> bool:
    """A CUDA matrix the kernel can stream: contiguous rows, input width a multiple of BLOCK_K."""
    return (weight.is_cuda and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weight.shape[1] % BLOCK_K == 0)


def supported(x: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether a projection of `x` by `weight` takes this path."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= min(max_rows, MAX_ROWS)
            and x.dtype == weight.dtype
            and weight_supported(weight))


def split_k(n_total: int, k: int, silu_mul: bool) -> int:
    """Split the K loop until there are enough programs (SiLU-mul needs whole sums: no split)."""
    if silu_mul:
        return 1
    blocks, split = -(-n_total // BLOCK_N), 1
    while blocks * split < MIN_PROGRAMS and split < MAX_SPLIT and k % (2 * split * BLOCK_K) == 0:
        split *= 2
    return split


def tiling(m: int, n_total: int, k: int, silu_mul: bool, dtype: torch.dtype) -> Tiling:
    """The launch shape for one projection, from the H200 sweep (benchmarks/gemv_sweep.py):
    deep pipelines (5 stages) only for unsplit single-matrix loops; split or wide (LM head)
    loops and SiLU-mul, which streams two matrices per stage, run best with 3 (gate/up at
    M = 1: 3.76 TB/s against 3.41 with 5). fp32 tiles are twice the bytes: 3 fits them."""
    if silu_mul:
        # 17..32 rows of 16-bit weights: 128-row blocks and 8 warps (3.56 against 3.25 TB/s).
        # fp32 tiles of that size overflow shared memory.
        # (33..64 rows, benchmarks only: 64-row blocks, whose three-stage tiles fit at 64 rows.)
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
    return tile if k % (tile.split * tile.block_k) == 0 else None


@functools.cache
def _pdl_ok(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (so importing flexrollout never needs Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def small_linear_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr, M, K, K_PER, N0, N1, N2,
                            BLOCKS0, BLOCKS1, stride_xm, stride_split, stride_om,
                            la_ptr, b0_ptr, b1_ptr, b2_ptr, R0, R1, R2, stride_la_split,
                            stride_la_m,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            SILU_MUL: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                            LORA: tl.constexpr, R: tl.constexpr, LA_SPLIT: tl.constexpr,
                            GELU: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        # Which matrix this program's output block belongs to, where its columns start, and its
        # adapter (B, rank, slot of the low-rank intermediate).
        if pid_n < BLOCKS0:
            w_ptr, n_rows, row0, col0 = w0_ptr, N0, pid_n * BLOCK_N, pid_n * 0
            b_ptr, rank, slot = b0_ptr, R0, 0
        elif pid_n < BLOCKS0 + BLOCKS1:
            w_ptr, n_rows, row0, col0 = w1_ptr, N1, (pid_n - BLOCKS0) * BLOCK_N, N0
            b_ptr, rank, slot = b1_ptr, R1, 1
        else:
            w_ptr, n_rows, row0, col0 = w2_ptr, N2, (pid_n - BLOCKS0 - BLOCKS1) * BLOCK_N, N0 + N1
            b_ptr, rank, slot = b2_ptr, R2, 2
        rows = row0 + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        precision: tl.constexpr = "ieee" if IEEE else "tf32"
        if PDL:
            # Launched early (PDL): x is the previous kernel's output; wait until it is written.
            tl.extra.cuda.gdc_wait()
        # Weights are the A operand (BLOCK_N x BLOCK_K), the few input rows the B operand:
        # the matrix units then work on 64-row tiles however small the batch is.
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(0, K_PER, BLOCK_K):
            offs_k = pid_k * K_PER + k + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=offs_m[:, None] < M, other=0.0)
            w_offs = rows[:, None] * K + offs_k[None, :]
            w_mask = rows[:, None] < n_rows
            w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)
            acc += tl.dot(w, tl.trans(x), input_precision=precision)
            if SILU_MUL:
                up = tl.load(w1_ptr + w_offs, mask=w_mask, other=0.0)
                acc_up += tl.dot(up, tl.trans(x), input_precision=precision)
        if LORA:  # noqa: SIM102 (compile-time branch around a runtime one)
            # The adapter's B (s A x) joins the fp32 sums once (in the first K slice), before
            # the epilogue: the partials' consumers and SiLU-mul see base + delta. Columns past
            # `rank` (and slots without an adapter, rank 0) are masked out of both operands.
            if pid_k == 0:
                offs_r = tl.arange(0, R)
                for j in tl.static_range(2 if SILU_MUL else 1):   # SiLU-mul: gate, then up
                    if j == 1:
                        b_ptr, rank, slot = b1_ptr, R1, 1
                    la_mask = (offs_m[:, None] < M) & (offs_r[None, :] < rank)
                    la = tl.zeros((BLOCK_M, R), dtype=tl.float32)
                    for s in tl.static_range(LA_SPLIT):
                        la += tl.load(la_ptr + s * stride_la_split + offs_m[:, None] * stride_la_m
                                      + slot * R + offs_r[None, :], mask=la_mask, other=0.0)
                    b = tl.load(b_ptr + rows[:, None] * rank + offs_r[None, :],
                                mask=(rows[:, None] < n_rows) & (offs_r[None, :] < rank), other=0.0)
                    delta = tl.dot(b.to(tl.float32), tl.trans(la), input_precision=precision)
                    if j == 0:
                        acc += delta
                    else:
                        acc_up += delta
        if SILU_MUL and GELU:
            # GELU-tanh(g) = 0.5 g (1 + tanh(u)) = g * sigmoid(2 u), u = sqrt(2 / pi) (g + 0.044715 g^3)
            u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = acc / (1.0 + tl.exp(-2.0 * u)) * acc_up
        elif SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        out = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + (col0 + rows)[:, None]
        # Stored in the output's dtype: fp32 partials, or x's dtype for SiLU-mul (rounded once).
        tl.store(out, acc.to(out_ptr.dtype.element_ty),
                 mask=(offs_m[None, :] < M) & (rows[:, None] < n_rows))

    return small_linear_kernel


def _out_width(w0, w1, w2, silu_mul: bool) -> int:
    if silu_mul:
        return w0.shape[0]
    return sum(w.shape[0] for w in (w0, w1, w2) if w is not None)


def _out_dtype(x: torch.Tensor, silu_mul: bool) -> torch.dtype:
    return x.dtype if silu_mul else torch.float32


@torch.library.custom_op("flexrollout::small_linear", mutates_args=())
def small_linear(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor | None = None,
                 w2: torch.Tensor | None = None, silu_mul: bool = False,
                 pdl: bool = True, low_rank: torch.Tensor | None = None,
                 b0: torch.Tensor | None = None, b1: torch.Tensor | None = None,
                 b2: torch.Tensor | None = None, act: str = "silu") -> torch.Tensor:
    """fp32 partials (split, M, N) of x @ [w0; w1; w2]^T, or act(x w0^T) * (x w1^T) as
    (1, M, N) in x's dtype (`silu_mul`; `act`: "silu" or "gelu_tanh", Gemma's gated MLP).
    `pdl`: allow programmatic dependent launch (where the GPU has it).

    Live LoRA: `low_rank` is `kernels.lora.lora_shrink`'s s * A x partials for the same
    matrices, `b0`..`b2` the adapters' B (out, rank) (None: no adapter on that matrix); each
    matrix's B (s A x) is added to its sums (to gate and up before SiLU-mul)."""
    tile = _tiling_of(x, w0, w1, w2, silu_mul)
    lora = None if low_rank is None else (low_rank, b0, b1, b2)
    if act not in GATED_ACTS:
        raise ValueError(f"act must be one of {sorted(GATED_ACTS)}, got {act!r}")
    if not x.is_cuda:
        return _reference(x, w0, w1, w2, silu_mul, tile.split, lora, act)
    return launch(x, w0, w1, w2, silu_mul, tile, pdl=pdl and _pdl_ok(x.device.index or 0),
                  lora=lora, act=act)


def _tiling_of(x, w0, w1, w2, silu_mul: bool) -> Tiling:
    return tiling(x.shape[0], _out_width(w0, w1, w2, silu_mul), x.shape[1], silu_mul, x.dtype)


def launch(x, w0, w1, w2, silu_mul: bool, tile: Tiling, pdl: bool = False,
           lora: tuple | None = None, act: str = "silu") -> torch.Tensor:
    """Run the Triton kernel (CUDA, or Triton's interpreter on CPU tensors in tests).
    `pdl`: launch with programmatic dependent launch (Hopper on). `lora`: (low_rank, b0, b1,
    b2) and `act` as `small_linear` takes them."""
    import triton

    m, k = x.shape
    if k % (tile.split * tile.block_k):
        raise ValueError(f"tiling {tile} does not divide the input width {k}")
    out = torch.empty(tile.split, m, _out_width(w0, w1, w2, silu_mul), device=x.device,
                      dtype=_out_dtype(x, silu_mul))
    n0 = w0.shape[0]
    n1 = 0 if w1 is None or silu_mul else w1.shape[0]
    n2 = 0 if w2 is None else w2.shape[0]
    blocks = [triton.cdiv(n, tile.block_n) for n in (n0, n1, n2)]
    extra = {"launch_pdl": True} if pdl else {}
    low_rank, bs = (None, (None,) * 3) if lora is None else (lora[0], lora[1:])
    ranks = [0 if b is None else b.shape[1] for b in bs]
    # Without LoRA the pointers are never read (LORA=False): any tensor stands in.
    la = out if low_rank is None else low_rank
    b_ptrs = [next((b for b in bs if b is not None), out) if b is None else b for b in bs]
    _kernel()[(sum(blocks), tile.split)](
        x, w0, w0 if w1 is None else w1, w0 if w2 is None else w2, out, m, k, k // tile.split,
        n0, n1, n2, blocks[0], blocks[1], x.stride(0), out.stride(0), out.stride(1),
        la, *b_ptrs, *ranks, la.stride(0), la.stride(1),
        BLOCK_M=row_block(m), BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, SILU_MUL=silu_mul, IEEE=x.dtype == torch.float32, PDL=pdl,
        LORA=low_rank is not None, R=rank_block(ranks), LA_SPLIT=la.shape[0] if low_rank is not None else 1,
        GELU=act == "gelu_tanh", num_warps=tile.warps, num_stages=tile.stages, **extra)
    return out


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
      act="silu"):
    split = _tiling_of(x, w0, w1, w2, silu_mul).split
    return x.new_empty(split, x.shape[0], _out_width(w0, w1, w2, silu_mul),
                       dtype=_out_dtype(x, silu_mul))


def _reference(x, w0, w1, w2, silu_mul: bool, split: int, lora: tuple | None = None,
               act: str = "silu") -> torch.Tensor:
    """The kernel's contract in plain torch (fp32 sums): the K axis cut into `split` partials,
    the adapters' B (s A x) added to the first."""
    x32 = x.float()
    deltas = _low_rank_reference(lora, x.shape[0])
    if silu_mul:
        gate, up = x32 @ w0.float().T + deltas[0], x32 @ w1.float().T + deltas[1]
        return (GATED_ACTS[act](gate) * up)[None].to(x.dtype)
    weights = [w for w in (w0, w1, w2) if w is not None]
    weight = torch.cat([w.float() for w in weights])
    k_per = x.shape[1] // split
    parts = torch.stack([x32[:, i * k_per:(i + 1) * k_per] @ weight[:, i * k_per:(i + 1) * k_per].T
                         for i in range(split)])
    parts[0] += torch.cat([d.expand(x.shape[0], w.shape[0]) for d, w in zip(deltas, weights)], dim=1)
    return parts


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


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            max_rows: int = MAX_ROWS, pdl: bool = True) -> torch.Tensor:
    """`F.linear` that routes small CUDA batches through the kernel (same dtype out)."""
    if not supported(x, weight, max_rows):
        return F.linear(x, weight, bias)
    out = small_linear(x, weight, pdl=pdl).sum(0).to(x.dtype)
    return out if bias is None else out + bias
