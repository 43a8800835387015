"""The engine loop, written once for every architecture: schedule, run, sample, stop.

Async decode (`EngineConfig.async_decode`): a decode step is launched before the previous step's
tokens are read back, and that previous result is processed while the GPU runs the new step. At
most one step is pending. The next step assumes every sequence continues; one that stopped (EOS,
stop id, stop string) is found a step late and its extra token is discarded. Anything that needs
the exact host state (a prefill, a preemption, the end of `run`) drains the pending step first.
The logits processors (penalties, biases, min_tokens, bad words) keep their state on the device,
per slot (`SlotSampling`), so their rows pipeline like any other.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..attention.kv_cache import KVCache
from ..config import EngineConfig
from ..facades import ModelConfig, VllmConfig
from ..kernels.gemv_4bit import MAX_ROWS as GEMV_4BIT_MAX_ROWS
from ..lora.table import AdapterTable
from ..models.base import ForwardOptions
from .detokenizer import append_text, final_text, find_stop_string
from .graphs import DecodeGraphs
from .logprobs import host_rows, prompt_entries, record_sampled
from .page_table import PageTable
from .runner import ModelRunner
from .sampler import (
    SamplerOutput,
    SlotSampling,
    build_sampling_tensors,
    sampling_to_device,
)
from .scheduler import Scheduler
from .sequence import Sequence, Status

logger = logging.getLogger(__name__)


def device_scope(device: torch.device):
    """`device` as the current CUDA device while the engine works on it: Triton launches, CUDA
    events and graph captures follow the current device, and a rank of a multi-GPU job may call
    in with another device current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _on_engine_device(method):
    @functools.wraps(method)
    def scoped(self, *args, **kwargs):
        with device_scope(self.device):
            return method(self, *args, **kwargs)
    return scoped


