"""Unsloth's `fast_inference=True` on flexrollout, as a plugin (no vLLM, no edits to Unsloth).

Activation: `UNSLOTH_FAST_INFERENCE=1` in the environment when Python starts (the package's
`flexrollout-unsloth.pth` then registers an import hook), or `import flexrollout.unsloth`.
When `unsloth` has finished importing, `install()`:

- wraps `FastLanguageModel.from_pretrained` / `FastModel.from_pretrained`: with
  `fast_inference=True` Unsloth loads the Hugging Face model its normal way (it is called with
  `fast_inference=False`, so vLLM is never imported), and the model gets `vllm_engine` (an
  `UnslothEngine`: a lazy flexrollout `LLM` over that model's own parameters), `fast_generate`
  and `fast_generate_batches`. `max_batch_size` is consumed here, never forwarded to
  transformers. `load_in_4bit=True` (Unsloth's default, and its `-bnb-4bit` checkpoints) gives a
  bitsandbytes 4-bit model, which the engine reads packed (`layers/quant.py`); other quantized loads
  (`load_in_8bit`, `load_in_fp8`, non-bitsandbytes-4-bit configs) raise a ValueError naming the option;
- wraps `get_peft_model` of the same classes: the returned model gets `load_lora` / `save_lora`
  and the engine runs over the PEFT model, reading the live adapter;
- wraps the (Unsloth-patched) TRL `GRPOTrainer.__init__` to grow the lazy engine to the run's
  batch before the trainer first touches it, and runs `flexrollout.patch_trl()` (after Unsloth's
  own TRL patches, which hand TRL `model.vllm_engine`);
- makes `import vllm` / `from vllm import SamplingParams` resolve to flexrollout's classes when
  vLLM is not installed. This comes after Unsloth's import on purpose: Unsloth probes for vLLM
  while it imports, and must find none. Only `vllm`, `vllm.sampling_params`, `vllm.outputs`,
  `vllm.lora` and `vllm.lora.request` exist; any other `vllm.*` import fails as usual.

LoRA semantics (vLLM's, as Unsloth uses them): the engine holds the base weights and a request
names the adapter. Each request maps onto the core's one rule (a row's `lora_request` replaces
the model's live adapters; rows without one run the model as held), row by row, so one call may
mix all three: `model.load_lora(dir, load_tensors=True)` on a model with LoRA layers is the
trainer's live adapter (Unsloth builds it from the live state dict): a row without a request,
reading PEFT's tensors in place, with CUDA graphs. `lora_request=None` is the base model (a
`BaseModelRequest` row), and a saved adapter (`load_lora(dir)`) replaces the live one. The live
adapters are never switched off, and no graph is re-captured for either.
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys

from ..config import _check_positive_int
from ..lora import BaseModelRequest
from ..lora import helpers as lora_helpers
from ..lora.live import lora_layers
from ..lora_request import LoRARequest
from .unsloth_sizing import LazyEngine, grpo_batch_size

logger = logging.getLogger(__name__)

_MARK = "_flexrollout_unsloth"
_STATE = {"installed": False}
# Unsloth `from_pretrained` keyword arguments that only ever meant something to load_vllm: passed to
# the engine as they are, and max_num_seqs, which floors the engine's batch size.
_ENGINE_ARGS = ("enforce_eager", "enable_prefix_caching", "max_num_batched_tokens", "max_loras")
_IGNORED_ARGS = ("use_async", "use_engine", "compilation_config", "conservativeness",
                 "max_logprobs", "return_args", "training")
# Loads that would hand the engine quantized weights it cannot run yet (bitsandbytes 4-bit, Unsloth's
# `load_in_4bit`, it runs).
_QUANTIZED_OPTIONS = ("load_in_8bit", "load_in_fp8")


# -- installation ----------------------------------------------------------------------------
def install() -> None:
    """Patch the imported `unsloth` (idempotent). Raises if it has no loader to patch."""
    if _STATE["installed"]:
        return
    unsloth = sys.modules.get("unsloth")
    if unsloth is None:
        raise RuntimeError("flexrollout's Unsloth plugin installs after `import unsloth`")
    _preimport_zoo_vllm_utils()
    loaders = [getattr(unsloth, name) for name in ("FastLanguageModel", "FastModel", "FastVisionModel")
               if inspect.isclass(getattr(unsloth, name, None))]
    patched = [cls.__name__ for cls in loaders if _wrap_loader(cls)]
    if not loaders:
        raise RuntimeError("unsloth has no FastLanguageModel / FastModel to patch; flexrollout's "
                           "fast_inference plugin cannot drive this Unsloth release")
    _patch_trl()
    install_vllm_names()
    _STATE["installed"] = True
    logger.info("Unsloth fast_inference=True now runs on flexrollout (patched %s)",
                ", ".join(patched) or "nothing new")


def _preimport_zoo_vllm_utils() -> None:
    """unsloth_zoo.vllm_utils imports vLLM internals at import time if a `vllm` is findable; import
    it while none is, so the `vllm` names installed below never reach that code."""
    if importlib.util.find_spec("unsloth_zoo") is None:
        return
    try:
        importlib.import_module("unsloth_zoo.vllm_utils")
    except ImportError as err:
        logger.info("unsloth_zoo.vllm_utils does not import (%s); Unsloth will not need it here", err)


def _wrap_loader(cls) -> bool:
    """Wrap `cls.from_pretrained` / `cls.get_peft_model` where `cls` defines them itself."""
    done = False
    for name, wrapper in (("from_pretrained", load_pretrained), ("get_peft_model", _peft_then_attach)):
        attr = cls.__dict__.get(name)
        func = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        if func is None or getattr(func, _MARK, False):
            continue
        if isinstance(attr, classmethod):
            raise TypeError(f"{cls.__name__}.{name} is a classmethod; flexrollout expects Unsloth's "
                            f"staticmethod")
        patched = functools.wraps(func)(functools.partial(wrapper, func))
        setattr(patched, _MARK, True)
        setattr(cls, name, staticmethod(patched))
        done = True
    return done


def _patch_trl() -> None:
    if importlib.util.find_spec("trl") is None:
        return
    from .trl import patch_trl

    try:
        patch_trl()
    except (RuntimeError, ImportError) as err:
        logger.warning("GRPOTrainer rollouts will not run on flexrollout: %s", err)
        return
    import trl

    # Unsloth rebinds all three names to its patched class; cover any that still differ.
    grpo = importlib.import_module("trl.trainer.grpo_trainer")
    for cls in {grpo.GRPOTrainer, trl.trainer.GRPOTrainer, trl.GRPOTrainer}:
        wrap_trainer_init(cls)


# -- from_pretrained -------------------------------------------------------------------------
def load_pretrained(original, *args, **kwargs):
    """Unsloth's `from_pretrained` with `fast_inference=True` served by flexrollout.

    `original` has Unsloth's signature and returns (model, tokenizer). Without fast_inference it
    runs unchanged (`max_batch_size` is still dropped: transformers would reject it).
    """
    max_batch_size = kwargs.pop("max_batch_size", None)
    sig = inspect.signature(original)
    bound = sig.bind(*args, **kwargs)
    given = _given_arguments(sig, bound)
    if not given.get("fast_inference", False):
        if max_batch_size is not None:
            logger.info("ignoring max_batch_size=%r: it sizes the fast_inference engine only",
                        max_batch_size)
        return original(*args, **kwargs)
    options = engine_options(sig, given, max_batch_size)
    extra = _var_keyword(sig, bound)
    for name in _ENGINE_ARGS + _IGNORED_ARGS + ("max_num_seqs", "unsloth_vllm_standby"):
        extra.pop(name, None)
    bound.arguments["fast_inference"] = False
    model, tokenizer = original(*bound.args, **bound.kwargs)
    attach_engine(model, tokenizer, options)
    return model, tokenizer


def engine_options(sig, given: dict, max_batch_size=None) -> dict:
    """flexrollout `LLM` arguments from Unsloth's `from_pretrained` arguments (validated)."""
    def value(name, default=None):
        if name in given:
            return given[name]
        param = sig.parameters.get(name)
        return default if param is None or param.default is param.empty else param.default

    for name in _QUANTIZED_OPTIONS:
        if value(name, False):
            raise ValueError(
                f"{name}={value(name)!r} with fast_inference=True is not supported by flexrollout "
                f"yet (it runs 16-bit and bitsandbytes 4-bit weights); pass {name}=False")
    if not _runs_quantization(value("quantization_config")):
        raise ValueError("quantization_config with fast_inference=True: flexrollout runs only "
                         "bitsandbytes 4-bit (load_in_4bit=True) among quantized weights; drop "
                         "quantization_config or make it a 4-bit BitsAndBytesConfig")
    if value("float8_kv_cache", False):
        raise ValueError("float8_kv_cache=True is not supported by flexrollout (its KV cache is in "
                         "the model's dtype); pass float8_kv_cache=False")
    floor = [_positive_int("max_batch_size", max_batch_size),
             _positive_int("max_num_seqs", given.get("max_num_seqs"))]
    for name in _IGNORED_ARGS:
        if name in given:
            logger.info("ignoring vLLM argument %s=%r (no effect in flexrollout)", name, given[name])
    standby = bool(value("unsloth_vllm_standby", False)) or \
        os.environ.get("UNSLOTH_VLLM_STANDBY", "0") != "0"
    options = {
        "max_model_len": value("max_seq_length"), "seed": value("random_state", 0),
        "gpu_memory_utilization": value("gpu_memory_utilization", 0.9),
        "max_lora_rank": value("max_lora_rank", 16), "enable_sleep_mode": standby,
        "max_batch_size": max([f for f in floor if f] or [0]) or None,
    }
    options.update({name: given[name] for name in _ENGINE_ARGS if name in given})
    return options


