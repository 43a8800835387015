"""Sleep / wake semantics (CPU), load_weights and the weight-sync hooks TRL calls."""
from __future__ import annotations

import pytest
import torch

from flexrollout import LLM, SamplingParams

from conftest import make_tiny_model

PROMPTS = [[3, 9, 27, 81], list(range(5, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(llm) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def shared():
    model, tok = make_tiny_model("llama")
    return model, LLM(model, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32,
                      enable_sleep_mode=True)


@pytest.mark.parametrize("level", [1, 2, "1", "2"])
def test_sleep_frees_cache_and_wake_restores_tokens(shared, level):
    model, llm = shared
    assert llm.llm_engine.vllm_config.model_config.enable_sleep_mode
    before = _tokens(llm)
    ptrs = [p.data_ptr() for p in model.parameters()]
    llm.sleep(level=level)
    assert not llm.llm_engine.kv_cache_awake and llm.is_sleeping()
    llm.sleep(level=level)                                   # twice is harmless
    with pytest.raises(RuntimeError, match="wake_up"):
        _tokens(llm)
    llm.wake_up(tags=["weights"])                            # TRL wakes the two tags separately
    assert llm.is_sleeping()
    llm.wake_up(tags=["kv_cache"])
    llm.wake_up()                                            # waking twice is harmless
    assert not llm.is_sleeping()
    assert _tokens(llm) == before
    assert [p.data_ptr() for p in model.parameters()] == ptrs   # shared weights never move


@pytest.mark.parametrize("level", [0, 3, "deep", None, True])
def test_bad_sleep_level(shared, level):
    _, llm = shared
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=level)
    assert llm.llm_engine.kv_cache_awake


def test_bad_wake_tag(shared):
    _, llm = shared
    llm.sleep()
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["weights", "everything"])
    llm.wake_up()
    assert _tokens(llm)


def test_owned_weights_sleep_and_wake(tmp_path):
    model, tok = make_tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=128, max_num_seqs=4, num_kv_pages=32, dtype="float32")
    before = _tokens(llm)
    llm.sleep(level=1)
    llm.wake_up(tags=["kv_cache"])
    with pytest.raises(RuntimeError, match="weights"):
        _tokens(llm)
    llm.wake_up(tags=["weights"])
    assert _tokens(llm) == before


def test_load_weights_copies_into_shared_tensor(shared):
    model, llm = shared
    runner_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    name = "model.layers.0.mlp.down_proj.weight"
    param = dict(model.named_parameters())[name]
    ptr = param.data_ptr()
    new = torch.randn_like(param)
    runner_model.load_weights([(name, new)])
    assert param.data_ptr() == ptr and torch.equal(param, new)
    with pytest.raises(KeyError, match="no_such"):
        runner_model.load_weights([("no_such.weight", new)])
    with pytest.raises(ValueError, match="shape"):
        runner_model.load_weights([(name, new[:2])])
    # Generation follows the new weights: compare with HF's own forward on the same model.
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPTS[1]])).logits[0, -1].argmax().item()
    assert out[0].outputs[0].token_ids == [ref]


def test_weight_sync_hooks(shared):
    _, llm = shared
    assert llm.collective_rpc("reload_weights") == [None]
    assert llm.reset_prefix_cache() is True
    with pytest.raises(NotImplementedError, match="no_such_method"):
        llm.collective_rpc("no_such_method")
