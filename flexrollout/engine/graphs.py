"""CUDA-graph capture and replay of the whole decode step (forward and sampler).

One graph per (batch bucket, sampler mode), captured lazily the first time it is needed and
sharing one memory pool. Inputs live in `graph_vars`, static buffers sized for max_num_seqs;
a batch smaller than its bucket is padded with rows that point at the reserved slot 0 and
page 0, which absorb their writes and attend only to themselves.

The captured step is `ModelRunner.decode_step`: it also picks device-side input ids for rows
whose previous token is still pending and scatters its own ids into `runner.slot_tokens`.
The sampler mode names the logits-processor parts a step applies (`SamplingTensors.processors`,
read from `runner.slot_sampling` by slot); a batch without them keeps a mode with none, and
its graph does none of that work. Such a step also records its tokens in the slot state
(penalty counts, bad-word histories).
Steps with LoRARequest rows have graphs of their own: each row's adapter slot is an input like
its position, so any mix of adapters replays the same graph. Graphs are keyed on the versions
of the tensors they read that can be replaced (the adapter table's stacks, the bad-word state,
both replaced when they grow); graphs over replaced tensors are dropped.
"""
from __future__ import annotations

import logging
import time
import weakref

import torch

from ..lora.table import TableBatch
from .sampler import SamplerOutput, SamplingTensors, float_bits

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16 (padding stays below ~12%)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, max(max_num_seqs, 80) + 1, 16))
    sizes = [s for s in sizes if s < max_num_seqs]
    return sizes + [max_num_seqs]


