"""Mixture-of-experts families (Qwen3-MoE, gpt-oss) against HF transformers and PEFT, fp32 on CPU.

Tiny configs (3 layers, 4 experts, top-2; Qwen3-MoE with a dense layer through mlp_only_layers;
gpt-oss with attention sinks and a 6-token sliding window on layers 0 and 2, so every prompt here
is longer than the window). References are HF `generate` (greedy) and HF's teacher-forced forward
(logprobs); with adapters, PEFT's own forward on the same model.
"""
from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_moe, randomize_lora, saved_adapter_models, tiny_llm

from flexrollout import LLM, LoRARequest, SamplingParams

ARCHS = ["qwen3_moe", "gpt_oss"]
PROMPTS = [[5, 17, 33, 2, 9, 100, 4, 8, 99, 250, 3], [300, 7, 8, 121, 64, 19, 23], [41, 42, 43, 44, 45, 46, 47, 48]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LP_TOL = 1e-4
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@torch.no_grad()
def _teacher_forced_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits: row i is the distribution of token i + 1."""
    return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def _engine_prompt_logprobs(llm, prompt: list[int]) -> list[float]:
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
    entries = out[0].prompt_logprobs
    return [entries[i][prompt[i]].logprob for i in range(1, len(prompt))]


def _reference_prompt_logprobs(model, prompt: list[int]) -> list[float]:
    lp = _teacher_forced_logprobs(model, prompt)
    return [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]


@pytest.mark.parametrize("decode", ["eager", "graphs"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_hf(arch, decode, hf_greedy, request):
    """`graphs`: decode replays graphs (on CPU through the `cpu_graphs` stand-in), padded rows included."""
    model, tok = make_tiny_moe(arch)
    llm = tiny_llm(model, tok)
    if decode == "graphs":
        request.getfixturevalue("cpu_graphs")(llm)
    spec = llm.llm_engine.spec
    if arch == "gpt_oss":
        assert [layer.window for layer in spec.layers] == [6, None, 6] and all(l.sinks for l in spec.layers)
        assert all(len(p) > 6 for p in PROMPTS)
    else:
        assert [layer.ffn for layer in spec.layers] == ["moe", "mlp", "moe"]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert _tokens(outs) == [hf_greedy(model, p, 12).tokens for p in PROMPTS]


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_and_sampled_logprobs_match_hf_teacher_forced(arch):
    model, tok = make_tiny_moe(arch, seed=4)
    llm = tiny_llm(model, tok)
    prompt = PROMPTS[0]
    ours, ref = _engine_prompt_logprobs(llm, prompt), _reference_prompt_logprobs(model, prompt)
    assert max(abs(a - b) for a, b in zip(ours, ref)) < LP_TOL
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        max_tokens=10, temperature=1.0, seed=3, logprobs=2, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    lp = _teacher_forced_logprobs(model, prompt + out.token_ids)
    for step, token in enumerate(out.token_ids):
        row = lp[len(prompt) - 1 + step]
        assert abs(out.logprobs[step][token].logprob - float(row[token])) < LP_TOL
        assert out.logprobs[step][token].rank == int((row > row[token]).sum()) + 1


@pytest.mark.parametrize("arch", ARCHS)
def test_groups_share_prefill_and_preemption_keeps_hf_tokens(arch, hf_greedy, engine_stats):
    model, tok = make_tiny_moe(arch, seed=1)
    prompt = PROMPTS[2] * 2                                  # 16 tokens: one full page
    ref = hf_greedy(model, prompt, 12).tokens
    llm = tiny_llm(model, tok)
    before = engine_stats(llm)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, GREEDY, use_tqdm=False)
    after = engine_stats(llm)
    assert _tokens(outs) == [ref] * 3
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt)
    # 5 pages of 16 tokens hold two 28-token sequences; four must preempt and recompute.
    small = tiny_llm(model, tok, num_gpu_blocks_override=5)
    before = engine_stats(small)
    outs = small.generate([{"prompt_token_ids": p} for p in [prompt, PROMPTS[0], PROMPTS[1], PROMPTS[2]]],
                          GREEDY, use_tqdm=False)
    after = engine_stats(small)
    assert after["preemptions"] > before["preemptions"]
    assert _tokens(outs) == [hf_greedy(model, p, 12).tokens for p in [prompt, PROMPTS[0], PROMPTS[1], PROMPTS[2]]]


# --------------------------------------------------------------------------------------------- expert LoRA


def _peft_moe(arch: str, seed: int = 2, lora_seed: int | None = None):
    """A PEFT model adapting q/o projections and both expert stacks, adapters large enough to
    move the logits well beyond the tolerance (drawn with `lora_seed`, default `seed`)."""
    from peft import LoraConfig, get_peft_model

    model, tok = make_tiny_moe(arch, seed=seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                        target_parameters=EXPERT_PARAMS, init_lora_weights=False)
    pm = get_peft_model(model, config).eval()
    randomize_lora(pm, seed if lora_seed is None else lora_seed)
    return pm, tok


def _adapter_effect(pm, prompt) -> float:
    with pm.disable_adapter():
        base = _reference_prompt_logprobs(pm, prompt)
    return max(abs(a - b) for a, b in zip(base, _reference_prompt_logprobs(pm, prompt)))


@pytest.mark.parametrize("mode", ["live", "merged"])
@pytest.mark.parametrize("arch", ARCHS)
def test_expert_lora_matches_peft_and_sees_updates(arch, mode, hf_greedy):
    pm, tok = _peft_moe(arch)
    prompt = PROMPTS[0]
    assert _adapter_effect(pm, prompt) > 100 * LP_TOL
    llm = tiny_llm(pm, tok, lora_mode=mode)
    ours = _engine_prompt_logprobs(llm, prompt)
    assert max(abs(a - b) for a, b in zip(ours, _reference_prompt_logprobs(pm, prompt))) < LP_TOL
    assert _tokens(llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)) == \
        [hf_greedy(pm, prompt, 12).tokens]
    # An optimizer-like in-place step on the expert adapters is seen by the next generate.
    experts = pm.base_model.model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.lora_B["default"].weight.mul_(-1.5)
        experts.base_layer.lora_A["default"].weight.add_(0.2)
    assert max(abs(a - b) for a, b in zip(_engine_prompt_logprobs(llm, prompt),
                                          _reference_prompt_logprobs(pm, prompt))) < LP_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_expert_adapter_by_path_and_tensors(arch, tmp_path):
    """A saved PEFT adapter with expert LoRA, by path and by tensors, on the base model, equals
    PEFT's model loaded from that directory."""
    from safetensors.torch import load_file

    pm, tok = _peft_moe(arch, seed=5)
    base, ref = saved_adapter_models(pm, lambda: make_tiny_moe(arch, seed=5)[0], tmp_path / "adapter")
    prompt = PROMPTS[1]
    expected = _reference_prompt_logprobs(ref, prompt)
    llm = tiny_llm(base, tok)
    by_path = LoRARequest("saved", 1, str(tmp_path / "adapter"))
    import json

    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    by_tensors = LoRARequest("tensors", 2, lora_tensors=load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")),
                             lora_config=config)
    for request in (by_path, by_tensors):
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False, lora_request=request)
        ours = [out[0].prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        assert max(abs(a - b) for a, b in zip(ours, expected)) < LP_TOL, request.lora_name
    # Rows without a request in the same call run the base model.
    assert max(abs(a - b) for a, b in zip(_engine_prompt_logprobs(llm, prompt),
                                          _reference_prompt_logprobs(base, prompt))) < LP_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_lora_request_rows_replace_the_live_expert_adapter(arch, tmp_path):
    """One call over a PEFT MoE model: rows with a saved expert adapter equal PEFT loading it
    (the live expert adapter masked off on those rows, in the experts' gate/up and down), rows
    without one equal the live PEFT model. Merged mode refuses such a call with a clear error,
    before any work, and still serves calls without a request."""
    donor, _ = _peft_moe(arch, 5)
    _, saved = saved_adapter_models(donor, lambda: make_tiny_moe(arch, seed=5)[0], tmp_path / "saved")
    live, tok = _peft_moe(arch, 5, lora_seed=13)
    request = LoRARequest("saved", 1, str(tmp_path / "saved"))
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    models = [saved, live, saved]
    llm = tiny_llm(live, tok)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False,
        lora_request=[request, None, request])
    for out, prompt, model in zip(outs, prompts, models):
        ours = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        assert max(abs(a - b) for a, b in zip(ours, _reference_prompt_logprobs(model, prompt))) < LP_TOL
    # the saved and live adapters differ well beyond the tolerance on the shared prompt
    assert max(abs(a - b) for a, b in zip(_reference_prompt_logprobs(saved, PROMPTS[0]),
                                          _reference_prompt_logprobs(live, PROMPTS[0]))) > 100 * LP_TOL

    merged = tiny_llm(live, tok, lora_mode="merged")
    before = merged.llm_engine.stats.prefill_steps
    with pytest.raises(ValueError, match="lora_mode='merged'.*expert"):
        merged.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=request)
    assert merged.llm_engine.stats.prefill_steps == before
    assert max(abs(a - b) for a, b in zip(_engine_prompt_logprobs(merged, PROMPTS[0]),
                                          _reference_prompt_logprobs(live, PROMPTS[0]))) < LP_TOL


