"""The Triton kernel of `small_linear` and the live-LoRA shrink (imported only when a kernel first
runs, so importing flexrollout never needs Triton). The GEMV's programs are of two kinds: the
first `SHRINK_PROGRAMS` compute live adapters' s A x (the fused shrink), the others one output
block of one K slice of the GEMV each. The separate shrink launch (`kernels/lora.py`, for steps
whose GEMV takes no fused shrink) shares the fused one's tile loop, `shrink_tile`."""
import triton
import triton.language as tl


@triton.jit
def shrink_tile(x_ptr, a_ptr, rank, offs_m, M, K, k_start, K_LEN, stride_xm,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, R: tl.constexpr,
                precision: tl.constexpr):
    """x[offs_m, k_start:k_start + K_LEN] A[:rank, same columns]^T as an fp32 (BLOCK_M, R) tile
    (rows past M and columns past `rank` zero): one K slice of an adapter's A x, for the fused
    shrink below and the separate shrink kernel (kernels/lora.py)."""
    offs_r = tl.arange(0, R)
    acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    # Two stages whatever the GEMV's pipeline depth: (R, BLOCK_K) fp32 tiles of A are large.
    for k in tl.range(0, K_LEN, BLOCK_K, num_stages=2):
        offs_k = k_start + k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        # A (rank, K) in its own dtype (PEFT's fp32): converted here, never copied.
        a = tl.load(a_ptr + offs_r[:, None] * K + offs_k[None, :],
                    mask=(offs_r[:, None] < rank) & (offs_k[None, :] < K), other=0.0)
        acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision=precision)
    return acc


@triton.jit
def _slot_adapter(slot, a0_ptr, a1_ptr, a2_ptr, R0, R1, R2, s0, s1, s2):
    """(A, rank, scaling) of the adapter in `slot` (0-2) of a shrink's group."""
    if slot == 0:
        a_ptr, rank, scale = a0_ptr, R0, s0
    elif slot == 1:
        a_ptr, rank, scale = a1_ptr, R1, s1
    else:
        a_ptr, rank, scale = a2_ptr, R2, s2
    return a_ptr, rank, scale


@triton.jit
def lora_shrink_kernel(x_ptr, a0_ptr, a1_ptr, a2_ptr, out_ptr, M, K, K_PER, R0, R1, R2,
                       s0, s1, s2, stride_xm, stride_split, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, R: tl.constexpr,
                       IEEE: tl.constexpr, PDL: tl.constexpr):
    """The separate shrink launch (kernels/lora.py): program (slot, K slice, row block) stores
    its fp32 partial of s A x for the adapter of that slot."""
    slot = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    a_ptr, rank, scale = _slot_adapter(slot, a0_ptr, a1_ptr, a2_ptr, R0, R1, R2, s0, s1, s2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, R)
    precision: tl.constexpr = "ieee" if IEEE else "tf32"
    if PDL:
        # Launched early (PDL): x is the previous kernel's output; wait until it is written.
        tl.extra.cuda.gdc_wait()
    acc = shrink_tile(x_ptr, a_ptr, rank, offs_m, M, K, pid_k * K_PER, K_PER, stride_xm,
                      BLOCK_M, BLOCK_K, R, precision)
    out = out_ptr + pid_k * stride_split + offs_m[:, None] * stride_om + slot * R + offs_r[None, :]
    tl.store(out, acc * scale, mask=offs_m[:, None] < M)


