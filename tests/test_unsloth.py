"""Unsloth fast_inference plugin, tested without Unsloth: the activation hook (in subprocesses, with
a stand-in `unsloth` package), the from_pretrained wrapper over a stand-in loader that loads a tiny
HF model, the engine it attaches, LoRA semantics and GRPO sizing."""
from __future__ import annotations

import logging
import os
import site
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from flexrollout import SamplingParams
from flexrollout.integrations import unsloth as plugin
from flexrollout.integrations.unsloth_sizing import DEFAULT_MAX_BATCH_SIZE

from conftest import make_tiny_model

peft = pytest.importorskip("peft")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTH = "flexrollout-unsloth.pth"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[3, 9, 27, 81, 5], [7, 7, 8, 40]]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# -- a stand-in for Unsloth's from_pretrained (its parameter names and defaults) -----------------
class Loader:
    """Records what reached "Unsloth"; rejects unknown keywords as transformers would."""

    def __init__(self):
        self.calls = []

    def from_pretrained(self, model_name="unsloth/x", max_seq_length=2048, dtype=None,
                        load_in_4bit=True, load_in_8bit=False, full_finetuning=False,
                        fast_inference=False, gpu_memory_utilization=0.5, float8_kv_cache=False,
                        random_state=3407, max_lora_rank=64, load_in_fp8=False, *args, **kwargs):
        self.calls.append({"fast_inference": fast_inference, "kwargs": dict(kwargs)})
        if kwargs:
            raise TypeError(f"from_pretrained() got unexpected keyword arguments {sorted(kwargs)}")
        return make_tiny_model("llama")


def _load(loader=None, **kwargs):
    loader = loader or Loader()
    args = dict(max_seq_length=128, load_in_4bit=False, fast_inference=True)
    args.update(kwargs)
    model, tok = plugin.load_pretrained(loader.from_pretrained, "tiny", **args)
    return model, tok, loader


def _hf(model, prompt, n=GREEDY.max_tokens) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _tokens(generate, prompts=PROMPTS, **kwargs) -> list[list[int]]:
    outs = generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, **kwargs)
    return [o.outputs[0].token_ids for o in outs]


# -- from_pretrained ---------------------------------------------------------------------------
def test_fast_inference_attaches_a_lazy_engine_and_generates_like_hf():
    model, tok, loader = _load(max_batch_size=48, gpu_memory_utilization=0.3)
    assert loader.calls == [{"fast_inference": False, "kwargs": {}}]   # no max_batch_size downstream
    engine = model.vllm_engine
    assert isinstance(engine, plugin.UnslothEngine) and not engine.built
    assert engine.shared_weights and engine.approx_max_num_seqs == 48 and not engine.built
    assert model.fast_generate == engine.generate
    got = _tokens(model.fast_generate)
    assert engine.built and engine.used
    assert got == [_hf(model, p) for p in PROMPTS]
    llm = engine.engine()
    assert llm.model is model and llm.config.max_num_seqs == 48
    assert llm.llm_engine.max_model_len == 128
    assert llm.llm_engine.vllm_config.lora_config is not None          # Unsloth enables LoRA
    text = model.fast_generate("t5 t9", GREEDY, use_tqdm=False)[0].outputs[0].text
    assert text.split() == [f"t{t}" for t in _hf(model, [5, 9])]


