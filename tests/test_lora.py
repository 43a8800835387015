"""LoRA: live PEFT layers, LoRARequest adapters (saved dir / in-memory tensors), helpers."""
from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from flexrollout import LLM, LoRARequest, SamplingParams  # noqa: E402
from flexrollout.lora import load_lora, save_lora  # noqa: E402

from conftest import make_tiny_model  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[3, 9, 27, 81, 5], list(range(5, 45)), [7, 7, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _peft(arch="llama", seed=1, **cfg):
    model, tok = make_tiny_model(arch)
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ALL, "lora_dropout": 0.1, **cfg})
    pm = get_peft_model(model, config).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:                 # PEFT inits B = 0: make the adapter matter
                p.normal_(0, 0.2)
    return pm, tok


def _hf(model, prompt, n=8) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _gen(llm, prompts=PROMPTS, **kw) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, **kw)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch,mlp_chunk", [("llama", 2048), ("qwen3", 2048), ("llama", 7)])
def test_peft_model_parity_and_live_update(arch, mlp_chunk):
    """mlp_chunk 7: the 48-token packed prefill runs o_proj + MLP in 7 chunks, the last partial."""
    pm, tok = _peft(arch)
    llm = LLM(pm, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32,
              mlp_chunk_tokens=mlp_chunk)
    assert llm.llm_engine.vllm_config.lora_config is not None
    base_tokens = None
    with pm.disable_adapter():
        base_tokens = [_hf(pm, p) for p in PROMPTS]
    got = _gen(llm)
    assert got == [_hf(pm, p) for p in PROMPTS]
    assert got != base_tokens                       # the adapter changes the output
    with torch.no_grad():                           # an optimizer step, in place
        for name, p in pm.named_parameters():
            if "lora_A" in name:
                p.add_(torch.randn_like(p) * 0.3)
    assert _gen(llm) == [_hf(pm, p) for p in PROMPTS]


def test_lora_gemv_max_rows_picks_each_steps_lora_path():
    """`lora_gemv_max_rows` decides, per step, where live adapters fold into the GEMV
    (`lora_small`) and where cuBLAS + shrink + expand run (`lora_expand`); row-masked
    LoRARequest terms fold at up to 32 rows whatever it is. (On CUDA; here the options CUDA
    would set are forced, and only the step's choice is read.)"""
    from dataclasses import replace
    from types import SimpleNamespace

    pm, tok = _peft("qwen3")
    llm = LLM(pm, tokenizer=tok, max_model_len=64, max_num_seqs=4, lora_gemv_max_rows=48)
    forward = llm.llm_engine.forward
    assert forward.options.lora_gemv_rows == 48
    forward.options = replace(forward.options, lora_kernels=True, small_rows=32)
    for rows, small, masked in ((32, True, True), (33, True, False), (48, True, False), (49, False, False)):
        positions = torch.zeros(rows, dtype=torch.long)
        kernels = forward._step(positions, SimpleNamespace(positions=positions), None).kernels
        assert (kernels.lora_small, kernels.lora_expand, kernels.lora_rows) == (small, not small, masked)


def test_rslora_scaling_matches_peft():
    pm, tok = _peft(use_rslora=True)
    llm = LLM(pm, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32)
    assert _gen(llm) == [_hf(pm, p) for p in PROMPTS]


def test_dora_raises():
    pm, tok = _peft(use_dora=True)
    with pytest.raises(NotImplementedError, match="DoRA"):
        LLM(pm, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32)


@pytest.fixture
def saved_adapter(tmp_path):
    """(base model, tokenizer, adapter dir, reference tokens with the adapter)."""
    pm, tok = _peft(seed=3)
    reference = [_hf(pm, p) for p in PROMPTS]
    save_lora(pm, str(tmp_path / "adapter"))
    base, _ = make_tiny_model("llama")             # same seed: the same base weights
    return base, tok, str(tmp_path / "adapter"), reference


def test_lora_request_from_dir_and_mixed_batch(saved_adapter):
    base, tok, path, reference = saved_adapter
    llm = LLM(base, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32, enable_lora=True)
    plain = [_hf(base, p) for p in PROMPTS]
    request = LoRARequest("a", 1, path)
    assert _gen(llm, lora_request=request) == reference
    mixed = _gen(llm, lora_request=[request, None, request])
    assert mixed == [reference[0], plain[1], reference[2]]
    assert _gen(llm) == plain                       # no adapter, no change to the base
    assert llm.list_loras() == {1}
    # Each output names the request it ran with, as vLLM's do.
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                        lora_request=[None, request, None])
    assert [(o.lora_request, o.outputs[0].lora_request) for o in outs] == [(None, None), (request, request), (None, None)]


