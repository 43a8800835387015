"""Sleep / wake semantics, load_weights and the weight-sync hooks TRL calls.

Tokens are checked against HF greedy `generate` on the same model (never against the engine's own
earlier output). What sleep frees is measured on the tensors themselves: on CPU, that the engine
drops every reference to its KV storage (weak references die) and that wake allocates storage of
the same size again; on CUDA, the allocator's byte count.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from flexrollout import LLM, SamplingParams

from conftest import make_tiny_model

PROMPTS = [[3, 9, 27, 81], list(range(5, 40))]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _tokens(llm) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _reference(hf_greedy, model) -> list[list[int]]:
    return [hf_greedy(model, p, MAX_TOKENS).tokens for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_greedy):
    """HF greedy tokens of the `shared` fixture's model (built from the same seed), computed once."""
    return _reference(hf_greedy, make_tiny_model("llama")[0])


def _kv_storages(llm) -> list[torch.Tensor]:
    return [t for pair in llm.llm_engine.cache.owned() for t in pair]


def _storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _all_freed(refs) -> bool:
    # No gc.collect(): the storage must go when the engine lets go, not at some later collection.
    return all(ref() is None for ref in refs)


@pytest.fixture
def shared():
    model, tok = make_tiny_model("llama")
    return model, LLM(model, tokenizer=tok, max_model_len=128, max_num_seqs=4, num_kv_pages=32,
                      enable_sleep_mode=True)


@pytest.mark.parametrize("level", [1, 2, "1", "2"])
def test_sleep_frees_cache_and_wake_restores_tokens(shared, level, reference):
    model, llm = shared
    assert llm.llm_engine.vllm_config.model_config.enable_sleep_mode
    assert _tokens(llm) == reference
    cache = _kv_storages(llm)
    cache_bytes = _storage_bytes(cache)
    cfg = model.config
    assert cache_bytes == ((32 + 1) * llm.llm_engine.page_size      # + the padding page
                           * cfg.num_hidden_layers * 2                     # K and V
                           * cfg.num_key_value_heads * cfg.head_dim * 4)   # fp32
    refs = [weakref.ref(t) for t in cache]
    ptrs = [p.data_ptr() for p in model.parameters()]
    del cache
    llm.sleep(level=level)
    assert _all_freed(refs), "sleep left a reference to the KV cache: its memory is not freed"
    assert llm.is_sleeping()
    llm.sleep(level=level)                                   # twice is harmless
    with pytest.raises(RuntimeError, match="wake_up"):
        _tokens(llm)
    llm.wake_up(tags=["weights"])                            # TRL wakes the two tags separately
    assert llm.is_sleeping() and not _kv_storages(llm)       # the cache is still not allocated
    llm.wake_up(tags=["kv_cache"])
    llm.wake_up()                                            # waking twice is harmless
    assert not llm.is_sleeping() and _storage_bytes(_kv_storages(llm)) == cache_bytes
    assert _tokens(llm) == reference
    assert [p.data_ptr() for p in model.parameters()] == ptrs   # shared weights never move


@pytest.mark.parametrize("level", [0, 3, "deep", None, True])
def test_bad_sleep_level(shared, level):
    _, llm = shared
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=level)
    assert llm.llm_engine.kv_cache_awake


def test_bad_wake_tag(shared, reference):
    """A bad tag is refused before anything wakes; the next valid call wakes everything."""
    _, llm = shared
    llm.sleep()
    with pytest.raises(ValueError, match="tags.*everything"):
        llm.wake_up(tags=["kv_cache", "everything"])
    assert llm.is_sleeping() and not _kv_storages(llm)
    llm.wake_up()
    assert _tokens(llm) == reference


def _owned_llm(tmp_path):
    """An engine that loads its own copy of a saved model, and the in-memory original (HF's)."""
    model, tok = make_tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=128, max_num_seqs=4, num_kv_pages=32, dtype="float32")
    assert llm.model is not model
    return llm, model


def test_owned_weights_sleep_and_wake(tmp_path, hf_greedy):
    """Weights the engine loaded itself sleep too: generation refuses until they are back, then
    matches HF. (On CPU the offload moves nothing; the GPU test below measures the bytes.)"""
    llm, reference_model = _owned_llm(tmp_path)
    reference = _reference(hf_greedy, reference_model)
    assert _tokens(llm) == reference
    llm.sleep(level=1)
    llm.wake_up(tags=["kv_cache"])
    with pytest.raises(RuntimeError, match="weights"):
        _tokens(llm)
    llm.wake_up(tags=["weights"])
    assert _tokens(llm) == reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_owned_weights_sleep_frees_gpu_memory(tmp_path, hf_greedy):
    """On CUDA, sleep hands back at least the weights' and the cache's bytes; wake takes them again."""
    from flexrollout.weights import weight_bytes

    llm, reference_model = _owned_llm(tmp_path)
    assert next(llm.model.parameters()).is_cuda
    reference = _reference(hf_greedy, reference_model)
    assert _tokens(llm) == reference
    weights, cache = weight_bytes(llm.model), _storage_bytes(_kv_storages(llm))
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    llm.sleep(level=1)
    gc.collect()
    asleep = torch.cuda.memory_allocated()
    assert awake - asleep >= weights + cache, (awake, asleep, weights, cache)
    llm.wake_up()
    assert torch.cuda.memory_allocated() - asleep >= weights + cache
    assert _tokens(llm) == reference


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


def _hf_tokens(model) -> list[list[int]]:
    """HF greedy generate now (not cached: these weights change during the test)."""
    outs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 eos_token_id=[], pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def test_weight_sync_hooks_follow_a_trainer_step(shared, reference):
    """TRL's sync after an optimizer step (weights changed in place, then `reset_prefix_cache` and,
    on older TRL, `collective_rpc("reload_weights")`): the next rollout follows the new weights, as
    HF's generate on the same model does. `collective_rpc` reaches the worker's objects by name."""
    model, llm = shared
    before = _tokens(llm)
    assert before == reference
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05, alpha=1.0)
    assert llm.collective_rpc("reload_weights") == [None]
    assert llm.reset_prefix_cache() is True
    after = _tokens(llm)
    assert after == _hf_tokens(model) and after != before
    name = "model.layers.1.mlp.up_proj.weight"
    new = torch.zeros_like(dict(model.named_parameters())[name])
    assert llm.collective_rpc("load_weights", args=([(name, new)],)) == [{name}]
    assert torch.equal(dict(model.named_parameters())[name], new)
    with pytest.raises(NotImplementedError, match="no_such_method"):
        llm.collective_rpc("no_such_method")