def test_fast_generate_batches_splits_and_keeps_order(monkeypatch):
    model, _, _ = _load()
    prompts = PROMPTS + [[11, 12, 13]]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    engine, chunks = model.vllm_engine, []
    generate = engine.generate

    def counting(batch, *args, **kwargs):
        chunks.append([item["prompt_token_ids"] for item in batch])
        return generate(batch, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", counting)
    outs = model.fast_generate_batches(inputs, 2, None, GREEDY, use_tqdm=False)
    assert chunks == [prompts[:2], prompts[2:]]
    assert [o.outputs[0].token_ids for o in outs] == [_hf(model, p) for p in prompts]
    with pytest.raises(ValueError, match="n_batches"):
        model.fast_generate_batches(inputs, 0)


def test_foreign_sampling_params_are_converted():
    """A real vLLM next to flexrollout hands its own SamplingParams class to notebooks."""
    model, _, _ = _load()
    foreign = SimpleNamespace(temperature=0.0, max_tokens=6, ignore_eos=True, top_p=1.0, top_k=-1,
                              structured_outputs=None)
    outs = model.fast_generate([{"prompt_token_ids": PROMPTS[0]}], foreign, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == _hf(model, PROMPTS[0])


@pytest.mark.parametrize("kwargs, option", [
    ({"load_in_8bit": True}, "load_in_8bit"),
    ({"load_in_fp8": "block"}, "load_in_fp8"),
    ({"quantization_config": {"load_in_8bit": True}}, "quantization_config"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ({"float8_kv_cache": True}, "float8_kv_cache"),
])
def test_unsupported_loads_raise_naming_the_option(kwargs, option):
    loader = Loader()
    args = {"load_in_4bit": False, **kwargs}
    call = lambda: plugin.load_pretrained(loader.from_pretrained, "tiny", fast_inference=True, **args)
    with pytest.raises(ValueError, match=option):
        call()
    assert loader.calls == []                                        # refused before loading
    _load(loader)                                                    # the next valid call works


def test_bad_max_batch_size():
    with pytest.raises(TypeError, match="max_batch_size"):
        _load(max_batch_size="64")
    with pytest.raises(ValueError, match="max_batch_size"):
        _load(max_batch_size=0)


def test_without_fast_inference_unsloth_runs_unchanged():
    loader = Loader()
    model, _ = plugin.load_pretrained(loader.from_pretrained, "tiny", max_batch_size=64,
                                      load_in_4bit=True)
    assert loader.calls == [{"fast_inference": False, "kwargs": {}}]
    assert not hasattr(model, "vllm_engine")
    with pytest.raises(TypeError, match="unexpected"):               # other keywords pass through
        plugin.load_pretrained(loader.from_pretrained, "tiny", bogus=1)


def test_vllm_engine_arguments_go_to_the_engine_not_to_unsloth(monkeypatch):
    monkeypatch.setenv("UNSLOTH_VLLM_STANDBY", "1")
    model, _, loader = _load(max_num_seqs=40, enforce_eager=True, conservativeness=0.5,
                             random_state=7, max_loras=2, max_lora_rank=32)
    assert loader.calls[-1]["kwargs"] == {}
    engine = model.vllm_engine
    assert engine.max_batch_size == 40
    llm = engine.engine()
    assert llm.config.enforce_eager and llm.config.seed == 7
    assert llm.config.enable_lora and (llm.config.max_loras, llm.config.max_lora_rank) == (2, 32)
    assert llm.llm_engine.vllm_config.model_config.enable_sleep_mode    # UNSLOTH_VLLM_STANDBY=1


def test_quantized_checkpoint_is_refused():
    model, tok = make_tiny_model("llama")
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    with pytest.raises(ValueError, match="quantization_config other than bitsandbytes 4-bit"):
        plugin.attach_engine(model, tok, {})


class Loader4bit(Loader):
    """Unsloth's `load_in_4bit=True` as transformers leaves it: bitsandbytes Linear4bit projections
    (NF4, double quantisation) and a BitsAndBytesConfig on the config."""

    def from_pretrained(self, *args, load_in_4bit=True, **kwargs):
        model, tok = super().from_pretrained(*args, load_in_4bit=load_in_4bit, **kwargs)
        if load_in_4bit:
            from test_quant4bit import _quantize_projections
            from transformers import BitsAndBytesConfig

            _quantize_projections(model, "nf4", True)
            model.config.quantization_config = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
        return model, tok


@pytest.mark.parametrize("given", [True, None], ids=["load_in_4bit=True", "Unsloth's default"])
def test_load_in_4bit_runs_the_packed_model_with_qlora(given):
    """load_in_4bit=True (also Unsloth's default, when omitted) loads 4-bit and generates like HF
    on the same bitsandbytes model, then with a live LoRA adapter on top (QLoRA)."""
    pytest.importorskip("bitsandbytes")
    loader = Loader4bit()
    args = {} if given is None else {"load_in_4bit": given}
    model, _ = plugin.load_pretrained(loader.from_pretrained, "tiny", fast_inference=True,
                                      max_seq_length=128, **args)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8
    assert _tokens(model.fast_generate) == [_hf(model, p) for p in PROMPTS]
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL)).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    plugin.attach_lora(pm)
    adapted = [_hf(pm, p) for p in PROMPTS]
    with pm.disable_adapter():
        assert adapted != [_hf(pm, p) for p in PROMPTS], "the adapter should matter"
    assert _tokens(pm.fast_generate, lora_request=pm.load_lora("qlora", load_tensors=True)) == adapted


# -- LoRA ----------------------------------------------------------------------------------------
def _peft_model():
    model, tok, _ = _load()
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL)).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:                  # PEFT starts B at 0: make the adapter matter
                p.normal_(0, 0.2)
    plugin.attach_lora(pm)                        # what the wrapped get_peft_model does
    return pm, tok


