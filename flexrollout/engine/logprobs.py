"""Logprob assembly: vLLM's `{token_id: Logprob}` dicts, one per generated or prompt token.

Each dict holds the chosen token (sampled, or the prompt's next token) and the top-k, k = -1
meaning the whole vocabulary (vLLM's rule), so a dict has up to k + 1 entries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import SamplerOutput
from .sequence import Sequence


@dataclass
class Logprob:
    """Log-probability of one token, with its rank in the distribution (1 = most likely).
    (vLLM's type; `flexrollout.outputs` hands it on with the other result objects.)"""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def top_count(k: int, vocab_size: int) -> int:
    return vocab_size if k == -1 else k


def host_rows(out: SamplerOutput):
    """A step's sampled logprobs, ranks and top-k on the host (None when no row asked)."""
    if out.logprobs is None:
        return None
    top = (out.top_ids.tolist(), out.top_logprobs.tolist()) if out.top_ids is not None else None
    return out.logprobs.tolist(), out.ranks.tolist(), top


def record_sampled(seq: Sequence, token: int, rows, row: int, vocab_size: int, token_text) -> None:
    """Append the dict of `seq`'s newest token (row `row` of `host_rows`) to `seq.logprobs`."""
    sampled_lp, ranks, top = rows
    text = token_text if seq.params.detokenize else _no_text
    entry = {token: Logprob(sampled_lp[row], ranks[row], text(token))}
    k = top_count(seq.params.logprobs, vocab_size)
    if top is not None and k > 0:
        for rank, (tid, value) in enumerate(zip(top[0][row][:k], top[1][row][:k]), start=1):
            entry.setdefault(tid, Logprob(value, rank, text(tid)))
    if seq.logprobs is None:
        seq.logprobs = []
    seq.logprobs.append(entry)
    seq.cumulative_logprob += sampled_lp[row]


def prompt_entries(logprobs: torch.Tensor, targets: list[int], params, vocab_size: int,
                   token_text) -> list[dict]:
    """One dict per row of `logprobs` (log-softmax over the vocabulary): its target token plus
    the top-k."""
    target_t = torch.tensor(targets, device=logprobs.device)
    chosen = logprobs.gather(1, target_t[:, None]).squeeze(1)
    ranks = ((logprobs > chosen[:, None]).sum(-1) + 1).tolist()
    chosen = chosen.tolist()
    k = top_count(params.prompt_logprobs, vocab_size)
    text = token_text if params.detokenize else _no_text
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    entries = []
    for i, token in enumerate(targets):
        entry = {token: Logprob(chosen[i], ranks[i], text(token))}
        if k > 0:
            for rank, (tid, value) in enumerate(zip(top_ids[i].tolist(), top_lp[i].tolist()), 1):
                entry.setdefault(tid, Logprob(value, rank, text(tid)))
        entries.append(entry)
    return entries


def _no_text(token: int) -> None:
    """decoded_token when the request asked for detokenize=False (as vLLM)."""
    return
