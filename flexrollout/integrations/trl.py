"""TRL integration: run `GRPOTrainer(use_vllm=True, vllm_mode="colocate")` on flexrollout.

`patch_trl()` re-points TRL's colocated vLLM backend (`trl.generation.vllm_generation`) at
flexrollout, without vLLM installed:

- the module's `is_vllm_available`, `LLM`, `SamplingParams`, `RequestOutput` and
  `StructuredOutputsParams` names are replaced (only in that module: the rest of the process
  still sees that vLLM is absent, so nothing else tries to import it);
- `VLLMGeneration._init_vllm` builds the engine over the trainer's own (unwrapped) model and
  tokenizer instead of loading `model.name_or_path` a second time, and refuses what cannot
  share the trainer's parameters (tensor parallelism, ZeRO-3, FSDP);
- `VLLMGeneration.sync_weights` pushes nothing when the engine runs over the trainer's
  parameters: LoRA A/B are read live and full fine-tuning updates the very tensors the engine
  reads. TRL's merge -> `load_weights` -> unmerge cycle would cost a pass over every weight and,
  in bf16, leave the base weights slightly changed after each merge/unmerge round trip.

TRL's own `generate` runs unchanged: token-id prompts repeated `num_generations` times with
`n=1`, `SamplingParams(..., logprobs=0)`, the sleep / wake calls of `vllm_enable_sleep_mode`.
The user's model object is never touched.
"""
from __future__ import annotations

import contextvars
import inspect
import logging
import re

logger = logging.getLogger(__name__)

# TRL releases the integration is tested against (the current one and the one Unsloth pins).
TESTED_TRL_VERSIONS = ("1.15", "1.16")
# The first release whose `VLLMGeneration` imports vLLM only at module level (1.0.0 imports
# `vllm` inside `generate`; 0.x keeps the vLLM code inside `GRPOTrainer`).
MIN_TRL_VERSION = "1.1.0"

_PATCH_MARK = "_flexrollout_patched"
_ORIGINALS: dict[str, object] = {}
# The VLLMGeneration whose `_init_vllm` is running: the `LLM` factory below builds over its model.
_BUILDING = contextvars.ContextVar("flexrollout_trl_building", default=None)


def patch_trl(**engine_kwargs) -> None:
    """Make TRL's colocated vLLM path (`use_vllm=True, vllm_mode="colocate"`) run on flexrollout.

    Call it before building the trainer. Idempotent: calling it again changes nothing but the
    engine options. `engine_kwargs` (flexrollout `LLM` / `EngineConfig` keyword arguments such as
    `lora_mode="merged"`, `num_kv_pages=...`, `enforce_eager=True`) are added to, and override,
    the arguments TRL passes when it builds an engine. Raises `ImportError` when TRL is missing
    and `RuntimeError` for a TRL release whose vLLM code path this patch cannot drive.
    """
    try:
        import trl
    except ImportError as exc:
        raise ImportError("flexrollout.patch_trl() needs TRL: pip install 'trl>=1.15'") from exc
    version = getattr(trl, "__version__", "unknown")
    vg = _vllm_generation_module(version)
    cls = vg.VLLMGeneration
    if getattr(cls, _PATCH_MARK, False):
        vg.LLM = EngineFactory(engine_kwargs)
        return
    _check_structure(vg, cls, version)
    if not any(version.startswith(v + ".") or version == v for v in TESTED_TRL_VERSIONS):
        logger.warning("TRL %s is untested with flexrollout (tested: %s); its vLLM backend has "
                       "the expected structure, so it is patched", version,
                       ", ".join(TESTED_TRL_VERSIONS))

    import flexrollout.sampling_params as fsp
    from flexrollout.outputs import RequestOutput
    from flexrollout.sampling_params import SamplingParams

    for name in ("is_vllm_available", "LLM", "SamplingParams", "RequestOutput",
                 "StructuredOutputsParams"):
        _ORIGINALS[name] = vg.__dict__.get(name)
    _ORIGINALS["_init_vllm"] = cls._init_vllm
    _ORIGINALS["sync_weights"] = cls.sync_weights

    vg.is_vllm_available = _vllm_available
    vg.LLM = EngineFactory(engine_kwargs)
    vg.SamplingParams = SamplingParams
    vg.RequestOutput = RequestOutput
    vg.StructuredOutputsParams = fsp.StructuredOutputsParams  # constructing works; using one raises
    cls._init_vllm = _init_vllm
    cls.sync_weights = _sync_weights
    setattr(cls, _PATCH_MARK, True)
    logger.info("patched TRL %s: colocated vLLM generation now runs on flexrollout", version)


# -- version / structure checks ------------------------------------------------------------------
def _vllm_generation_module(version: str):
    import importlib
    import importlib.util

    if importlib.util.find_spec("trl.generation") is None or \
            importlib.util.find_spec("trl.generation.vllm_generation") is None:
        raise RuntimeError(
            f"flexrollout.patch_trl() supports TRL >= {MIN_TRL_VERSION}; TRL {version} has no "
            f"trl.generation.vllm_generation (its vLLM code lives inside GRPOTrainer). "
            f"Upgrade TRL: pip install 'trl>=1.15'")
    vg = importlib.import_module("trl.generation.vllm_generation")
    if not inspect.isclass(getattr(vg, "VLLMGeneration", None)):
        raise RuntimeError(f"flexrollout.patch_trl(): TRL {version} has no "
                           f"trl.generation.vllm_generation.VLLMGeneration; supported: TRL >= "
                           f"{MIN_TRL_VERSION} (tested: {', '.join(TESTED_TRL_VERSIONS)})")
    return vg


_LOCAL_VLLM_IMPORT = re.compile(r"^\s+(import vllm\b|from vllm\b)", re.MULTILINE)