@triton.jit
def _shrink_slice(x_ptr, a0_ptr, a1_ptr, a2_ptr, s0, s1, s2, la_ptr, sync_ptr, M, K, K_SHRINK,
                  R0, R1, R2, stride_xm, stride_la_split, stride_la_m,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, R: tl.constexpr,
                  SLOTS: tl.constexpr, precision: tl.constexpr):
    """One K slice of one adapter's s A x, stored as fp32 partial `part` of the low-rank
    buffer; then this program counts itself done (`sync_ptr[0]`) for the consumers."""
    slot = tl.program_id(0) % SLOTS
    part = tl.program_id(0) // SLOTS
    a_ptr, rank, scale = _slot_adapter(slot, a0_ptr, a1_ptr, a2_ptr, R0, R1, R2, s0, s1, s2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, R)
    acc = shrink_tile(x_ptr, a_ptr, rank, offs_m, M, K, part * K_SHRINK, K_SHRINK, stride_xm,
                      BLOCK_M, BLOCK_K, R, precision)
    tl.store(la_ptr + part * stride_la_split + offs_m[:, None] * stride_la_m + slot * R
             + offs_r[None, :], acc * scale, mask=offs_m[:, None] < M)
    # Every thread's stores, then one release: a consumer that sees the count sees them.
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release")

@triton.jit
def _gemv_block(x_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr, M, K, K_PER, N0, N1, N2,
                BLOCKS0, BLOCKS1, stride_xm, stride_split, stride_om,
                la_ptr, b0_ptr, b1_ptr, b2_ptr, R0, R1, R2, stride_la_split,
                stride_la_m, sync_ptr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SILU_MUL: tl.constexpr, precision: tl.constexpr,
                LORA: tl.constexpr, R: tl.constexpr, LA_SPLIT: tl.constexpr,
                GELU: tl.constexpr, SHRINK_PROGRAMS: tl.constexpr, PREFETCH_B: tl.constexpr,
                EXPAND_LAST: tl.constexpr, EVEN_K: tl.constexpr):
    """One output block of one K slice: W x over the slice, plus B (s A x) in one slice: the
    first, or with EXPAND_LAST the last (launched last, when the shrink has long finished).
    Without EVEN_K the slices overrun K (an input width off the K step): loads past K are masked."""
    pid_n = tl.program_id(0) - SHRINK_PROGRAMS
    pid_k = tl.program_id(1)
    expand_slice = tl.num_programs(1) - 1 if EXPAND_LAST else 0
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
    offs_r = tl.arange(0, R)
    if LORA and PREFETCH_B:
        # B's tiles load before the K loop, so their latency hides behind it (in the one
        # slice that adds B (s A x)).
        b_mask = (rows[:, None] < n_rows) & (offs_r[None, :] < rank) & (pid_k == expand_slice)
        b_first = tl.load(b_ptr + rows[:, None] * rank + offs_r[None, :], mask=b_mask, other=0.0)
        if SILU_MUL:
            b_up_mask = (rows[:, None] < n_rows) & (offs_r[None, :] < R1) & (pid_k == expand_slice)
            b_up = tl.load(b1_ptr + rows[:, None] * R1 + offs_r[None, :], mask=b_up_mask,
                           other=0.0)
    # Weights are the A operand (BLOCK_N x BLOCK_K), the few input rows the B operand:
    # the matrix units then work on 64-row tiles however small the batch is.
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K_PER, BLOCK_K):
        offs_k = pid_k * K_PER + k + tl.arange(0, BLOCK_K)
        x_mask = offs_m[:, None] < M
        w_mask = rows[:, None] < n_rows
        if not EVEN_K:
            x_mask &= offs_k[None, :] < K
            w_mask &= offs_k[None, :] < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        w_offs = rows[:, None] * K + offs_k[None, :]
        w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)
        acc += tl.dot(w, tl.trans(x), input_precision=precision)
        if SILU_MUL:
            up = tl.load(w1_ptr + w_offs, mask=w_mask, other=0.0)
            acc_up += tl.dot(up, tl.trans(x), input_precision=precision)
    if LORA:  # noqa: SIM102 (compile-time branch around a runtime one)
        # The adapter's B (s A x) joins the fp32 sums once (in one K slice), before the
        # epilogue: the partials' consumers and SiLU-mul see base + delta. Columns past
        # `rank` (and slots without an adapter, rank 0) are masked out of both operands.
        if pid_k == expand_slice:
            if SHRINK_PROGRAMS > 0:
                # The fused shrink's programs (launched first) must all have stored.
                done = tl.atomic_add(sync_ptr, 0, sem="acquire")
                while done < SHRINK_PROGRAMS:
                    done = tl.atomic_add(sync_ptr, 0, sem="acquire")
                tl.debug_barrier()
            for j in tl.static_range(2 if SILU_MUL else 1):   # SiLU-mul: gate, then up
                if j == 1:
                    b_ptr, rank, slot = b1_ptr, R1, 1
                la_mask = (offs_m[:, None] < M) & (offs_r[None, :] < rank)
                la = tl.zeros((BLOCK_M, R), dtype=tl.float32)
                for s in tl.static_range(LA_SPLIT):
                    # .cg: from L2, where this launch's shrink programs just wrote them.
                    la += tl.load(la_ptr + s * stride_la_split + offs_m[:, None] * stride_la_m
                                  + slot * R + offs_r[None, :], mask=la_mask, other=0.0,
                                  cache_modifier=".cg")
                if PREFETCH_B:
                    b = b_first if j == 0 else b_up
                else:
                    b = tl.load(b_ptr + rows[:, None] * rank + offs_r[None, :],
                                mask=(rows[:, None] < n_rows) & (offs_r[None, :] < rank),
                                other=0.0)
                delta = tl.dot(b.to(tl.float32), tl.trans(la), input_precision=precision)
                if j == 0:
                    acc += delta
                else:
                    acc_up += delta
            if SHRINK_PROGRAMS > 0:
                # The last reader resets both counters for the next launch (which starts
                # its shrink only after this grid has finished: stream order, or PDL's wait).
                readers = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
                if readers == tl.num_programs(0) - SHRINK_PROGRAMS - 1:
                    tl.atomic_xchg(sync_ptr, 0)
                    tl.atomic_xchg(sync_ptr + 1, 0)
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


