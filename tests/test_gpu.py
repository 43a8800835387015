"""GPU correctness (skipped without CUDA): fused flex kernels and CUDA graphs against HF."""
from __future__ import annotations

import pytest
import torch

from flexrollout import LLM, SamplingParams
from flexrollout.bench import random_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompts(vocab: int, lengths=(5, 37, 130, 260), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "llama-3.2-1b"])
def test_fp32_greedy_matches_hf_with_graphs(preset):
    model = random_model(preset, torch.float32, "cuda", 2048)
    prompts = _prompts(model.config.vocab_size)
    llm = LLM(model, max_model_len=1024, max_num_seqs=8, num_kv_pages=64)
    assert llm.llm_engine.runner.graphs is not None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(model, prompt, 24)


def test_rope_buffer_on_cpu_matches_hf():
    """Unsloth's rotary embedding keeps inv_freq on the CPU while the weights are on the GPU."""
    model = random_model("qwen3-0.6b", torch.float32, "cuda", 2048)
    rotary = model.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq.cpu()
    prompts = _prompts(model.config.vocab_size, lengths=(9, 140), seed=3)
    llm = LLM(model, max_model_len=1024, max_num_seqs=4, num_kv_pages=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(model, prompt, 16)


def test_graphs_match_eager():
    # fp32: in bf16, a padded graph bucket and an unpadded eager batch pick different GEMM
    # kernels, and sampled sequences drift apart legitimately after a few tokens.
    model = random_model("qwen3-0.6b", torch.float32, "cuda", 2048)
    prompts = _prompts(model.config.vocab_size, lengths=(3, 17, 64, 100, 129, 200), seed=1)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=32, ignore_eos=True, logprobs=2)
    graphed = LLM(model, max_model_len=1024, max_num_seqs=8, num_kv_pages=64)
    eager = LLM(model, max_model_len=1024, max_num_seqs=8, num_kv_pages=64, enforce_eager=True)
    a = graphed.generate(prompts, params, use_tqdm=False)
    b = eager.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lp_x = [next(iter(d.values())).logprob for d in x.outputs[0].logprobs]
        lp_y = [next(iter(d.values())).logprob for d in y.outputs[0].logprobs]
        assert torch.allclose(torch.tensor(lp_x), torch.tensor(lp_y), atol=1e-3)


def test_bf16_first_logits_close_to_hf():
    model = random_model("qwen3-0.6b", torch.bfloat16, "cuda", 2048)
    prompts = _prompts(model.config.vocab_size, lengths=(50, 300), seed=2)
    llm = LLM(model, max_model_len=1024, max_num_seqs=4, num_kv_pages=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float().log_softmax(-1)
        for token, lp in out.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - ref[token].item()) < 0.05


def test_short_packed_prefill_bf16():
    """A packed prefill under one 128-token query block (GQA 2): flex must not pick its decode
    kernel there (inductor found no valid config for it on the H200)."""
    model = random_model("qwen3-0.6b", torch.bfloat16, "cuda", 2048)
    prompts = _prompts(model.config.vocab_size, lengths=(5, 40, 51), seed=3)
    llm = LLM(model, max_model_len=512, max_num_seqs=4, num_kv_pages=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, logprobs=0), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float().log_softmax(-1)
        token, lp = next(iter(out.outputs[0].logprobs[0].items()))
        assert abs(lp.logprob - ref[token].item()) < 0.05


def _peft_on_gpu(rank: int = 8):
    from peft import LoraConfig, get_peft_model

    model = random_model("qwen3-0.6b", torch.float32, "cuda", 2048)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)).eval()
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return pm


@pytest.mark.parametrize("lora_mode", ["live", "merged"])
def test_captured_graphs_follow_in_place_lora_update(lora_mode):
    pm = _peft_on_gpu()
    prompts = _prompts(pm.config.vocab_size, lengths=(9, 70), seed=4)
    llm = LLM(pm, max_model_len=512, max_num_seqs=4, num_kv_pages=16, lora_mode=lora_mode)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.llm_engine.runner.graphs.graphs, "decode should have replayed a captured graph"
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)                      # an optimizer-like in-place update
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    reference = [_hf_greedy(pm, p, 12) for p in prompts]
    assert second == reference and second != first


