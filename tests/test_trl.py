"""TRL's GRPOTrainer (use_vllm=True, vllm_mode="colocate") on flexrollout, end to end on CPU.

Each run checks that the rollouts came from a flexrollout engine built over the trainer's own
model object, that training moved the trainable weights, that no weights were pushed
(`load_weights`), and that TRL's own measure of engine-vs-trainer logprob agreement,
`sampling/sampling_logp_difference/max`, stays below 1e-3.
"""
from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import flexrollout  # noqa: E402
from flexrollout.integrations import trl as fr_trl  # noqa: E402
from flexrollout.integrations.trl import patch_trl  # noqa: E402

LOGP_DIFF_KEY = "sampling/sampling_logp_difference/max"
# bf16 on the GPU: the engine's flex kernels and TRL's HF forward round differently. Measured on an
# H200 (random Qwen3-0.6B, LoRA, 64 x 256 tokens a step): at most 0.039. fp32 runs are held to 1e-3.
BF16_LOGP_TOL = 0.1


@pytest.fixture(autouse=True)
def _restore_distributed_env():
    """TRL's colocate init sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* for vLLM and leaves them
    set; a later Accelerator would then pick device "cpu:0" and copy the model. Undo it per test."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def reward_len(completions, **kwargs):
    """Prefer completions of about 20 characters (a real, if silly, reward)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [-abs(len(t) - 20) / 20.0 for t in texts]


