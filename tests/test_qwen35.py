"""Qwen3.5 hybrids (GatedDeltaNet linear attention + gated full attention; dense and MoE with a
shared expert) against HF transformers, fp32 on CPU, where both run the torch gated delta rule.

Tiny configs: 4 layers alternating linear / full attention (full_attention_interval 2), hidden 64,
2 key / 4 value linear heads (so key heads are shared by two value heads), head_dim 16 with
partial rope 0.25. Weights are re-drawn so every block matters (sharp q/k, conv taps 0.5 N(0, 1),
norms away from their init). References: HF `generate` (greedy) and HF's teacher-forced forward.
"""
from __future__ import annotations

import os

import pytest
import torch

from conftest import (
    TINY_EOS,
    TINY_VOCAB,
    make_tiny_tokenizer,
    random_prompts,
    run_fresh_python,
    saved_adapter_models,
    tiny_llm,
)
from flexrollout import SamplingParams

ARCHS = ["dense", "moe"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LP_TOL = 1e-4
MIXED = random_prompts([11, 7, 23, 3], seed=7)


def make_tiny_qwen35(arch: str, seed: int = 0, **overrides):
    """(model, tokenizer): a tiny random Qwen3.5 text model (`Qwen3_5ForCausalLM` or
    `Qwen3_5MoeForCausalLM`), fp32, eval mode; `overrides` replace config fields."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  full_attention_interval=2, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=TINY_EOS, pad_token_id=0, tie_word_embeddings=False)
    common.update(overrides)
    if arch == "moe":
        config = Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32, **common)
    else:
        config = Qwen3_5TextConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    return model, make_tiny_tokenizer(TINY_VOCAB, TINY_EOS)


def _redraw(model, seed: int) -> None:
    """Decoder weights drawn so that every block moves the logits (HF's init leaves them nearly
    uniform); eval mode."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".layers." not in name or name.endswith(("A_log", "dt_bias")):
                continue
            if "norm" in name:     # zero-centred norms (1 + w), and the gated norm's plain w
                param.copy_((1.0 if "linear_attn.norm" in name else 0.0)
                            + 0.1 * torch.randn(param.shape, generator=gen))
            elif "conv1d" in name or ".gate." in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    model.eval()


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request):
    return make_tiny_qwen35(request.param)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_small_moe_steps_route_and_run_experts_on_the_small_batch_kernels(monkeypatch):
    """Qwen3.5-MoE (Qwen3.6-35B-A3B's layout) in small decode steps: the router's projection
    takes the GEMV, and the experts get the step's small-row limit (they ran grouped_mm at every
    batch size); greedy decode still matches HF's on CPU."""
    from conftest import assert_small_moe_steps_take_small_kernels

    model, tok = make_tiny_qwen35("moe", hidden_size=128)
    prompts = [[5, 17, 33, 2, 9, 100, 4, 8, 99, 250, 3], [300, 7, 8, 121, 64, 19, 23]]
    routers = [layer.mlp.gate.weight for layer in model.model.layers]
    assert_small_moe_steps_take_small_kernels(monkeypatch, model, tok, prompts, routers, 8)


def _prompts(ids) -> list[dict]:
    return [{"prompt_token_ids": p} for p in ids]


