"""Text of generated tokens: incremental (for stop strings) and final."""
from __future__ import annotations

from .sequence import Sequence

# Prompt tokens decoded before the output so the first output token gets its leading space right.
_CONTEXT = 5


def _ids(seq: Sequence) -> list[int]:
    return seq.token_ids[max(0, seq.num_prompt_tokens - _CONTEXT):]


def append_text(tokenizer, seq: Sequence) -> str:
    """Decode what the newest token adds to `seq.text`; hold back incomplete UTF-8."""
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
