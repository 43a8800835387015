"""Projections over the user's own parameters: the base weight, its bias, and LoRA terms.

A `Linear` names the tensors one projection reads, where the model keeps them: the base weight
(or, in merged LoRA mode, the merged copy), the bias, the live PEFT adapters (A, B, scaling) and,
for a step with `LoRARequest` rows, the adapters those rows asked for with their row masks
(`lora.batch`: a row's adapter replaces the live ones). Layer math takes `Linear`s
and calls `linear`, so one function serves the plain, the live-LoRA and the LoRARequest paths;
compiled regions take them as inputs too (dynamo reads their tensors without a recompile per
instance; only which fields are present specialises).

Live LoRA (one adapter per projection, no LoRARequest rows) runs at nearly the base model's
launch count: the adapters of projections that share an input (q/k/v, gate/up) get one shrink
launch (`kernels.lora`: s * A x over PEFT's fp32 A, in place, or the GEMV launch's own first
programs), and up to the live-LoRA row limit (`Kernels.lora_small`: 64 rows by default) the GEMV
adds B (s A x) to its fp32 sums, so q/k/v stay one launch feeding the q/k/v epilogue and
gate/up one launch with SiLU-mul. Larger CUDA batches (`Kernels.lora_expand`: prefill) run cuBLAS for W x, the same one
shrink per group, and one expand launch per projection that adds B (s A x) and rounds once, where
the unfused path casts PEFT's fp32 A and B every step and launches five kernels per projection.
4-bit bases with adapters (QLoRA) take the same shrink, then the expand around their 4-bit
projection at every batch size, or, with `Kernels.quant_small`, B (s A x) folded into our 4-bit
GEMV. Everything else (LoRARequest rows unless `Kernels.lora_rows`, several
adapter terms on one projection, ranks past `kernels.lora.MAX_RANK`, CPU) runs `_add_low_rank`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..kernels import gemv_4bit
from ..kernels import lora as lora_kernels
from ..kernels import small_linear as gemv
from ..lora.live import active_adapters
from .quant import packed_4bit, project_4bit


@dataclass(frozen=True)
class Kernels:
    """How this step's projections run: the small-batch GEMV kernel (`small`: the batch has at
    most its row limit; `pdl`: launched with programmatic dependent launch), and the q/k/v
    epilogue kernel after the projections in decode, and the grouped GEMV of small MoE steps.
    `lora_small`: projections with a live adapter run the GEMV with the adapter folded in (the
    engine sets it for steps of up to `EngineConfig.lora_gemv_max_rows` rows), or, where the
    GEMV cannot stream the weight, cuBLAS, the shrink and the expand kernel; `lora_expand`:
    past those rows every adapted projection runs the latter. `lora_rows`: in steps with
    LoRARequest rows, a projection whose one adapter term is masked by rows (the adapter
    table's stacked term, or a live adapter off the request rows) takes those kernels too, the
    mask applied to the shrink's partials. `quant_small`: 4-bit projections run the Triton 4-bit GEMV where it takes the
    batch (`kernels.gemv_4bit.takes`), else bitsandbytes' ops."""

    small: bool = False
    pdl: bool = True
    epilogue: bool = True
    expert_rows: int = 0      # MoE steps of at most this many (token, expert) rows: grouped GEMV
    lora_small: bool = False
    lora_expand: bool = False
    lora_rows: bool = False
    quant_small: bool = False
    # The GEMV's live-LoRA launches compute s A x themselves (their first programs) instead of
    # after a separate shrink launch; row-masked terms keep the shrink.
    fused_shrink: bool = True
    # Input widths off the GEMV's 128-wide K step stream through it too, with masked K tails
    # (`EngineConfig.ragged_gemv`); without it they run cuBLAS.
    ragged: bool = False


@dataclass(frozen=True)
class Linear:
    weight: torch.Tensor                    # (out, in)
    bias: torch.Tensor | None = None
    # Live adapters: (A (r, in), B (out, r), scaling) each, read in place from PEFT.
    lora: tuple = ()
    # LoRARequest adapters of some rows of this step: (A, B, scaling, row mask (T, 1)) each.
    # Those rows take their adapter instead of the live ones, which then apply where
    # `live_mask` (T, 1) is set.
    row_lora: tuple = ()
    live_mask: torch.Tensor | None = None
    # lora_mode="merged": the unmerged base weight, read by rows outside `live_mask` (a
    # LoRARequest row must not see the merged live adapters).
    unmerged: torch.Tensor | None = None
    # A bitsandbytes 4-bit weight's quant state, a `kernels.gemv_4bit.Packed4bit` (`weight` is
    # then its packed uint8 data).
    quant: object | None = None

    @property
    def plain(self) -> bool:
        """Only a 16/32-bit weight and bias: the fused kernels may read it. In a step with
        LoRARequest rows (`live_mask` set) a projection no adapter touches is still plain; a
        merged one is not (those rows read `unmerged`)."""
        return (len(self.lora) == 0 and len(self.row_lora) == 0  # (dynamo cannot `not` a tuple)
                and (self.live_mask is None or self.unmerged is None) and self.quant is None)

    def with_rows(self, row_lora: tuple, live_mask: torch.Tensor) -> Linear:
        return replace(self, row_lora=row_lora, live_mask=live_mask)


def read_linear(module: torch.nn.Module, merged=None) -> Linear:
    """What `module(x)` computes, as tensors: through a PEFT LoRA wrapper, its base layer plus
    its active adapters, or the merged weight when `merged` (a MergedLora) holds one."""
    base = getattr(module, "base_layer", module)
    if merged is not None and merged.has(module):
        return Linear(merged.weight(module), base.bias, unmerged=base.weight)
    return Linear(base.weight, base.bias, tuple(active_adapters(module)),
                  quant=packed_4bit(base.weight))


def linear(x: torch.Tensor, p: Linear, kernels: Kernels = Kernels()) -> torch.Tensor:
    """x @ W^T + b + sum(scaling * B (A x)) for (T, in) rows."""
    if _adapter_of(p) is not None and (_on_gemv(x, [p], kernels) or _on_gemv_4bit(x, [p], kernels)
                                       or _on_expand([p], kernels)):
        # The GEMV (16- or 4-bit) with the adapter folded in, or cuBLAS + expand: a group of one.
        return finish_group(project_group(x, [p], kernels), [p], x.dtype)[0]
    small_rows = gemv.MAX_ROWS if kernels.small and _k_step_fits(p.weight, kernels) else 0
    if p.quant is not None:
        out = project_4bit(x, p.weight, p.quant, p.bias, kernels.quant_small)
    else:
        out = gemv.project(x, p.weight, p.bias, small_rows, kernels.pdl)
    if p.unmerged is not None and p.live_mask is not None:
        # Rows with a LoRARequest multiply the base weight: exact, where subtracting the merged
        # delta would leave the merged copy's rounding behind.
        unmerged = gemv.project(x, p.unmerged, p.bias, small_rows, kernels.pdl)
        out = torch.where(p.live_mask, out, unmerged)
    for lora_a, lora_b, scaling in p.lora:
        out = _add_low_rank(out, x, lora_a, lora_b, scaling, p.live_mask)
    for lora_a, lora_b, scaling, mask in p.row_lora:
        out = _add_low_rank(out, x, lora_a, lora_b, scaling, mask)
    return out


def _add_low_rank(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """out + scaling * B (A x), on the rows `mask` (T, 1) selects when given: the path of
    LoRARequest rows, several live adapters, 4-bit weights and CPU. PEFT keeps adapters
    in fp32 over a bf16 base; casting the adapter (r x in, out x r) instead of the activations
    spares a prefill fp32 copies of (tokens, in) and (tokens, out). The GEMMs accumulate in fp32
    and round once, as PEFT does. The mask multiplies the (T, r) intermediate: zero rows of A x
    add exactly nothing, and the shapes do not depend on which rows are selected."""
    if lora_a.dtype != x.dtype:
        lora_a, lora_b = lora_a.to(x.dtype), lora_b.to(x.dtype)
    low_rank = F.linear(x, lora_a)
    if mask is not None:
        low_rank = low_rank * mask
    if out.dim() == 2 and out.dtype == x.dtype and not torch.compiler.is_compiling():
        # In place into `out` (ours, just computed): no (tokens, out) delta temporaries.
        return out.addmm_(low_rank, lora_b.T, alpha=scaling)
    return out + F.linear(low_rank, lora_b) * scaling


def _k_step_fits(weight: torch.Tensor, kernels: Kernels) -> bool:
    """The GEMV may stream this weight in this step: its input width is on the 128-wide K step,
    or off it with `kernels.ragged` (masked K tails)."""
    return kernels.ragged or weight.shape[-1] % gemv.BLOCK_K == 0


def gemv_ready(p: Linear) -> bool:
    """Small batches of this projection can run a GEMV kernel: the 16-bit one streams its weight,
    or it is a 4-bit weight, which `project_4bit` routes by itself (bitsandbytes' GEMV at one
    row), so it does not keep the model's 16-bit projections (the LM head) off the GEMV."""
    return p.quant is not None or gemv.weight_supported(p.weight)


def _adapter_of(p: Linear) -> tuple | None:
    """The one adapter term of p the LoRA kernels can fold in, as (A, B, scaling, mask): its live
    adapter (mask None, or the rows' `live_mask` in a step with LoRARequest rows that do not
    adapt p), or, without a live adapter, the step's one LoRARequest term (its row mask (T, 1),
    or the adapter table's column mask (T, slots * rank)). None: no term, or several."""
    if len(p.lora) == 1 and len(p.row_lora) == 0:
        return (*p.lora[0], p.live_mask)
    if len(p.lora) == 0 and len(p.row_lora) == 1 and p.unmerged is None:
        return p.row_lora[0]
    return None


def _fusable(p: Linear, kernels: Kernels) -> bool:
    """The GEMV kernel can compute this projection: plain, or 16-bit with one adapter term the
    LoRA kernels take. Several terms, 4-bit weights and larger ranks run `linear`."""
    return p.plain or (p.quant is None and _term_fits(p, kernels))


def _term_fits(p: Linear, kernels: Kernels) -> bool:
    """p has one adapter term of a rank the LoRA kernels take (row-masked terms when
    `kernels.lora_rows`), in tensors they read."""
    term = _adapter_of(p)
    if term is None:
        return False
    lora_a, lora_b, _, mask = term
    limit = lora_kernels.MAX_RANK if mask is None else lora_kernels.MAX_MASKED_RANK
    return ((mask is None or kernels.lora_rows) and lora_a.shape[0] <= limit
            and lora_a.is_contiguous() and lora_b.is_contiguous())


def _on_gemv(x: torch.Tensor, projections: list[Linear], kernels: Kernels) -> bool:
    """These projections of `x` run the GEMV kernel: a small batch of projections it can
    compute, or a live-LoRA batch within its LoRA row limit."""
    if not all(_fusable(p, kernels) for p in projections):
        return False
    adapted = any(_adapter_of(p) is not None for p in projections)
    rows_fit = kernels.small or (adapted and kernels.lora_small and x.shape[0] <= gemv.LAUNCH_MAX_ROWS)
    # Decided per projection: a weight the kernel cannot stream runs cuBLAS without keeping the
    # others off the GEMV. Widths off the 128-wide K step (gpt-oss's 2,880-wide inputs, 26B-A4B's
    # 2,112-wide dense down_proj) stream with masked K tails where `kernels.ragged` lets them,
    # adapters folded in as elsewhere. (CPU tensors take the op's reference implementation:
    # tests and kernel_count.py.)
    weights = [p.weight for p in projections]
    return (rows_fit and all(gemv.weight_fits(w) and _k_step_fits(w, kernels) for w in weights)
            and (not x.is_cuda or all(w.is_cuda for w in weights)))


def _on_gemv_4bit(x: torch.Tensor, projections: list[Linear], kernels: Kernels) -> bool:
    """These 4-bit projections of `x` run our 4-bit GEMV as one launch (`quant_small`): batch
    and weights the kernel takes, quantised alike, and adapter terms (QLoRA) only where the
    LoRA kernels run and take them, to be folded in."""
    if (not kernels.quant_small or any(p.quant is None for p in projections)
            or not _lora_kernels_take(projections, kernels)):
        return False
    states = [p.quant for p in projections]
    return all(gemv_4bit.takes(x, q) for q in states) and gemv_4bit.groupable(states)


def _on_expand(projections: list[Linear], kernels: Kernels) -> bool:
    """These projections run W x (cuBLAS, or the 4-bit projection) + the expand kernel: a batch
    past the GEMV (or weights it does not stream this step: widths off its K step without
    `kernels.ragged`, such as gpt-oss's 2,880-wide inputs) whose
    adapters the kernels take, or 4-bit bases with adapters (QLoRA) at any batch the LoRA
    kernels run, where the unfused path cast and applied each adapter alone."""
    if not any(_adapter_of(p) is not None for p in projections):
        return False
    if any(p.quant is not None for p in projections):
        return _lora_kernels_take(projections, kernels)
    return (kernels.lora_expand or kernels.lora_small) and all(_fusable(p, kernels) for p in projections)


def _lora_kernels_take(projections: list[Linear], kernels: Kernels) -> bool:
    """Every adapter term of these projections (none, or one each) goes to the LoRA kernels,
    which this step runs."""
    running = kernels.lora_small or kernels.lora_expand
    return all(len(p.lora) + len(p.row_lora) == 0 or (running and _term_fits(p, kernels))
               for p in projections)


def _expand_group(x: torch.Tensor, projections: list[Linear], kernels: Kernels) -> list[torch.Tensor]:
    """Each projection's W x + b from cuBLAS (or its 4-bit projection), then B (s A x) added by
    the expand kernel (rounded once, PEFT's order for 16-bit bases), the group's s A x from one
    shrink launch. Its K-slice partials are summed once, before the expands: each expand program
    would otherwise re-read all of them (64 rows, r=32 on an H100, benchmarks/lora_sweep.py:
    52 us added per Qwen3-4B layer against 71 us)."""
    low_rank, lora_b = _shrink(x, projections, kernels)
    if low_rank is not None:
        low_rank = low_rank.sum(0, keepdim=True)
    r_block = lora_kernels.rank_block([0 if b is None else b.shape[1] for b in lora_b])
    outs = []
    for slot, (p, b) in enumerate(zip(projections, lora_b)):
        if p.quant is not None:
            out = project_4bit(x, p.weight, p.quant, p.bias, kernels.quant_small)
        else:
            out = F.linear(x, p.weight, p.bias)
        outs.append(out if b is None else lora_kernels.lora_expand(out, low_rank, b, slot, r_block,
                                                                   kernels.pdl))
    return outs


def _shrink(x: torch.Tensor, projections: list[Linear], kernels: Kernels):
    """s * A x of the projections' adapter terms in one launch (fp32 partials, slot i for
    projection i, row masks applied), and each projection's B (None without a term); (None,
    Nones) when none has one."""
    terms = [_adapter_of(p) for p in projections]
    terms += [None] * (3 - len(terms))
    lora_b = [None if t is None else t[1] for t in terms]
    if all(t is None for t in terms):
        return None, lora_b
    lora_a = [None if t is None else t[0] for t in terms]
    scales = [0.0 if t is None else float(t[2]) for t in terms]
    low_rank = lora_kernels.lora_shrink(x, *lora_a, *scales, pdl=kernels.pdl)
    masks = [None if t is None else t[3] for t in terms]
    if any(m is not None for m in masks):
        low_rank = low_rank * _column_mask(masks, lora_a, x.shape[0], x.device)
    return low_rank, lora_b


def _gemv_lora(x: torch.Tensor, projections: list[Linear], kernels: Kernels) -> dict:
    """The GEMV's adapter arguments for these projections: their B, and their s A x from one
    shrink launch (`low_rank`), or, for live adapters without row masks under
    `kernels.fused_shrink`, their A and scalings, for the GEMV launch to compute s A x itself."""
    terms = [_adapter_of(p) for p in projections]
    if kernels.fused_shrink and any(terms) and all(t is None or t[3] is None for t in terms):
        terms += [None] * (3 - len(terms))
        args = {f"b{i}": None if t is None else t[1] for i, t in enumerate(terms)}
        args.update({f"a{i}": None if t is None else t[0] for i, t in enumerate(terms)})
        args.update({f"s{i}": 0.0 if t is None else float(t[2]) for i, t in enumerate(terms)})
        return args
    low_rank, lora_b = _shrink(x, projections, kernels)
    return {"low_rank": low_rank, "b0": lora_b[0], "b1": lora_b[1], "b2": lora_b[2]}


def _column_mask(masks: list, lora_a: list, rows: int, device: torch.device) -> torch.Tensor:
    """(rows, slots * R) 0/1 over the shrink's columns: each slot's row mask (T, 1) or column
    mask (T, width <= R), ones for an unmasked slot. Zeroed columns add exactly nothing."""
    r_block = lora_kernels.rank_block([0 if a is None else a.shape[0] for a in lora_a])
    columns = []
    for mask in masks[:lora_kernels.slot_count(*lora_a)]:
        if mask is None:
            columns.append(torch.ones(rows, r_block, device=device))
        elif mask.shape[1] == 1:
            columns.append(mask.to(torch.float32).expand(rows, r_block))
        else:
            columns.append(F.pad(mask.to(torch.float32), (0, r_block - mask.shape[1])))
    return torch.cat(columns, dim=1)


def project_group(x: torch.Tensor, projections: list[Linear], kernels: Kernels) -> list[torch.Tensor]:
    """Several projections of one input (q/k/v). Small batches run as one GEMV launch (live
    adapters folded in: one more launch computes their s * A x; 4-bit weights: our 4-bit GEMV
    with `quant_small`) and come back as fp32 partial sums (split, T, width) each, for a
    consumer that sums them (the q/k/v epilogue, or `finish_group`); otherwise each is a full
    (T, out) result with its bias (larger batches with live adapters: one shrink launch for
    the group, then cuBLAS + expand per projection)."""
    if len(projections) > 3:
        return [linear(x, p, kernels) for p in projections]
    if _on_gemv_4bit(x, projections, kernels):
        low_rank, lora_b = _shrink(x, projections, kernels)
        return gemv_4bit.project_partials(x, [(p.weight, p.quant) for p in projections], low_rank, lora_b)
    if _on_gemv(x, projections, kernels):
        widths = [p.weight.shape[0] for p in projections]
        weights = [p.weight for p in projections] + [None] * (3 - len(projections))
        partials = gemv.small_linear(x, *weights, pdl=kernels.pdl,
                                     **_gemv_lora(x, projections, kernels))
        return list(partials.split(widths, dim=-1))
    if _on_expand(projections, kernels):
        return _expand_group(x, projections, kernels)
    return [linear(x, p, kernels) for p in projections]


def finish_group(outputs: list[torch.Tensor], projections: list[Linear], dtype: torch.dtype):
    """`project_group`'s results as (T, out) tensors in `dtype`, biases added."""
    finished = []
    for out, p in zip(outputs, projections):
        if out.dim() == 3:              # GEMV partials: sum, round, then the bias (HF's order)
            out = gemv.sum_partials(out).to(dtype)
            out = out if p.bias is None else out + p.bias
        finished.append(out)
    return finished


def gated_act(x: torch.Tensor, gate: Linear, up: Linear, act, kernels: Kernels) -> torch.Tensor:
    """act(gate(x)) * up(x). Small batches of SiLU or GELU-tanh projections run as one GEMV
    launch whose epilogue applies act(gate) * up (live adapters folded in before it)."""
    epilogue = "silu" if act is F.silu else ("gelu_tanh" if act is gemv.GELU_TANH else None)
    if epilogue and gate.bias is None and up.bias is None and _on_gemv(x, [gate, up], kernels):
        return gemv.small_linear(x, gate.weight, up.weight, silu_mul=True, pdl=kernels.pdl,
                                 act=epilogue, **_gemv_lora(x, [gate, up], kernels))[0]
    if (_adapter_of(gate) is not None or _adapter_of(up) is not None
            or _on_gemv_4bit(x, [gate, up], kernels)):
        # Other activations (or biases) with adapters: still one shrink for both, and one
        # GEMV launch for both in small batches; 4-bit gate and up: one 4-bit GEMV launch.
        projections = [gate, up]
        gate_out, up_out = finish_group(project_group(x, projections, kernels), projections, x.dtype)
        return act(gate_out) * up_out
    return act(linear(x, gate, kernels)) * linear(x, up, kernels)
