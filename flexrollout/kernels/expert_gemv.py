"""Experts of small decode batches: a Triton grouped GEMV over the model's stacked expert tensors.

A decode step of B tokens with top-k routing runs B * k (token, expert) rows through at most
B * k distinct experts. `F.grouped_mm` tiles every one of the E groups whatever its row count
(at B = 1, 8 of Qwen3-30B-A3B's 128 experts do work) and needs the rows sorted by expert first
(a sort, a histogram, a cumsum, gathers and a scatter back: a dozen small kernels per layer).
Here nothing is sorted: each program loads the step's B * k expert ids (at most 64), and the
program at the first row of an expert multiplies all of that expert's rows, so each chosen
expert's weights are read once, and nothing else is read or launched.

Two launches per MoE layer: gate/up with the gated activation (and the biases) in the epilogue,
then down, whose epilogue multiplies each row by its routing weight. Both read the stacks where
the model keeps them, in either layout: [out, in] per expert (Qwen3-MoE) or [in, out] (gpt-oss,
gate/up columns interleaved), through strides.
"""
from __future__ import annotations

import functools

import torch

# Activation codes of the gate/up epilogue (layers.moe's names map onto them).
ACT_CODES = {"silu": 1, "gelu_tanh": 2, "gpt_oss": 3}
MAX_ROWS = 64       # (token, expert) rows of one step: every program loads all their expert ids
BLOCK_K = 128


