"""Gemma-4 against HF transformers and PEFT, fp32 on CPU.

Tiny configs (4 layers alternating sliding / full, head_dim 16 on sliding and 32 on full layers,
a 6-token window, so every prompt here is longer than it; final logit softcap 3):
- "dense": the 31B layout (sandwich norms, q/k/v norms, proportional rope on full layers);
- "e2b": per-layer inputs, the last two layers reading the KV of layers 0 and 1 (owning no
  cache), double-wide MLPs on those two;
- "moe": the 26B-A4B layout, dense MLP plus 4 experts top-2 in every layer, `attention_k_eq_v`
  with one KV head on full layers;
- "wrapper": the e2b weights inside `Gemma4ForConditionalGeneration` (with a vision tower).
References are HF `generate` (greedy) and HF's teacher-forced forward; with adapters, PEFT's.
"""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_EOS, TINY_VOCAB, make_tiny_tokenizer, randomize_lora, saved_adapter_models, tiny_llm
from flexrollout import SamplingParams

VARIANTS = ["dense", "e2b", "moe", "wrapper"]
PROMPTS = [[5, 17, 33, 2, 9, 100, 4, 8, 99, 250, 3], [300, 7, 8, 121, 64, 19, 23], [41, 42, 43, 44, 45, 46, 47, 48]]
WINDOW = 6
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LP_TOL = 1e-4
PLACEHOLDERS = {"image_token_id": 500, "video_token_id": 501, "audio_token_id": 502}


def make_tiny_gemma4(variant: str, seed: int = 0, **overrides):
    """(model, tokenizer): a tiny random Gemma-4 of `variant`, fp32, eval mode. Weights are
    re-drawn as conftest's tiny models are (sharp q/k, norms 1 + 0.1 N(0, 1)), and the router's
    scales, per-expert scales and each layer's `layer_scalar` too, so that skipping any of them
    changes the tokens."""
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    config = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, head_dim=16, global_head_dim=32,
                  sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                  hidden_size_per_layer_input=0, final_logit_softcapping=3.0, bos_token_id=1,
                  eos_token_id=TINY_EOS, pad_token_id=0, max_position_embeddings=512)
    if variant in ("e2b", "wrapper"):
        config.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=TINY_VOCAB,
                      num_kv_shared_layers=2, use_double_wide_mlp=True)
    if variant == "moe":
        config.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                      attention_k_eq_v=True, num_global_key_value_heads=1)
    config.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Gemma4TextConfig(**config), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
            elif ".router." in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif ".layers." in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=gen))
    model.eval()
    if variant == "wrapper":
        model = _wrapped(model)
    return model, make_tiny_tokenizer(TINY_VOCAB, TINY_EOS)


