"""GatedDeltaNet's token mixer over per-sequence states: a depthwise causal conv1d and the gated
delta rule, for packed prefill (several sequences, each from its own state) and decode.

The recurrence, per value head, with state S (dk, dv) in fp32, q and k L2-normalised and q scaled
by dk^-1/2:  S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t.

States live in pools indexed by batch slot (the cache manager's `states`): conv (slots, C, K) holding
the last K inputs of each sequence (column K - 1 the newest) and recurrent (slots, Hv, dk, dv).
A sequence whose chunk starts at position 0 starts from zeros whatever its slot holds (a slot's
previous owner, a preempted run), so nothing needs clearing when slots are handed out.

Two implementations of the prefill rule: flash-linear-attention's `chunk_gated_delta_rule`
(Triton; an optional dependency, used on CUDA in 16-bit when importable) and a torch reference in
chunked form (the UT / WY transform: within a chunk the writes u solve one unit-lower-triangular
system), which serves on CPU, in fp32 and wherever fla is absent. Decode is one recurrent step:
fla's fused recurrent kernel where fla serves (one pass over each state, read from and written back
to its pool slot in place), else a handful of torch ops on the gathered states; either way captured
in the decode graphs.
"""
from __future__ import annotations

import functools
import importlib
import logging

import torch
import torch.nn.functional as F

from ..kernels import custom_op

logger = logging.getLogger(__name__)

CHUNK = 64                 # tokens per chunk of the torch reference (as transformers' fallback)
L2_EPS = 1e-6              # q/k L2 norm epsilon (transformers and fla)


@functools.cache
def fla_chunk_rule():
    """fla's `chunk_gated_delta_rule`, or None when flash-linear-attention is not installed."""
    try:
        module = importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError:
        return None
    logger.info("GatedDeltaNet prefill uses flash-linear-attention's chunk_gated_delta_rule")
    return module.chunk_gated_delta_rule


@functools.cache
def fla_decode_kernel():
    """fla's one-token recurrent kernel with states updated in place at their slots (its KDA
    kernel's `ssm_state_indices`: KDA is the gated delta rule with a decay per key channel, so the
    rule's per-head decay is that decay repeated), or None without fla 0.6 or later."""
    try:
        module = importlib.import_module("fla.ops.kda.fused_recurrent")
    except ImportError:
        return None
    return getattr(module, "fused_recurrent_kda_fwd", None)


def use_fla(x: torch.Tensor, backend: str) -> bool:
    """`backend`: "auto" (fla on CUDA for 16-bit inputs when importable), "fla" or "torch"."""
    if backend == "torch":
        return False
    if backend == "fla":
        if fla_chunk_rule() is None:
            raise ImportError("backend='fla' needs flash-linear-attention (pip install "
                              "'flexrollout[hybrid]')")
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'fla' or 'torch', got {backend!r}")
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and fla_chunk_rule() is not None


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


# -- per-sequence layout of a packed prefill ------------------------------------------------------
def packed_layout(cu_seqlens: torch.Tensor, tokens: int):
    """(sequence index of each token (T,), its offset in its sequence's chunk (T,)), on the device."""
    index = torch.arange(tokens, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), index, right=True)
    return seq, index - cu_seqlens.long()[seq]