def supported(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """CUDA and one 16/32-bit dtype for activations and both stacks (the K loop masks any width)."""
    return (h.is_cuda and h.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and gate_up.dtype == h.dtype and down.dtype == h.dtype)


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (importing flexrollout never needs Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def expert_gemv_kernel(x_ptr, ids_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr,
                           S, rows_per_input, K, N, stride_xm, stride_we, stride_wn, stride_wk,
                           stride_be, stride_om, up_offset, limit, alpha,
                           ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                           INTERLEAVED: tl.constexpr, IEEE: tl.constexpr, BLOCK_S: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Program (s, j): row s's expert, output columns [j * BLOCK_N, (j + 1) * BLOCK_N). Only
        # the program of an expert's first row works, for all of that expert's rows at once.
        s = tl.program_id(0)
        rows = tl.arange(0, BLOCK_S)
        ids = tl.load(ids_ptr + rows, mask=rows < S, other=-1)
        expert = tl.load(ids_ptr + s)
        mine = ids == expert
        if tl.min(tl.where(mine, rows, BLOCK_S)) == s:
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            x_rows = (rows // rows_per_input).to(tl.int64)       # gate/up: a row's token
            precision: tl.constexpr = "ieee" if IEEE else "tf32"
            acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                x = tl.load(x_ptr + x_rows[:, None] * stride_xm + ks[None, :],
                            mask=mine[:, None] & k_ok[None, :], other=0.0)
                if INTERLEAVED:
                    # gate/up alternate along the contiguous output axis: one load of 2 * BLOCK_N
                    # columns, split into the gate (even) and up (odd) halves.
                    pair_cols = 2 * tl.program_id(1) * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
                    pair = tl.load(w_base + ks[:, None] * stride_wk + pair_cols[None, :] * stride_wn,
                                   mask=k_ok[:, None] & (pair_cols < 2 * N)[None, :], other=0.0)
                    w, w_up = tl.split(tl.reshape(pair, (BLOCK_K, BLOCK_N, 2)))
                    acc += tl.dot(x, w, input_precision=precision)
                    acc_up += tl.dot(x, w_up, input_precision=precision)
                else:
                    w_offs = ks[:, None] * stride_wk + cols[None, :] * stride_wn
                    w_ok = k_ok[:, None] & col_ok[None, :]
                    acc += tl.dot(x, tl.load(w_base + w_offs, mask=w_ok, other=0.0),
                                  input_precision=precision)
                    if ACT != 0:
                        w_up = tl.load(w_base + w_offs + up_offset * stride_wn, mask=w_ok, other=0.0)
                        acc_up += tl.dot(x, w_up, input_precision=precision)
            if HAS_BIAS:
                b_base = bias_ptr + expert.to(tl.int64) * stride_be
                if INTERLEAVED:
                    acc += tl.load(b_base + 2 * cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                    acc_up += tl.load(b_base + 2 * cols + 1, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                else:
                    acc += tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                    if ACT != 0:
                        acc_up += tl.load(b_base + cols + up_offset, mask=col_ok,
                                          other=0.0).to(tl.float32)[None, :]
            if ACT == 1:
                acc = acc * tl.sigmoid(acc) * acc_up
            elif ACT == 2:
                # tanh-approximated GELU, written with a sigmoid: 0.5 (1 + tanh(z)) = sigmoid(2z)
                z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
                acc = acc * tl.sigmoid(2.0 * z) * acc_up
            elif ACT == 3:
                gate = tl.minimum(acc, limit)
                up = tl.minimum(tl.maximum(acc_up, -limit), limit)
                acc = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
            if HAS_SCALE:
                acc *= tl.load(scale_ptr + rows, mask=mine, other=0.0).to(tl.float32)[:, None]
            out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mine[:, None] & col_ok[None, :])

    return expert_gemv_kernel


def _block_n(rows: int, n: int) -> int:
    """Narrow column blocks when few experts work, so enough programs stream (132 SMs)."""
    return 32 if rows * -(-n // 64) < 512 else 64


def _launch(x, rows_per_input: int, ids, stack, bias, scale, out, n: int, k: int, strides,
            up_offset: int, interleaved: bool, act: int, limit: float, alpha: float) -> torch.Tensor:
    import triton

    rows = ids.shape[0]
    block_n = _block_n(rows, n)
    stride_we, stride_wn, stride_wk = strides
    wide = x.dtype == torch.float32
    _kernel()[(rows, -(-n // block_n))](
        x, ids, stack, bias if bias is not None else stack, scale if scale is not None else x, out,
        rows, rows_per_input, k, n, x.stride(0), stride_we, stride_wn, stride_wk,
        bias.stride(0) if bias is not None else 0, out.stride(0), up_offset, limit, alpha,
        ACT=act, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, INTERLEAVED=interleaved,
        IEEE=wide, BLOCK_S=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n,
        BLOCK_K=64 if wide else BLOCK_K, num_warps=4, num_stages=2 if wide else 3)
    return out


def experts_small(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                  transposed: bool, interleaved: bool, act: str, limit: float, alpha: float) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(h[t]) for every token t: (T, H) in h's dtype.
    At most MAX_ROWS (token, expert) rows."""
    tokens, top_k = ids.shape
    rows, hidden = tokens * top_k, h.shape[-1]
    if rows > MAX_ROWS:
        raise ValueError(f"the grouped GEMV takes at most {MAX_ROWS} (token, expert) rows, got {rows}")
    flat_ids = ids.reshape(-1)
    inter = down.shape[1] if transposed else down.shape[2]
    # (expert, output column, input column) strides of each stack, whichever way it is stored
    gu_strides = ((gate_up.stride(0), gate_up.stride(2), gate_up.stride(1)) if transposed
                  else gate_up.stride())
    act_out = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    _launch(h, top_k, flat_ids, gate_up, gate_up_bias, None, act_out, inter, hidden, gu_strides,
            0 if interleaved else inter, interleaved, ACT_CODES[act], limit, alpha)
    down_strides = ((down.stride(0), down.stride(2), down.stride(1)) if transposed else down.stride())
    out = torch.empty(rows, hidden, dtype=h.dtype, device=h.device)
    _launch(act_out, 1, flat_ids, down, down_bias, weights.reshape(-1), out, hidden, inter,
            down_strides, 0, False, 0, limit, alpha)
    return out.view(tokens, top_k, hidden).sum(dim=1)