def test_lora_request_in_memory_tensors(saved_adapter):
    base, tok, path, reference = saved_adapter
    llm = LLM(base, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32, enable_lora=True)
    request = load_lora(base, path, load_tensors=True)
    again = load_lora(base, path, load_tensors=True)
    assert request.lora_int_id != again.lora_int_id       # a fresh id per call
    assert request.lora_tensors is not None
    assert _gen(llm, lora_request=request) == reference
    assert _gen(llm, lora_request=load_lora(base, path)) == reference


def test_adapter_config_read_with_peft_defaults(saved_adapter, tmp_path):
    """A saved config without lora_alpha: PEFT (the reference, loading the same directory)
    scales by its default alpha of 8, not by alpha = r."""
    import shutil

    from peft import PeftModel

    base, tok, path, _ = saved_adapter
    stripped = tmp_path / "no_alpha"
    shutil.copytree(path, stripped)
    cfg = json.loads((stripped / "adapter_config.json").read_text())
    assert cfg.pop("lora_alpha") == 8 and cfg["r"] == 4
    (stripped / "adapter_config.json").write_text(json.dumps(cfg))
    reference_model = PeftModel.from_pretrained(make_tiny_model("llama")[0], str(stripped)).eval()
    reference = [_hf(reference_model, p) for p in PROMPTS]
    llm = LLM(base, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32, enable_lora=True)
    assert _gen(llm, lora_request=LoRARequest("no_alpha", 3, str(stripped))) == reference


def test_bad_adapters_raise_before_work(saved_adapter, tmp_path):
    base, tok, path, reference = saved_adapter
    llm = LLM(base, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32, enable_lora=True)
    before = llm.llm_engine.stats.prefill_steps
    with pytest.raises(ValueError, match="lora_path"):
        _gen(llm, lora_request=LoRARequest("missing", 5, str(tmp_path / "nope")))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    (broken / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="JSON"):
        _gen(llm, lora_request=LoRARequest("broken", 6, str(broken)))
    wrong_rank = load_lora(base, path, load_tensors=True)
    wrong_rank.lora_config = {**wrong_rank.lora_config, "r": 8}
    with pytest.raises(ValueError, match="expected"):
        _gen(llm, lora_request=wrong_rank)
    with pytest.raises(TypeError, match="lora_request"):
        _gen(llm, lora_request="adapter")
    assert llm.llm_engine.stats.prefill_steps == before
    assert _gen(llm, lora_request=LoRARequest("a", 1, path)) == reference


def test_save_lora_writes_only_adapter(saved_adapter):
    _, _, path, _ = saved_adapter
    cfg = json.loads(open(f"{path}/adapter_config.json").read())
    assert cfg["r"] == 4
    from safetensors.torch import load_file

    assert all("lora_" in k for k in load_file(f"{path}/adapter_model.safetensors"))


def test_merged_mode_matches_peft_and_refreshes_after_update():
    pm, tok = _peft(seed=5)
    llm = LLM(pm, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32, lora_mode="merged")
    base_before = {n: p.clone() for n, p in pm.named_parameters() if "base_layer" in n}
    assert _gen(llm) == [_hf(pm, p) for p in PROMPTS]
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)                      # an in-place update: must be re-merged
    assert _gen(llm) == [_hf(pm, p) for p in PROMPTS]
    for name, p in pm.named_parameters():       # the trainer's base weights never drift
        if "base_layer" in name:
            assert torch.equal(p, base_before[name])


def test_bad_lora_mode():
    model, tok = make_tiny_model("llama")
    with pytest.raises(ValueError, match="lora_mode"):
        LLM(model, tokenizer=tok, max_model_len=128, lora_mode="fused")


def test_engine_allocates_no_weight_copy():
    """Building the engine over a model must not allocate its weights again (RSS), and it
    reports shared_weights for Unsloth."""
    psutil = pytest.importorskip("psutil")
    model, tok = make_tiny_model("llama", vocab_size=64_000, hidden_size=256, heads=4, kv_heads=2,
                                 head_dim=64)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes > 100e6
    rss = psutil.Process().memory_info().rss
    llm = LLM(model, tokenizer=tok, max_model_len=128, max_num_seqs=2, num_kv_pages=16)
    grown = psutil.Process().memory_info().rss - rss
    assert grown < 0.25 * weight_bytes, f"engine construction grew RSS by {grown / 1e6:.0f} MB"
    assert llm.shared_weights is True
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == _hf(model, [3, 4, 5])