@torch.no_grad()
def _teacher_forced(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


# --------------------------------------------------------------------------------------------- kernels


def test_torch_gated_delta_rule_matches_hf_fallbacks():
    """The chunked reference (from a non-zero state, across a chunk boundary) and the one-token
    decode step against transformers' own torch_chunk / torch_recurrent gated delta rules."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from flexrollout.layers import gated_delta as gd

    gen = torch.Generator().manual_seed(0)
    batch, length, heads, dk, dv = 2, 70, 4, 16, 8
    q, k = torch.randn(batch, length, heads, dk, generator=gen), torch.randn(batch, length, heads, dk, generator=gen)
    v = torch.randn(batch, length, heads, dv, generator=gen)
    g, beta = -torch.rand(batch, length, heads, generator=gen), torch.rand(batch, length, heads, generator=gen)
    state = torch.randn(batch, heads, dk, dv, generator=gen)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    out, final = gd.chunked_rule(q, k, v, g, beta, state)
    assert (out - ref_out).abs().max() < 1e-5 and (final - ref_state).abs().max() < 1e-5
    rec_out, rec_state = hf.torch_recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1],
                                                            beta[:, :1], **kwargs)
    step_out, step_state = gd.recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    assert (step_out - rec_out[:, 0]).abs().max() < 1e-6 and (step_state - rec_state).abs().max() < 1e-6


def test_packed_conv_matches_hf_conv_with_history():
    """Packed causal conv: each sequence continues from its own K-input history (zeros = a fresh
    sequence), as HF's causal_conv1d_fn over [history, chunk]; the new history is the last K inputs."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from flexrollout.layers import gated_delta as gd

    gen = torch.Generator().manual_seed(1)
    channels, width, lengths = 6, 4, [5, 1, 2]
    weight = torch.randn(channels, width, generator=gen)
    history = torch.randn(len(lengths), channels, width, generator=gen)
    history[1] = 0.0
    x = torch.randn(sum(lengths), channels, generator=gen)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    seq, offset = gd.packed_layout(cu, x.shape[0])
    out, new_history = gd.conv_prefill(x, weight, history, seq, offset, cu)
    for n, (start, stop) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        full = torch.cat([history[n], x[start:stop].T], dim=-1)[None]
        ref = hf.causal_conv1d_fn(full, weight, None, activation="silu")[0, :, width:].T
        assert (out[start:stop] - ref).abs().max() < 1e-6
        assert torch.equal(new_history[n], full[0, :, -width:])
    step, window = gd.conv_decode(x[:3], weight, history)
    state = history.clone()
    ref = hf.causal_conv1d_update(x[:3, :, None], state, weight, None, "silu")[..., 0]
    assert (step - ref).abs().max() < 1e-6 and torch.equal(window, state)


def _kda_reference(q, k, v, g, beta, initial_state, inplace_final_state, ssm_state_indices,
                   use_qk_l2norm_in_kernel, out):
    """fla's `fused_recurrent_kda_fwd` as its kernel reads (fla 0.6, kda/fused_recurrent.py), for
    one token per sequence: q/k (B, 1, H, K), v (B, 1, HV, V), g (B, 1, HV, K) a decay per key
    channel, beta (B, 1, HV); value head h reads key head h // (HV / H); each row's state is read
    from and written back to `initial_state[ssm_state_indices[row]]`; the output into `out`."""
    assert inplace_final_state and use_qk_l2norm_in_kernel and q.shape[1] == 1
    heads, value_heads = q.shape[2], v.shape[2]
    for row, slot in enumerate(ssm_state_indices.tolist()):
        for h in range(value_heads):
            kh = h // (value_heads // heads)
            qv, kv = q[row, 0, kh].float(), k[row, 0, kh].float()
            qv = qv / torch.sqrt((qv * qv).sum() + 1e-6) * q.shape[-1] ** -0.5
            kv = kv / torch.sqrt((kv * kv).sum() + 1e-6)
            state = initial_state[slot, h] * g[row, 0, h].float().exp()[:, None]
            write = (v[row, 0, h].float() - (state * kv[:, None]).sum(0)) * beta[row, 0, h].float()
            state = state + kv[:, None] * write[None, :]
            out[row, 0, h] = (state * qv[:, None]).sum(0).to(out.dtype)
            initial_state[slot, h] = state
    return out, initial_state


def test_fla_decode_wiring_matches_torch_step(monkeypatch):
    """The decode step's fla path (key heads unrepeated, the per-head decay repeated over the key
    channels, states updated in place at their slots), eager and compiled by Inductor as the
    engine compiles it (the op's in-place write must reach the pool), against the torch step,
    with fla's kernel replaced by a torch transcription of what it computes (`_kda_reference`;
    the GPU tests below run fla's own)."""
    from flexrollout.layers import gated_delta as gd
    from flexrollout.models.qwen3_5 import linear_attention_decode

    monkeypatch.setattr(gd, "fla_decode_kernel", lambda: _kda_reference)
    gen = torch.Generator().manual_seed(3)
    rows, key_heads, value_heads, dk, dv, width = 3, 2, 4, 8, 6, 4
    conv_dim = 2 * key_heads * dk + value_heads * dv
    mixed = torch.randn(rows, conv_dim, generator=gen)
    z = torch.randn(rows, value_heads * dv, generator=gen)
    beta = torch.rand(rows, value_heads, generator=gen)
    g = -torch.rand(rows, value_heads, generator=gen)
    conv_w, norm_w = torch.randn(conv_dim, width, generator=gen), torch.randn(dv, generator=gen)
    conv_pool = torch.randn(5, conv_dim, width, generator=gen)
    rec_pool = torch.randn(5, value_heads, dk, dv, generator=gen)
    slots = torch.tensor([4, 0, 2])
    heads = (key_heads, dk, value_heads, dv)
    compiled = torch.compile(linear_attention_decode, fullgraph=True, dynamic=True)
    results = []
    for fn, fla in ((linear_attention_decode, False), (linear_attention_decode, True), (compiled, True)):
        pools = conv_pool.clone(), rec_pool.clone()
        out = fn(mixed, z, beta, g, conv_w, norm_w, *pools, slots, heads, 1e-6, fla)
        results.append((out, *pools))
    for fla_run in results[1:]:
        for torch_side, fla_side in zip(results[0], fla_run):
            assert (torch_side - fla_side).abs().max() < 1e-5
        assert torch.equal(fla_run[2][[1, 3]], rec_pool[[1, 3]])        # other slots untouched


def test_bad_linear_backend_is_a_clear_error():
    from flexrollout.layers import gated_delta as gd
    from flexrollout.models.qwen3_5 import Qwen3_5Forward

    model, _ = make_tiny_qwen35("dense")
    with pytest.raises(ValueError, match="linear_backend"):
        Qwen3_5Forward(model, torch.float32, linear_backend="triton")
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="backend"):
        gd.use_fla(x, "triton")
    assert not gd.use_fla(x, "auto")           # CPU: always the torch reference
    if gd.fla_chunk_rule() is None:
        with pytest.raises(ImportError, match="flash-linear-attention"):
            gd.use_fla(x, "fla")