def test_merged_refresh_keeps_base_bit_identical():
    pm = _peft_on_gpu()
    llm = LLM(pm, max_model_len=256, max_num_seqs=2, num_kv_pages=8, lora_mode="merged")
    base = {n: p.detach().clone() for n, p in pm.named_parameters() if "base_layer" in n}
    merged = llm.llm_engine.forward.merged
    for _ in range(100):
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_A" in name:
                    p.add_(1e-4)
        assert merged.refresh() > 0
    assert all(torch.equal(p, base[n]) for n, p in pm.named_parameters() if "base_layer" in n)


def test_deleting_the_engine_frees_its_memory():
    """`del llm` returns the KV cache and graph pools without waiting for a gc pass: a script
    that builds engines one after another (benchmarks, sweeps) must not run out of memory."""
    import gc

    model = random_model("qwen3-0.6b", torch.bfloat16, "cuda", 2048)
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # capture clears them: earlier tests' must not count
    before = torch.cuda.memory_allocated()
    llm = LLM(model, max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.2)
    llm.generate([{"prompt_token_ids": list(range(3, 40))}] * 4, SamplingParams(max_tokens=8),
                 use_tqdm=False)  # captures a graph
    cache_bytes = llm.llm_engine.cache_bytes
    assert torch.cuda.memory_allocated() - before >= cache_bytes
    gc.disable()
    try:
        del llm
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - before
    finally:
        gc.enable()
    assert left < 0.05 * cache_bytes, (left, cache_bytes)


def _sampling_tensors(batch: int, device: str):
    from flexrollout.engine.sampler import SamplingTensors

    return SamplingTensors(
        temperature=torch.ones(batch, device=device), top_k=torch.full((batch,), 10**6, device=device),
        top_p=torch.ones(batch, device=device), min_p=torch.zeros(batch, device=device),
        seeds=torch.arange(batch, device=device) * 7919, counters=torch.full((batch,), 300, device=device),
        need_truncation=False, all_greedy=False, max_logprobs=0)


def test_fused_sampler_matches_eager_and_stays_small():
    """The compiled draw / logprob path picks the eager path's tokens (the noise is an integer hash)
    and allocates less than three (B, V) fp32 tensors beyond its input at GRPO's batch 64."""
    from flexrollout.engine import sampler

    batch, vocab = 64, 151936
    logits = torch.randn(batch, vocab, device="cuda") * 3
    st = _sampling_tensors(batch, "cuda")
    fused = sampler.sample(logits, st)                     # compiles on the first call
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused = sampler.sample(logits, st)
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - base
    greedy = st.temperature == 0
    tokens = sampler.draw(logits, logits, greedy, st.seeds, st.counters)
    lp, ranks, _ = sampler.token_logprob_rank(logits, tokens)
    assert torch.equal(fused.token_ids, tokens)
    assert torch.equal(fused.ranks, ranks)
    assert torch.allclose(fused.logprobs, logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1),
                          atol=1e-4)
    assert torch.allclose(fused.logprobs, lp, atol=1e-5)
    assert transient < 3 * batch * vocab * 4, transient


