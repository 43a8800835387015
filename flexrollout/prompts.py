"""Turn every prompt form vLLM accepts into token ids, rejecting bad input before any work."""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None


def _is_token_list(value) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(
        isinstance(t, Integral) and not isinstance(t, bool) for t in value)


def split_prompts(prompts) -> list:
    """One prompt or a list of them -> a list of single prompts (not yet tokenized)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, tuple):
        prompts = list(prompts)
    if not isinstance(prompts, list):
        raise TypeError(f"prompts must be a str, a list of token ids, a dict or a list of those, "
                        f"got {type(prompts).__name__}")
    if _is_token_list(prompts):
        return [prompts]
    return prompts


def to_prompt(prompt, tokenizer, index: int) -> Prompt:
    """One prompt -> token ids (and its text when given as text)."""
    where = f"prompts[{index}]"
    if isinstance(prompt, dict):
        if prompt.get("multi_modal_data") is not None:
            raise NotImplementedError(f"{where}: multi_modal_data is not supported")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(
                    isinstance(t, Integral) and not isinstance(t, bool) for t in ids):
                raise TypeError(f"{where}['prompt_token_ids'] must be a list of ints")
            if not ids:
                raise ValueError(f"{where}['prompt_token_ids'] is empty: a prompt needs at least one token")
            return Prompt([int(t) for t in ids], prompt.get("prompt"))
        if "prompt" in prompt:
            return to_prompt(prompt["prompt"], tokenizer, index)
        raise ValueError(f"{where} is a dict without 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where} is an empty string: a prompt needs at least one token")
        if tokenizer is None:
            raise ValueError(f"{where} is text but the engine has no tokenizer; pass token ids")
        ids = tokenizer(prompt).input_ids
        if not ids:
            raise ValueError(f"{where} tokenizes to no tokens")
        return Prompt(list(ids), prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise ValueError(f"{where} is an empty token list: a prompt needs at least one token")
        if _is_token_list(prompt):
            return Prompt([int(t) for t in prompt], None)
        raise TypeError(f"{where} must be a list of int token ids, got elements of type "
                        f"{sorted({type(t).__name__ for t in prompt})}")
    raise TypeError(f"{where} has unsupported type {type(prompt).__name__}; expected str, "
                    f"list[int] or a dict with 'prompt' / 'prompt_token_ids'")


def check_tokens(prompt: Prompt, vocab_size: int, max_model_len: int, index: int) -> None:
    bad = [t for t in prompt.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompts[{index}] has token ids outside [0, {vocab_size}): {bad[:5]}")
    if len(prompt.token_ids) >= max_model_len:
        raise ValueError(
            f"prompts[{index}] has {len(prompt.token_ids)} tokens; with max_model_len="
            f"{max_model_len} a prompt may have at most {max_model_len - 1} (one token to generate)")


def chat_prompts(messages, tokenizer, /, **template_kwargs) -> list[dict]:
    """One conversation (a list of message dicts) or a list of them -> prompts with token ids and
    text, through the tokenizer's chat template (`template_kwargs` go to `apply_chat_template`)."""
    if isinstance(messages, str) or not isinstance(messages, (list, tuple)):
        raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) "
                        f"or a list of conversations, got {type(messages).__name__}")
    conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
    prompts = []
    for i, conv in enumerate(conversations):
        if not isinstance(conv, (list, tuple)) or not all(isinstance(m, dict) for m in conv):
            raise TypeError(f"messages[{i}] must be a list of message dicts")
        text = tokenizer.apply_chat_template(list(conv), tokenize=False, **template_kwargs)
        # The template wrote the special tokens already.
        ids = tokenizer(text, add_special_tokens=False).input_ids
        prompts.append({"prompt_token_ids": ids, "prompt": text})
    return prompts