def test_fp32_adapter_over_bf16_base_matches_peft_within_bf16_rounding():
    """PEFT keeps adapters in fp32 over a bf16 base; the engine casts the adapter, not the
    activations (a prefill's memory). Its error against an fp64 reference stays within a small
    multiple of PEFT's own bf16 error, and the adapter's contribution is far larger than either."""
    from flexrollout.layers.linear import linear, read_linear

    model, _ = make_tiny_model("llama")
    pm = get_peft_model(model.to(torch.bfloat16), LoraConfig(r=4, lora_alpha=8, target_modules=ALL)).eval()
    module = pm.base_model.model.model.layers[0].mlp.down_proj
    lora_a, lora_b = module.lora_A["default"].weight, module.lora_B["default"].weight
    assert lora_a.dtype == torch.float32 and module.base_layer.weight.dtype == torch.bfloat16
    torch.manual_seed(0)
    with torch.no_grad():
        lora_b.normal_(0, 0.2)
        x = torch.randn(96, module.in_features, dtype=torch.bfloat16)
        ours, theirs = linear(x, read_linear(module)), module(x)
        x64 = x.double()
        base = x64 @ module.base_layer.weight.double().T
        ref = base + module.scaling["default"] * (x64 @ lora_a.double().T) @ lora_b.double().T
    assert ours.dtype == torch.bfloat16
    err_ours = (ours.double() - ref).abs().mean()
    err_peft = (theirs.double() - ref).abs().mean()
    assert err_ours <= 2 * err_peft, (err_ours, err_peft)
    assert (ref - base).abs().mean() > 20 * err_ours


# -- vLLM's rule: a row's lora_request replaces the live adapters; rows without one run the model as held
LP_TOL = 1e-4


def _prompt_logprobs(llm, sequences, lora_request=None) -> list[list[float]]:
    """The engine's teacher-forced logprob of every token after the first, per sequence."""
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                        use_tqdm=False, lora_request=lora_request)
    return [[o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))] for o, s in zip(outs, sequences)]


@torch.no_grad()
def _hf_logprobs(model, seq) -> list[float]:
    lp = model(torch.tensor([seq])).logits[0].double().log_softmax(-1)
    return [float(lp[i - 1, seq[i]]) for i in range(1, len(seq))]


def _close(ours, reference) -> bool:
    return max(abs(a - b) for a, b in zip(ours, reference)) < LP_TOL


def _saved(tmp_path, name: str, seed: int, **cfg):
    """(directory of a saved adapter, PEFT's model loaded from it over a fresh base); `cfg`
    overrides the LoraConfig."""
    from peft import PeftModel

    donor, _ = _peft(seed=seed, **cfg)
    path = str(tmp_path / name)
    save_lora(donor, path)
    return path, PeftModel.from_pretrained(make_tiny_model("llama")[0], path).eval()


def test_saved_adapter_is_read_from_disk_not_from_the_live_one(tmp_path, hf_greedy):
    """Held out: save S, then move the live adapter in place (an optimizer step); a LoRARequest
    for S equals PEFT loading S, and rows without one follow the live adapter as it is now."""
    from peft import PeftModel

    pm, tok = _peft(seed=3)
    path = str(tmp_path / "S")
    save_lora(pm, path)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.3)
    saved = PeftModel.from_pretrained(make_tiny_model("llama")[0], path).eval()
    llm = LLM(pm, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32)
    request = LoRARequest("S", 1, path)
    want = [hf_greedy(saved, p, 8).tokens for p in PROMPTS]
    assert want != [hf_greedy(pm, p, 8).tokens for p in PROMPTS]     # the live adapter moved
    assert _gen(llm, lora_request=request) == want
    sequences = [p + t for p, t in zip(PROMPTS, want)]
    for ours, seq in zip(_prompt_logprobs(llm, sequences, request), sequences):
        assert _close(ours, _hf_logprobs(saved, seq))
    assert _gen(llm) == [hf_greedy(pm, p, 8).tokens for p in PROMPTS]