def _config(tmp_path, **overrides):
    from trl import GRPOConfig

    args = dict(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
        vllm_max_model_length=128, max_steps=2, learning_rate=5e-3, logging_steps=1, save_strategy="no",
        use_vllm=True, vllm_mode="colocate", temperature=1.0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    args.update(overrides)
    return GRPOConfig(**args)


class _Calls:
    """Counts calls through an instance attribute, as clients wrap `llm.generate`."""

    def __init__(self, fn, outputs_are_requests=True):
        self.fn, self.count, self.tokens = fn, 0, 0
        self.outputs_are_requests = outputs_are_requests

    def __call__(self, *args, **kwargs):
        self.count += 1
        outputs = self.fn(*args, **kwargs)
        if self.outputs_are_requests:
            self.tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return outputs


def _train(trainer, monkeypatch):
    """Run `trainer.train()` counting engine generate and load_weights calls."""
    llm = trainer.vllm_generation.llm
    gen_calls = _Calls(llm.generate)
    monkeypatch.setattr(llm, "generate", gen_calls, raising=False)
    load_calls = _Calls(lambda weights: {name for name, _ in weights}, outputs_are_requests=False)
    runner_model = _runner_model(llm)
    if runner_model is not None:
        monkeypatch.setattr(runner_model, "load_weights", load_calls, raising=False)
    trainer.train()
    return gen_calls, load_calls


def _runner_model(llm):
    try:
        return llm.llm_engine.model_executor.driver_worker.model_runner.model
    except AttributeError:
        return None


def _check_logp_difference(trainer):
    values = [entry[LOGP_DIFF_KEY] for entry in trainer.state.log_history if LOGP_DIFF_KEY in entry]
    assert values, f"TRL logged no {LOGP_DIFF_KEY}: {trainer.state.log_history}"
    assert max(values) < 1e-3, f"engine logprobs disagree with the trainer's: {values}"
    return values


def _trainable_copy(model, tok):
    """A private copy of the session's SmolLM2 (TRL injects LoRA layers into the model it is given
    and may set the tokenizer's pad token).  The GGUF weights are already de-quantized to fp32; drop
    the GGUF quantizer marker, which makes transformers' Trainer refuse the model."""
    model, tok = copy.deepcopy(model), copy.deepcopy(tok)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    assert next(model.parameters()).dtype == torch.float32
    return model, tok


def _snapshot(model, select):
    return {n: p.detach().clone() for n, p in model.named_parameters() if select(n, p)}


# ------------------------------------------------------------------------------------------ patch


def test_patch_trl_is_idempotent_and_exported():
    import importlib.util
    import sys

    assert importlib.util.find_spec("vllm") is None, "these tests assume vLLM is not installed"
    patch_trl()
    from trl.generation import vllm_generation as vg

    init, sync = vg.VLLMGeneration._init_vllm, vg.VLLMGeneration.sync_weights
    patch_trl()
    assert vg.VLLMGeneration._init_vllm is init and vg.VLLMGeneration.sync_weights is sync
    assert vg.is_vllm_available() is True
    assert vg.SamplingParams is flexrollout.SamplingParams
    # only TRL's generation module was told about an engine: no stand-in `vllm` module exists
    assert "vllm" not in sys.modules
    assert flexrollout.patch_trl is patch_trl and flexrollout.integrations.patch_trl is patch_trl


def test_patch_trl_engine_options_belong_to_the_installed_factory():
    """Engine options live on the `LLM` factory the call installs; a later call replaces them."""
    from trl.generation import vllm_generation as vg

    patch_trl(num_kv_pages=40, enforce_eager=True)
    assert vg.LLM.engine_kwargs == {"num_kv_pages": 40, "enforce_eager": True}
    patch_trl()
    assert vg.LLM.engine_kwargs == {}


def test_patch_trl_refuses_unsupported_structure():
    class InlineImport:  # TRL 1.0.0: `import vllm` inside VLLMGeneration.generate
        def _init_vllm(self):
            self.llm = LLM(model="x")  # noqa: F821

        def sync_weights(self):
            pass

        def generate(self):
            import vllm  # noqa: F401

    class NoSync:
        def _init_vllm(self):
            self.llm = LLM(model="x")  # noqa: F821

        def generate(self):
            pass

    module = type("M", (), {"is_vllm_available": staticmethod(lambda: False)})
    with pytest.raises(RuntimeError, match=r"imports vllm inside a method.*trl>=1\.15"):
        fr_trl._check_structure(module, InlineImport, "1.0.0")
    with pytest.raises(RuntimeError, match="sync_weights is missing"):
        fr_trl._check_structure(module, NoSync, "9.9.9")


def _tiny_dataset(n=8):
    return datasets.Dataset.from_dict({"prompt": [f"t{5 + i} t{40 + 3 * i} t{90 + i}" for i in range(n)]})


def test_tensor_parallel_raises(tmp_path, tiny_llama):
    from trl import GRPOTrainer

    patch_trl()
    model, tok = tiny_llama()
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=2"):
        GRPOTrainer(model=model, reward_funcs=reward_len, processing_class=tok,
                    args=_config(tmp_path, vllm_tensor_parallel_size=2),
                    train_dataset=_tiny_dataset())


def test_server_mode_without_vllm_raises(tmp_path, tiny_llama):
    import importlib.util

    from trl import GRPOTrainer

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: TRL's server mode runs unchanged")
    patch_trl()
    model, tok = tiny_llama()
    with pytest.raises(ImportError, match="vllm_mode='server'.*colocate"):
        GRPOTrainer(model=model, reward_funcs=reward_len, processing_class=tok,
                    args=_config(tmp_path, vllm_mode="server"), train_dataset=_tiny_dataset())


def test_sharded_training_is_refused():
    from types import SimpleNamespace as NS

    def acc(**state):
        return NS(state=NS(**state))

    assert fr_trl._sharded_training(acc(deepspeed_plugin=None, fsdp_plugin=None)) is None
    assert fr_trl._sharded_training(acc(deepspeed_plugin=NS(zero_stage=2), fsdp_plugin=None)) is None
    assert fr_trl._sharded_training(acc(deepspeed_plugin=NS(zero_stage=3))) == "DeepSpeed ZeRO-3"
    assert fr_trl._sharded_training(acc(deepspeed_plugin=None, fsdp_plugin=NS())) == "FSDP"


# ------------------------------------------------------------------------------------------ LoRA


def test_grpo_lora_smollm2(tmp_path, smollm2, monkeypatch, caplog):
    from peft import LoraConfig
    from trl import GRPOTrainer

    patch_trl()
    model, tok = _trainable_copy(*smollm2)
    dataset = datasets.Dataset.from_dict({"prompt": [
        [{"role": "user", "content": q}] for q in (
            "Name a colour.", "Say hello.", "What is 2+2?", "Name a fruit.",
            "Count to three.", "Name an animal.", "Say goodbye.", "Name a city.")]})
    peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    with caplog.at_level(logging.INFO, logger="flexrollout.integrations.trl"):
        trainer = GRPOTrainer(model=model, reward_funcs=reward_len, processing_class=tok,
                              args=_config(tmp_path), train_dataset=dataset,
                              peft_config=peft_config)
    llm = trainer.vllm_generation.llm
    assert isinstance(llm, flexrollout.LLM)
    assert llm.model is trainer.model  # the trainer's PeftModel, not a second copy
    assert "not loading" in caplog.text
    lora_before = _snapshot(trainer.model, lambda n, p: "lora_" in n)
    base_before = _snapshot(trainer.model, lambda n, p: "lora_" not in n)
    assert lora_before and all(p.requires_grad for n, p in trainer.model.named_parameters()
                               if n in lora_before)

    gen_calls, load_calls = _train(trainer, monkeypatch)

    assert trainer.state.global_step == 2
    assert gen_calls.count >= 2 and gen_calls.tokens > 0  # every rollout went through the engine
    assert load_calls.count == 0  # nothing pushed: the adapter is read live
    after = dict(trainer.model.named_parameters())
    moved = [n for n, p in lora_before.items() if not torch.equal(p, after[n].detach())]
    assert moved, "no LoRA weight moved"
    # merge -> load_weights -> unmerge never ran: the frozen base weights are bit-identical
    drifted = [n for n, p in base_before.items() if not torch.equal(p, after[n].detach())]
    assert not drifted, f"base weights changed: {drifted[:3]}"
    _check_logp_difference(trainer)


def test_grpo_qlora_bitsandbytes_4bit_tiny(tmp_path, tiny_llama, monkeypatch):
    """QLoRA as TRL users run it: a model loaded with BitsAndBytesConfig(load_in_4bit=True) and a
    peft_config. The engine reads the trainer's packed 4-bit base in place under the live adapter."""
    bnb = pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from trl import GRPOTrainer

    patch_trl()
    model, tok = tiny_llama()
    model.save_pretrained(tmp_path / "tiny")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", quantization_config=quant,
                                                 device_map="cpu", dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            # bitsandbytes' CPU forward would otherwise repack the weights in place for its
            # AVX512-BF16 kernel, a layout the engine refuses (the trainer's forward runs first)
            module.support_avx512bf16_for_cpu = False
    peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "v_proj", "down_proj"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, processing_class=tok,
                          args=_config(tmp_path, learning_rate=1e-2), train_dataset=_tiny_dataset(),
                          peft_config=peft_config)
    llm = trainer.vllm_generation.llm
    assert isinstance(llm, flexrollout.LLM) and llm.model is trainer.model
    packed = _snapshot(trainer.model, lambda n, p: p.dtype == torch.uint8)
    assert packed, "the base should be bitsandbytes 4-bit"
    lora_before = _snapshot(trainer.model, lambda n, p: "lora_" in n)

    gen_calls, load_calls = _train(trainer, monkeypatch)

    assert trainer.state.global_step == 2
    assert gen_calls.count >= 2 and gen_calls.tokens > 0
    assert load_calls.count == 0
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(p, after[n].detach()) for n, p in lora_before.items()), "no LoRA weight moved"
    assert all(torch.equal(p, after[n].detach()) for n, p in packed.items())    # still packed, unchanged
    _check_logp_difference(trainer)