@dataclass
class EngineStats:
    """Cumulative counters; tests and benchmarks read differences."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    pages_allocated: int = 0
    overlapped_decode_steps: int = 0   # launched while the previous step's tokens were unread
    discarded_tokens: int = 0          # computed past a stop found one step late (async decode)


@dataclass
class PendingDecode:
    """A launched decode step whose sampled outputs are on their way to the host."""

    seqs: list[Sequence]
    out: SamplerOutput                 # host tensors, valid once `ready` has completed
    ready: torch.cuda.Event | None     # None on CPU: the outputs are already there


class LLMEngine:
    def __init__(self, forward, tokenizer, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, model_name: str,
                 owned_weight_bytes: int = 0) -> None:
        self.forward = forward
        self.owned_weight_bytes = owned_weight_bytes
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.spec = forward.spec
        self.max_model_len = max_model_len
        self.model_config = ModelConfig(model_name, max_model_len, dtype,
                                        enable_prefix_caching=config.enable_prefix_caching)
        self.vllm_config = VllmConfig(self.model_config)
        self.page_size = config.page_size or (128 if device.type == "cuda" else 16)
        self.max_batched_tokens = config.max_num_batched_tokens or (
            8192 if device.type == "cuda" else 2048)
        self.num_slots = config.max_num_seqs + 1       # batch slots, the padding slot 0 included
        num_pages = self._num_pages(dtype)
        self.cache = KVCache(self.spec.layers, num_pages, self.page_size, dtype, device,
                             num_slots=self.num_slots)
        max_pages_per_seq = -(-max_model_len // self.page_size)
        self.pages = PageTable(num_pages, self.page_size, config.max_num_seqs, max_pages_per_seq, device)
        self.scheduler = Scheduler(self.pages, config.max_num_seqs, self.max_batched_tokens)
        forward.prepare(ForwardOptions(
            max_len=max_model_len, compile_layers=device.type == "cuda" and config.compile_layers,
            small_rows=config.small_batch_max_rows if config.small_batch_kernels else 0,
            mlp_chunk=config.mlp_chunk_tokens, gemv_pdl=config.gemv_pdl,
            qkv_epilogue=config.qkv_epilogue, lora_rows=config.lora_request_kernels,
            gemma_qkv_epilogue=config.gemma_qkv_epilogue, fla_decode=config.fla_decode,
            ragged_gemv=config.ragged_gemv,
            quant_rows=GEMV_4BIT_MAX_ROWS if config.quant_kernels and device.type == "cuda" else 0,
            compile_4bit=config.compile_4bit, static_weight_shapes=config.static_weight_shapes,
            lora_kernels=device.type == "cuda", fused_shrink=config.lora_fused_shrink,
            lora_gemv_rows=config.lora_gemv_max_rows,
            expert_rows=config.moe_small_batch_max_rows if config.small_batch_kernels else 0))
        backend = config.attention_backend
        if backend == "auto":
            backend = "flex" if device.type == "cuda" else "reference"
        self.runner = ModelRunner(forward, self.cache, self.pages, device, backend,
                                  config.flex_kernel_options, config.max_loras)
        if device.type == "cuda" and not config.enforce_eager and backend == "flex":
            self.runner.graphs = DecodeGraphs(self.runner, config.max_num_seqs)
        self.stats = EngineStats()
        self._pending: PendingDecode | None = None
        page_bytes = KVCache.bytes_per_page(self.spec.layers, self.page_size, dtype)
        states = KVCache.state_bytes(self.spec.layers, self.num_slots)
        self.cache_bytes = num_pages * page_bytes + states
        owning = sum(s.owns_kv for s in self.spec.layers)
        logger.info("KV cache: %d pages x %d tokens = %d tokens, %.1f MiB (%d KiB per token; %d of "
                    "%d layers hold KV)", num_pages - 1, self.page_size,
                    (num_pages - 1) * self.page_size, num_pages * page_bytes / 2**20,
                    page_bytes // self.page_size // 1024, owning, len(self.spec.layers))
        if states:
            logger.info("per-sequence states (linear attention): %.1f MiB for %d slots",
                        states / 2**20, self.num_slots)

    # -- sizing ------------------------------------------------------------------------------
    def _num_pages(self, dtype: torch.dtype) -> int:
        """Pages in the cache, page 0 (padding) included."""
        cfg = self.config
        cap = KVCache.max_pages(self.spec.layers, self.page_size)
        if cfg.num_kv_pages is not None:
            if cfg.num_kv_pages + 1 > cap:
                raise ValueError(f"num_kv_pages={cfg.num_kv_pages} is more than this model's K/V tensors "
                                 f"can index (at most {cap - 1} pages of {self.page_size} tokens)")
            return cfg.num_kv_pages + 1
        page_bytes = KVCache.bytes_per_page(self.spec.layers, self.page_size, dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # vLLM's meaning: the engine may hold this fraction of the GPU for itself. Weights
            # shared with a trainer are the trainer's and do not count; weights the engine
            # loaded do. Never more than is free now.
            own = int(total * cfg.gpu_memory_utilization) - self.owned_weight_bytes
            # Activations, logits and graph pools need room beyond the cache.
            margin = 2 * 2**30 + cfg.max_num_seqs * self.spec.vocab_size * 4 * 4
            # The logits processors' per-slot state is allocated only when a request uses it, but
            # mid-run, when no memory could be freed for it: reserved here (about 0.4 GB at 256
            # slots and a 152k vocabulary).
            margin += SlotSampling.max_bytes(self.num_slots, self.spec.vocab_size)
            if cfg.enable_lora:      # the LoRARequest adapter table, also allocated mid-run
                margin += AdapterTable.max_bytes(self.forward.lora_targets(), len(self.spec.layers),
                                                 cfg.max_loras, cfg.max_lora_rank, dtype)
            states = KVCache.state_bytes(self.spec.layers, self.num_slots)
            pages = (min(own, free) - margin - states) // page_bytes
            if pages < 2:
                # Linear-attention states are per batch slot: a hybrid model's can fill the GPU.
                held = (f" (the linear-attention layers' per-sequence states take "
                        f"{states / 2**30:.1f} GiB at max_num_seqs={cfg.max_num_seqs}: lower it)"
                        if states else "")
                raise ValueError(
                    f"no GPU memory left for the KV cache at gpu_memory_utilization="
                    f"{cfg.gpu_memory_utilization}{held}; raise it or set num_kv_pages")
            if pages + 1 > cap:
                logger.info("KV cache capped at %d pages (of %d that fit): one layer's K/V tensor "
                            "stays under 2^31 elements", cap - 1, pages)
            return int(min(pages + 1, cap))
        tokens = min(self.max_model_len * min(cfg.max_num_seqs, 8), cfg.cpu_kv_cache_tokens)
        return max(-(-tokens // self.page_size), -(-self.max_model_len // self.page_size)) + 1

    # -- sleep -------------------------------------------------------------------------------
    @property
    def kv_cache_awake(self) -> bool:
        return self.cache.allocated

    @_on_engine_device
    def release_kv_cache(self) -> None:
        """Free the KV cache, the logits processors' slot state and the decode graphs that point
        into them."""
        if self.scheduler.has_work():
            raise RuntimeError("cannot sleep while requests are running")
        self.invalidate_graphs()
        self.cache.release()
        self.runner.slot_sampling.release()
        self.pages.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @_on_engine_device
    def restore_kv_cache(self) -> None:
        if not self.cache.allocated:
            self.cache.allocate()

    def invalidate_graphs(self) -> None:
        """Captured graphs hold weight and cache addresses; drop them when either moves."""
        if self.runner.graphs is not None:
            self.runner.graphs.reset()

    @property
    def capacity_tokens(self) -> int:
        return (self.pages.num_pages - 1) * self.page_size

    # -- the loop ----------------------------------------------------------------------------
    @_on_engine_device
    def run(self, groups: list[list[Sequence]], on_finish=None) -> None:
        """Generate every sequence of `groups` to completion."""
        for _ in self.steps(groups, on_finish):
            pass

    def steps(self, groups: list[list[Sequence]], on_finish=None) -> Iterator[None]:
        """`run` one engine step per iteration, so a caller can read the sequences' new tokens
        between steps (streaming). Closing the iterator early drops the unfinished sequences."""
        if not self.cache.allocated:
            raise RuntimeError("the KV cache is asleep; call wake_up() (or wake_up(tags=['kv_cache']))")
        if self.scheduler.has_work():
            raise RuntimeError("the engine is still running an unfinished generate_stream; "
                               "exhaust or close it first")
        for group in groups:
            for part in self._fitting_groups(group):
                self.scheduler.add_group(part)
        try:
            while self.scheduler.has_work():
                with device_scope(self.device):     # a streaming caller may switch devices
                    self.step(on_finish)
                yield
            with device_scope(self.device):
                self._drain(on_finish)       # steps computed only past stops: discarded
        except BaseException:
            # Leave nothing of this call behind (an error, or a stream closed early: GeneratorExit):
            # the next call must start clean. An unread step is dropped without waiting (after a
            # device error waiting would raise again); stream order keeps its writes ahead of
            # anything the next call launches.
            self._pending = None
            self.scheduler.abort_all()
            raise

    def _fitting_groups(self, group: list[Sequence]) -> list[list[Sequence]]:
        """Split a group whose members cannot be admitted together (slots or pages)."""
        size = max(1, min(len(group), self.config.max_num_seqs))
        leader = group[0]
        partial = int(leader.num_tokens % self.page_size != 0)
        while size > 1 and self.pages.pages_for(leader.num_tokens) + (size - 1) * partial > \
                self.pages.num_pages - 1:
            size //= 2
        return [group[i:i + size] for i in range(0, len(group), size)]

    def step(self, on_finish=None) -> None:
        if self._pending is not None and not self._can_overlap():
            self._drain(on_finish)
            if not self.scheduler.has_work():
                return
        batch = self.scheduler.schedule()
        if batch.prefill:
            self._prefill(batch.prefill, on_finish)
        elif batch.decode:
            self._decode(batch.decode, on_finish)
        elif self._pending is not None:
            self._drain(on_finish)       # every running sequence ends with its pending token
        else:
            raise RuntimeError("scheduler made no progress: no sequence could be scheduled")
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.pages_allocated = self.pages.pages_allocated

    # -- async decode ------------------------------------------------------------------------
    def _can_overlap(self) -> bool:
        """The next step can be scheduled and built while the pending tokens are unknown: it is
        a decode step without preemption. (No row's step needs its previous token on the host:
        the processors' state lives on the device, and a LoRARequest row's adapter is fixed.)"""
        sched = self.scheduler
        return (self.config.async_decode and not sched.prefill_ready()
                and not sched.admission_after_drain() and sched.decode_fits())

    def _drain(self, on_finish) -> None:
        """Process the pending step, if any, so the host state is exact."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._process(pending, on_finish)

    def _process(self, pending: PendingDecode, on_finish) -> None:
        if pending.ready is not None:
            pending.ready.synchronize()
        for seq in pending.seqs:
            if seq.status is not Status.FINISHED:
                seq.num_pending -= 1
        self._append(pending.seqs, pending.out, on_finish)

    def _prefill(self, chunks: list[tuple[Sequence, int]], on_finish) -> None:
        hidden = self.runner.prefill(chunks)
        self.stats.prefill_steps += 1
        rows, samplers = [], []
        end = 0
        for seq, count in chunks:
            start, end = end, end + count
            if (seq.params.prompt_logprobs is not None and seq.num_computed < seq.num_prompt_tokens
                    and len(seq.prompt_logprobs or ()) < seq.num_prompt_tokens):
                self._prompt_logprobs(seq, hidden[start:end])
            seq.num_computed += count
            self.stats.prefill_tokens += count
            if seq.num_computed == seq.num_tokens:
                members = [seq] + [s for s in self.scheduler.running if s.share_with is seq]
                rows += [end - 1] * len(members)
                samplers += members
        if not rows:
            return
        for follower in samplers:
            if follower.share_with is not None:
                self._fork(follower)
        # Every sampler has just got its slot (admission, a fork, a recompute after preemption):
        # its processors' rows are written now, from exact host state, and stay on the device.
        slot_state = self.runner.slot_sampling
        slot_state.admit(samplers)
        st = sampling_to_device(build_sampling_tensors(samplers, self.spec.vocab_size, slot_state),
                                self.device)
        out = self.runner.sample(hidden[rows], st)
        self._append(samplers, out, on_finish)

    def _fork(self, seq: Sequence) -> None:
        """A group member takes its leader's prompt KV: shared pages plus a copied last page."""
        leader = seq.share_with
        copy = self.pages.fork(leader.slot, seq.slot, leader.num_computed)
        if copy is not None:
            src, dst = (torch.tensor([p], device=self.device) for p in copy)
            self.cache.copy_pages(src, dst)
        self.cache.copy_states(leader.slot, seq.slot)      # linear-attention layers' states
        seq.num_computed = seq.num_cached = leader.num_computed
        seq.prompt_logprobs = leader.prompt_logprobs
        seq.share_with = None

    def _decode(self, seqs: list[Sequence], on_finish) -> None:
        st = build_sampling_tensors(seqs, self.spec.vocab_size, self.runner.slot_sampling)
        out = self.runner.decode(seqs, st)
        self.stats.decode_steps += 1
        for seq in seqs:
            seq.num_computed = seq.num_tokens_with_pending
        if not self.config.async_decode:
            self._append(seqs, out, on_finish)      # synchronous (nothing is pending here)
            return
        launched = PendingDecode(seqs, *self.runner.read_back(out))
        for seq in seqs:
            seq.num_pending += 1
        previous, self._pending = self._pending, launched
        if previous is not None:
            self.stats.overlapped_decode_steps += 1
            self._process(previous, on_finish)     # while the GPU runs `launched`

    # -- after sampling ----------------------------------------------------------------------
    def _append(self, seqs: list[Sequence], out: SamplerOutput, on_finish) -> None:
        token_ids = out.token_ids.tolist()          # the one device -> host transfer per step
        rows = host_rows(out)
        for row, (seq, token) in enumerate(zip(seqs, token_ids)):
            if seq.status is Status.FINISHED:
                self.stats.discarded_tokens += 1    # it stopped one step earlier
                continue
            seq.token_ids.append(token)
            self.stats.generated_tokens += 1
            if seq.params.logprobs is not None:
                record_sampled(seq, token, rows, row, self.spec.vocab_size, self._token_text)
            if self._check_stop(seq, token):
                self.scheduler.finish(seq)
                if on_finish is not None:
                    on_finish(seq)

    def _token_text(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    # Prompt positions whose full-vocabulary logits are materialised at once (bounds memory:
    # a whole 8k-token chunk of 152k-vocab fp32 logits would be 5 GB).
    _PROMPT_LOGPROB_ROWS = 512

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Raw log-softmax (no temperature or penalties) of each prompt token given its prefix."""
        start = seq.num_computed
        targets = seq.token_ids[start + 1:min(start + hidden.shape[0] + 1, seq.num_prompt_tokens)]
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        for first in range(0, len(targets), self._PROMPT_LOGPROB_ROWS):
            block = targets[first:first + self._PROMPT_LOGPROB_ROWS]
            rows = hidden[first:first + len(block)]
            seq.prompt_logprobs += prompt_entries(
                self.runner.logits(rows).log_softmax(dim=-1), block, seq.params,
                self.spec.vocab_size, self._token_text)

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        stopped_by_token = token in seq.stop_ids
        if stopped_by_token:
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in (params.stop_token_ids or ()) else None
        elif params.stop and params.detokenize:
            new_text = append_text(self.tokenizer, seq)
            hit = find_stop_string(seq, len(new_text)) if new_text else None
            if hit is not None and seq.num_generated >= params.min_tokens:
                stop, index = hit
                seq.text = seq.text[:index + (len(stop) if params.include_stop_str_in_output else 0)]
                seq.finish_reason, seq.stop_reason = "stop", stop
        if seq.finish_reason is None and (seq.num_generated >= seq.max_tokens
                                          or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is None:
            return False
        if params.detokenize and self.tokenizer is not None:
            seq.text = final_text(self.tokenizer, seq, stopped_by_token)
        return True

