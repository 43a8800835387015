"""`LLM`: vLLM's offline API over flexrollout's engine."""
from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from .config import EngineConfig, resolve_dtype
from .engine.engine import LLMEngine, device_scope
from .engine.sequence import Sequence
from .facades import LoRAConfig
from .layers.quant import quant_state_of
from .lora import AdapterRegistry
from .lora.merged import MergedLora
from .lora_request import LoRARequest
from .models import build_forward, unwrap_peft
from .outputs import DeltaStream, RequestOutput, TokenDelta, request_output
from .prompts import chat_prompts
from .requests import Request, SequenceMaker, parse_requests, prefill_groups
from .weights import ModelExecutor, weight_bytes

logger = logging.getLogger(__name__)

# vLLM keyword arguments that change nothing here when they hold these values.
_MUST_EQUAL = {
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
    "quantization": None, "kv_cache_dtype": "auto", "cpu_offload_gb": 0,
    "logprobs_mode": "processed_logprobs", "speculative_config": None,
}
# vLLM keyword arguments renamed into EngineConfig.
_RENAMED = {"block_size": "page_size", "num_gpu_blocks_override": "num_kv_pages"}
# vLLM keyword arguments that have no meaning for an in-process engine over shared weights.
# (Those `LLM.__init__` names itself, such as `enable_lora`, never reach this set.)
_IGNORED = {
    "tokenizer_revision", "tokenizer_mode", "skip_tokenizer_init",
    "download_dir", "load_format", "swap_space", "disable_log_stats", "disable_custom_all_reduce",
    "distributed_executor_backend", "model_impl", "enable_chunked_prefill", "max_seq_len_to_capture",
    "compilation_config", "worker_extension_cls", "max_logprobs",
    "lora_dtype", "hf_overrides",
    "served_model_name", "allowed_local_media_path", "limit_mm_per_prompt", "async_scheduling",
    "disable_async_output_proc", "use_v2_block_manager", "num_scheduler_steps",
}