# --------------------------------------------------------------------------------------------- engine


def test_spec_states_and_mixed_batch_with_slot_reuse_match_hf(tiny, hf_greedy):
    """Four prompts of different lengths, two slots: packed prefill of several sequences, decode
    of several, and slots handed to new sequences while others run (their state starts at zero);
    then sleep and wake-up."""
    model, tok = tiny
    llm = tiny_llm(model, tok, max_num_seqs=2)
    spec = llm.llm_engine.spec
    assert [layer.mixer for layer in spec.layers] == ["linear", "attention"] * 2
    cache = llm.llm_engine.cache
    assert cache.states[0]["conv"].shape == (3, 2 * 32 + 64, 4)
    assert cache.states[0]["recurrent"].shape == (3, 4, 16, 16)
    assert cache.states[0]["recurrent"].dtype == torch.float32 and cache.states[1] == {}
    refs = [hf_greedy(model, p, 10).tokens for p in MIXED]
    assert _tokens(llm.generate(_prompts(MIXED), GREEDY, use_tqdm=False)) == refs
    # Sleep drops the state pools with the KV cache; wake-up brings fresh ones.
    llm.sleep()
    assert cache.states == []
    llm.wake_up()
    assert cache.states[2]["recurrent"].abs().sum() == 0
    assert _tokens(llm.generate(_prompts(MIXED[:2]), GREEDY, use_tqdm=False)) == refs[:2]


def test_decode_graphs_leave_live_states_alone_and_match_hf(tiny, hf_greedy, cpu_graphs):
    """Decode graphs (on CPU through the `cpu_graphs` stand-in) captured mid-generation as rows finish
    (batches 4, 3 padded to 4, 2, 1): a capture's warm-up steps must not advance a live row's conv or
    recurrent state, and padded rows must write only the padding slot's."""
    model, tok = tiny
    llm = tiny_llm(model, tok, max_num_seqs=4)
    graphs = cpu_graphs(llm)
    lengths = [10, 7, 5, 3]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs = llm.generate(_prompts(MIXED), params, use_tqdm=False)
    assert sorted({key[0] for key in graphs.graphs}) == [1, 2, 4]
    assert _tokens(outs) == [hf_greedy(model, p, n).tokens for p, n in zip(MIXED, lengths)]


