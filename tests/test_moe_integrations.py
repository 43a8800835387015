"""TRL's GRPOTrainer and the Unsloth plugin with expert LoRA on tiny mixture-of-experts models,
end to end on CPU.

PEFT adapts the attention projections and the stacked experts (`target_parameters`); the engine
reads those adapters live from the trainer's own model. GRPO: training must move the adapters,
leave the base weights bit-identical, push no weights, and keep TRL's engine-vs-trainer logprob
gap (`sampling/sampling_logp_difference/max`) below 1e-3. Unsloth (its loader stood in for, as in
test_unsloth.py): fast_generate gives HF's greedy tokens, with and without the live adapter.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from conftest import make_tiny_moe
from test_trl import (  # noqa: F401  (_restore_distributed_env: the autouse fixture)
    _check_logp_difference,
    _config,
    _restore_distributed_env,
    _snapshot,
    _tiny_dataset,
    _train,
    reward_len,
)

import flexrollout
from flexrollout import SamplingParams
from flexrollout.integrations import unsloth as plugin
from flexrollout.integrations.trl import patch_trl


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_grpo_expert_lora_tiny_moe(tmp_path, monkeypatch, arch):
    from peft import LoraConfig
    from trl import GRPOTrainer

    patch_trl()
    model, tok = make_tiny_moe(arch)
    peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "v_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, processing_class=tok,
                          args=_config(tmp_path, learning_rate=2e-2, max_completion_length=12),
                          train_dataset=_tiny_dataset(), peft_config=peft_config)
    llm = trainer.vllm_generation.llm
    assert isinstance(llm, flexrollout.LLM) and llm.model is trainer.model
    expert_lora = lambda n, p: "lora_" in n and "experts" in n
    lora_before = _snapshot(trainer.model, expert_lora)
    base_before = _snapshot(trainer.model, lambda n, p: "lora_" not in n)
    assert lora_before, "PEFT put no adapter on the experts"

    gen_calls, load_calls = _train(trainer, monkeypatch)

    assert trainer.state.global_step == 2
    assert gen_calls.count >= 2 and gen_calls.tokens > 0
    assert load_calls.count == 0                      # adapters are read live, nothing pushed
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(p, after[n].detach()) for n, p in lora_before.items()), \
        "no expert LoRA weight moved"
    assert all(torch.equal(p, after[n].detach()) for n, p in base_before.items())
    _check_logp_difference(trainer)


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_unsloth_fast_generate_with_live_expert_lora(arch):
    from peft import LoraConfig, get_peft_model

    def from_pretrained(model_name="x", max_seq_length=2048, load_in_4bit=True, fast_inference=False):
        return make_tiny_moe(arch)

    model, _ = plugin.load_pretrained(from_pretrained, "tiny", max_seq_length=128, load_in_4bit=False,
                                      fast_inference=True)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[3, 9, 27, 81, 5, 6, 7, 8], [7, 7, 8, 40]]

    def tokens(m, **kwargs):
        outs = m.fast_generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False, **kwargs)
        return [o.outputs[0].token_ids for o in outs]

    assert tokens(model) == [_hf_greedy(model, p, 8) for p in prompts]
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                          target_parameters=["mlp.experts.gate_up_proj",
                                                             "mlp.experts.down_proj"])).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:                  # PEFT starts B at 0: make the adapter matter
                p.normal_(0, 0.3)
    plugin.attach_lora(pm)
    adapted = [_hf_greedy(pm, p, 8) for p in prompts]
    with pm.disable_adapter():
        assert adapted != [_hf_greedy(pm, p, 8) for p in prompts], "the adapter should change tokens"
    request = pm.load_lora("grpo_trainer_lora_model", load_tensors=True)
    assert tokens(pm, lora_request=request) == adapted