def _runs_quantization(config) -> bool:
    """No quantization, or bitsandbytes 4-bit (a BitsAndBytesConfig or its dict): what the
    engine runs. Anything else (8-bit, fp8, GPTQ, ...) it cannot."""
    if config is None:
        return True
    get = config.get if isinstance(config, dict) else functools.partial(getattr, config)
    method = get("quant_method", "bitsandbytes")
    method = getattr(method, "value", method)               # an enum in transformers' configs
    return method == "bitsandbytes" and bool(get("load_in_4bit", False)) \
        and not get("load_in_8bit", False)


def _positive_int(name: str, value):
    """`value` if it is None or a positive int; TypeError / ValueError naming `name` otherwise."""
    if value is not None:
        _check_positive_int(name, value)
    return value


def _given_arguments(sig, bound) -> dict:
    """The arguments the caller passed, with the `**kwargs` ones flattened in."""
    given = dict(bound.arguments)
    given.update(given.pop(_var_keyword_name(sig), None) or {})
    return given


def _var_keyword_name(sig) -> str | None:
    return next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)


def _var_keyword(sig, bound) -> dict:
    name = _var_keyword_name(sig)
    return bound.arguments.get(name, {}) if name else {}


# -- the engine on the model -----------------------------------------------------------------
class UnslothEngine(LazyEngine):
    """`model.vllm_engine`: a flexrollout `LLM` over the model's own parameters, built on first use.

    Reads that need no engine (`shared_weights`, `approx_max_num_seqs`) do not build it, so the
    batch dimension can still grow when a GRPO trainer is created. `generate` / `chat` map
    Unsloth's LoRA requests onto the live adapter (see the module docstring).
    """

    shared_weights = True            # Unsloth and its TRL patch read this: nothing to sync

    def __init__(self, model, tokenizer, options: dict) -> None:
        options = dict(options)
        max_batch_size = options.pop("max_batch_size", None)
        self._model, self._tokenizer, self._options = model, tokenizer, options
        self._peft = None
        super().__init__(self._build_llm, max_batch_size)

    @property
    def approx_max_num_seqs(self) -> int:
        return self.max_batch_size

    def _build_llm(self, size: int):
        from ..llm import LLM

        logger.info("building the flexrollout engine for %d sequences over %s", size,
                    type(self._model).__name__)
        return LLM(self._model, tokenizer=self._tokenizer, max_num_seqs=size, enable_lora=True,
                   **self._options)

    def set_peft_model(self, peft_model) -> None:
        """After get_peft_model: run over the PEFT model (its LoRA layers wrap the same weights)."""
        self._peft = peft_model
        if self._engine is None:
            self._model = peft_model

    def generate(self, prompts=None, sampling_params=None, *, use_tqdm=True, lora_request=None,
                 **kwargs):
        call = functools.partial(self.engine().generate, prompts, _as_flexrollout(sampling_params),
                                 use_tqdm=use_tqdm, **kwargs)
        return self._with_lora(call, lora_request)

    def chat(self, messages, sampling_params=None, use_tqdm=True, lora_request=None,
             chat_template=None, add_generation_prompt=True, continue_final_message=False,
             chat_template_kwargs=None, tools=None, **kwargs):
        call = functools.partial(
            self.engine().chat, messages, _as_flexrollout(sampling_params), use_tqdm=use_tqdm,
            chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs, tools=tools, **kwargs)
        return self._with_lora(call, lora_request)

    def _with_lora(self, call, lora_request):
        self._used = True
        live = self._peft is not None and _has_lora_layers(self._peft)
        if isinstance(lora_request, (list, tuple)):
            return call(lora_request=[_core_request(r, live) for r in lora_request])
        return call(lora_request=_core_request(lora_request, live))