# ------------------------------------------------------------------------------------------ full FT


def test_grpo_full_finetune_tiny(tmp_path, tiny_llama, monkeypatch):
    from trl import GRPOTrainer

    patch_trl(num_kv_pages=40)  # engine options pass through to every engine TRL builds
    model, tok = tiny_llama()
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, processing_class=tok,
                          args=_config(tmp_path, learning_rate=1e-2, max_completion_length=16),
                          train_dataset=_tiny_dataset())
    llm = trainer.vllm_generation.llm
    assert isinstance(llm, flexrollout.LLM) and llm.model is trainer.model
    assert llm.config.num_kv_pages == 40
    before = _snapshot(trainer.model, lambda n, p: True)

    gen_calls, load_calls = _train(trainer, monkeypatch)

    assert trainer.state.global_step == 2
    assert gen_calls.count >= 2 and gen_calls.tokens > 0
    assert load_calls.count == 0
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(p, after[n].detach()) for n, p in before.items())
    assert llm.model is trainer.model  # still the very model being trained
    _check_logp_difference(trainer)


def test_grpo_sleep_mode_tiny(tmp_path, tiny_llama, monkeypatch):
    """vllm_enable_sleep_mode=True: TRL puts the engine to sleep after building it and after every
    rollout, and wakes the KV cache before each; the cache tensors are really dropped in between."""
    from trl import GRPOTrainer

    calls = []
    for name in ("sleep", "wake_up"):
        original = getattr(flexrollout.LLM, name)

        def record(self, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, args, kwargs))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(flexrollout.LLM, name, record)
    patch_trl()
    model, tok = tiny_llama()
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, processing_class=tok,
                          args=_config(tmp_path, vllm_enable_sleep_mode=True),
                          train_dataset=_tiny_dataset())
    llm = trainer.vllm_generation.llm
    assert calls == [("sleep", (), {"level": 2})] and not llm.llm_engine.kv_cache_awake
    gen_calls, load_calls = _train(trainer, monkeypatch)
    assert trainer.state.global_step == 2 and gen_calls.count >= 2 and load_calls.count == 0
    wakes = [c for c in calls if c == ("wake_up", (), {"tags": ["kv_cache"]})]
    sleeps = [c for c in calls if c[0] == "sleep"]
    assert len(wakes) == gen_calls.count and len(sleeps) == gen_calls.count + 1
    assert not llm.llm_engine.kv_cache_awake and llm.llm_engine.cache.k == []
    _check_logp_difference(trainer)


