"""How often dynamo compiles each of the engine's layer functions, and why it recompiles.

    python benchmarks/compile_count.py --preset gemma-4-e2b --layers 10 --batch-sizes 1,8,64
    python benchmarks/compile_count.py --preset tiny-gemma4 --backend eager

Builds a random model of a `flexrollout bench` preset (`--layers`: fewer layers, same widths),
forces the per-layer compilation on (the engine compiles only on CUDA), generates a few tokens at
each batch size and prints, per compiled function: its compiles, its guard failures grouped by
reason, graph breaks, and whether the recompile limit was hit (a fullgraph=True function, as
the engine's are, then raises; others run eagerly from then on). Recompiles are decided by dynamo's guards, not by the backend, so `--backend
eager` counts the same compiles in seconds on a CPU; inductor (the default on CUDA) also times
the real compilation. On CUDA the decode steps capture their CUDA graphs as the engine does.
"""
from __future__ import annotations

import argparse
import logging
import re
import time
from collections import Counter, defaultdict
from dataclasses import replace

import torch
import torch._dynamo.utils as dynamo_utils

from flexrollout import LLM, SamplingParams
from flexrollout.bench import PRESETS, random_model

logger = logging.getLogger("compile_count")

# A guard failure reads "0/3: tensor 'pre_args[3].weight' size mismatch at index 0. expected 8,
# actual 16. Guard failed on a parameter, ...": the compile id and the sizes vary, the guard
# (what it checks, on which argument) does not.
_COMPILE_ID = re.compile(r"^\[?\d+/\d+\]?:?\s*")
_SIZES = re.compile(r"expected \d+, actual \d+")


class LimitWatcher(logging.Handler):
    """Catches dynamo's "hit config.recompile_limit" warnings: a function compiled without
    fullgraph runs eagerly from then on (the engine's, compiled with fullgraph=True, raise)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "recompile_limit" in message:
            self.messages.append(message)


def build_llm(args, device: str) -> LLM:
    dtype = getattr(torch, args.dtype)
    model = random_model(args.preset, dtype, device, args.max_len, args.layers)
    max_seqs = max(args.batch_sizes)
    return LLM(model, tokenizer=None, skip_tokenizer_init=True, dtype=args.dtype,
               max_model_len=args.max_len, max_num_seqs=max_seqs,
               max_num_batched_tokens=max(256, args.prompt_len * max_seqs), seed=0,
               static_weight_shapes=args.weight_shapes)


def force_compile(llm: LLM, backend: str) -> None:
    """The engine's forward with its layer functions compiled, whatever the device."""
    forward = llm.llm_engine.forward
    forward.prepare(replace(forward.options, compile_layers=True, compile_backend=backend))


def generate(llm: LLM, batch: int, prompt_len: int, max_tokens: int) -> None:
    vocab = llm.llm_engine.spec.vocab_size
    prompts = [{"prompt_token_ids": [(7 * b + 3 * i + 2) % vocab for i in range(prompt_len)]}
               for b in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)


def summarize(metrics) -> dict[str, dict]:
    """Per function (name and line): compiles, seconds, failure reasons grouped, graph breaks."""
    rows: dict[str, dict] = defaultdict(lambda: dict(compiles=0, seconds=0.0, reasons=Counter(),
                                                     breaks=0, failed=0))
    for m in metrics:
        if m.co_filename is None or "flexrollout" not in m.co_filename:
            continue
        row = rows[f"{m.co_name}:{m.co_firstlineno}"]
        row["compiles"] += 1
        row["seconds"] += m.entire_frame_compile_time_s or 0.0
        row["breaks"] += m.num_graph_breaks or 0
        row["failed"] += m.fail_type is not None
        if m.recompile_reason:
            logger.info("%s recompile %s: %s", m.co_name, m.compile_id, m.recompile_reason.strip())
            row["reasons"][reason_kind(m.recompile_reason)] += 1
    return rows


def reason_kind(reason: str) -> str:
    """The first guard failure of a recompile, without its compile id, sizes and advice."""
    first = _COMPILE_ID.sub("", reason.strip().splitlines()[0])
    first = _SIZES.sub("expected a, actual b", first).split(". Guard failed", 1)[0]
    return first.split("  #", 1)[0][:90]


def print_table(rows: dict[str, dict], limits: list[str]) -> None:
    print(f"{'function':40} {'compiles':>8} {'seconds':>8} {'breaks':>6}  recompile reasons")
    for name, row in sorted(rows.items(), key=lambda kv: -kv[1]["compiles"]):
        reasons = "; ".join(f"{n}x {r}" for r, n in row["reasons"].most_common(4)) or "-"
        failed = f" ({row['failed']} failed)" if row["failed"] else ""
        print(f"{name:40} {row['compiles']:>8} {row['seconds']:>8.1f} {row['breaks']:>6}  "
              f"{reasons}{failed}")
    print(f"total compiles: {sum(r['compiles'] for r in rows.values())}")
    for message in limits:
        print(f"RECOMPILE LIMIT: {message.splitlines()[0]}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-gemma4", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (same widths)")
    p.add_argument("--batch-sizes", default="1,4", help="comma-separated decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=11)
    p.add_argument("--max-tokens", type=int, default=3)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (eager: fast counting)")
    p.add_argument("--device", default=None)
    p.add_argument("--verbose", action="store_true", help="also log every recompile's full reason")
    p.add_argument("--weight-shapes", default="decode", choices=("always", "decode", "never"),
                   help="LLM(static_weight_shapes=...): which steps trace weight shapes as constants")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    logger.setLevel(logging.INFO if args.verbose else logging.WARNING)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    watcher = LimitWatcher()
    logging.getLogger("torch._dynamo").addHandler(watcher)
    llm = build_llm(args, device)
    force_compile(llm, args.backend)
    dynamo_utils.clear_compilation_metrics()
    start = time.perf_counter()
    try:
        for batch in args.batch_sizes:
            generate(llm, batch, args.prompt_len, args.max_tokens)
    except torch._dynamo.exc.FailOnRecompileLimitHit as e:
        # fullgraph=True functions (the engine's) fail at the limit instead of running eagerly.
        watcher.messages.append(f"{e} (during batch {batch}): {e.__cause__}")
    elapsed = time.perf_counter() - start
    print(f"{args.preset} layers={args.layers or PRESETS[args.preset]['layers']} "
          f"batch sizes {args.batch_sizes} backend={args.backend} device={device}: {elapsed:.1f} s")
    print_table(summarize(dynamo_utils.get_compilation_metrics()), watcher.messages)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