def test_live_lora_request_reads_the_adapter_in_place():
    pm, _ = _peft_model()
    with pm.disable_adapter():
        base = [_hf(pm, p) for p in PROMPTS]
    adapted = [_hf(pm, p) for p in PROMPTS]
    assert adapted != base
    request = pm.load_lora("grpo_trainer_lora_model", load_tensors=True)
    again = pm.load_lora("grpo_trainer_lora_model", load_tensors=True)
    assert isinstance(request, plugin.LiveLoRARequest) and request.lora_int_id != again.lora_int_id
    params = {n.replace(".default", ""): p for n, p in pm.named_parameters() if "lora_" in n}
    assert request.lora_tensors.keys() == params.keys()
    assert all(t.data_ptr() == params[k].data_ptr() for k, t in request.lora_tensors.items())
    assert request.lora_config["r"] == 4
    assert _tokens(pm.fast_generate, lora_request=request) == adapted   # applied once, not twice
    assert pm.vllm_engine.engine().model is pm
    with torch.no_grad():                          # an optimizer step, in place
        for name, p in pm.named_parameters():
            if "lora_A" in name:
                p.add_(torch.randn_like(p) * 0.3)
    stepped = [_hf(pm, p) for p in PROMPTS]
    assert stepped != adapted
    assert _tokens(pm.fast_generate, lora_request=pm.load_lora("x", load_tensors=True)) == stepped


def test_no_request_is_the_base_model_and_a_saved_adapter_replaces_the_live_one(tmp_path, monkeypatch):
    pm, _ = _peft_model()
    with pm.disable_adapter():
        base = [_hf(pm, p) for p in PROMPTS]
    adapted = [_hf(pm, p) for p in PROMPTS]
    assert _tokens(pm.fast_generate) == base                   # vLLM: no request, no adapter
    assert not pm.base_model.model.model.layers[0].self_attn.q_proj.disable_adapters
    pm.save_lora(str(tmp_path / "saved"))
    assert sorted(os.listdir(tmp_path / "saved")) == ["README.md", "adapter_config.json",
                                                      "adapter_model.safetensors"]
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "saved" / "adapter_model.safetensors")).keys()
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    saved = pm.load_lora(str(tmp_path / "saved"))
    assert saved.lora_path == str(tmp_path / "saved") and not isinstance(saved, plugin.LiveLoRARequest)
    assert _tokens(pm.fast_generate, lora_request=saved) == adapted      # once, not live + saved
    with torch.no_grad():                          # the live adapter moves on; the saved one not
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(-1)
    assert _tokens(pm.fast_generate, lora_request=pm.load_lora(str(tmp_path / "saved"),
                                                               load_tensors=False)) == adapted
    assert pm.load_lora(str(tmp_path / "saved"), lora_request_id=77).lora_int_id == 77
    with pytest.raises(ValueError, match="save_directory"):
        pm.load_lora(str(tmp_path / "missing"))
    # One call mixes the live adapter, the base model and the saved adapter, row by row, without
    # switching the live adapter off (the core's per-row rule serves all three).
    stepped = [_hf(pm, p) for p in PROMPTS]             # PEFT with the live adapter as it is now
    assert stepped != adapted

    def no_switch(*args, **kwargs):
        raise AssertionError("the plugin switched the live adapter off")

    monkeypatch.setattr(pm, "disable_adapter", no_switch)
    requests = [pm.load_lora("x", load_tensors=True), None, pm.load_lora(str(tmp_path / "saved"))]
    assert _tokens(pm.fast_generate, prompts=[PROMPTS[0], PROMPTS[1], PROMPTS[1]],
                   lora_request=requests) == [stepped[0], base[1], adapted[1]]


