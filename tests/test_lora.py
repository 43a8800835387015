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
    config = LoraConfig(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=0.1, **cfg)
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


def test_lora_request_replaces_the_live_adapter(saved_adapter):
    """vLLM's rule on a PEFT model: a row's lora_request runs the base model plus that adapter
    (not on top of the live one); rows without one run the model as the user holds it."""
    _, tok, path, reference = saved_adapter
    live, _ = _peft(seed=9)                        # same base weights, another live adapter
    live_tokens = [_hf(live, p) for p in PROMPTS]
    assert live_tokens != reference
    llm = LLM(live, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32)
    request = LoRARequest("saved", 1, path)
    assert _gen(llm, lora_request=[request, None, request]) == [reference[0], live_tokens[1], reference[2]]
    assert _gen(llm) == live_tokens


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