def start_states(pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Each sequence's state from its slot, zeros where its chunk starts the sequence (`fresh`)."""
    state = pool.index_select(0, slots)
    keep = (~fresh).view(-1, *([1] * (state.dim() - 1)))
    return torch.where(keep, state, torch.zeros((), dtype=state.dtype, device=state.device))


# -- causal conv1d --------------------------------------------------------------------------------
def conv_prefill(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor, seq: torch.Tensor,
                 offset: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over packed tokens x (T, C), weight (C, K); `history` (N, C, K)
    the last K inputs of each sequence before its chunk. Returns (output (T, C) in x's dtype, the
    new history (N, C, K))."""
    tokens, channels = x.shape
    width = weight.shape[-1]
    # One table: the packed tokens, then each sequence's history; a tap reads a token of its own
    # chunk or, before the chunk's start, the history.
    table = torch.cat([x.to(history.dtype), history.transpose(1, 2).reshape(-1, channels)])

    def source(seq_index, at, back):
        """Row of `table` holding the input `back` steps before offset `at` of sequence seq_index."""
        inside = cu_seqlens.long()[seq_index] + at - back
        before = tokens + seq_index * width + width + at - back
        return torch.where(at >= back, inside, before)

    w = weight.to(torch.float32)
    out = torch.zeros(tokens, channels, dtype=torch.float32, device=x.device)
    for tap in range(width):
        out += table[source(seq, offset, width - 1 - tap)].float() * w[:, tap]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seqs = torch.arange(lengths.shape[0], device=x.device)
    last = torch.stack([table[source(seqs, lengths - 1, width - 1 - k)] for k in range(width)], dim=-1)
    return F.silu(out).to(x.dtype), last


def conv_decode(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor):
    """One token per sequence: x (B, C), history (B, C, K). Returns (output (B, C), new history)."""
    window = torch.cat([history[..., 1:], x.to(history.dtype)[..., None]], dim=-1)
    out = (window.float() * weight.float()).sum(-1)
    return F.silu(out).to(x.dtype), window


# -- the gated delta rule -------------------------------------------------------------------------
def _prepare(q, k, v, g, beta):
    """fp32, q/k L2-normalised, q scaled by dk^-1/2."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def recurrent_step(q, k, v, g, beta, state: torch.Tensor):
    """One token per row: q/k (B, H, dk), v (B, H, dv), g/beta (B, H), state (B, H, dk, dv) fp32.
    Returns (output (B, H, dv) fp32, new state)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)
    write = (v - predicted) * beta[..., None]
    state = state + k[..., None] * write[..., None, :]
    return (state * q[..., None]).sum(-2), state


@custom_op("gated_delta_decode", mutates_args=("pool",))
def fla_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`recurrent_step` through fla's kernel, each row's state read from and written back to its
    slot of `pool` (slots, Hv, dk, dv) fp32 in one pass. q/k (B, Hk, dk) (the kernel maps value
    head h to key head h // (Hv / Hk), as `split_heads` repeats them), v (B, Hv, dv), g/beta (B, Hv).
    Returns (B, Hv, dv) in v's dtype. An op torch.compile treats as opaque: fla's Python wrapper
    picks its backend at run time."""
    batch, value_heads = g.shape
    decay = g.float()[:, None, :, None].expand(batch, 1, value_heads, q.shape[-1]).contiguous()
    out = torch.empty_like(v)[:, None]
    fla_decode_kernel()(q.contiguous()[:, None], k.contiguous()[:, None], v.contiguous()[:, None], decay,
                        beta.contiguous()[:, None], initial_state=pool, inplace_final_state=True,
                        ssm_state_indices=slots, use_qk_l2norm_in_kernel=True, out=out)
    return out[:, 0]


@fla_decode_step.register_fake
def _(q, k, v, g, beta, pool, slots):
    return torch.empty_like(v)


def chunked_rule(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK):
    """Padded batch: q/k (N, L, H, dk), v (N, L, H, dv), g/beta (N, L, H), state (N, H, dk, dv).
    Padding at the end of a row must carry g = 0 and beta = 0 (then it leaves the state alone).
    Returns (output (N, L, H, dv) fp32, final state)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    batch, length, heads, _ = k.shape
    pad = -length % chunk
    # -> (N, H, chunks, chunk, ...)
    def split(x):
        x = F.pad(x.transpose(1, 2), (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.reshape(batch, heads, -1, chunk, *x.shape[3:])

    q, k, v, g, beta = (split(x) for x in (q, k, v, g, beta))
    decay = g.cumsum(-1)                                            # log decay since chunk start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    strict = pair.masked_fill(torch.eye(chunk, dtype=torch.bool, device=q.device), 0.0)
    # (I + A) U = beta V - (beta e^decay K) S0, A[i, j] = beta_i e^(d_i - d_j) k_i.k_j for j < i.
    system = torch.eye(chunk, device=q.device) + beta[..., None] * (k @ k.transpose(-1, -2)) * strict
    writes = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, (beta * decay.exp())[..., None] * k, upper=False,
                                          unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pair
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(q.shape[2]):
        u = writes[:, :, c] - reads[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + scores[:, :, c] @ u
        state = state * decay[:, :, c, -1, None, None].exp() + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = out.reshape(batch, heads, -1, v.shape[-1])[:, :, :length].transpose(1, 2)
    return out, state


def rule_prefill(q, k, v, g, beta, state: torch.Tensor, seq: torch.Tensor, offset: torch.Tensor,
                 cu_seqlens: torch.Tensor, backend: str = "auto"):
    """Packed tokens: q/k (T, H, dk), v (T, H, dv), g/beta (T, H); state (N, H, dk, dv) fp32, one
    per sequence. Returns (output (T, H, dv) in v's dtype, final states (N, H, dk, dv) fp32)."""
    if use_fla(v, backend):
        # fla's varlen layout: batch 1, the packed tokens along T; states (N, Hv, dk, dv) fp32.
        q, k, v, beta = (x.contiguous()[None] for x in (q, k, v, beta))
        out, final = fla_chunk_rule()(q, k, v, g.float().contiguous()[None], beta,
                                      initial_state=state.contiguous(), output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.long())
        return out[0], final.float()
    # Scatter the packed tokens into a zero-padded (N, L) batch (zeros leave the state alone).
    batch = state.shape[0]
    length = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    def padded(x):
        out = x.new_zeros(batch, length, *x.shape[1:])
        out[seq, offset] = x
        return out

    out, final = chunked_rule(*(padded(x) for x in (q, k, v, g, beta)), state)
    return out[seq, offset].to(v.dtype), final
