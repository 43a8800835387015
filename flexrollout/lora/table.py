"""LoRARequest adapters in device-resident slots, so decode steps with adapter rows replay from a
CUDA graph.

Slot s (1..capacity) holds one adapter. Every adapted (layer, target) has one stacked pair:
A (S*R, in) and B (out, S*R), slot s in columns (s-1)*R .. s*R, ranks below R zero-padded (zero
rows of A and columns of B add exactly nothing), B pre-multiplied by the adapter's scaling. A step
hands each row's slot to the device as a tensor (0: the model as held, live adapters on;
`BASE_ROW`: the base model); the row's one-hot over the S*R columns multiplies A x, so each row
gets its own adapter and nothing else, and the shapes depend only on the batch. Which row uses
which adapter is data, not graph structure: a captured step serves every mix.

Loading an adapter writes its slot in place (captured graphs read the stacks by address).
Growing the stacks (an adapter with a new target, a larger rank, more slots) replaces them and
bumps `generation`, which the decode graphs key on. Stacked expert adapters are not slotted:
steps with them take the per-adapter path (`lora.batch`), as do steps that mix more adapters than
`capacity` allows.

The slots copy the registry's adapters (a few MB per adapter at r = 16): the copies are what the
graphs read; the registry's tensors serve prefill and the steps that do not fit.
"""
from __future__ import annotations

import torch

from .adapters import BASE_MODEL, Adapter, Targets

BASE_ROW = -1       # a row's slot for `BaseModelRequest`: no adapter column, live adapters off


class AdapterTable:
    def __init__(self, max_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.max_slots, self.device, self.dtype = max_slots, device, dtype
        self.held: list[Adapter | None] = []            # the adapter in slot i + 1
        self.rank = 0
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.column_slots = torch.zeros(0, dtype=torch.long, device=device)   # (S*R,) slot per column
        self.generation = 0
        self._last_use: dict[int, int] = {}             # lora_int_id -> step counter
        self._clock = 0

    @staticmethod
    def max_bytes(targets: Targets, num_layers: int, slots: int, rank: int, dtype: torch.dtype) -> int:
        """A full table's size: every projection an adapter may adapt, in every layer (a bound:
        hybrid layers lack some), `slots` adapters of rank `rank`. Stacked experts are not slotted."""
        widths = sum(fan_out + fan_in for fan_out, fan_in in targets.linear.values())
        return num_layers * widths * slots * rank * torch.finfo(dtype).bits // 8

    def row_slots(self, adapters: list[Adapter | None]) -> list[int] | None:
        """Each row's slot (placing missing adapters, evicting the least recently used ones this
        step does not need), or None when the step does not fit: more distinct adapters than
        `max_slots`, or an adapter of stacked experts."""
        needed = {a.lora_int_id: a for a in adapters if a is not None and a is not BASE_MODEL}
        if len(needed) > self.max_slots or any(_adapts_experts(a) for a in needed.values()):
            return None
        self._clock += 1
        for adapter in needed.values():
            self._place(adapter, needed)
            self._last_use[adapter.lora_int_id] = self._clock
        slot_of = {a.lora_int_id: i + 1 for i, a in enumerate(self.held) if a is not None}
        return [0 if a is None else BASE_ROW if a is BASE_MODEL else slot_of[a.lora_int_id]
                for a in adapters]

    def remove(self, lora_int_id: int) -> None:
        """Free the slot of a removed adapter (its columns stay until the slot is reused; no row
        points at them)."""
        self.held = [None if a is not None and a.lora_int_id == lora_int_id else a for a in self.held]
        self._last_use.pop(lora_int_id, None)

    def _place(self, adapter: Adapter, needed: dict[int, Adapter]) -> None:
        if any(a is not None and a.lora_int_id == adapter.lora_int_id for a in self.held):
            return
        if None in self.held:
            slot = self.held.index(None)
        elif len(self.held) < self.max_slots:
            slot = len(self.held)
            self.held.append(None)
        else:                               # evict the least recently used one this step can spare
            spare = [i for i, a in enumerate(self.held) if a.lora_int_id not in needed]
            slot = min(spare, key=lambda i: self._last_use[self.held[i].lora_int_id])
            del self._last_use[self.held[slot].lora_int_id]
        self.held[slot] = adapter
        if not self._fits(adapter) or slot >= self.capacity:
            self._rebuild()
        else:
            self._write(slot)

    @property
    def capacity(self) -> int:
        return self.column_slots.numel() // self.rank if self.rank else 0

    def _fits(self, adapter: Adapter) -> bool:
        return all(key in self.stacks and a.shape[0] <= self.rank for key, (a, _, _) in adapter.weights.items())

    def _rebuild(self) -> None:
        """New stacks sized for the held adapters (slots rounded up to a power of two, so a run
        that adds adapters one by one rebuilds a few times, not once per adapter)."""
        held = [a for a in self.held if a is not None]
        self.rank = max(max(a.shape[0] for a, _, _ in adapter.weights.values()) for adapter in held)
        slots = min(self.max_slots, 1 << (len(self.held) - 1).bit_length())
        shapes: dict[tuple[int, str], tuple[int, int]] = {}
        for adapter in held:
            for key, (a, b, _) in adapter.weights.items():
                shapes[key] = (a.shape[1], b.shape[0])
        width = slots * self.rank
        self.stacks = {key: (torch.zeros(width, fan_in, device=self.device, dtype=self.dtype),
                             torch.zeros(fan_out, width, device=self.device, dtype=self.dtype))
                       for key, (fan_in, fan_out) in shapes.items()}
        self.column_slots = torch.arange(width, device=self.device) // self.rank + 1
        self.generation += 1
        for slot in range(len(self.held)):
            self._write(slot)

    def _write(self, slot: int) -> None:
        """Slot `slot`'s columns of every stack: the held adapter's A and scaled B, zeros where it
        has no such target (a previous adapter's columns must not leak into it)."""
        adapter = self.held[slot]
        columns = slice(slot * self.rank, (slot + 1) * self.rank)
        for key, (stack_a, stack_b) in self.stacks.items():
            stack_a[columns].zero_()
            stack_b[:, columns].zero_()
            weights = None if adapter is None else adapter.weights.get(key)
            if weights is not None:
                a, b, scaling = weights
                rank = a.shape[0]
                stack_a[columns][:rank].copy_(a)
                stack_b[:, columns][:, :rank].copy_(b.float() * scaling)


def _adapts_experts(adapter: Adapter) -> bool:
    return any(name.startswith("experts.") for _, name in adapter.weights)


class TableBatch:
    """One step's LoRARequest rows read from the table: the same interface as `LoraBatch`
    (`terms`, `expert_terms`, `live_mask`), built from device tensors only (capturable). Its
    structure is fixed per table generation, so the compiled layer functions take it."""

    compiles = True

    def __init__(self, table: AdapterTable, row_slots: torch.Tensor) -> None:
        self.stacks = table.stacks
        self.live_mask = (row_slots == 0).unsqueeze(1)
        self.columns = (row_slots.unsqueeze(1) == table.column_slots).to(table.dtype)   # (T, S*R)

    def terms(self, layer: int, proj: str) -> tuple:
        stack = self.stacks.get((layer, proj))
        return () if stack is None else ((*stack, 1.0, self.columns),)

    def expert_terms(self, layer: int, name: str) -> tuple:
        return ()