def test_unsupported_moe_type_is_a_clear_error():
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    config = Qwen2MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(NotImplementedError, match="qwen2_moe"):
        LLM(model, tokenizer=None, dtype="float32", max_model_len=64, num_gpu_blocks_override=8)


def test_graph_safe_expert_product_matches_grouped_mm():
    """Under CUDA-graph capture a non-bf16 expert product scatters rows into a padded batch and
    runs one bmm (grouped_mm's fallback copies offsets to the host). The two agree on every row,
    empty experts included."""
    from flexrollout.layers import moe

    torch.manual_seed(0)
    tokens, top_k, num_experts = 7, 3, 6
    # distinct experts per token, and the last expert gets no rows
    ids = torch.stack([torch.randperm(num_experts - 1)[:top_k] for _ in range(tokens)])
    flat = ids.reshape(-1)
    groups = moe._Groups(flat, torch.argsort(flat, stable=True), top_k, tokens, num_experts)
    x = torch.randn(tokens * top_k, 16)
    stack = torch.randn(num_experts, 16, 24)
    expected = moe._grouped(x, stack, groups)
    groups.capturing = True
    assert torch.allclose(moe._grouped(x, stack, groups), expected, atol=1e-5)


_GEMV_CHECK = """
import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
from flexrollout.kernels import expert_gemv
from flexrollout.layers import moe

torch.manual_seed(0)
arch = "{arch}"
if arch == "qwen3_moe":
    cfg = Qwen3MoeConfig(hidden_size=96, moe_intermediate_size=40, num_experts=6, num_experts_per_tok=2)
    experts = Qwen3MoeExperts(cfg)
    layout = dict(transposed=False, interleaved=False, act="silu", limit=7.0, alpha=1.702)
elif arch == "gemma4":
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts
    cfg = Gemma4TextConfig(hidden_size=96, moe_intermediate_size=40, num_experts=6, top_k_experts=2,
                           enable_moe_block=True, hidden_activation="gelu_pytorch_tanh")
    experts = Gemma4TextExperts(cfg)
    layout = dict(transposed=False, interleaved=False, act="gelu_tanh", limit=7.0, alpha=1.702)
else:
    cfg = GptOssConfig(hidden_size=96, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2)
    experts = GptOssExperts(cfg)
    layout = dict(transposed=True, interleaved=True, act="gpt_oss", limit=float(experts.limit),
                  alpha=float(experts.alpha))
with torch.no_grad():
    for p in experts.parameters():
        p.normal_(0, 0.3)
tokens, top_k = 29, 2                     # 58 rows: the kernel's 64-row tile, partly masked
h = torch.randn(tokens, 96)
logits = torch.randn(tokens, 6)
logits[:25, 0] += 10                      # expert 0 takes 25 rows, expert 5 may take none
weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
with torch.no_grad():
    ref = experts(h, ids, weights)
biases = dict(gate_up_bias=getattr(experts, "gate_up_proj_bias", None),
              down_bias=getattr(experts, "down_proj_bias", None))
got = expert_gemv.experts_small(h, ids, weights, experts.gate_up_proj.detach(), experts.down_proj.detach(),
                                **{{k: (v.detach() if v is not None else None) for k, v in biases.items()}},
                                **layout)
err = ((got - ref).norm() / ref.norm()).item()
assert err < 1e-5, err
"""


@pytest.mark.parametrize("arch", [*ARCHS, "gemma4"])
def test_expert_gemv_kernel_matches_hf_experts(arch):
    """The small-batch grouped GEMV (Triton, interpreted on CPU) against HF's expert module:
    both layouts (gpt-oss's interleaved gate/up), biases, the gpt-oss clamp, Gemma-4's GELU-tanh,
    one expert with most rows."""
    pytest.importorskip("triton")
    from conftest import run_fresh_python

    run_fresh_python(_GEMV_CHECK.format(arch=arch), triton_interpret=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_small_steps_route_and_run_experts_on_the_small_batch_kernels(arch, monkeypatch):
    """In small decode steps the router's projection takes the GEMV like every other projection
    (it ran cuBLAS, a launch of its own, in every MoE layer), and the experts get the step's
    small-row limit; greedy decode still matches HF's (CPU: the GEMV's reference, grouped_mm)."""
    from conftest import assert_small_moe_steps_take_small_kernels

    model, tok = make_tiny_moe(arch, hidden_size=128)
    routers = [layer.mlp.router.weight if arch == "gpt_oss" else layer.mlp.gate.weight
               for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert_small_moe_steps_take_small_kernels(monkeypatch, model, tok, PROMPTS, routers, 12)
