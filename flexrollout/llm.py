"""`LLM`: vLLM's offline API over flexrollout's engine."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from itertools import count

import torch

from .config import EngineConfig, resolve_dtype
from .engine.engine import LLMEngine, device_scope
from .engine.sequence import Sequence
from .layers.quant import quant_state_of
from .lora import AdapterRegistry
from .lora.merged import MergedLora
from .lora_request import LoRARequest
from .weights import ModelExecutor, weight_bytes
from .models import build_forward, unwrap_peft
from .outputs import CompletionOutput, RequestOutput
from .prompts import Prompt, check_tokens, split_prompts, to_prompt
from .sampling_params import SamplingParams

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
    "max_loras", "max_cpu_loras", "lora_dtype", "hf_overrides",
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
            enable_prefix_caching=enable_prefix_caching, **engine_kwargs)
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
            self.llm_engine.vllm_config.lora_config = LoRAConfig(max_lora_rank=max_lora_rank)
        self._eos_ids = self._eos_token_ids(hf)
        self._rng = random.Random(seed)
        self._request_ids = count()

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
        items = split_prompts(prompts)
        params = self._params_list(sampling_params, len(items))
        parsed = [to_prompt(p, self.tokenizer, i) for i, p in enumerate(items)]
        requests = [self._prepare(i, prompt, sp) for i, (prompt, sp) in enumerate(zip(parsed, params))]
        for request, adapter in zip(requests, self._adapters(lora_request, len(items))):
            request["lora"] = adapter
        self._check_weights()
        return self._run(parsed, requests, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm=True, lora_request=None,
             chat_template=None, add_generation_prompt=True, continue_final_message=False,
             chat_template_kwargs=None, tools=None, **kwargs) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list, then generate."""
        if isinstance(messages, str) or not isinstance(messages, (list, tuple)):
            raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) "
                            f"or a list of conversations, got {type(messages).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            return []
        prompts = []
        for i, conv in enumerate(conversations):
            if not isinstance(conv, (list, tuple)) or not all(isinstance(m, dict) for m in conv):
                raise TypeError(f"messages[{i}] must be a list of message dicts")
            text = self.tokenizer.apply_chat_template(
                list(conv), tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                tools=tools, **(chat_template_kwargs or {}))
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt_token_ids": ids, "prompt": text})
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

    # -- request preparation -----------------------------------------------------------------
    @staticmethod
    def _params_list(sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != num_prompts:
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for "
                                 f"{num_prompts} prompts; pass one or one per prompt")
            for i, sp in enumerate(sampling_params):
                if not isinstance(sp, SamplingParams):
                    raise TypeError(f"sampling_params[{i}] must be a SamplingParams, "
                                    f"got {type(sp).__name__}")
            return list(sampling_params)
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                        f"got {type(sampling_params).__name__}")

    def _adapters(self, lora_request, num_prompts: int) -> list:
        """One Adapter (or None) per prompt, loaded and validated before any work."""
        if lora_request is None:
            return [None] * num_prompts
        if isinstance(lora_request, LoRARequest):
            requests = [lora_request] * num_prompts
        elif isinstance(lora_request, (list, tuple)):
            if len(lora_request) != num_prompts:
                raise ValueError(f"lora_request has {len(lora_request)} entries for {num_prompts} prompts")
            requests = list(lora_request)
        else:
            raise TypeError(f"lora_request must be a LoRARequest or a list of them, "
                            f"got {type(lora_request).__name__}")
        for i, req in enumerate(requests):
            if req is not None and not isinstance(req, LoRARequest):
                raise TypeError(f"lora_request[{i}] must be a LoRARequest or None, got {type(req).__name__}")
        return [None if req is None else self._registry().get(req) for req in requests]

    def _registry(self) -> AdapterRegistry:
        if self._lora_registry is None:
            engine = self.llm_engine
            self._lora_registry = AdapterRegistry(
                len(engine.spec.layers), engine.forward.lora_targets(), engine.device,
                engine.model_config.dtype)
        return self._lora_registry

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_registry is not None and self._lora_registry.remove(lora_id)

    def list_loras(self) -> set[int]:
        return set() if self._lora_registry is None else set(self._lora_registry.adapters)

    def _prepare(self, index: int, prompt: Prompt, params: SamplingParams) -> dict:
        engine = self.llm_engine
        vocab = engine.spec.vocab_size
        truncate = params.truncate_prompt_tokens
        if truncate is not None:
            keep = engine.max_model_len if truncate == -1 else truncate
            prompt.token_ids = prompt.token_ids[-keep:]
        check_tokens(prompt, vocab, engine.max_model_len, index)
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(params, name) or () if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"sampling_params.{name} has ids outside [0, {vocab}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"sampling_params.{name}={k} exceeds the vocabulary size {vocab} "
                                 f"(use -1 for all tokens)")
        bad = [t for t in params.logit_bias or {} if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"sampling_params.logit_bias has ids outside [0, {vocab}): {bad[:5]}")
        room = engine.max_model_len - len(prompt.token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        needed = len(prompt.token_ids) + max_tokens
        if needed > engine.capacity_tokens:
            raise ValueError(
                f"prompts[{index}] needs {needed} KV tokens (prompt {len(prompt.token_ids)} + "
                f"max_tokens {max_tokens}) but the cache holds {engine.capacity_tokens}; lower "
                f"max_tokens or raise num_kv_pages / gpu_memory_utilization")
        if params.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop needs a tokenizer")
        return {"params": params, "max_tokens": max_tokens}

    def _bad_words(self, params: SamplingParams) -> list[list[int]]:
        if not params.bad_words:
            return []
        copy = params.clone()
        copy.update_from_tokenizer(self.tokenizer)
        return [list(w) for w in copy.bad_words_token_ids or []]

    def _sequences(self, index: int, prompt: Prompt, request: dict) -> list[Sequence]:
        params = request["params"]
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self._eos_ids
        bad_words = self._bad_words(params)
        seqs = []
        for sample in range(params.n):
            if params.seed is not None:
                seed = (params.seed + sample * 0x9E3779B97F4A7C15) % (1 << 63)
            else:
                seed = self._rng.getrandbits(63)
            seqs.append(Sequence(
                seq_id=next(self._request_ids), request_index=index, sample_index=sample,
                token_ids=list(prompt.token_ids), num_prompt_tokens=len(prompt.token_ids),
                params=params, max_tokens=request["max_tokens"], seed=seed,
                stop_ids=frozenset(stop_ids), bad_words_ids=bad_words, lora=request["lora"]))
        return seqs

    def _groups(self, per_request: list[list[Sequence]]) -> list[list[Sequence]]:
        """Samples of one prompt, and identical prompts in this call, share one prefill."""
        if not self.config.enable_prefix_caching:
            return [[s] for seqs in per_request for s in seqs]
        groups: dict[tuple, list[Sequence]] = {}
        for seqs in per_request:
            for seq in seqs:
                # A request that skips reading shared prompt KV (by default, one asking for
                # prompt_logprobs, which only a group's leader computes) stays alone.
                lora_id = seq.lora.lora_int_id if seq.lora is not None else 0
                key = ((seq.seq_id,) if seq.params.skip_reading_prefix_cache
                       else (lora_id, tuple(seq.token_ids)))
                groups.setdefault(key, []).append(seq)
        return list(groups.values())

    def _run(self, prompts: list[Prompt], requests: list[dict], use_tqdm: bool) -> list[RequestOutput]:
        per_request = [self._sequences(i, p, r) for i, (p, r) in enumerate(zip(prompts, requests))]
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
        return [self._output(p, seqs) for p, seqs in zip(prompts, per_request)]

    @staticmethod
    def _output(prompt: Prompt, seqs: list[Sequence]) -> RequestOutput:
        completions = [CompletionOutput(
            index=s.sample_index, text=s.text, token_ids=s.generated_ids,
            cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
            logprobs=s.logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason)
            for s in seqs]
        return RequestOutput(
            request_id=str(seqs[0].seq_id), prompt=prompt.text, prompt_token_ids=prompt.token_ids,
            prompt_logprobs=seqs[0].prompt_logprobs, outputs=completions, finished=True,
            num_cached_tokens=max(s.num_cached for s in seqs))


@dataclass
class LoRAConfig:
    """What vLLM clients read from `llm_engine.vllm_config.lora_config`."""

    max_lora_rank: int = 16
    max_loras: int = 64


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

