"""The Triton kernel of `gemv_4bit` (imported only when it first runs, so importing flexrollout
never needs Triton), and the per-block scale it reads, which `benchmarks/gemv_4bit_probe.py`
shares."""
import triton
import triton.language as tl


@triton.jit
def block_scale(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, row_ok,
                BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, EMULATE: tl.constexpr):
    """Each row's absmax for its quantisation block `block`: stored in fp32, or (NESTED) as a
    uint8 code scaled by the second level's absmax, plus the offset."""
    if NESTED:
        q = tl.load(absmax_ptr + block, mask=row_ok, other=0).to(tl.int32)
        scale2 = tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=row_ok, other=0.0)
        code2 = tl.load(code2_ptr + q)
        if EMULATE:
            scale = code2 * scale2 + tl.load(offset_ptr)
        else:
            # bitsandbytes multiplies, rounds, then adds the offset in a second op; a fused
            # multiply-add (the compiler's default) can land one ulp away, and the bf16 weight
            # one rounding step away (NF4 at 40 rows, H100, 2026-12-06: 2.9e-5 relative error):
            # `mul.rn` is never contracted.
            product = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r",
                                                [code2, scale2], dtype=tl.float32,
                                                is_pure=True, pack=1)
            scale = product + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + block, mask=row_ok, other=0.0)
    return scale