@pytest.mark.parametrize("lora_mode", ["live", "merged"])
def test_mixed_batch_of_live_and_two_adapters_matches_peft_one_adapter_at_a_time(tmp_path, hf_greedy,
                                                                                 lora_mode):
    """One call: rows of the live model, of adapter A and of adapter B (the same prompt under
    each, and other prompts) equal PEFT's own runs of each model alone. In merged mode the
    request rows must not see the merged live adapter."""
    path_a, model_a = _saved(tmp_path, "A", seed=3)
    path_b, model_b = _saved(tmp_path, "B", seed=11)
    live, tok = _peft(seed=9)
    llm = LLM(live, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=64,
              lora_mode=lora_mode)
    a, b = LoRARequest("A", 1, path_a), LoRARequest("B", 2, path_b)
    rows = [(PROMPTS[0], None, live), (PROMPTS[0], a, model_a), (PROMPTS[0], b, model_b),
            (PROMPTS[1], b, model_b), (PROMPTS[2], a, model_a), (PROMPTS[1], None, live)]
    want = [hf_greedy(model, p, 8).tokens for p, _, model in rows]
    assert len({tuple(t) for t in want[:3]}) == 3              # the three models differ here
    assert _gen(llm, [p for p, _, _ in rows], lora_request=[r for _, r, _ in rows]) == want
    sequences = [p + t for (p, _, _), t in zip(rows, want)]
    ours = _prompt_logprobs(llm, sequences, [r for _, r, _ in rows])
    for lp, seq, (_, _, model) in zip(ours, sequences, rows):
        assert _close(lp, _hf_logprobs(model, seq))


def test_base_model_rows_beside_live_rows():
    """BaseModelRequest: an adapter with no tensors, so its rows run the base model with the
    live adapter masked off (the Unsloth plugin's lora_request=None)."""
    from flexrollout.lora import BaseModelRequest

    pm, tok = _peft(seed=9)
    with pm.disable_adapter():                     # (uncached HF runs: the same model object)
        base = [_hf(pm, p) for p in PROMPTS[:2]]
    live = [_hf(pm, p) for p in PROMPTS[:2]]
    assert base != live
    llm = LLM(pm, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32)
    base_row = BaseModelRequest()
    got = _gen(llm, [PROMPTS[0], PROMPTS[0], PROMPTS[1]], lora_request=[base_row, None, base_row])
    assert got == [base[0], live[0], base[1]]


@pytest.mark.parametrize("decode", ["eager", "graphs"])
def test_adapter_slots_load_evict_reload_and_fall_back_match_peft(tmp_path, hf_greedy, decode, request):
    """Decode reads LoRARequest adapters from the adapter table's slots. With two slots: A and B
    fill them; C (rank 8, another scaling, two targets only) grows the rank (a rebuild) and
    evicts one; A comes back into a slot C's neighbour held (its columns rewritten in place,
    none of the previous adapter's left); three adapters in one step do not fit and take the
    per-adapter path. Every row equals PEFT's own model of its adapter. `graphs`: table steps
    replay decode graphs (on CPU through the `cpu_graphs` stand-in); a rebuild drops the graphs
    over the old stacks, an in-place slot write keeps them."""
    path_a, model_a = _saved(tmp_path, "A", seed=3)
    path_b, model_b = _saved(tmp_path, "B", seed=11)
    path_c, model_c = _saved(tmp_path, "C", seed=5, r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    live, tok = _peft(seed=9)
    llm = LLM(live, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=64, max_loras=2,
              max_cpu_loras=8)
    graphs = request.getfixturevalue("cpu_graphs")(llm) if decode == "graphs" else None
    table = llm.llm_engine.runner.adapter_table

    def table_graphs() -> set[int]:
        """The adapter-table generations the captured graphs read."""
        return set() if graphs is None else {key[2][0] for key in graphs.graphs if key[2][0] is not None}
    a, b, c = LoRARequest("A", 1, path_a), LoRARequest("B", 2, path_b), LoRARequest("C", 3, path_c)
    models = {None: live, a: model_a, b: model_b, c: model_c}

    def check(requests):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(requests))]
        want = [hf_greedy(models[r], p, 8).tokens for p, r in zip(prompts, requests)]
        assert _gen(llm, prompts, lora_request=list(requests)) == want

    check([a, b, None])
    assert [x.name for x in table.held] == ["A", "B"] and table.rank == 4
    check([c, c])
    assert sorted(x.name for x in table.held) == ["B", "C"] and table.rank == 8
    generation, stacks = table.generation, dict(table.stacks)
    assert table_graphs() == ({generation} if graphs else set())
    check([a, c, None])
    assert sorted(x.name for x in table.held) == ["A", "C"]
    assert table.generation == generation and all(table.stacks[k] is v for k, v in stacks.items())
    assert table_graphs() == ({generation} if graphs else set())
    check([a, b, c, None])                          # three adapters, two slots: per-adapter path
    assert sorted(x.name for x in table.held) == ["A", "C"]
    llm.remove_lora(3)
    check([b, a])
    assert sorted(x.name for x in table.held) == ["A", "B"]