@pytest.mark.parametrize("expert_rows", [64, 0], ids=["grouped-gemv", "grouped-mm"])
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_moe_real_widths_fp32_greedy_matches_hf_with_graphs(preset, expert_rows):
    """Real widths (128 experts top-8; 32 experts top-4 with sinks and a 128-token window) at two
    layers, fp32: graphs, the expert paths (decode's grouped GEMV kernel, or grouped_mm's
    graph-safe form) and flex decode against HF generate. The prompts are longer than gpt-oss's
    window."""
    model = random_model(preset, torch.float32, "cuda", 2048, num_layers=2)
    prompts = _prompts(model.config.vocab_size, lengths=(5, 140, 300), seed=5)
    llm = LLM(model, max_model_len=1024, max_num_seqs=8, num_kv_pages=64,
              moe_small_batch_max_rows=expert_rows)
    assert llm.llm_engine.runner.graphs is not None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(model, prompt, 16)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_moe_graphs_match_eager(preset):
    model = random_model(preset, torch.float32, "cuda", 2048, num_layers=2)
    prompts = _prompts(model.config.vocab_size, lengths=(3, 64, 200), seed=6)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logprobs=1)
    graphed = LLM(model, max_model_len=1024, max_num_seqs=8, num_kv_pages=64)
    eager = LLM(model, max_model_len=1024, max_num_seqs=8, num_kv_pages=64, enforce_eager=True)
    for x, y in zip(graphed.generate(prompts, params, use_tqdm=False),
                    eager.generate(prompts, params, use_tqdm=False)):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lp_x = [next(iter(d.values())).logprob for d in x.outputs[0].logprobs]
        lp_y = [next(iter(d.values())).logprob for d in y.outputs[0].logprobs]
        assert torch.allclose(torch.tensor(lp_x), torch.tensor(lp_y), atol=1e-3)


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gemma-4-26b-a4b"])
def test_live_lora_beside_weights_off_the_gemv_k_step_matches_peft(preset):
    """gpt-oss's 2,880-wide inputs and 26B-A4B's 2,112-wide dense down_proj are off the GEMV's
    128-wide K step: with `ragged_gemv` (on by default since both cases passed on an H100,
    2026-12-07) they stream through it with masked K tails, their adapters folded in as on the
    other projections (without it, cuBLAS + expand, which passed on the H200 for gpt-oss). Real
    widths at two layers, fp32, graphs, r=16 on every attention and dense MLP projection,
    against PEFT's own generate and forward. A random 26B-A4B repeats its prompt's last token
    with probability ~1 whatever the adapters do (H200, 2026-12-07: neither its tokens nor the
    chosen token's logprob moved by 1e-3), so the top 20 logprobs of every step are compared,
    and the adapters must move PEFT's among them."""
    from peft import LoraConfig, get_peft_model

    model = random_model(preset, torch.float32, "cuda", 2048, num_layers=2)
    prompts = _prompts(model.config.vocab_size, lengths=(5, 140), seed=9)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj"] + (["gate_proj", "up_proj", "down_proj"]
                                                          if preset.startswith("gemma") else [])
    pm = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=modules)).eval()
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    want = [_hf_greedy(pm, p, 12) for p in prompts]
    llm = LLM(pm, max_model_len=1024, max_num_seqs=4, num_kv_pages=32, ragged_gemv=True)
    assert llm.llm_engine.forward.options.small_rows > 0 and llm.llm_engine.forward.options.lora_kernels
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=20)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.runner.graphs.graphs, "decode should have replayed a captured graph"
    assert [o.outputs[0].token_ids for o in outs] == want
    moved = 0.0
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        ids = torch.tensor([prompt + tokens], device="cuda")
        with torch.no_grad():
            ref = pm(ids).logits[0].float().log_softmax(-1)
            with pm.disable_adapter():
                base = pm(ids).logits[0].float().log_softmax(-1)
        for step, top in enumerate(out.outputs[0].logprobs):
            at = len(prompt) - 1 + step
            top_ids = torch.tensor(list(top), device="cuda")
            got = torch.tensor([lp.logprob for lp in top.values()], device="cuda")
            torch.testing.assert_close(got, ref[at, top_ids], rtol=1e-4, atol=2e-3)
            moved = max(moved, (ref[at, top_ids] - base[at, top_ids]).abs().max().item())
    assert moved > 0.1, "the adapters should move PEFT's logprobs"


def test_moe_expert_lora_live_in_graphs_follows_updates():
    """bf16 Qwen3-MoE widths with PEFT expert LoRA (fp32 adapters): graphs replay PEFT's tensors
    in place; an in-place update is seen by the next generate. PEFT's bf16 forward adds B A to
    each expert's weight before the product, the engine adds B (A x) after it: the two round
    differently, so the logprobs agree within 0.15 while the update moves them by far more."""
    from peft import LoraConfig, get_peft_model

    model = random_model("qwen3-30b-a3b", torch.bfloat16, "cuda", 2048, num_layers=2)
    pm = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"],
                                          target_parameters=["mlp.experts.gate_up_proj",
                                                             "mlp.experts.down_proj"])).eval()
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    prompts = _prompts(pm.config.vocab_size, lengths=(40, 90), seed=8)
    llm = LLM(pm, max_model_len=512, max_num_seqs=4, num_kv_pages=16)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)
    first_logprobs = []
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.runner.graphs.graphs, "decode should have replayed a captured graph"
        for prompt, out in zip(prompts, outs):
            tokens = out.outputs[0].token_ids
            with torch.no_grad():
                ids = torch.tensor([prompt + tokens], device="cuda")
                ref = pm(ids).logits[0].float().log_softmax(-1)
            for step, token in enumerate(tokens):
                got = out.outputs[0].logprobs[step][token].logprob
                assert abs(got - ref[len(prompt) - 1 + step, token].item()) < 0.15
            first_logprobs.append(ref[len(prompt) - 1])
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name:
                    p.mul_(-2.0)
    before, after = first_logprobs[:len(prompts)], first_logprobs[len(prompts):]
    moved = max((a - b).abs().max().item() for a, b in zip(before, after))
    assert moved > 0.5, f"the update should move some logprob by more than the tolerance, moved {moved}"