def _core_request(request, live: bool):
    """An Unsloth request as the core's row: the trainer's live adapter is the model as held
    (no request); no request is the base model when the model has live adapters."""
    if isinstance(request, LiveLoRARequest):
        return None
    if request is None and live:
        return BaseModelRequest()
    return request


def _as_flexrollout(sampling_params):
    """A real vLLM's SamplingParams (vLLM installed next to flexrollout) as flexrollout's."""
    from ..sampling_params import SamplingParams

    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return sampling_params
    if isinstance(sampling_params, (list, tuple)):
        return [_as_flexrollout(sp) for sp in sampling_params]
    names = inspect.signature(SamplingParams).parameters
    values = {n: getattr(sampling_params, n) for n in names if hasattr(sampling_params, n)}
    for name in ("structured_outputs", "guided_decoding"):
        if values.get(name) is None:
            values.pop(name, None)
    return SamplingParams(**values)


def attach_engine(model, tokenizer, options: dict) -> UnslothEngine:
    """Give a loaded HF model Unsloth's fast_inference attributes, served by flexrollout."""
    config = getattr(model, "config", None)
    if not _runs_quantization(getattr(config, "quantization_config", None)):
        raise ValueError(
            f"{getattr(config, '_name_or_path', 'the model')} loaded with a quantization_config "
            f"other than bitsandbytes 4-bit (a pre-quantized checkpoint?); fast_inference=True on "
            f"flexrollout needs 16-bit or bitsandbytes 4-bit weights")
    tok = getattr(tokenizer, "tokenizer", tokenizer)      # a multimodal processor's tokenizer
    engine = UnslothEngine(model, tok, options)
    model.vllm_engine = engine
    model.fast_generate = engine.generate
    model.fast_generate_batches = functools.partial(generate_batches, engine)
    return engine