def test_chunked_prefill_matches_hf(tiny, hf_greedy):
    """A 70-token prompt prefilled in 16-token engine chunks (state and conv history carried from
    chunk to chunk), and in one step (the torch rule crosses its 64-token chunk)."""
    model, tok = tiny
    prompt = random_prompts([70], seed=3)[0]
    ref = hf_greedy(model, prompt, 10).tokens
    for budget in (16, 256):
        llm = tiny_llm(model, tok, max_num_batched_tokens=budget)
        before = llm.llm_engine.stats.prefill_steps
        assert _tokens(llm.generate(_prompts([prompt, MIXED[1]]), GREEDY, use_tqdm=False))[0] == ref
        assert (llm.llm_engine.stats.prefill_steps - before > 1) == (budget == 16)


def test_prompt_and_sampled_logprobs_match_hf_teacher_forced(tiny):
    model, tok = tiny
    llm = tiny_llm(model, tok)
    prompt = MIXED[2]
    out = llm.generate(_prompts([prompt]), SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=2,
                                                          prompt_logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    lp = _teacher_forced(model, prompt + generated)
    prompt_errors = [abs(out.prompt_logprobs[i][prompt[i]].logprob - float(lp[i - 1, prompt[i]]))
                     for i in range(1, len(prompt))]
    assert max(prompt_errors) < LP_TOL
    for step, token in enumerate(generated):
        row = lp[len(prompt) - 1 + step]
        assert abs(out.outputs[0].logprobs[step][token].logprob - float(row[token])) < LP_TOL


def test_async_stops_one_step_late_and_slots_are_reused(tiny, hf_greedy):
    """Async decode (the default): sequences stop at different steps while the next step is in
    flight, so that step writes a finished sequence's state slot; queued prompts then take those
    slots and must start from a zero state. Every output is HF's greedy path cut at its stop."""
    model, tok = tiny
    prompts = random_prompts([5, 12, 20, 9, 7, 14], seed=2)
    paths = [hf_greedy(model, p, 14).tokens for p in prompts]
    stops = [path[k] for path, k in zip(paths, [2, 4, 6, 8, 3, 5])]
    llm = tiny_llm(model, tok, max_num_seqs=3)
    discarded = llm.llm_engine.stats.discarded_tokens
    outs = llm.generate(_prompts(prompts), [SamplingParams(temperature=0, max_tokens=14, stop_token_ids=[s])
                                            for s in stops], use_tqdm=False)
    for out, path, stop in zip(outs, paths, stops):
        assert out.outputs[0].token_ids == path[:path.index(stop) + 1]
    assert llm.llm_engine.stats.discarded_tokens > discarded, "no step was in flight at a stop"


def test_groups_fork_states_and_preemption_recomputes(tiny, hf_greedy, engine_stats):
    """n = 3 samples of a prompt prefill once and each continues from its own copy of the state;
    with too few pages sequences are preempted and recomputed from scratch."""
    model, tok = tiny
    prompt = MIXED[0] + MIXED[3]                          # 14 tokens: a partly filled page
    ref = hf_greedy(model, prompt, 10).tokens
    llm = tiny_llm(model, tok)
    before = engine_stats(llm)
    outs = llm.generate(_prompts([prompt] * 3), GREEDY, use_tqdm=False)
    assert _tokens(outs) == [ref] * 3
    assert engine_stats(llm)["prefill_tokens"] - before["prefill_tokens"] == len(prompt)
    # Sampled members diverge; each one's logprobs are HF's along its own tokens.
    sampled = llm.generate(_prompts([prompt]), SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5,
                                                              logprobs=0, ignore_eos=True), use_tqdm=False)
    members = sampled[0].outputs
    assert len({tuple(c.token_ids) for c in members}) > 1
    for member in members:
        lp = _teacher_forced(model, prompt + member.token_ids)
        errors = [abs(member.logprobs[i][t].logprob - float(lp[len(prompt) - 1 + i, t]))
                  for i, t in enumerate(member.token_ids)]
        assert max(errors) < LP_TOL
    # 3 pages of 16 tokens: 14 + 12 and 7 + 12 tokens need 4, so the later one is preempted.
    small = tiny_llm(model, tok, num_gpu_blocks_override=3)
    before = engine_stats(small)
    prompts = [prompt, MIXED[1]]
    outs = small.generate(_prompts(prompts), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)
    assert engine_stats(small)["preemptions"] > before["preemptions"]
    assert _tokens(outs) == [hf_greedy(model, p, 12).tokens for p in prompts]


# --------------------------------------------------------------------------------------------- LoRA