def test_max_loras_is_checked():
    live, tok = _peft(seed=9)
    with pytest.raises(ValueError, match="max_loras"):
        LLM(live, tokenizer=tok, max_model_len=128, max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(live, tokenizer=tok, max_model_len=128, max_loras=4, max_cpu_loras=2)


def test_loaded_adapters_are_capped_least_recently_used_first(tmp_path, hf_greedy):
    """Unsloth's load_lora makes a fresh id per call: the engine keeps at most max_cpu_loras adapters
    loaded (the least recently used dropped, with its table slot), and a dropped one asked for again is
    reloaded and still right. One call may use more adapters than that."""
    paths, models = zip(*[_saved(tmp_path, name, seed=seed) for name, seed in (("A", 3), ("B", 11), ("C", 5))])
    live, tok = _peft(seed=9)
    llm = LLM(live, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=64, max_loras=2)
    requests = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(zip("ABC", paths))]

    def check(indices):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(indices))]
        want = [hf_greedy(models[i], p, 8).tokens for p, i in zip(prompts, indices)]
        assert _gen(llm, prompts, lora_request=[requests[i] for i in indices]) == want

    check([0])
    check([1])
    check([0])                                      # A used last: B is the one to go
    check([2])
    assert llm.list_loras() == {1, 3}
    assert {a.name for a in llm.llm_engine.runner.adapter_table.held if a is not None} <= {"A", "C"}
    check([1, 0, 2])                                # three in one call, two kept
    assert len(llm.list_loras()) == 2
    check([1])


def test_reserved_adapter_table_bytes_equal_a_full_table(tmp_path):
    """With enable_lora the CUDA KV budget leaves AdapterTable.max_bytes for the adapter table, which
    is allocated mid-run: on a dense model with every projection adapted, max_loras adapters of rank
    max_lora_rank fill exactly that much."""
    from flexrollout.lora.table import AdapterTable

    paths = [_saved(tmp_path, f"A{i}", seed=i)[0] for i in range(3)]       # r = 4, all seven targets
    live, tok = _peft(seed=9)
    llm = LLM(live, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=64, enable_lora=True,
              max_loras=3, max_lora_rank=4)
    _gen(llm, PROMPTS, lora_request=[LoRARequest(f"A{i}", i + 1, path) for i, path in enumerate(paths)])
    table, engine = llm.llm_engine.runner.adapter_table, llm.llm_engine
    used = sum(t.numel() * t.element_size() for pair in table.stacks.values() for t in pair)
    assert len(table.held) == 3 and table.capacity == 3
    assert used == AdapterTable.max_bytes(engine.forward.lora_targets(), len(engine.spec.layers), 3, 4,
                                          torch.float32)


def test_adapter_table_steps_trace_as_one_graph(tmp_path, hf_greedy):
    """On CUDA, decode steps over the adapter table run the compiled layer functions (fullgraph: a graph
    break raises). Traced here on CPU with dynamo's eager backend, the steps equal PEFT's models."""
    import dataclasses

    torch._dynamo.reset()
    path_a, model_a = _saved(tmp_path, "A", seed=3)
    live, tok = _peft(seed=9)
    llm = LLM(live, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=64)
    forward = llm.llm_engine.forward
    forward.prepare(dataclasses.replace(forward.options, compile_layers=True, compile_backend="eager"))
    a = LoRARequest("A", 1, path_a)
    want = [hf_greedy(model_a, PROMPTS[0], 8).tokens, hf_greedy(live, PROMPTS[1], 8).tokens]
    assert _gen(llm, PROMPTS[:2], lora_request=[a, None]) == want
    assert forward._compiled, "decode over the adapter table should have run the compiled functions"