def test_get_peft_model_wrapper_attaches_lora_helpers():
    class FastLanguageModel:
        @staticmethod
        def from_pretrained(model_name="x", max_seq_length=2048, load_in_4bit=True,
                            fast_inference=False, **kwargs):
            return make_tiny_model("llama")

        @staticmethod
        def get_peft_model(model, r=4, target_modules=ALL):
            return peft.get_peft_model(model, peft.LoraConfig(r=r, target_modules=target_modules))

    assert plugin._wrap_loader(FastLanguageModel)
    assert not plugin._wrap_loader(FastLanguageModel)             # idempotent
    model, _ = FastLanguageModel.from_pretrained("x", max_seq_length=64, load_in_4bit=False,
                                                 fast_inference=True, max_batch_size=8)
    pm = FastLanguageModel.get_peft_model(model)
    assert pm.vllm_engine is model.vllm_engine and callable(pm.load_lora)
    assert isinstance(pm.load_lora("a", load_tensors=True), plugin.LiveLoRARequest)
    plain, _ = FastLanguageModel.from_pretrained("x", load_in_4bit=True)
    assert not hasattr(FastLanguageModel.get_peft_model(plain), "load_lora")


# -- GRPO sizing -----------------------------------------------------------------------------------
class FakeGRPOTrainer:
    def __init__(self, model, reward_funcs=None, args=None):
        self.size_seen = model.vllm_engine.max_batch_size


def test_grpo_trainer_grows_the_engine_before_its_init(caplog):
    plugin.wrap_trainer_init(FakeGRPOTrainer)
    plugin.wrap_trainer_init(FakeGRPOTrainer)                      # idempotent
    pm, _ = _peft_model()
    args = SimpleNamespace(per_device_train_batch_size=4, steps_per_generation=4, num_generations=8)
    with caplog.at_level(logging.WARNING):
        trainer = FakeGRPOTrainer(pm, None, args=args)
    assert trainer.size_seen == 128 and f"{DEFAULT_MAX_BATCH_SIZE} -> 128" in caplog.text
    assert pm.vllm_engine.engine().config.max_num_seqs == 128
    _tokens(pm.fast_generate)
    small = SimpleNamespace(per_device_train_batch_size=1, steps_per_generation=None,
                            num_generations=4)
    assert FakeGRPOTrainer(pm, args=small).size_seen == 128
    bigger = SimpleNamespace(per_device_train_batch_size=8, steps_per_generation=4, num_generations=8)
    with pytest.raises(RuntimeError, match="max_batch_size=256"):
        FakeGRPOTrainer(pm, args=bigger)
    foreign = SimpleNamespace(vllm_engine=SimpleNamespace(max_batch_size=1))   # not ours
    assert FakeGRPOTrainer(foreign, args=bigger).size_seen == 1


# -- activation ------------------------------------------------------------------------------------
def _python(code: str, env: dict, no_site: bool = False) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "UNSLOTH_FAST_INFERENCE"}
    full.update(env)
    cmd = [sys.executable] + (["-S"] if no_site else []) + ["-c", textwrap.dedent(code)]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value, active", [(None, False), ("0", False), ("", False), ("1", True)])