def _peft_qwen35(arch: str, seed: int = 2):
    """PEFT adapters on gated attention, every GatedDeltaNet projection and the MLP (the shared
    expert's in the MoE), large enough to move the logits well beyond the tolerance."""
    from peft import LoraConfig, get_peft_model

    model, tok = make_tiny_qwen35(arch, seed=seed)
    targets = ["q_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
               "gate_proj", "down_proj", "shared_expert_gate"]
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                          init_lora_weights=False)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in pm.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return pm, tok


def _prompt_logprobs(llm, prompt, **kwargs) -> list[float]:
    out = llm.generate(_prompts([prompt]), SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                       use_tqdm=False, **kwargs)[0]
    return [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]


def _reference_logprobs(model, prompt) -> list[float]:
    lp = _teacher_forced(model, prompt)
    return [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]


def _max_error(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("arch,mode", [("dense", "live"), ("dense", "merged"), ("moe", "live")])
def test_lora_on_linear_attention_matches_peft(arch, mode, hf_greedy):
    pm, tok = _peft_qwen35(arch)
    prompt = MIXED[0]
    with pm.disable_adapter():
        base = _reference_logprobs(pm, prompt)
    expected = _reference_logprobs(pm, prompt)
    assert _max_error(base, expected) > 100 * LP_TOL
    llm = tiny_llm(pm, tok, lora_mode=mode)
    assert _max_error(_prompt_logprobs(llm, prompt), expected) < LP_TOL
    assert _tokens(llm.generate(_prompts([prompt]), GREEDY, use_tqdm=False)) == [hf_greedy(pm, prompt, 10).tokens]
    # An optimizer-like in-place step on a GatedDeltaNet adapter is seen by the next generate.
    with torch.no_grad():
        pm.base_model.model.model.layers[0].linear_attn.in_proj_qkv.lora_B["default"].weight.mul_(-1.5)
    assert _max_error(_prompt_logprobs(llm, prompt), _reference_logprobs(pm, prompt)) < LP_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_trl_grpo_lora_on_linear_attention(tmp_path, monkeypatch, arch):
    """TRL's GRPOTrainer (colocate) with LoRA on GatedDeltaNet and gated-attention projections: the
    engine runs over the trainer's own model, training moves the adapters and leaves the base
    weights bit-identical, nothing is pushed, and the engine's logprobs agree with TRL's forward."""
    pytest.importorskip("trl")
    from peft import LoraConfig
    from test_trl import _check_logp_difference, _config, _snapshot, _tiny_dataset, _train, reward_len
    from trl import GRPOTrainer

    import flexrollout
    from flexrollout.integrations.trl import patch_trl

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)      # TRL's colocate init sets them; restored after
    patch_trl(num_kv_pages=40)
    model, tok = make_tiny_qwen35(arch, seed=4)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "in_proj_qkv", "in_proj_z", "out_proj", "down_proj"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, processing_class=tok,
                          args=_config(tmp_path, learning_rate=2e-2), train_dataset=_tiny_dataset(4),
                          peft_config=lora)
    llm = trainer.vllm_generation.llm
    assert isinstance(llm, flexrollout.LLM) and llm.model is trainer.model
    lora_before = _snapshot(trainer.model, lambda n, p: "lora_B" in n and "linear_attn" in n)
    base_before = _snapshot(trainer.model, lambda n, p: "lora_" not in n)
    gen_calls, load_calls = _train(trainer, monkeypatch)
    assert trainer.state.global_step == 2 and gen_calls.count >= 2 and load_calls.count == 0
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(p, after[n].detach()) for n, p in lora_before.items()), \
        "no GatedDeltaNet adapter moved"
    assert all(torch.equal(p, after[n].detach()) for n, p in base_before.items())
    _check_logp_difference(trainer)