# ------------------------------------------------------------------------------------------ GPU


# (per_device_train_batch_size, gradient_accumulation_steps, num_generations, prompt words,
#  max_completion_length, vllm_max_model_length)
_GPU_SHAPES = {
    # 8 prompts x 8 samples per optimizer step, the shape of the H200 comparison in the report
    "grpo-8x8": (8, 8, 8, 128, 64, 1024),
    # 2 prompts x 4 samples: 96 packed prompt tokens, less than one 128-token query block
    "small-2x4": (8, 1, 4, 48, 32, 256),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [
    "grpo-8x8",
    # Raised inductor's NoValidChoicesError on the H200 until prefill forced flex's main kernel
    # (FORCE_USE_FLEX_ATTENTION); kept as the regression case.
    "small-2x4",
])
def test_grpo_lora_bf16_gpu(tmp_path, monkeypatch, shape):
    """The same loop on a random-weight Qwen3-0.6B-sized model in bf16, engine on CUDA graphs."""
    from conftest import make_tiny_tokenizer
    from peft import LoraConfig
    from trl import GRPOTrainer

    from flexrollout.bench import random_model

    batch, accumulation, generations, words, completion, model_len = _GPU_SHAPES[shape]
    patch_trl()
    model = random_model("qwen3-0.6b", torch.bfloat16, "cuda", 2048)
    vocab = model.config.vocab_size
    tok = make_tiny_tokenizer(vocab, vocab - 1)
    g = torch.Generator().manual_seed(0)
    dataset = datasets.Dataset.from_dict({"prompt": [
        " ".join(f"t{int(t)}" for t in torch.randint(4, vocab - 1, (words,), generator=g))
        for _ in range(64)]})
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules="all-linear")
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_len, processing_class=tok, train_dataset=dataset,
        peft_config=peft_config,
        args=_config(tmp_path, use_cpu=False, bf16=True, per_device_train_batch_size=batch,
                     gradient_accumulation_steps=accumulation, num_generations=generations,
                     max_completion_length=completion, vllm_max_model_length=model_len,
                     learning_rate=1e-3))
    llm = trainer.vllm_generation.llm
    assert isinstance(llm, flexrollout.LLM) and llm.model is trainer.model
    lora_before = _snapshot(trainer.model, lambda n, p: "lora_" in n)

    gen_calls, load_calls = _train(trainer, monkeypatch)

    assert trainer.state.global_step == 2 and gen_calls.count >= 2 and load_calls.count == 0
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(p, after[n].detach()) for n, p in lora_before.items())
    values = [e[LOGP_DIFF_KEY] for e in trainer.state.log_history if LOGP_DIFF_KEY in e]
    print(f"bf16 {LOGP_DIFF_KEY}: {values}")
    assert values and max(values) < BF16_LOGP_TOL, values