class LLM:
    """Generate with a Hugging Face causal LM through flex_attention over a paged KV cache.

    `model` is a hub id / local directory (loaded with transformers; `gguf_file=` passes through)
    or a `PreTrainedModel` / `PeftModel` already in memory, whose parameters are used as they
    are: no copy, no change to its modules. `trust_remote_code` and `revision` go to
    transformers' `from_pretrained` calls (model and tokenizer) when `model` is a hub id.
    """

    def __init__(self, model, tokenizer=None, dtype="auto", seed: int = 0,
                 gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                 max_num_seqs: int = 256, enforce_eager: bool = False,
                 enable_sleep_mode: bool = False, enable_lora: bool = False, max_lora_rank: int = 16,
                 enable_prefix_caching: bool = True, gguf_file: str | None = None,
                 trust_remote_code: bool = False, revision: str | None = None, **kwargs) -> None:
        engine_kwargs = self._engine_kwargs(kwargs)
        self.config = EngineConfig(
            dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching, enable_lora=enable_lora,
            max_lora_rank=max_lora_rank, **engine_kwargs)
        hub = {"trust_remote_code": trust_remote_code, "revision": revision}
        self.model, self.tokenizer, model_name = self._load(
            model, tokenizer, gguf_file, hub, dtype, self.config.device)
        hf = unwrap_peft(self.model)
        if kwargs.get("quantization") == "bitsandbytes" and \
                not any(quant_state_of(p) is not None for p in hf.parameters()):
            raise ValueError("quantization='bitsandbytes' on a model without bitsandbytes 4-bit weights: "
                             "flexrollout never quantises; load the model with "
                             "BitsAndBytesConfig(load_in_4bit=True) instead")
        param = next(hf.parameters())
        run_dtype = resolve_dtype(dtype, param.dtype)
        if run_dtype != param.dtype:
            raise ValueError(f"dtype={dtype!r} differs from the in-memory model's {param.dtype}; "
                             f"flexrollout never copies weights, so cast the model itself or pass 'auto'")
        merged = MergedLora(self.model) if self.config.lora_mode == "merged" else None
        forward = build_forward(self.model, run_dtype, merged)
        spec = forward.spec
        model_len = max_model_len or spec.max_position_embeddings
        device = torch.device(self.config.device) if self.config.device else param.device
        owned = weight_bytes(self.model) if isinstance(model, str) else 0
        with device_scope(device):       # the model's GPU, whichever device is current
            self.llm_engine = LLMEngine(forward, self.tokenizer, self.config, device, run_dtype,
                                        model_len, model_name, owned_weight_bytes=owned)
        self.llm_engine.model_config.enable_sleep_mode = bool(enable_sleep_mode)
        self.llm_engine.model_executor = ModelExecutor(self.model)
        # Weights this engine loaded itself may be offloaded by sleep(); a trainer's never are.
        self._owns_weights = isinstance(model, str)
        # Unsloth reads this: True when the engine runs over a trainer's own parameters.
        self.shared_weights = not self._owns_weights
        self._weights_offloaded = False
        self._weights_key = self._weights_fingerprint()
        self._lora_registry: AdapterRegistry | None = None
        if enable_lora or hasattr(self.model, "peft_config"):
            self.llm_engine.vllm_config.lora_config = LoRAConfig(max_lora_rank=self.config.max_lora_rank,
                                                                 max_loras=self.config.max_loras)
        self._sequence_maker = SequenceMaker(seed, self._eos_token_ids(hf))

    # -- construction helpers ----------------------------------------------------------------
    @staticmethod
    def _engine_kwargs(kwargs: dict) -> dict:
        out = {}
        for name, value in kwargs.items():
            if name in _MUST_EQUAL:
                # "bitsandbytes": TRL passes it for a model loaded in 4-bit (checked in __init__)
                harmless = name == "quantization" and value in ("", "none", "bitsandbytes")
                if value != _MUST_EQUAL[name] and not harmless:
                    raise ValueError(f"{name}={value!r} is not supported by flexrollout "
                                     f"(supported: {_MUST_EQUAL[name]!r})")
            elif name in _RENAMED:
                ours = _RENAMED[name]
                if value is not None and kwargs.get(ours, value) != value:
                    raise ValueError(f"{name}={value!r} conflicts with {ours}={kwargs[ours]!r}; "
                                     f"they name the same setting")
                if value is not None:
                    out[ours] = value
            elif name in EngineConfig.field_names():
                out[name] = value
            elif name in _IGNORED or name.startswith("disable_"):
                logger.info("ignoring vLLM argument %s=%r (no effect in flexrollout)", name, value)
            else:
                raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        return out

    @staticmethod
    def _load(model, tokenizer, gguf_file, hub: dict, dtype, device):
        """(model, tokenizer, name). `hub` (trust_remote_code, revision) goes to every
        `from_pretrained` of a hub id / directory; an in-memory model's own tokenizer path is read
        without them (the user already ran whatever code that model needed)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                path = getattr(unwrap_peft(model).config, "_name_or_path", None)
                tokenizer = AutoTokenizer.from_pretrained(path) if path else None
            elif isinstance(tokenizer, str):
                tokenizer = AutoTokenizer.from_pretrained(tokenizer, **hub)
            name = getattr(unwrap_peft(model).config, "_name_or_path", "") or type(model).__name__
            return model, tokenizer, name
        if not isinstance(model, str):
            raise TypeError(f"model must be a str or a torch.nn.Module, got {type(model).__name__}")
        extra = dict(hub)
        if gguf_file is not None:
            extra["gguf_file"] = gguf_file
        load_dtype = dtype if dtype == "auto" else resolve_dtype(dtype, torch.float32)
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=load_dtype, **extra)
        loaded = loaded.to(device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
        if isinstance(tokenizer, str) or tokenizer is None:
            tok_extra = {"gguf_file": gguf_file} if gguf_file and tokenizer is None else {}
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or model, **tok_extra, **hub)
        return loaded, tokenizer, model

    def _eos_token_ids(self, hf) -> frozenset[int]:
        ids = set()
        gen = getattr(hf, "generation_config", None)
        for source in (getattr(gen, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(t) for t in source)
        return frozenset(ids)

    # -- public API --------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.llm_engine.tokenizer = tokenizer

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None,
                 **kwargs) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order."""
        if kwargs.get("prompt_token_ids") is not None:      # vLLM 0.x keyword form
            prompts = [{"prompt_token_ids": ids} for ids in kwargs.pop("prompt_token_ids")]
        if kwargs:
            raise TypeError(f"generate() got unexpected keyword arguments {sorted(kwargs)}")
        return self._run(self._requests(prompts, sampling_params, lora_request), use_tqdm)

    def generate_stream(self, prompts, sampling_params=None, *,
                        lora_request=None) -> Iterator[TokenDelta]:
        """`generate`, yielding each sample's new tokens and text as the engine produces them.

        A flexrollout extension (vLLM's offline `LLM` does not stream). Arguments as `generate`'s,
        checked now rather than at the first item. Each `TokenDelta` names its prompt
        (`request_index`) and sample (`index`); a sample's deltas' texts join to its final text
        (see `DeltaStream` for what is held back), and the delta that ends a prompt's last sample
        carries that prompt's `RequestOutput`, as `generate` would return it. Leaving the loop
        early (break, close) drops the unfinished work; until the iterator is exhausted or
        closed, the engine takes no other call.
        """
        requests = self._requests(prompts, sampling_params, lora_request)
        per_request = self._sequences(requests)
        return self._stream(DeltaStream(requests, per_request, self.tokenizer),
                            self._groups(per_request))

    def _stream(self, stream: DeltaStream, groups: list[list[Sequence]]) -> Iterator[TokenDelta]:
        for _ in self.llm_engine.steps(groups):
            yield from stream.deltas()

    def chat(self, messages, sampling_params=None, use_tqdm=True, lora_request=None,
             chat_template=None, add_generation_prompt=True, continue_final_message=False,
             chat_template_kwargs=None, tools=None, chat_template_content_format="auto",
             mm_processor_kwargs=None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list, then generate.

        vLLM's signature; `chat_template_content_format` and `mm_processor_kwargs` concern image
        and audio content, which flexrollout does not take, and change nothing for text."""
        prompts = chat_prompts(messages, self.tokenizer, chat_template=chat_template,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               **(chat_template_kwargs or {}))
        if not prompts:
            return []
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # -- sleep / wake and weight-sync hooks (vLLM's names) -----------------------------------
    def sleep(self, level: int | str = 1) -> None:
        """Free GPU memory between rollouts.

        Level 1 and 2 both free the KV cache and the decode graphs. Weights shared with a trainer
        are never moved; weights this engine loaded itself go to CPU memory (both levels: level 2
        keeps them on the host instead of discarding them, so wake_up needs no reload).
        Sleeping twice is harmless.
        """
        level = _sleep_level(level)
        if self.llm_engine.kv_cache_awake:
            self.llm_engine.release_kv_cache()
        if self._owns_weights and not self._weights_offloaded:
            self.model.to("cpu")
            self._weights_offloaded = True
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        logger.info("asleep (level %d)", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed: tags None (everything), ["weights"] and/or ["kv_cache"]."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"tags must be a subset of ['weights', 'kv_cache'], got {sorted(unknown)}")
        if "weights" in tags and self._weights_offloaded:
            self.model.to(self.llm_engine.device)
            self._weights_offloaded = False
            self.llm_engine.invalidate_graphs()
        if "kv_cache" in tags:
            self.llm_engine.restore_kv_cache()

    def is_sleeping(self) -> bool:
        return not self.llm_engine.kv_cache_awake or self._weights_offloaded

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        """No KV is reused across calls (weights may change between them): nothing to drop."""
        return True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list:
        """vLLM's worker RPC, for the one worker this process is. `reload_weights` is a no-op
        because the engine reads the model's parameters directly."""
        kwargs = kwargs or {}
        if method == "reload_weights":
            return [None]
        target = self.llm_engine.model_executor.driver_worker
        if callable(method):
            return [method(target, *args, **kwargs)]
        for obj in (target, target.model_runner, target.model_runner.model):
            if hasattr(obj, method):
                return [getattr(obj, method)(*args, **kwargs)]
        raise NotImplementedError(f"collective_rpc: method {method!r} is not supported")

    def _weights_fingerprint(self) -> tuple:
        """Parameter addresses: captured graphs are valid only while these stay put."""
        return tuple((name, p.data_ptr()) for name, p in self.model.named_parameters())

    def _check_weights(self) -> None:
        if self._weights_offloaded:
            raise RuntimeError("the weights are asleep; call wake_up() (or wake_up(tags=['weights']))")
        # Merged copies are refreshed in place (graphs that read them stay valid); live adapters
        # switched on or off change what the graphs read.
        adapters_changed = self.llm_engine.forward.refresh()
        key = self._weights_fingerprint()
        if key != self._weights_key or adapters_changed:
            logger.info("model parameters or active adapters changed; re-capturing decode graphs")
            self.llm_engine.invalidate_graphs()
            self._weights_key = key

    # -- requests ----------------------------------------------------------------------------
    def _adapters(self, loras: list[LoRARequest | None]) -> list:
        """The Adapter (or None) of each row's LoRARequest, loaded before any work."""
        merged = self.llm_engine.forward.merged
        if merged is not None and merged.expert_stacks and any(r is not None for r in loras):
            # Linear projections read the unmerged base weight for such rows; stacked experts
            # have no such path yet, and subtracting the merged delta would not be exact.
            raise ValueError(
                f"lora_request with lora_mode='merged' on a model whose expert stacks carry LoRA "
                f"({merged.expert_stacks[0]}) is not supported: a request's rows must not see the "
                f"merged live adapter. Use lora_mode='live'")
        return [None if req is None else self._registry().get(req) for req in loras]

    def _registry(self) -> AdapterRegistry:
        if self._lora_registry is None:
            engine = self.llm_engine
            self._lora_registry = AdapterRegistry(
                len(engine.spec.layers), engine.forward.lora_targets(), engine.device,
                engine.model_config.dtype, self.config.max_cpu_loras or self.config.max_loras,
                engine.runner.adapter_table.remove)
        return self._lora_registry

    def remove_lora(self, lora_id: int) -> bool:
        self.llm_engine.runner.adapter_table.remove(lora_id)
        return self._lora_registry is not None and self._lora_registry.remove(lora_id)

    def list_loras(self) -> set[int]:
        return set() if self._lora_registry is None else set(self._lora_registry.adapters)

    def _requests(self, prompts, sampling_params, lora_request) -> list[Request]:
        """Every request checked (and its adapter loaded) before any work; weights current."""
        requests = parse_requests(prompts, sampling_params, lora_request, self.llm_engine,
                                  self.tokenizer, self._adapters)
        self._check_weights()
        return requests

    def _sequences(self, requests: list[Request]) -> list[list[Sequence]]:
        return [self._sequence_maker.sequences(r, self.tokenizer) for r in requests]

    def _groups(self, per_request: list[list[Sequence]]) -> list[list[Sequence]]:
        return prefill_groups(per_request, self.config.enable_prefix_caching)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        per_request = self._sequences(requests)
        remaining = [len(s) for s in per_request]
        bar = _progress(len(per_request), use_tqdm)

        def on_finish(seq: Sequence) -> None:
            remaining[seq.request_index] -= 1
            if remaining[seq.request_index] == 0 and bar is not None:
                bar.update(1)

        try:
            self.llm_engine.run(self._groups(per_request), on_finish)
        finally:
            if bar is not None:
                bar.close()
        return [request_output(r, seqs) for r, seqs in zip(requests, per_request)]


def _sleep_level(level) -> int:
    try:
        value = int(level)
    except (TypeError, ValueError):
        raise ValueError(f"level must be 1 or 2, got {level!r}") from None
    if value not in (1, 2) or isinstance(level, bool):
        raise ValueError(f"level must be 1 or 2, got {level!r}")
    return value


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


FlexEngine = LLM