class DecodeGraphs:
    # Every per-row input of the captured step, in the order of one packed int64 buffer
    # (float32 rows bit-cast, after the int64 rows), so a step needs a single host-to-device copy.
    _VARS = (("input_ids", torch.long), ("from_device", torch.long), ("positions", torch.long),
             ("slot_mapping", torch.long), ("slots", torch.long), ("seeds", torch.long),
             ("counters", torch.long), ("lora_slots", torch.long),
             ("top_k", torch.long), ("temperature", torch.float32), ("top_p", torch.float32),
             ("min_p", torch.float32))

    def __init__(self, runner, max_num_seqs: int) -> None:
        # The runner owns these graphs; a weak reference back keeps the pair out of a cycle, so
        # `del llm` frees the KV cache and graph pools at once instead of at the next gc pass.
        self.runner = weakref.proxy(runner)
        self.buckets = batch_buckets(max_num_seqs)
        self.vocab = runner.forward.spec.vocab_size
        self._num_int = sum(dtype == torch.long for _, dtype in self._VARS)
        names = [name for name, _ in self._VARS]
        self._top_k_row, self._top_p_row = names.index("top_k"), names.index("top_p")
        self._one_bits = int(float_bits(torch.ones(1))[0])
        self.packed = torch.zeros(len(self._VARS), max_num_seqs, dtype=torch.long, device=runner.device)
        # Two pinned staging buffers, used in turn: with async decode the host fills step t+1
        # while step t's copy out of the other one may still wait behind the GPU's queue.
        self.staging = [torch.zeros(len(self._VARS), max_num_seqs, dtype=torch.long).pin_memory()
                        for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]   # last copy out of each
        self._turn = 0
        self.graph_vars: dict[str, torch.Tensor] = {
            name: self.packed[i] if dtype == torch.long else self.packed[i].view(torch.float32)[::2]
            for i, (name, dtype) in enumerate(self._VARS)}
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, SamplerOutput]] = {}
        self.pool = None
        # One side stream for every warm-up and capture (torch.cuda.graph would otherwise take
        # its own): cuBLAS keeps a workspace per stream it has run on (see _capture).
        self.capture_stream = torch.cuda.Stream(device=runner.device)
        self.capture_seconds = 0.0

    def reset(self) -> None:
        """Forget every graph and its memory pool (the cache or the weights moved)."""
        self.graphs.clear()
        self.pool = None

    def _versions(self, st: SamplingTensors, table) -> tuple[int | None, int | None]:
        """Versions of the replaceable tensors a step reads (None: it reads none of them)."""
        return (None if table is None else table.generation,
                self.runner.slot_sampling.bad_words_version if "bad_words" in st.processors else None)

    def _drop_stale(self, versions: tuple) -> None:
        """Graphs captured over tensors since replaced read memory that is no longer theirs."""
        for key in [k for k in self.graphs
                    if any(None not in (old, new) and old != new for old, new in zip(k[2], versions))]:
            del self.graphs[key]

    def can_run(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

    def _bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _fill(self, inputs: dict[str, list[int]], st: SamplingTensors, batch: int, bucket: int) -> None:
        """Write this step's rows (and harmless padding rows) into the static inputs: two host
        tensors, one pinned staging buffer, one host-to-device copy."""
        staging = self._free_staging()
        rows = {"lora_slots": [0] * batch, **inputs}        # without LoRARequests: live rows
        int_rows = [rows[n] if n in rows else getattr(st, n) for n, d in self._VARS if d == torch.long]
        staging[:self._num_int, :batch] = torch.stack([torch.as_tensor(r, dtype=torch.long) for r in int_rows])
        floats = torch.stack([getattr(st, n) for n, d in self._VARS if d == torch.float32])
        # Bit patterns in the low half of each int64 cell (little-endian), read by graph_vars' views.
        staging[self._num_int:, :batch] = float_bits(floats)
        self._pad(staging, batch, bucket)
        self.packed[:, :bucket].copy_(staging[:, :bucket], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._copied[self._turn] = copied

    def _pad(self, rows: torch.Tensor, start: int, end: int) -> None:
        """Make columns start:end of a packed buffer padding rows: slot 0 / page 0 (which absorb
        their writes), greedy, untruncated."""
        rows[:, start:end].zero_()
        rows[self._top_k_row, start:end] = self.vocab
        rows[self._top_p_row, start:end] = self._one_bits

    def _free_staging(self) -> torch.Tensor:
        """The next staging buffer, once the copy that last read it has run."""
        self._turn ^= 1
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()
        return self.staging[self._turn]

    def _step(self, bucket: int, mode: tuple[bool, bool, int, tuple[str, ...]],
              table=None) -> SamplerOutput:
        all_greedy, need_truncation, max_logprobs, processors = mode
        gv = {name: t[:bucket] for name, t in self.graph_vars.items()}
        st = SamplingTensors(
            temperature=gv["temperature"], top_k=gv["top_k"], top_p=gv["top_p"], min_p=gv["min_p"],
            seeds=gv["seeds"], counters=gv["counters"],
            need_truncation=need_truncation, all_greedy=all_greedy, max_logprobs=max_logprobs,
            slots=gv["slots"], processors=processors, slot_state=self.runner.slot_sampling)
        lora = None if table is None else TableBatch(table, gv["lora_slots"])
        return self.runner.decode_step(gv["input_ids"], gv["from_device"], gv["positions"],
                                       gv["slot_mapping"], gv["slots"], st, lora)

    def _capture(self, bucket: int, mode: tuple, table=None) -> tuple[torch.cuda.CUDAGraph, SamplerOutput]:
        start = time.perf_counter()
        stream = self.capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        # Warm-up steps run for real: over this step's rows they would advance state the real
        # step (the first replay) must still read from where it was (the previous step's pending
        # ids, penalty counts, bad-word histories, a linear-attention layer's conv and recurrent
        # states). They run over padding rows instead, whose writes slot 0 and page 0 absorb.
        with torch.cuda.stream(stream):
            rows = self.packed[:, :bucket].clone()
            self._pad(self.packed, 0, bucket)
            for _ in range(2):                   # compile kernels and settle allocations first
                self._step(bucket, mode, table)
            self.packed[:, :bucket].copy_(rows)
        torch.cuda.current_stream().wait_stream(stream)
        # cuBLAS keeps one workspace per (handle, stream) until cleared. Cleared before, the
        # capture takes its own from the graph pool: reusing the warm-up's eager one would leave
        # a replay's GEMM scratch in memory that a later clear (inductor's CUDA graph trees
        # make one) hands to other tensors. Cleared after, that workspace goes back to the pool,
        # which lives as long as the graphs, instead of outliving the engine in cuBLAS's map.
        torch._C._cuda_clearCublasWorkspaces()
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = self._step(bucket, mode, table)
        torch._C._cuda_clearCublasWorkspaces()
        elapsed = time.perf_counter() - start
        self.capture_seconds += elapsed
        logger.info("captured decode graph for batch %d, mode %s in %.2f s", bucket, mode, elapsed)
        return graph, out

    def run(self, inputs: dict[str, list[int]], st: SamplingTensors, table=None) -> SamplerOutput:
        """Replay (capturing first if new) the graph of this step's bucket and mode; `table`:
        the adapter table when rows carry LoRARequests (`inputs["lora_slots"]`)."""
        batch = len(inputs["input_ids"])
        bucket = self._bucket(batch)
        mode = (st.all_greedy, st.need_truncation, st.max_logprobs, st.processors)
        self._fill(inputs, st, batch, bucket)
        versions = self._versions(st, table)
        self._drop_stale(versions)
        key = (bucket, mode, versions)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, mode, table)   # the step only reads graph_vars
        graph, out = self.graphs[key]
        graph.replay()
        return SamplerOutput(*(None if t is None else t[:batch] for t in
                               (out.token_ids, out.logprobs, out.ranks, out.top_ids, out.top_logprobs)))