@pytest.mark.parametrize("arch", ARCHS)
def test_unsloth_fast_generate_with_live_lora_on_linear_attention(arch, hf_greedy):
    """Unsloth's loader (stood in for, as in test_unsloth.py) with fast_inference=True, then PEFT on
    GatedDeltaNet and attention projections: fast_generate gives HF's greedy tokens for the base
    model, PEFT's with the live adapter's request, and the base model's again without a request."""
    from peft import LoraConfig, get_peft_model

    from flexrollout.integrations import unsloth as plugin

    def from_pretrained(model_name="x", max_seq_length=2048, load_in_4bit=True, fast_inference=False):
        return make_tiny_qwen35(arch, seed=6)

    model, _ = plugin.load_pretrained(from_pretrained, "tiny", max_seq_length=128, load_in_4bit=False,
                                      fast_inference=True)

    def tokens(m, **kwargs):
        return _tokens(m.fast_generate(_prompts(MIXED[:2]), GREEDY, use_tqdm=False, **kwargs))

    base = [hf_greedy(model, p, 10).tokens for p in MIXED[:2]]
    assert tokens(model) == base
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                          target_modules=["q_proj", "in_proj_qkv", "in_proj_z", "out_proj"])).eval()
    with torch.no_grad():
        for name, param in pm.named_parameters():
            if "lora_B" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    plugin.attach_lora(pm)
    adapted = [hf_greedy(pm, p, 10).tokens for p in MIXED[:2]]
    assert adapted != base, "the adapter should change tokens"
    assert tokens(pm, lora_request=pm.load_lora("grpo_trainer_lora_model", load_tensors=True)) == adapted
    assert tokens(pm) == base                     # Unsloth's rule: no request, the base model


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_request_on_linear_attention_matches_peft(tmp_path, arch):
    """A saved adapter that adapts GatedDeltaNet projections (and, in the MoE, the shared expert
    and its gate), given by LoRARequest over the base model, equals PEFT's model loaded from that
    directory; rows without it run the base."""
    from flexrollout import LoRARequest

    pm, tok = _peft_qwen35(arch, seed=5)
    base, reference = saved_adapter_models(pm, lambda: make_tiny_qwen35(arch, seed=5)[0], tmp_path / "adapter")
    prompt = MIXED[2]
    llm = tiny_llm(base, tok)
    request = LoRARequest("saved", 1, str(tmp_path / "adapter"))
    assert _max_error(_prompt_logprobs(llm, prompt, lora_request=request),
                      _reference_logprobs(reference, prompt)) < LP_TOL
    assert _max_error(_prompt_logprobs(llm, prompt), _reference_logprobs(base, prompt)) < LP_TOL


# --------------------------------------------------------------------------------------------- multimodal


def test_multimodal_checkpoint_runs_its_language_model(hf_greedy):
    """`Qwen3_5ForConditionalGeneration` (the VLM checkpoints' class): text prompts run over the
    wrapper's own language model and lm_head; image input is a clear error."""
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    text = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                full_attention_interval=2, max_position_embeddings=512, eos_token_id=TINY_EOS, pad_token_id=0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision,
                                                          tie_word_embeddings=False))
    _redraw(model, 0)
    llm = tiny_llm(model, make_tiny_tokenizer(TINY_VOCAB, TINY_EOS))
    prompt = MIXED[0]
    assert _tokens(llm.generate(_prompts([prompt]), GREEDY, use_tqdm=False)) == [hf_greedy(model, prompt, 10).tokens]
    with pytest.raises(NotImplementedError, match="multi_modal_data"):
        llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": None}}], GREEDY, use_tqdm=False)
    assert _tokens(llm.generate(_prompts([prompt]), GREEDY, use_tqdm=False)) == [hf_greedy(model, prompt, 10).tokens]


# --------------------------------------------------------------------------------------------- GPU
# (marked `gpu`: conftest skips them where CUDA is absent)