def _wrapped(text_lm):
    """The same text weights inside the multimodal Gemma4ForConditionalGeneration."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    config = Gemma4Config(text_config=text_lm.config.to_dict(), vision_config=vision, **PLACEHOLDERS)
    torch.manual_seed(0)
    wrapper = Gemma4ForConditionalGeneration(config).eval()
    state = {"model.language_model." + k[len("model."):]: v for k, v in text_lm.state_dict().items()
             if k.startswith("model.")}
    missing = wrapper.load_state_dict(state, strict=False).missing_keys
    assert all(k.startswith(("model.vision_tower.", "model.embed_vision.", "lm_head.")) for k in missing), missing
    return wrapper


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@torch.no_grad()
def _reference_prompt_logprobs(model, prompt: list[int]) -> list[float]:
    lp = model(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    return [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]


def _engine_prompt_logprobs(llm, prompt: list[int], **kwargs) -> list[float]:
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False,
                       **kwargs)
    entries = out[0].prompt_logprobs
    return [entries[i][prompt[i]].logprob for i in range(1, len(prompt))]


def _max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("decode", ["eager", "graphs"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_batch_matches_hf(variant, decode, hf_greedy, request):
    """`graphs`: decode replays graphs (on CPU through the `cpu_graphs` stand-in), padded rows included."""
    model, tok = make_tiny_gemma4(variant)
    llm = tiny_llm(model, tok)
    if decode == "graphs":
        request.getfixturevalue("cpu_graphs")(llm)
    layers = llm.llm_engine.spec.layers
    assert [(l.window, l.head_dim, l.scale) for l in layers] == [(WINDOW, 16, 1.0), (None, 32, 1.0)] * 2
    assert all(len(p) > WINDOW for p in PROMPTS)
    if variant in ("e2b", "wrapper"):
        assert [l.kv_source for l in layers] == [None, None, 0, 1]
    if variant == "moe":
        assert [l.ffn for l in layers] == ["mlp+moe"] * 4 and [l.num_kv_heads for l in layers] == [2, 1] * 2
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [hf_greedy(model, p, 12).tokens for p in PROMPTS]


@pytest.mark.parametrize("variant", VARIANTS[:3])
def test_prompt_and_sampled_logprobs_match_hf_teacher_forced(variant):
    model, tok = make_tiny_gemma4(variant, seed=4)
    llm = tiny_llm(model, tok)
    prompt = PROMPTS[0]
    assert _max_diff(_engine_prompt_logprobs(llm, prompt), _reference_prompt_logprobs(model, prompt)) < LP_TOL
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        max_tokens=10, temperature=1.0, seed=3, logprobs=2, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        lp = model(torch.tensor([prompt + out.token_ids])).logits[0].double().log_softmax(-1)
    for step, token in enumerate(out.token_ids):
        row = lp[len(prompt) - 1 + step]
        assert abs(out.logprobs[step][token].logprob - float(row[token])) < LP_TOL
        assert out.logprobs[step][token].rank == int((row > row[token]).sum()) + 1


def test_kv_sharing_layers_own_no_cache():
    """The two KV-sharing layers read layers 0 and 1's tensors and add nothing to the bytes
    a token occupies (HF's own cache also holds only the two computing layers)."""
    from flexrollout.attention.kv_cache import KVCache

    model, tok = make_tiny_gemma4("e2b")
    engine = tiny_llm(model, tok).llm_engine
    cache, layers = engine.cache, engine.spec.layers
    assert cache.k[2] is cache.k[0] and cache.v[3] is cache.v[1]
    assert len(cache.owned()) == 2
    # sliding: 2 kv heads x 16, full: 2 kv heads x 32; K and V; fp32
    assert KVCache.bytes_per_token(layers, torch.float32) == 2 * (2 * 16 + 2 * 32) * 4
    with torch.no_grad():
        hf_cache = model(torch.tensor([PROMPTS[0]]), use_cache=True).past_key_values
    assert len(hf_cache.layers) == 2


def test_groups_share_prefill_and_preemption_keep_hf_tokens(hf_greedy, engine_stats):
    """Shared prefix pages and preemption by recompute with KV-sharing layers (E2B layout; the
    expert layers' routing is per token and exercised by every other test)."""
    model, tok = make_tiny_gemma4("e2b", seed=1)
    prompt = PROMPTS[2] * 2                                  # 16 tokens: one full page
    ref = hf_greedy(model, prompt, 12).tokens
    llm = tiny_llm(model, tok)
    before = engine_stats(llm)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, GREEDY, use_tqdm=False)
    assert _tokens(outs) == [ref] * 3
    assert engine_stats(llm)["prefill_tokens"] - before["prefill_tokens"] == len(prompt)
    # 5 pages of 16 tokens hold two 28-token sequences; the others must preempt and recompute.
    small = tiny_llm(model, tok, num_gpu_blocks_override=5)
    before = engine_stats(small)
    prompts = [prompt, PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert engine_stats(small)["preemptions"] > before["preemptions"]
    assert _tokens(outs) == [hf_greedy(model, p, 12).tokens for p in prompts]


def test_per_layer_inputs_follow_row_chunks(hf_greedy):
    """A prefill whose `post` runs in 4-row chunks hands each chunk its own per-layer inputs."""
    model, tok = make_tiny_gemma4("e2b", seed=2)
    llm = tiny_llm(model, tok, mlp_chunk_tokens=4)
    assert llm.llm_engine.forward.options.mlp_chunk == 4
    prompt = PROMPTS[0]
    assert _max_diff(_engine_prompt_logprobs(llm, prompt), _reference_prompt_logprobs(model, prompt)) < LP_TOL
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [hf_greedy(model, p, 12).tokens for p in PROMPTS]


def test_multimodal_inputs_are_a_clear_error():
    model, tok = make_tiny_gemma4("wrapper")
    llm = tiny_llm(model, tok)
    with pytest.raises(NotImplementedError, match="text model only"):
        llm.generate([{"prompt_token_ids": [5, PLACEHOLDERS["image_token_id"], 6]}], GREEDY, use_tqdm=False)
    with pytest.raises(NotImplementedError, match="multi_modal_data"):
        llm.generate([{"prompt_token_ids": [5, 6], "multi_modal_data": {"image": object()}}], GREEDY,
                     use_tqdm=False)
    # the engine is still usable
    assert len(_tokens(llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False))[0]) == 12