def test_pth_line_gates_on_the_variable(tmp_path, value, active):
    (tmp_path / PTH).write_text(open(os.path.join(REPO, PTH)).read())
    env = {"PYTHONPATH": REPO}
    if value is not None:
        env["UNSLOTH_FAST_INFERENCE"] = value
    out = _python(f"""
        import site, sys
        site.addsitedir({str(tmp_path)!r})
        print('_flexrollout_unsloth' in sys.modules, 'flexrollout' in sys.modules, 'torch' in sys.modules)
        """, env, no_site=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(active), "False", "False"]     # the hook imports nothing heavy


def test_pth_is_installed_with_the_package():
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    found = [d for d in dirs if os.path.isfile(os.path.join(d, PTH))]
    assert found, f"{PTH} is not installed in {dirs} (reinstall: pip install -e .)"
    assert open(os.path.join(found[0], PTH)).read() == open(os.path.join(REPO, PTH)).read()


FAKE_UNSLOTH = '''
class FastLanguageModel:
    @staticmethod
    def from_pretrained(model_name="x", max_seq_length=2048, load_in_4bit=True,
                        fast_inference=False, **kwargs):
        return model_name, kwargs

    @staticmethod
    def get_peft_model(model, **kwargs):
        return model
'''
CHECK = """
    import importlib.util, sys
    {before}
    import unsloth
    {after}
    print(getattr(unsloth.FastLanguageModel.from_pretrained, "_flexrollout_unsloth", False))
    try:
        from vllm import SamplingParams, LLM
        from vllm.lora.request import LoRARequest
        import flexrollout
        assert SamplingParams is flexrollout.SamplingParams and LoRARequest is flexrollout.LoRARequest
        print("vllm-names")
    except ImportError:
        print("no-vllm")
    try:
        import vllm.worker
        print("vllm.worker!")
    except ImportError:
        pass
    trl = sys.modules.get("trl")      # the plugin imports TRL; without it nothing does
    print(trl is not None and getattr(trl.GRPOTrainer.__init__, "_flexrollout_unsloth", False))
"""


HOOK_CASES = [  # UNSLOTH_FAST_INFERENCE, code before / after `import unsloth`, expected output
    ("1", "", "", ["True", "vllm-names", "True"]),
    (None, "", "", ["False", "no-vllm", "False"]),
    ("0", "", "", ["False", "no-vllm", "False"]),
    (None, "import flexrollout.unsloth", "", ["True", "vllm-names", "True"]),
    ("0", "", "import flexrollout.unsloth", ["True", "vllm-names", "True"]),
]


def test_hook_patches_unsloth_after_its_import(tmp_path):
    """The installed .pth with the variable set, and the explicit import before or after
    `import unsloth` (a stand-in package), patch Unsloth, TRL and the `vllm` names; unset or "0"
    patches nothing. The interpreters run in parallel (each imports torch and TRL)."""
    if importlib_find("trl") is None or importlib_find("vllm") is not None:
        pytest.skip("needs TRL and no vLLM installed")
    (tmp_path / "unsloth").mkdir()
    (tmp_path / "unsloth" / "__init__.py").write_text(FAKE_UNSLOTH)
    procs = []
    for env_value, before, after, _ in HOOK_CASES:
        env = {k: v for k, v in os.environ.items() if k != "UNSLOTH_FAST_INFERENCE"}
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), REPO])
        if env_value is not None:
            env["UNSLOTH_FAST_INFERENCE"] = env_value
        code = textwrap.dedent(CHECK.format(before=before, after=after))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for proc, (env_value, before, after, expected) in zip(procs, HOOK_CASES):
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr
        assert stdout.split() == expected, (env_value, before, after, stderr[-2000:])


def importlib_find(name):
    import importlib.util

    return importlib.util.find_spec(name)
