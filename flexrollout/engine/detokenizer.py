"""Text of generated tokens: incremental (for stop strings) and final.

Fast tokenizers decode incrementally with `tokenizers.decoders.DecodeStream` (it holds back
incomplete UTF-8 itself, and each step costs one token); slow (Python) tokenizers re-decode a
short window of ids per step.
"""
from __future__ import annotations

from .sequence import Sequence

# Prompt tokens decoded before the output so the first output token gets its leading space right.
_CONTEXT = 5


def _ids(seq: Sequence) -> list[int]:
    return seq.token_ids[max(0, seq.num_prompt_tokens - _CONTEXT):]


def append_text(tokenizer, seq: Sequence) -> str:
    """Decode what the newest tokens add to `seq.text`; hold back incomplete UTF-8."""
    backend = getattr(tokenizer, "backend_tokenizer", None)     # fast tokenizers only
    if backend is not None:
        return _append_streamed(backend, seq)
    return _append_by_offsets(tokenizer, seq)


def _append_streamed(backend, seq: Sequence) -> str:
    if seq.detok_stream is None:
        from tokenizers.decoders import DecodeStream

        # The prompt's last tokens as context, so the first output token gets its leading space.
        context = seq.token_ids[max(0, seq.num_prompt_tokens - _CONTEXT):seq.num_prompt_tokens]
        seq.detok_stream = DecodeStream(ids=context, skip_special_tokens=seq.params.skip_special_tokens)
    generated = seq.token_ids[seq.num_prompt_tokens:]
    pieces = [seq.detok_stream.step(backend, token) for token in generated[seq.detok_fed:]]
    seq.detok_fed = len(generated)
    new_text = "".join(p for p in pieces if p is not None)
    seq.text += new_text
    return new_text


def _append_by_offsets(tokenizer, seq: Sequence) -> str:
    ids = _ids(seq)
    prefix, read = seq.detok_offsets
    if read == 0:
        prefix, read = 0, min(_CONTEXT, seq.num_prompt_tokens)
    skip = seq.params.skip_special_tokens
    before = tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
    after = tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
    if len(after) <= len(before) or after.endswith("\ufffd"):
        seq.detok_offsets = (prefix, read)
        return ""
    new_text = after[len(before):]
    seq.detok_offsets = (read, len(ids))
    seq.text += new_text
    return new_text


def find_stop_string(seq: Sequence, new_text_len: int) -> tuple[str, int] | None:
    """The first stop string that the newest text completes, and where it starts in seq.text."""
    for stop in seq.params.stop or ():
        start = max(0, len(seq.text) - new_text_len - len(stop) + 1)
        index = seq.text.find(stop, start)
        if index != -1:
            return stop, index
    return None


def final_text(tokenizer, seq: Sequence, stopped_by_token: bool) -> str:
    """vLLM's output text: the stop token's own text is left out unless asked for."""
    if seq.params.stop and seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
        return seq.text
    ids = seq.generated_ids
    if stopped_by_token and not seq.params.include_stop_str_in_output:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