def test_checkpoint_by_path_loads_the_wrapper(tmp_path, hf_greedy):
    """A saved `gemma4` checkpoint loads (transformers' causal-LM auto class gives the
    multimodal wrapper) and generates HF's tokens."""
    from flexrollout import LLM

    model, tok = make_tiny_gemma4("wrapper")
    model.save_pretrained(str(tmp_path / "ckpt"))
    llm = LLM(str(tmp_path / "ckpt"), tokenizer=tok, dtype="float32", max_model_len=128, max_num_seqs=4,
              block_size=16, num_gpu_blocks_override=64, device="cpu")
    assert type(llm.model).__name__ == "Gemma4ForConditionalGeneration"
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [hf_greedy(model, PROMPTS[0], 12).tokens]


def test_kv_sources_and_unsupported_configs_are_clear():
    from flexrollout.models.gemma4 import kv_sources

    types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert kv_sources(types, 0) == [None] * 5
    assert kv_sources(types, 3) == [None, None, 0, 0, 1]
    with pytest.raises(ValueError, match="no earlier layer"):
        kv_sources(["sliding_attention", "full_attention"], 1)
    from flexrollout import LLM

    model, tok = make_tiny_gemma4("dense")
    model.config.use_bidirectional_attention = "all"
    with pytest.raises(NotImplementedError, match="causal"):
        LLM(model, tokenizer=tok, dtype="float32", max_model_len=64, num_gpu_blocks_override=8)


# --------------------------------------------------------------------------------------------- LoRA


def _peft_gemma4(variant: str, seed: int = 2):
    """PEFT LoRA on every attention and MLP projection (and both expert stacks of "moe"),
    adapters large enough to move the logits well beyond the tolerance."""
    from peft import LoraConfig, get_peft_model

    model, tok = make_tiny_gemma4(variant, seed=seed)
    experts = ["experts.gate_up_proj", "experts.down_proj"] if variant == "moe" else None
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_parameters=experts,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                        "down_proj"])
    pm = get_peft_model(model, config).eval()
    randomize_lora(pm, seed)
    return pm, tok


@pytest.mark.parametrize("mode", ["live", "merged"])
@pytest.mark.parametrize("variant", ["e2b", "moe"])
def test_lora_matches_peft_and_sees_updates(variant, mode):
    pm, tok = _peft_gemma4(variant)
    prompt = PROMPTS[0]
    with pm.disable_adapter():
        base = _reference_prompt_logprobs(pm, prompt)
    assert _max_diff(base, _reference_prompt_logprobs(pm, prompt)) > 100 * LP_TOL
    llm = tiny_llm(pm, tok, lora_mode=mode)
    assert _max_diff(_engine_prompt_logprobs(llm, prompt), _reference_prompt_logprobs(pm, prompt)) < LP_TOL
    # An optimizer-like in-place step on the adapters is seen by the next generate.
    layer = pm.base_model.model.model.layers[2]
    with torch.no_grad():
        layer.self_attn.q_proj.lora_B["default"].weight.mul_(-1.5)
        if variant == "moe":
            layer.experts.lora_B["default"].weight.mul_(-1.5)
    assert _max_diff(_engine_prompt_logprobs(llm, prompt), _reference_prompt_logprobs(pm, prompt)) < LP_TOL