@triton.jit
def small_linear_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr, M, K, K_PER, N0, N1, N2,
                        BLOCKS0, BLOCKS1, stride_xm, stride_split, stride_om,
                        la_ptr, b0_ptr, b1_ptr, b2_ptr, R0, R1, R2, stride_la_split,
                        stride_la_m, a0_ptr, a1_ptr, a2_ptr, s0, s1, s2, K_SHRINK, sync_ptr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SILU_MUL: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                        LORA: tl.constexpr, R: tl.constexpr, LA_SPLIT: tl.constexpr,
                        GELU: tl.constexpr, SHRINK_PROGRAMS: tl.constexpr,
                        SLOTS: tl.constexpr, PREFETCH_B: tl.constexpr,
                        EXPAND_LAST: tl.constexpr = False, EVEN_K: tl.constexpr = True):
    precision: tl.constexpr = "ieee" if IEEE else "tf32"
    if PDL:
        # Launched early (PDL): x is the previous kernel's output; wait until it is written.
        tl.extra.cuda.gdc_wait()
    if tl.program_id(0) < SHRINK_PROGRAMS:
        # The first programs compute the adapters' s A x (fused shrink; none without it).
        if tl.program_id(1) == 0:
            _shrink_slice(x_ptr, a0_ptr, a1_ptr, a2_ptr, s0, s1, s2, la_ptr, sync_ptr, M, K,
                          K_SHRINK, R0, R1, R2, stride_xm, stride_la_split, stride_la_m,
                          BLOCK_M, 128, R, SLOTS, precision)    # (K_SHRINK: a multiple of 128)
    else:
        _gemv_block(x_ptr, w0_ptr, w1_ptr, w2_ptr, out_ptr, M, K, K_PER, N0, N1, N2, BLOCKS0,
                    BLOCKS1, stride_xm, stride_split, stride_om, la_ptr, b0_ptr, b1_ptr,
                    b2_ptr, R0, R1, R2, stride_la_split, stride_la_m, sync_ptr,
                    BLOCK_M, BLOCK_N, BLOCK_K, SILU_MUL, precision, LORA, R, LA_SPLIT,
                    GELU, SHRINK_PROGRAMS, PREFETCH_B, EXPAND_LAST, EVEN_K)