@triton.jit
def as_bnb_weight(w, W_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """Dequantised fp32 weights rounded as bitsandbytes' are (to its dtype), then to x's. Under
    the interpreter (EMULATE) in fp32 by bit arithmetic: it truncates fp32 -> bf16 casts."""
    if EMULATE:
        if W_DTYPE == tl.float16:
            w = w.to(tl.float16).to(tl.float32)
        if W_DTYPE == tl.bfloat16 or X_DTYPE == tl.bfloat16:
            bits = w.to(tl.uint32, bitcast=True)         # nearest even, by bit arithmetic
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            w = bits.to(tl.float32, bitcast=True)
        if X_DTYPE == tl.float16:
            w = w.to(tl.float16).to(tl.float32)
    else:
        w = w.to(W_DTYPE).to(X_DTYPE)
    return w


@triton.jit
def gemv_4bit_kernel(x_ptr, out_ptr,
                     packed_0, absmax_0, code_0, absmax2_0, code2_0, offset_0,
                     packed_1, absmax_1, code_1, absmax2_1, code2_1, offset_1,
                     packed_2, absmax_2, code_2, absmax2_2, code2_2, offset_2,
                     M, N0, N1, N2, BLOCKS0, BLOCKS1, K, K_PER,
                     stride_xm, stride_split, stride_om,
                     la_ptr, b_0, b_1, b_2, R0, R1, R2, stride_la_split, stride_la_m,
                     BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                     NESTED: tl.constexpr, W_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr,
                     EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     LORA: tl.constexpr, R: tl.constexpr, LA_SPLIT: tl.constexpr,
                     BLOCKS_PER_STEP: tl.constexpr = 1):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Which matrix this program's output block belongs to (q, k or v: one launch for all
    # three), where its rows start in that matrix and its columns in the output.
    if pid_n < BLOCKS0:
        packed_ptr, absmax_ptr, code_ptr = packed_0, absmax_0, code_0
        absmax2_ptr, code2_ptr, offset_ptr = absmax2_0, code2_0, offset_0
        n_rows, row0, col0 = N0, pid_n * BLOCK_N, pid_n * 0
        b_ptr, rank, slot = b_0, R0, 0
    elif pid_n < BLOCKS0 + BLOCKS1:
        packed_ptr, absmax_ptr, code_ptr = packed_1, absmax_1, code_1
        absmax2_ptr, code2_ptr, offset_ptr = absmax2_1, code2_1, offset_1
        n_rows, row0, col0 = N1, (pid_n - BLOCKS0) * BLOCK_N, N0
        b_ptr, rank, slot = b_1, R1, 1
    else:
        packed_ptr, absmax_ptr, code_ptr = packed_2, absmax_2, code_2
        absmax2_ptr, code2_ptr, offset_ptr = absmax2_2, code2_2, offset_2
        n_rows, row0, col0 = N2, (pid_n - BLOCKS0 - BLOCKS1) * BLOCK_N, N0 + N1
        b_ptr, rank, slot = b_2, R2, 2
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    HALF: tl.constexpr = BLOCKSIZE // 2
    # A loop step covers BLOCKS_PER_STEP quantisation blocks of K: byte j of the step holds its
    # elements 2j (high nibble) and 2j + 1 (low), and its scale is block j // HALF's.
    STEP: tl.constexpr = BLOCKSIZE * BLOCKS_PER_STEP
    pairs = tl.arange(0, STEP // 2)
    blocks_in_step = tl.arange(0, BLOCKS_PER_STEP)
    precision: tl.constexpr = "ieee" if EMULATE or X_DTYPE == tl.float32 else None
    row_bytes = rows64[:, None] * (K // 2)
    row_blocks = rows64[:, None] * (K // BLOCKSIZE)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    k_start = pid_k * K_PER
    k_end = tl.minimum(k_start + K_PER, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    code = tl.broadcast_to(tl.load(code_ptr + tl.arange(0, 16))[None, :], (BLOCK_N, 16))
    cols = tl.arange(0, STEP)
    for k0 in range(k_start, k_end, STEP):       # (the launcher makes K and K_PER multiples of STEP)
        packed = tl.load(packed_ptr + row_bytes + (k0 // 2 + pairs)[None, :],
                         mask=row_ok[:, None], other=0).to(tl.int32)
        scale = block_scale(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                            row_blocks + k0 // BLOCKSIZE + blocks_in_step[None, :], row_ok[:, None],
                            BLOCKSIZE2, NESTED, EMULATE)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCKS_PER_STEP, HALF)),
                           (BLOCK_N, STEP // 2))
        # Even elements are the high nibbles, odd ones the low, each looked up in the code held
        # in registers (a gather from memory per weight stalled every step: 174 against 25 us
        # for Qwen3-4B's q/k/v at one row, H100, benchmarks/gemv_4bit_probe.py).
        w_even = as_bnb_weight(tl.gather(code, packed >> 4, axis=1) * scale,
                               W_DTYPE, X_DTYPE, EMULATE)
        w_odd = as_bnb_weight(tl.gather(code, packed & 0xF, axis=1) * scale,
                              W_DTYPE, X_DTYPE, EMULATE)
        # x's step in one contiguous load, split into its even and odd columns in registers
        # (strided loads of each: 104 against 33 us at 64 rows, same probe).
        x_block = tl.load(x_rows + (k0 + cols)[None, :], mask=m_ok[:, None], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x_block, (BLOCK_M, STEP // 2, 2)))
        if EMULATE:
            x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
        acc += tl.dot(w_even, tl.trans(x_even), input_precision=precision)
        acc += tl.dot(w_odd, tl.trans(x_odd), input_precision=precision)
    if LORA:  # noqa: SIM102 (compile-time branch around a runtime one)
        # QLoRA: the adapter's B (s A x) joins the fp32 sums once, in the first K slice, as
        # in `small_linear` (`kernels.lora`'s shrink made s A x; rank 0: no adapter).
        if pid_k == 0:
            offs_r = tl.arange(0, R)
            la_mask = m_ok[:, None] & (offs_r[None, :] < rank)
            la = tl.zeros((BLOCK_M, R), dtype=tl.float32)
            for s in tl.static_range(LA_SPLIT):
                la += tl.load(la_ptr + s * stride_la_split + offs_m[:, None] * stride_la_m
                              + slot * R + offs_r[None, :], mask=la_mask, other=0.0)
            b = tl.load(b_ptr + rows64[:, None] * rank + offs_r[None, :],
                        mask=row_ok[:, None] & (offs_r[None, :] < rank), other=0.0)
            lora_precision: tl.constexpr = "ieee" if EMULATE or X_DTYPE == tl.float32 else "tf32"
            acc += tl.dot(b.to(tl.float32), tl.trans(la), input_precision=lora_precision)
    out = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + (col0 + rows)[:, None]
    tl.store(out, acc, mask=m_ok[None, :] & row_ok[:, None])