@pytest.mark.parametrize("variant", ["e2b", "moe"])
def test_saved_adapter_by_lora_request_matches_peft(variant, tmp_path):
    """A saved PEFT adapter (projections of both layer kinds, whose shapes differ, and the
    experts of "moe") given by LoRARequest to the base model equals PEFT's model loaded from
    that directory; rows without a request in the same call run the base model."""
    from flexrollout import LoRARequest

    pm, tok = _peft_gemma4(variant, seed=5)
    base, ref = saved_adapter_models(pm, lambda: make_tiny_gemma4(variant, seed=5)[0], tmp_path / "adapter")
    prompt = PROMPTS[1]
    llm = tiny_llm(base, tok)
    request = LoRARequest("saved", 1, str(tmp_path / "adapter"))
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False, lora_request=[request, None])
    with_adapter, without = ([o.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
                             for o in outs)
    assert _max_diff(with_adapter, _reference_prompt_logprobs(ref, prompt)) < LP_TOL
    assert _max_diff(without, _reference_prompt_logprobs(base, prompt)) < LP_TOL


def test_trl_grpo_lora_on_the_multimodal_wrapper(tmp_path, monkeypatch):
    """TRL's GRPOTrainer (colocate) with LoRA on the wrapper's language model: the engine runs over
    the trainer's own model and its logprobs agree with TRL's forward within 1e-3."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    import flexrollout
    from flexrollout.integrations import trl as fr_trl

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)      # TRL's colocate init sets them; restored after
    fr_trl.patch_trl(num_kv_pages=40)
    model, tok = make_tiny_gemma4("wrapper")
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, seed=0,
                      per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
                      vllm_max_model_length=128, max_steps=2, learning_rate=1e-2, logging_steps=1,
                      save_strategy="no", use_vllm=True, vllm_mode="colocate", temperature=1.0,
                      dataloader_num_workers=0, disable_tqdm=True)
    dataset = datasets.Dataset.from_dict({"prompt": [f"t{5 + i} t{40 + 3 * i} t{90 + i}" for i in range(4)]})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj|o_proj|gate_proj)")
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [-abs(len(c) - 20) / 20.0
                                                                             for c in completions],
                          processing_class=tok, args=args, train_dataset=dataset, peft_config=lora)
    llm = trainer.vllm_generation.llm
    assert isinstance(llm, flexrollout.LLM) and llm.model is trainer.model
    trainer.train()
    assert trainer.state.global_step == 2
    diffs = [e["sampling/sampling_logp_difference/max"] for e in trainer.state.log_history
             if "sampling/sampling_logp_difference/max" in e]
    assert diffs and max(diffs) < 1e-3, diffs


def test_unsloth_fast_inference_on_the_wrapper_generates_like_hf(hf_greedy):
    """Unsloth's `FastModel.from_pretrained(..., fast_inference=True)` (its signature, through a
    stand-in loader returning the multimodal wrapper), then `get_peft_model`: fast_generate gives
    HF's tokens; with `load_lora(..., load_tensors=True)` it runs the live adapter, without a
    request the base model, as Unsloth's vLLM path does."""
    from peft import LoraConfig, get_peft_model

    from flexrollout.integrations import unsloth as plugin

    model, tok = make_tiny_gemma4("wrapper", seed=3)

    def from_pretrained(model_name="unsloth/gemma-4-E2B-it", max_seq_length=2048, dtype=None,
                        load_in_4bit=True, fast_inference=False, gpu_memory_utilization=0.5):
        return model, tok

    loaded, _ = plugin.load_pretrained(from_pretrained, "tiny", max_seq_length=128, load_in_4bit=False,
                                       fast_inference=True)
    outs = loaded.fast_generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [hf_greedy(model, p, 12).tokens for p in PROMPTS]
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                      target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|up_proj)")
    pm = plugin._peft_then_attach(get_peft_model, loaded, lora).eval()   # Unsloth's get_peft_model
    with torch.no_grad():
        for name, param in pm.named_parameters():
            if "lora_B" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    prompt = PROMPTS[0]
    with pm.disable_adapter():
        base = _reference_prompt_logprobs(pm, prompt)
    expected = _reference_prompt_logprobs(pm, prompt)
    assert _max_diff(base, expected) > 100 * LP_TOL
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for request, reference in ((None, base), (pm.load_lora("grpo", load_tensors=True), expected)):
        out = pm.fast_generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=request)
        ours = [out[0].prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        assert _max_diff(ours, reference) < LP_TOL       # Unsloth's rule: no request, no adapter


# --------------------------------------------------------------------------------------------- compiles
def _layer_compiles(num_layers: int, static_weight_shapes: str = "always"):
    """(compiles of each layer function, tokens, the same engine's tokens uncompiled) while a
    tiny E2B-layout model of `num_layers` (sliding / full alternating, the last two reading KV,
    double-wide MLPs and per-layer inputs; no projection as wide as the hidden size, a relation
    symbolic shapes would guard on) prefills and decodes batches of 1 and 3 with its
    layer functions compiled, weight shapes traced as `static_weight_shapes` says (compiles with
    symbolic shapes under the function's name + "_symbolic"). The "eager" backend: dynamo's guards decide recompiles whatever
    the backend, and it traces in seconds."""
    from dataclasses import replace

    import torch._dynamo.utils as dynamo_utils
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=48, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=1, intermediate_size=128, head_dim=16, global_head_dim=32,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=TINY_VOCAB, num_kv_shared_layers=2,
        use_double_wide_mlp=True, bos_token_id=1, eos_token_id=TINY_EOS, pad_token_id=0,
        max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    llm = tiny_llm(model, make_tiny_tokenizer(TINY_VOCAB, TINY_EOS))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    batches = [[{"prompt_token_ids": p} for p in prompts] for prompts in (PROMPTS[:1], PROMPTS)]
    uncompiled = [_tokens(llm.generate(batch, params, use_tqdm=False)) for batch in batches]
    forward = llm.llm_engine.forward
    forward.prepare(replace(forward.options, compile_layers=True, compile_backend="eager",
                            static_weight_shapes=static_weight_shapes))
    torch._dynamo.reset()
    dynamo_utils.clear_compilation_metrics()
    compiled = [_tokens(llm.generate(batch, params, use_tqdm=False)) for batch in batches]
    counts: dict[str, int] = {}
    for m in dynamo_utils.get_compilation_metrics():
        if m.co_filename and "flexrollout" in m.co_filename:
            counts[m.co_name] = counts.get(m.co_name, 0) + 1
    torch._dynamo.reset()
    return counts, compiled, uncompiled


def test_layer_functions_compile_per_layer_kind_not_per_layer():
    """With compilation forced on (CPU), each layer function compiles once per layer kind and
    batch specialisation, not once per layer. The 10 layers hold 4 kinds (computing sliding /
    full, KV-sharing double-wide sliding / full) and 4 kinds of neighbours (decode fuses layer
    i's `post` with layer i+1's `pre`: sliding -> full, full -> sliding, full -> shared sliding,
    shared sliding -> shared full), each compiled for batch 1 (dynamo specialises size 1) and
    for a dynamic batch: at most 8 per function, where a compile per layer would be 9 or more
    for the fused region. No function comes near dynamo's recompile limit (past it dynamo runs
    the function eagerly). A regression guard: the code it was written against already
    compiled once per kind (benchmarks/compile_count.py shows the same for the real E2B)."""
    from flexrollout.compile import _LIMITS

    counts, tokens, uncompiled = _layer_compiles(10)
    assert tokens == uncompiled
    assert set(counts) == {"attention_inputs", "shared_kv_queries", "post_then_pre", "attention_out_mlp"}
    assert max(counts.values()) <= 4 * 2 < _LIMITS["recompile_limit"], counts


def test_symbolic_weight_shapes_compile_fewer_times_with_the_same_tokens():
    """`LLM(static_weight_shapes="never")`: weight shapes traced as symbols, so layers of other
    widths (head dims 16 / 32 here, double-wide MLPs) share compiles: fewer in all than with
    constant shapes, and the same tokens as uncompiled."""
    static, _, _ = _layer_compiles(10)
    counts, tokens, uncompiled = _layer_compiles(10, static_weight_shapes="never")
    assert tokens == uncompiled
    assert sum(counts.values()) < sum(static.values()), (counts, static)


def test_default_prefill_symbolic_decode_constant_weight_shapes():
    """The default, "decode": prefill compiles with symbolic weight shapes (fewer compiles before
    the first token) and decode with constant ones, each under its own entries. Two wrappers of
    one function would share dynamo's entries (a symbolic one passes every width's guards), so
    decode would run prefill's symbolic compiles: here decode's fused region compiles exactly
    as often as with constant shapes everywhere, the first layer's `pre` compiles for decode
    apart from prefill's, and prefill compiles fewer times than with constant shapes."""
    static, _, _ = _layer_compiles(10)
    counts, tokens, uncompiled = _layer_compiles(10, static_weight_shapes="decode")
    assert tokens == uncompiled
    assert counts["post_then_pre"] == static["post_then_pre"], (counts, static)
    assert counts.get("attention_inputs", 0) >= 1, counts        # decode's, with constant shapes
    prefill = {name: n for name, n in counts.items() if name.endswith("_symbolic")}
    assert set(prefill) == {"attention_inputs_symbolic", "shared_kv_queries_symbolic",
                            "attention_out_mlp_symbolic"}, counts
    decode = sum(counts.values()) - sum(prefill.values())      # the same in both modes
    assert sum(prefill.values()) < sum(static.values()) - decode, (counts, static)


# --------------------------------------------------------------------------------------------- real sizes


def _preset_model(name: str, dtype: torch.dtype, device: str, num_layers: int | None = None):
    from transformers import AutoModelForCausalLM

    from flexrollout.models.gemma4_presets import GEMMA4_PRESETS, gemma4_config

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(gemma4_config(GEMMA4_PRESETS[name], 2048, num_layers),
                                                 dtype=dtype)
    return model.eval()


def test_presets_have_the_real_layouts():
    """The bench presets, built on the meta device: layer kinds, head dims, shared KV, experts,
    and the KV bytes a token occupies (E2B: 15 computing layers of one KV head)."""
    from flexrollout.attention.kv_cache import KVCache
    from flexrollout.models import build_forward
    from flexrollout.models.gemma4_presets import rows_only_weights

    e2b_model = _preset_model("gemma-4-e2b", torch.bfloat16, "meta")
    assert [t.shape for t in rows_only_weights(e2b_model)] == [(262144, 35 * 256)]
    e2b = build_forward(e2b_model, torch.bfloat16).spec.layers
    assert [l.window for l in e2b[:5]] == [512] * 4 + [None] and e2b[-1].window is None
    assert [l.kv_source for l in e2b[15:20]] == [13] * 4 + [14] and e2b[34].kv_source == 14
    assert KVCache.bytes_per_token(e2b, torch.bfloat16) == (12 * 2 * 256 + 3 * 2 * 512) * 2
    model = _preset_model("gemma-4-26b-a4b", torch.bfloat16, "meta")
    forward = build_forward(model, torch.bfloat16)
    layers = forward.spec.layers
    assert [(l.num_kv_heads, l.head_dim, l.window) for l in layers[4:6]] == [(8, 256, 1024), (2, 512, None)]
    assert all(l.ffn == "mlp+moe" for l in layers) and forward.experts[0].gate_up.shape == (128, 1408, 2816)
    assert not rows_only_weights(model)
    dense = build_forward(_preset_model("gemma-4-31b", torch.bfloat16, "meta", 12), torch.bfloat16).spec.layers
    assert [(l.num_kv_heads, l.head_dim) for l in dense[4:6]] == [(16, 256), (4, 512)]


def _random_prompts(lengths, seed: int, vocab: int = 262144) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset,layers", [("gemma-4-e2b", 10), ("gemma-4-26b-a4b", 6), ("gemma-4-31b", 6)])
def test_real_widths_fp32_greedy_matches_hf_with_graphs(preset, layers):
    _check_real_widths_fp32(preset, layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset,layers", [("gemma-4-e2b", 10), ("gemma-4-26b-a4b", 6)])
def test_real_widths_fp32_with_qkv_epilogue_matches_hf(preset, layers):
    """The same with decode's q/k/v epilogue kernel (`gemma_qkv_epilogue`; 26B-A4B: V from
    k_proj on its full layers)."""
    _check_real_widths_fp32(preset, layers, gemma_qkv_epilogue=True)


def _check_real_widths_fp32(preset: str, layers: int, **engine_args) -> None:
    """Real widths at reduced depth (E2B: 5 KV-sharing layers; full layers at head_dim 512),
    fp32 on the GPU, CUDA graphs on, prompts longer than the sliding windows (512 / 1024).
    HF's random init leaves the logits of a 262k vocabulary close together: tokens are compared
    up to HF's first near-tie (top-2 gap below 1e-3, where fp32 rounding may pick either), which
    must leave at least 4 per prompt; each first token's logprob must match HF's."""
    from flexrollout import LLM

    model = _preset_model(preset, torch.float32, "cuda", layers)
    prompts = _random_prompts((5, 300, 1100), seed=5)
    llm = LLM(model, max_model_len=2048, max_num_seqs=8, num_kv_pages=64, **engine_args)
    assert llm.llm_engine.runner.graphs is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        tokens = ref.sequences[0, len(prompt):].tolist()
        gaps = [float(g[0] - g[1]) for g in (s[0].float().topk(2).values for s in ref.scores)]
        sure = next((i for i, gap in enumerate(gaps) if gap < 1e-3), len(gaps))
        assert sure >= 4, f"HF's greedy path has a near-tie at token {sure}: {gaps}"
        assert out.outputs[0].token_ids[:sure] == tokens[:sure], (sure, gaps)
        first = torch.log_softmax(ref.scores[0][0].float(), -1)[tokens[0]].item()
        assert out.outputs[0].logprobs[0][tokens[0]].logprob == pytest.approx(first, abs=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset,layers", [("gemma-4-e2b", 10), ("gemma-4-26b-a4b", 6)])
def test_real_widths_bf16_graphs_match_eager(preset, layers):
    """bf16 decode replayed as CUDA graphs (per-layer inputs, shared KV and experts captured)
    gives the eager engine's tokens and logprobs."""
    from flexrollout import LLM

    model = _preset_model(preset, torch.bfloat16, "cuda", layers)
    prompts = [{"prompt_token_ids": p} for p in _random_prompts((3, 64, 700), seed=6)]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logprobs=1)
    graphed = LLM(model, max_model_len=2048, max_num_seqs=8, num_kv_pages=64)
    eager = LLM(model, max_model_len=2048, max_num_seqs=8, num_kv_pages=64, enforce_eager=True)
    for x, y in zip(graphed.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False)):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lp_x = [next(iter(d.values())).logprob for d in x.outputs[0].logprobs]
        lp_y = [next(iter(d.values())).logprob for d in y.outputs[0].logprobs]
        assert torch.allclose(torch.tensor(lp_x), torch.tensor(lp_y), atol=1e-2)


def test_small_moe_steps_route_and_run_experts_on_the_small_batch_kernels(monkeypatch):
    """26B-A4B-style layers in small decode steps: the router's projection takes the GEMV, and the
    experts get the step's small-row limit (they ran grouped_mm at every batch size, the grouped
    GEMV's GELU-tanh never reached); greedy decode still matches HF's on CPU."""
    from conftest import assert_small_moe_steps_take_small_kernels

    model, tok = make_tiny_gemma4("moe", hidden_size=128)
    prompts = [[5, 17, 300, 42, 9, 11, 23, 40, 2, 7, 19, 33], [7, 8]]
    routers = [layer.router.proj.weight for layer in model.model.layers]
    assert_small_moe_steps_take_small_kernels(monkeypatch, model, tok, prompts, routers, 6)


def test_small_decode_steps_project_per_layer_inputs_through_the_gemv(monkeypatch):
    """E2B-style per-layer inputs in small decode steps: the context projection of the embeddings
    (hidden -> layers * P, once a step) takes the GEMV as every layer's projections do (it ran
    cuBLAS through a kernel-less `linear`), and greedy decode still matches HF's on CPU."""
    from conftest import _hf_greedy, small_kernels_on_cpu

    from flexrollout import LLM, SamplingParams

    model, tok = make_tiny_gemma4("e2b", hidden_size=128)
    seen = small_kernels_on_cpu(monkeypatch)
    prompts = [[5, 17, 300, 42, 9, 11, 23, 40, 2, 7, 19, 33], [7, 8]]
    refs = [_hf_greedy(model, p, 6).tokens for p in prompts]
    llm = LLM(model, tokenizer=tok, max_model_len=128, max_num_seqs=2, num_kv_pages=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert _tokens(outs) == refs
    projection = model.model.per_layer_model_projection.weight
    assert sum(w is projection for w in seen["gemv"]) >= 5      # one a decode step