def _real_width_model(arch: str, dtype: torch.dtype, layers: int = 4):
    """Real widths at reduced depth (3 GatedDeltaNet + 1 gated attention layer): Qwen3.5-4B's
    (dense) or transformers' Qwen3.5-MoE defaults, which are Qwen3.5-35B-A3B's (256 experts
    top-8, shared expert). HF's own init."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    common = dict(num_hidden_layers=layers, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
    if arch == "dense":
        config = Qwen3_5TextConfig(hidden_size=2560, intermediate_size=9216, num_attention_heads=16,
                                   num_key_value_heads=4, head_dim=256, tie_word_embeddings=True, **common)
    else:
        config = Qwen3_5MoeTextConfig(**common)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _cuda_prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_cuda_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def _first_logprobs(out) -> list[float]:
    return [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]


_HF_TORCH_RULE = """
import json, sys
sys.modules["fla"] = None     # before transformers resolves its kernels: HF's own torch rule
sys.path.insert(0, {tests!r})
from test_qwen35 import _cuda_prompts, _hf_cuda_greedy, _real_width_model
model = _real_width_model({arch!r}, __import__("torch").float32)
prompts = _cuda_prompts(model.config.vocab_size, {lengths!r}, seed={seed})
print(json.dumps([_hf_cuda_greedy(model, p, {new_tokens}) for p in prompts]))
"""


def _hf_torch_rule_greedy(arch: str, lengths, seed: int, new_tokens: int) -> list[list[int]]:
    """HF generate on `_real_width_model(arch)` in fp32 with its torch gated-delta rule. With
    flash-linear-attention installed, transformers binds fla's kernels at import, even for fp32
    inputs, and their tf32-class dots are not the fp32 rule: the reference runs in a fresh
    interpreter where fla cannot be imported (same seeds, same weights)."""
    import json

    code = _HF_TORCH_RULE.format(tests=os.path.dirname(__file__), arch=arch, lengths=tuple(lengths),
                                 seed=seed, new_tokens=new_tokens)
    return json.loads(run_fresh_python(code, triton_interpret=False).strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_real_widths_fp32_greedy_matches_hf_with_graphs(arch):
    """fp32 (the torch rule on both sides): packed prefill past the 64-token rule chunk, decode
    graphs with the compiled linear-attention step, against HF generate."""
    from flexrollout import LLM

    lengths, seed = (5, 140, 300), 5
    model = _real_width_model(arch, torch.float32)
    prompts = _cuda_prompts(model.config.vocab_size, lengths, seed=seed)
    llm = LLM(model, max_model_len=1024, max_num_seqs=8, num_kv_pages=64)
    assert llm.llm_engine.runner.graphs is not None
    outs = llm.generate(_prompts(prompts), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    del llm, model
    torch.cuda.empty_cache()
    assert [out.outputs[0].token_ids for out in outs] == _hf_torch_rule_greedy(arch, lengths, seed, 16)


@pytest.mark.gpu
def test_gpu_graphs_match_eager():
    """Graph replay (padded rows on the padding slot's state) against eager decode, fp32."""
    from flexrollout import LLM

    model = _real_width_model("dense", torch.float32)
    prompts = _cuda_prompts(model.config.vocab_size, (3, 17, 64, 100, 129), seed=1)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logprobs=1)
    graphed = LLM(model, max_model_len=1024, max_num_seqs=8, num_kv_pages=64)
    eager = LLM(model, max_model_len=1024, max_num_seqs=8, num_kv_pages=64, enforce_eager=True)
    for x, y in zip(graphed.generate(_prompts(prompts), params, use_tqdm=False),
                    eager.generate(_prompts(prompts), params, use_tqdm=False)):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert torch.allclose(torch.tensor(_first_logprobs(x)), torch.tensor(_first_logprobs(y)), atol=1e-3)


@pytest.mark.gpu
def test_gpu_fla_prefill_matches_torch_reference():
    """fla's chunk kernel (varlen, from per-sequence states) against the torch reference, bf16
    inputs at Qwen3.5-4B's linear-attention widths."""
    pytest.importorskip("fla")
    from flexrollout.layers import gated_delta as gd

    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths, heads, dim = [5, 130, 70], 32, 128
    tokens = sum(lengths)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(tokens, heads, dim, device="cuda", generator=gen).bfloat16() for _ in range(3))
    g = -torch.rand(tokens, heads, device="cuda", generator=gen)
    beta = torch.rand(tokens, heads, device="cuda", generator=gen).bfloat16()
    state = 0.1 * torch.randn(len(lengths), heads, dim, dim, device="cuda", generator=gen)
    seq, offset = gd.packed_layout(cu, tokens)
    out_fla, final_fla = gd.rule_prefill(q, k, v, g, beta, state.clone(), seq, offset, cu, backend="fla")
    out_ref, final_ref = gd.rule_prefill(q, k, v, g, beta, state.clone(), seq, offset, cu, backend="torch")
    scale = out_ref.float().abs().max()
    assert (out_fla.float() - out_ref.float()).abs().max() < 2e-2 * scale
    assert (final_fla - final_ref).abs().max() < 2e-2 * final_ref.abs().max()