def generate_batches(engine, inputs, n_batches=None, lora_request=None, *args, **kwargs):
    """Unsloth's `fast_generate_batches`: `inputs` in chunks of `n_batches` prompts (default: the
    engine's batch size), outputs in input order."""
    size = _positive_int("n_batches", n_batches) or engine.approx_max_num_seqs
    outputs = []
    for start in range(0, len(inputs), size):
        outputs += engine.generate(inputs[start:start + size], *args, lora_request=lora_request,
                                   **kwargs)
    return outputs


def find_engine(model) -> UnslothEngine | None:
    """The UnslothEngine on a model or on the model under its PEFT wrapper."""
    get_base = getattr(model, "get_base_model", None)
    for candidate in (model, get_base() if callable(get_base) else None):
        engine = getattr(candidate, "vllm_engine", None)
        if isinstance(engine, UnslothEngine):
            return engine
    return None


# -- LoRA --------------------------------------------------------------------------------------
class LiveLoRARequest(LoRARequest):
    """`load_lora(..., load_tensors=True)` on a model with LoRA layers: the trainer's adapter as it
    is now. `lora_tensors` are the live PEFT tensors (no copy); the engine reads them in place."""


def _peft_then_attach(original, *args, **kwargs):
    model = original(*args, **kwargs)
    attach_lora(model)
    return model


def attach_lora(peft_model) -> None:
    """After get_peft_model: `load_lora` / `save_lora`, and the engine over the PEFT model."""
    engine = find_engine(peft_model)
    if engine is None:
        return
    engine.set_peft_model(peft_model)
    peft_model.vllm_engine = engine
    peft_model.fast_generate = engine.generate
    peft_model.fast_generate_batches = functools.partial(generate_batches, engine)
    peft_model.load_lora = functools.partial(load_lora, peft_model)
    peft_model.save_lora = functools.partial(save_lora, peft_model)


