"""One prefill step and one decode step: host lists in, sampled tokens out.

The runner owns the KV cache and builds the attention metadata from the page table. It knows
nothing about any architecture beyond the `ModelSpec` the forward gives it: one prefill mask per
sliding window, one decode mask per (window, GQA group) that some layer uses.

Async decode: a step may be launched before the previous step's tokens reach the host. Every
decode step leaves its sampled ids in `slot_tokens` (indexed by batch slot), and a row whose
`from_device` flag is set reads its input id from there instead of the host list.
"""
from __future__ import annotations

import torch

from ..attention.flex import AttentionMetadata
from ..attention.kv_cache import KVCache
from ..attention.masks import decode_block_mask, prefill_block_mask, prefill_page_lists
from ..lora.batch import LoraBatch
from ..lora.table import AdapterTable, TableBatch
from .page_table import PageTable
from .sampler import (
    SamplerOutput,
    SamplingTensors,
    SlotSampling,
    sample,
    sampling_to_device,
)
from .sequence import Sequence


class ModelRunner:
    def __init__(self, forward, cache: KVCache, pages: PageTable, device: torch.device,
                 backend: str, kernel_options: dict | None = None, max_loras: int = 1) -> None:
        self.backend = backend
        self.kernel_options = dict(kernel_options or {})
        self.forward = forward
        self.cache = cache
        self.pages = pages
        self.device = device
        self.windows = forward.spec.windows
        self.mask_keys = forward.spec.mask_keys
        self.kv_len = pages.num_pages * pages.page_size
        self.graphs = None      # set by LLMEngine when CUDA graphs are enabled
        # The last id each slot sampled in decode (slot 0 absorbs padding rows). Fixed address:
        # captured graphs read and write it.
        self.slot_tokens = torch.zeros(pages.max_slots + 1, dtype=torch.long, device=device)
        # Logits processors' per-slot state (penalty counts, bias rows, ...), allocated on demand.
        self.slot_sampling = SlotSampling(pages.max_slots + 1, forward.spec.vocab_size, device)
        # LoRARequest adapters of decode steps, in slots the graphs read (empty until one is used).
        self.adapter_table = AdapterTable(max_loras, device, cache.dtype)

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _slots(self, seq: Sequence, start: int, count: int) -> list[int]:
        pages, size = self.pages.pages[seq.slot], self.pages.page_size
        return [pages[p // size] * size + p % size for p in range(start, start + count)]

    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Compute KV for each chunk; return final hidden rows of every token (T, H)."""
        ids, positions, slot_map, q_slot, layout, adapters = [], [], [], [], [], []
        for seq, count in chunks:
            adapters += [seq.lora] * count
            start = seq.num_computed
            ids += seq.token_ids[start:start + count]
            positions += range(start, start + count)
            slot_map += self._slots(seq, start, count)
            q_slot += [seq.slot] * count
            layout.append((self.pages.pages[seq.slot], start, count))
        self.pages.flush()
        q_slot_t, pos_t = self._tensor(q_slot), self._tensor(positions)
        masks = {}
        for window in self.windows:
            lists, width = prefill_page_lists(layout, len(ids), self.pages.page_size, window)
            kv_indices = torch.zeros(len(lists), max(width, 1), dtype=torch.int32)
            for row, pages in enumerate(lists):
                kv_indices[row, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            num_blocks = torch.tensor([len(x) for x in lists], dtype=torch.int32)
            masks[window] = prefill_block_mask(
                self.pages.table, q_slot_t, pos_t, self.pages.page_logical, self.pages.page_size,
                self.kv_len, kv_indices.to(self.device), num_blocks.to(self.device), window)
        counts = [count for _, count in chunks]
        cu_seqlens = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        meta = AttentionMetadata(pos_t, self._tensor(slot_map), decode=False, block_masks=masks,
                                 backend=self.backend, lora=LoraBatch.build(adapters, self.device),
                                 seq_slots=self._tensor([seq.slot for seq, _ in chunks]),
                                 cu_seqlens=cu_seqlens.to(self.device, non_blocking=True))
        return self.forward.forward(self._tensor(ids), meta, self.cache)

    def decode_inputs(self, seqs: list[Sequence]) -> dict[str, list[int]]:
        """Host lists for one decode step: the last token of each sequence, not yet cached.
        A pending last token is still on the device: its row says so and carries a 0."""
        positions = [seq.num_tokens_with_pending - 1 for seq in seqs]
        return {
            "input_ids": [0 if seq.num_pending else seq.token_ids[-1] for seq in seqs],
            "from_device": [int(seq.num_pending > 0) for seq in seqs],
            "positions": positions,
            "slot_mapping": [self._slots(seq, pos, 1)[0] for seq, pos in zip(seqs, positions)],
            "slots": [seq.slot for seq in seqs],
        }

    def decode_step(self, input_ids: torch.Tensor, from_device: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, slots: torch.Tensor, st: SamplingTensors,
                    lora=None) -> SamplerOutput:
        """Forward and sampler of one decode step on device tensors only (capturable)."""
        input_ids = torch.where(from_device != 0, self.slot_tokens[slots], input_ids)
        hidden = self.decode_forward(input_ids, positions, slot_mapping, slots, lora)
        out = sample(self.forward.logits(hidden), st)
        # Padding rows all write slot 0, which no row reads back.
        self.slot_tokens.index_copy_(0, slots, out.token_ids)
        return out

    def decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       slot_mapping: torch.Tensor, slots: torch.Tensor, lora=None) -> torch.Tensor:
        """The decode step on device tensors only (capturable): hidden states (B, H)."""
        size = self.pages.page_size
        rows = self.pages.table[slots]
        num_pages = (positions // size + 1).to(torch.int32)
        masks = {(window, group): decode_block_mask(rows, num_pages, positions, self.pages.page_logical,
                                                    size, group, self.kv_len, window)
                 for window, group in self.mask_keys}
        meta = AttentionMetadata(positions, slot_mapping, decode=True, block_masks=masks,
                                 backend=self.backend, lora=lora, kernel_options=self.kernel_options,
                                 seq_slots=slots)
        return self.forward.forward(input_ids, meta, self.cache)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], st: SamplingTensors) -> SamplerOutput:
        """One token for every sequence; replayed from a CUDA graph when one fits. LoRARequest
        rows read the adapter table (graphs too) unless the step does not fit in it."""
        self.pages.flush()
        inputs = self.decode_inputs(seqs)
        adapters = [seq.lora for seq in seqs]
        has_lora = any(a is not None for a in adapters)
        table_slots = self.adapter_table.row_slots(adapters) if has_lora else None
        per_adapter = has_lora and table_slots is None      # more adapters than slots: eager
        if table_slots is not None:
            inputs["lora_slots"] = table_slots
        table = None if table_slots is None else self.adapter_table
        if self.graphs is not None and not per_adapter and self.graphs.can_run(len(seqs)):
            return self.graphs.run(inputs, st, table)
        tensors = {name: self._tensor(values) for name, values in inputs.items()}
        lora = (LoraBatch(adapters, self.device) if per_adapter
                else None if table is None else TableBatch(table, tensors.pop("lora_slots")))
        return self.decode_step(**tensors, st=sampling_to_device(st, self.device), lora=lora)

    def read_back(self, out: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
        """Queue host copies of a step's outputs and an event that marks them complete.

        Call it right after the step, before anything else is launched: a graph's outputs are
        static and the next replay of its bucket overwrites them; stream order keeps the copy
        ahead of that. On CPU the outputs are already host tensors of their own step.
        """
        if self.device.type != "cuda":
            return out, None
        host = SamplerOutput(*(None if t is None else _to_pinned(t) for t in
                               (out.token_ids, out.logprobs, out.ranks, out.top_ids, out.top_logprobs)))
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    @torch.inference_mode()
    def sample(self, hidden: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
        return sample(self.forward.logits(hidden), st)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.forward.logits(hidden)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A non-blocking device-to-host copy into a pinned block of torch's caching host allocator.
    The host reads it after the step's event; a block dropped unread (a failed run) is not
    handed out again before the copy into it has run (the allocator records the copy)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