def _check_structure(vg, cls, version: str) -> None:
    """The patch replaces module-level names and two methods; refuse a TRL that differs."""
    problems = [f"VLLMGeneration.{name} is missing" for name in ("_init_vllm", "sync_weights",
                                                                "generate")
                if not callable(getattr(cls, name, None))]
    if not callable(getattr(vg, "is_vllm_available", None)):
        problems.append("vllm_generation.is_vllm_available is missing")
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = None
        logger.warning("cannot read TRL's VLLMGeneration source; assuming TRL %s imports vLLM at "
                       "module level only", version)
    if source is not None:
        if _LOCAL_VLLM_IMPORT.search(source):
            problems.append("VLLMGeneration imports vllm inside a method, which only a real vLLM "
                            "install satisfies")
        if not re.search(r"\bLLM\(", source):
            problems.append("VLLMGeneration does not construct LLM(...) itself")
    if problems:
        raise RuntimeError(
            f"flexrollout.patch_trl() cannot drive TRL {version}'s vLLM backend: "
            f"{'; '.join(problems)}. Supported: TRL >= {MIN_TRL_VERSION} "
            f"(tested: {', '.join(TESTED_TRL_VERSIONS)}); pip install 'trl>=1.15'")


# -- replacements ----------------------------------------------------------------------------
def _real_vllm_available() -> bool:
    original = _ORIGINALS.get("is_vllm_available")
    return bool(original()) if callable(original) else False


def _vllm_available(min_version: str | None = None) -> bool:
    """What `trl.generation.vllm_generation` sees: a vLLM-compatible engine is always there."""
    return True


def _init_vllm(self) -> None:
    """`VLLMGeneration._init_vllm`: colocate mode builds a flexrollout engine over `self.model`."""
    if self.mode != "colocate":
        if not _real_vllm_available():
            raise ImportError(
                f"vllm_mode={self.mode!r} talks to a vLLM server and needs vLLM installed; "
                f"flexrollout.patch_trl() drives vllm_mode='colocate' only")
        return _ORIGINALS["_init_vllm"](self)
    tp = int(getattr(self, "tensor_parallel_size", 1) or 1)
    if tp > 1:
        raise ValueError(
            f"vllm_tensor_parallel_size={tp} is not supported by flexrollout: the engine runs "
            f"over each rank's own model replica. Use vllm_tensor_parallel_size=1 (data-parallel "
            f"ranks each build their own engine)")
    sharded = _sharded_training(self.accelerator)
    if sharded:
        raise NotImplementedError(
            f"flexrollout cannot run over {sharded}-sharded parameters (each rank holds a slice "
            f"of every weight); use DDP or DeepSpeed ZeRO-1/2, or vllm_mode='server' with vLLM")
    token = _BUILDING.set(self)
    try:
        _ORIGINALS["_init_vllm"](self)
    finally:
        _BUILDING.reset(token)


class EngineFactory:
    """Stands in for `vllm.LLM` inside TRL's vllm_generation module; `patch_trl` installs one.

    TRL passes `model=model.name_or_path`; while a `VLLMGeneration` is initialising, the engine
    is built over that trainer's unwrapped model and its tokenizer instead. `engine_kwargs` (the
    patch_trl call's) are added to, and override, what TRL passes.
    """

    def __init__(self, engine_kwargs: dict) -> None:
        self.engine_kwargs = dict(engine_kwargs)

    def __call__(self, model=None, tokenizer=None, **kwargs):
        from flexrollout.llm import LLM

        kwargs.update(self.engine_kwargs)
        gen = _BUILDING.get()
        if gen is None:
            return LLM(model, tokenizer=tokenizer, **kwargs)
        target = _rollout_model(gen)
        tok = _tokenizer_of(gen.processing_class)
        logger.info("building the flexrollout engine over the trainer's %s (not loading %r again)",
                    type(target).__name__, model)
        return LLM(target, tokenizer=tok, **kwargs)


def _sync_weights(self) -> None:
    """`VLLMGeneration.sync_weights`: nothing to push when the engine shares the parameters."""
    llm = getattr(self, "llm", None)
    if self.mode != "colocate" or not shares_trainer_weights(self):
        return _ORIGINALS["sync_weights"](self)
    if self.enable_sleep_mode:
        # TRL's order: wake the weights before a (here empty) push. Shared weights never left.
        llm.wake_up(tags=["weights"])
        self._llm_weights_sleeping = False
    llm.reset_prefix_cache()


# -- helpers ---------------------------------------------------------------------------------
def _tokenizer_of(processing_class):
    """A multimodal processor's tokenizer, or the tokenizer itself."""
    from transformers import PreTrainedTokenizerBase

    if isinstance(processing_class, PreTrainedTokenizerBase):
        return processing_class
    return getattr(processing_class, "tokenizer", processing_class)


def _rollout_model(gen):
    """The trainer's model without accelerate / DDP wrappers (a PeftModel stays a PeftModel)."""
    model = gen.model
    unwrap = getattr(gen.accelerator, "unwrap_model", None)
    return unwrap(model) if callable(unwrap) else model


def shares_trainer_weights(gen) -> bool:
    """Whether `gen.llm` is a flexrollout engine over `gen`'s own model object."""
    from flexrollout.llm import LLM

    llm = getattr(gen, "llm", None)
    return isinstance(llm, LLM) and getattr(llm, "model", None) is _rollout_model(gen)


def _sharded_training(accelerator) -> str | None:
    state = getattr(accelerator, "state", None)
    ds = getattr(state, "deepspeed_plugin", None)
    if ds is not None and getattr(ds, "zero_stage", 0) == 3:
        return "DeepSpeed ZeRO-3"
    if getattr(state, "fsdp_plugin", None) is not None:
        return "FSDP"
    return None