def save_lora(model, save_directory: str) -> None:
    """Unsloth's `model.save_lora(dir)`: the LoRA tensors and adapter config only."""
    lora_helpers.save_lora(model, save_directory)


def load_lora(model, save_directory: str, load_tensors: bool = False, lora_request_id=None):
    """Unsloth's `model.load_lora`: a LoRARequest with a fresh `lora_int_id` on every call.

    With `load_tensors=True` on a model with LoRA layers the request is the live adapter (Unsloth
    reads the model's state dict, not the directory); otherwise the saved adapter in
    `save_directory` (read now with `load_tensors=True`, by the engine otherwise).
    """
    lora_id = _positive_int("lora_request_id", lora_request_id)
    if load_tensors and _has_lora_layers(model):
        lora_id = lora_id or lora_helpers.fresh_lora_id()
        name = f"{os.path.basename(os.path.normpath(str(save_directory)))}_{lora_id}"
        return LiveLoRARequest(name, lora_id, lora_tensors=_live_lora_tensors(model),
                               lora_config=_adapter_config(model))
    request = lora_helpers.load_lora(model, save_directory, load_tensors)
    if lora_id is not None:
        request.lora_int_id = lora_id
    return request


def _has_lora_layers(model) -> bool:
    return hasattr(model, "peft_config") and any(True for _ in lora_layers(model))


def _live_lora_tensors(model) -> dict:
    return {name.replace(".default", ""): p.detach() for name, p in model.named_parameters()
            if ".lora_A." in name or ".lora_B." in name}


def _adapter_config(model) -> dict:
    name = getattr(model, "active_adapter", "default")
    config = model.peft_config[name if isinstance(name, str) else name[0]]
    return config.to_dict()


# -- GRPO sizing ---------------------------------------------------------------------------------
def size_for_grpo(model, args) -> None:
    """Grow the model's lazy engine to the GRPO run's batch (no-op without one)."""
    engine = find_engine(model)
    if engine is None or args is None:
        return
    need = grpo_batch_size(args.per_device_train_batch_size,
                           getattr(args, "steps_per_generation", None), args.num_generations)
    engine.ensure_batch_size(need)


def wrap_trainer_init(cls) -> None:
    """Size the engine from the trainer's arguments before its `__init__` first touches it."""
    original = cls.__init__
    if getattr(original, _MARK, False):
        return
    sig = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        arguments = sig.bind_partial(self, *args, **kwargs).arguments
        size_for_grpo(arguments.get("model"), arguments.get("args"))
        original(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__


# -- `import vllm` without vLLM ------------------------------------------------------------------
# module -> {name: (flexrollout module, attribute)}
_VLLM_NAMES = {
    "vllm": {"LLM": ("llm", "LLM"), "SamplingParams": ("sampling_params", "SamplingParams"),
             "RequestOutput": ("outputs", "RequestOutput"),
             "CompletionOutput": ("outputs", "CompletionOutput")},
    "vllm.sampling_params": {n: ("sampling_params", n) for n in (
        "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutputKind",
        "SamplingType")},
    "vllm.outputs": {n: ("outputs", n) for n in ("RequestOutput", "CompletionOutput", "Logprob")},
    "vllm.lora": {},
    "vllm.lora.request": {"LoRARequest": ("lora_request", "LoRARequest")},
}
_PACKAGES = {"vllm", "vllm.lora"}


class _VllmNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the `vllm` modules in `_VLLM_NAMES` from flexrollout's classes."""

    def find_spec(self, name, path=None, target=None):
        if name not in _VLLM_NAMES:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=name in _PACKAGES)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__flexrollout__ = True
        for attr, (source, value) in _VLLM_NAMES[module.__name__].items():
            setattr(module, attr, getattr(importlib.import_module(f"flexrollout.{source}"), value))


def install_vllm_names() -> bool:
    """Make the `vllm` names Unsloth notebooks import resolve, unless a real vLLM is installed."""
    if any(isinstance(f, _VllmNames) for f in sys.meta_path):
        return True
    if importlib.util.find_spec("vllm") is not None:
        logger.info("a vLLM is installed; `import vllm` keeps resolving to it")
        return False
    sys.meta_path.append(_VllmNames())
    return True