@pytest.mark.gpu
def test_gpu_fla_decode_matches_torch_step():
    """fla's in-place decode kernel against the torch step at Qwen3.5-4B's linear-attention widths
    (16 key heads, 32 value heads of 128), bf16 inputs, fp32 states in scattered pool slots."""
    pytest.importorskip("fla")
    from flexrollout.layers import gated_delta as gd

    if gd.fla_decode_kernel() is None:
        pytest.skip("this fla has no in-place recurrent kernel")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, key_heads, value_heads, dim = 5, 16, 32, 128
    q, k = (torch.randn(rows, key_heads, dim, device="cuda", generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(rows, value_heads, dim, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(rows, value_heads, device="cuda", generator=gen)
    beta = torch.rand(rows, value_heads, device="cuda", generator=gen).bfloat16()
    pool = 0.1 * torch.randn(9, value_heads, dim, dim, device="cuda", generator=gen)
    slots = torch.tensor([8, 1, 4, 0, 6], device="cuda", dtype=torch.int32)
    fla_pool = pool.clone()
    out = gd.fla_decode_step(q, k, v, g, beta, fla_pool, slots)
    group = value_heads // key_heads
    ref_out, ref_state = gd.recurrent_step(q.repeat_interleave(group, 1), k.repeat_interleave(group, 1), v, g,
                                           beta, pool[slots.long()])
    assert (out.float() - ref_out).abs().max() < 2e-2 * ref_out.abs().max()
    assert (fla_pool[slots.long()] - ref_state).abs().max() < 1e-4 * ref_state.abs().max()
    untouched = torch.ones(9, dtype=torch.bool)
    untouched[slots.long().cpu()] = False
    assert torch.equal(fla_pool[untouched.cuda()], pool[untouched.cuda()])


@pytest.mark.gpu
def test_gpu_bf16_fla_decode_engine_close_to_torch_step():
    """bf16 decode with `fla_decode` (fla's in-place kernel, from CUDA graphs) against the same
    engine's torch step: the prefill's token agrees, the logprobs agree to bf16 precision while
    the greedy tokens do, and where they first part it is between two tokens the torch step
    nearly ties (random bf16 models' greedy tokens often do: on an H100 two of three prompts
    parted, at their second and third tokens, between tokens one bf16 step of the logits apart,
    their logprobs swapped)."""
    pytest.importorskip("fla")
    from flexrollout import LLM

    model = _real_width_model("dense", torch.bfloat16)
    prompts = _cuda_prompts(model.config.vocab_size, (7, 90, 200), seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    runs = []
    for fla_decode in (True, False):
        llm = LLM(model, max_model_len=1024, max_num_seqs=4, num_kv_pages=32, fla_decode=fla_decode)
        runs.append([r.outputs[0] for r in llm.generate(_prompts(prompts), params, use_tqdm=False)])
        del llm
    for fla, ref in zip(*runs):
        agree = next((i for i, (a, b) in enumerate(zip(fla.token_ids, ref.token_ids)) if a != b),
                     len(ref.token_ids))
        assert agree >= 1, (fla.token_ids, ref.token_ids)
        diff = [fla.logprobs[i][t].logprob - ref.logprobs[i][t].logprob
                for i, t in enumerate(ref.token_ids[:agree])]
        assert torch.tensor(diff).abs().mean() < 0.05, diff
        if agree < len(ref.token_ids):
            ref_top = ref.logprobs[agree]
            parted = fla.token_ids[agree]
            assert parted in ref_top and ref.token_ids[agree] in fla.logprobs[agree], agree
            gap = ref_top[ref.token_ids[agree]].logprob - ref_top[parted].logprob
            assert gap < 0.1, (agree, gap)


@pytest.mark.gpu
def test_gpu_bf16_fla_engine_close_to_torch_rule():
    """bf16 engine with fla prefill against the same engine on the torch rule: the prompt's
    logprobs agree to bf16 precision (greedy tokens of random bf16 models are nearly tied)."""
    pytest.importorskip("fla")
    from flexrollout import LLM

    model = _real_width_model("dense", torch.bfloat16)
    prompt = _cuda_prompts(model.config.vocab_size, (200,), seed=2)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    results = []
    for backend in ("fla", "torch"):
        llm = LLM(model, max_model_len=1024, max_num_seqs=4, num_kv_pages=32)
        llm.llm_engine.forward.linear_backend = backend
        out = llm.generate(_prompts([prompt]), params, use_tqdm=False)[0]
        results.append(torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]))
        del llm
    assert (results[0] - results[1]).abs().mean() < 0.05
