"""Live LoRA on the GEMV path: the shrink kernel (s * A x over the adapter's own fp32 A) and the
GEMV with B (s A x) folded into its sums, against float64 torch (W x + s B (A x), PEFT's math),
run by Triton's interpreter on CPU; and the layer functions that route live adapters there,
against the same reference, row masks (LoRARequest rows) included."""
from __future__ import annotations

import functools
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import run_fresh_python

from flexrollout.kernels import lora as lk
from flexrollout.kernels import small_linear as sl
from flexrollout.layers.linear import Kernels, Linear, gated_act, linear, project_group

# Runs in a fresh interpreter: TRITON_INTERPRET must be set before the kernels are built.
# Each case: (rows, K, output widths, adapter ranks (0: none on that matrix), silu_mul, split).
_CHECK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from flexrollout.kernels import small_linear as sl, lora as lk
    dtype = getattr(torch, "{dtype}")
    for case_index, (m, k, widths, ranks, silu, split) in enumerate({cases}):
        torch.manual_seed(case_index)
        ws = [torch.randn(n, k).to(dtype) for n in widths]
        # PEFT's adapters: fp32 whatever the model dtype.
        a_s = [torch.randn(r, k) / k ** 0.5 if r else None for r in ranks]
        b_s = [torch.randn(n, r) if r else None for n, r in zip(widths, ranks)]
        scales = [0.5, 2.0, 1.25][:len(widths)]
        pad = [None] * (3 - len(widths))
        x = torch.randn(m, k).to(dtype)
        low_rank = lk.launch(x, *(a_s + pad), scales + [1.0] * len(pad))
        assert low_rank.shape[:2] == (lk.split_of(k, m), m), low_rank.shape
        tile = sl.tiling(m, sum(widths), k, silu, dtype) if split == "auto" else sl.Tiling(split=split)
        out = sl.launch(x, *(ws + pad), silu, tile, lora=(low_rank, *(b_s + pad)))
        # float64 reference: W x + s B (A x) per matrix.
        x64 = x.double()
        full = [x64 @ w.double().T + (0 if a is None else s * (x64 @ a.double().T) @ b.double().T)
                for w, a, b, s in zip(ws, a_s, b_s, scales)]
        ref = F.silu(full[0]) * full[1] if silu else torch.cat(full, dim=1)
        got = out.double().sum(0)
        assert got.shape == ref.shape, (got.shape, ref.shape)
        err = ((got - ref).norm() / ref.norm()).item()
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert err < tol, (case_index, err)
        # The op's torch path (what runs off CUDA) has the same contract.
        cpu = sl._reference(x, *(ws + pad), silu, tile, (low_rank, *(b_s + pad)))
        err = ((cpu.double().sum(0) - ref).norm() / ref.norm()).item()
        assert err < tol, ("reference", case_index, err)
        # The fused shrink: the launch's first programs compute s A x (16 or 3 K slices), its
        # GEMV programs wait for them (in the first K slice, or the last); both counters are
        # back at zero after the launch.
        for parts, prefetch, last in ((sl.SHRINK_SPLIT, True, False), (3, False, False),
                                      (sl.SHRINK_SPLIT, True, True)):
            fused = sl.launch(x, *(ws + pad), silu, tile, lora=(None, *(b_s + pad)),
                              lora_a=(*(a_s + pad), scales + [0.0] * len(pad)),
                              shrink_split=parts, prefetch_b=prefetch, expand_last=last)
            err = ((fused.double().sum(0) - ref).norm() / ref.norm()).item()
            assert err < tol, ("fused", parts, case_index, err)
            assert sl.sync_counters(x.device).tolist() == [0, 0]
""")

CASES = {
    # fp32: ranks 8 / 16 / 64, 1..32 rows, q/k/v with one matrix unadapted, split partials.
    "float32-qkv": [(1, 256, [96, 32, 32], [8, 0, 8], False, 1),
                    (5, 384, [64, 48, 40], [16, 16, 16], False, 3),
                    (17, 256, [130], [64], False, 2),
                    (32, 256, [64, 64], [0, 64], False, 1)],
    "float32-silu": [(3, 256, [72, 72], [8, 16], True, 1),
                     (32, 256, [64, 64], [64, 64], True, 1)],
    # Input widths off the 128-wide K step (gpt-oss's 2,880, 26B-A4B's 2,112): masked K tails
    # in the GEMV and in both shrinks, unsplit, split in two, gated.
    "float32-ragged": [(3, 320, [64, 40, 40], [8, 8, 0], False, "auto"),
                       (2, 704, [96], [16], False, 2),
                       (3, 320, [72, 72], [8, 16], True, 1)],
    # 16-bit (fp16: Triton 3.6's interpreter mis-reads bf16; bf16 runs in the GPU tests),
    # up to the 64 rows 16-bit live-LoRA batches take; the engine's own tilings (down's long-K
    # one: 256-wide K steps, split 2).
    "float16": [(1, 512, [136], [16], False, "auto"),
                (1, 2048, [128], [32], False, "auto"),
                (8, 1024, [136], [64], False, "auto"),
                (24, 256, [80, 48, 48], [16, 16, 0], False, 2),
                (64, 256, [96, 32, 32], [8, 8, 8], False, "auto"),
                (16, 256, [64, 64], [16, 16], True, "auto"),
                (64, 256, [72, 72], [64, 64], True, "auto"),
                (8, 704, [136], [16], False, "auto")],
}


@pytest.mark.parametrize("name", list(CASES))
def test_shrink_and_folded_gemv_match_float64_in_triton_interpreter(name):
    pytest.importorskip("triton")
    dtype = name.split("-")[0]
    run_fresh_python(_CHECK.format(dtype=dtype, cases=CASES[name]), triton_interpret=True)


_EXPAND_CHECK = textwrap.dedent("""
    import torch
    from flexrollout.kernels import lora as lk
    dtype = getattr(torch, "{dtype}")
    for case_index, (m, k, n, rank, slot) in enumerate({cases}):
        torch.manual_seed(case_index)
        x = torch.randn(m, k).to(dtype)
        a = torch.randn(rank, k) / k ** 0.5             # PEFT's fp32 adapter
        b = torch.randn(n, rank)
        adapters = [None, None, None]
        adapters[slot] = a
        low_rank = lk.launch(x, *adapters, (1.5, 1.5, 1.5))
        base = (x.double() @ torch.randn(n, k).double().T).to(dtype)     # a cuBLAS output
        r_block = lk.rank_block([rank])
        out = lk.launch_expand(base, low_rank, b, slot, r_block)
        # PEFT's order: the base output plus the fp32 delta, rounded once.
        ref = base.double() + 1.5 * (x.double() @ a.double().T) @ b.double().T
        err = ((out.double() - ref).norm() / ref.norm()).item()
        tol = 1e-6 if dtype == torch.float32 else 1e-3
        assert out.dtype == dtype and err < tol, (case_index, err)
        cpu = lk.lora_expand(base, low_rank, b, slot, r_block)
        assert ((cpu.double() - ref).norm() / ref.norm()).item() < tol
""")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_expand_past_the_gemv_matches_float64_in_triton_interpreter(dtype):
    """Batches past the GEMV (prefill, large decode batches): cuBLAS output + B (s A x)."""
    pytest.importorskip("triton")
    cases = [(1, 256, 200, 8, 0), (70, 256, 130, 64, 1), (130, 384, 64, 16, 2)]
    run_fresh_python(_EXPAND_CHECK.format(dtype=dtype, cases=cases), triton_interpret=True)


# Compiles (no GPU needed: Triton's own ptxas) the heaviest LoRA variants for Hopper (sm_90),
# with the tilings the engine picks, and checks codegen and shared memory (an H100 / H200 block
# has 227 KiB): what the interpreter cannot see. Arguments are specialised as a real launch's
# are (pointers and sizes divisible by 16: Triton then pipelines with async copies, which is
# what fills shared memory; without it this check read 104 KiB where an H100 asked 232).
# Variants past 227 KiB launch shallower (`small_linear.launch_fitting`): each must still fit
# with at least two stages (a pipeline).
_HOPPER_CHECK = textwrap.dedent("""
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from flexrollout.kernels import small_linear as sl, lora as lk

    TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}

    LIMIT = 227 * 1024

    def compiled_shared(fn, types, consts, warps, stages):
        # (depth, shared memory) of the deepest pipeline (<= stages) that fits, or of one stage
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n].startswith("*") or sig[n] == "i32"}
        src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs)
        for depth in range(stages, 0, -1):
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": warps, "num_stages": depth})
            if kernel.metadata.shared <= LIMIT or depth == 1:
                return depth, kernel.metadata.shared

    def gemv(m, n, k, silu, dtype, r_block=64, fused=False, lora=True):
        tile, t = sl.tiling(m, n, k, silu, dtype), TYPES[dtype]
        types = {p: "*" + t for p in ("x_ptr", "w0_ptr", "w1_ptr", "w2_ptr")}
        types.update(out_ptr="*" + (t if silu else "fp32"), la_ptr="*fp32", b0_ptr="*fp32",
                     b1_ptr="*fp32", b2_ptr="*fp32", a0_ptr="*fp32", a1_ptr="*fp32",
                     a2_ptr="*fp32", s0="fp32", s1="fp32", s2="fp32", sync_ptr="*i32")
        # The fused shrink: 3 slots x its K slices ahead of the GEMV's programs, B prefetched.
        slots = 2 if silu else 3
        parts = sl.shrink_parts(k, sl.SHRINK_SPLIT)[1]
        consts = dict(BLOCK_M=sl.row_block(m), BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                      SILU_MUL=silu, IEEE=dtype == torch.float32, PDL=True, LORA=lora,
                      R=r_block, LA_SPLIT=parts if fused else lk.split_of(k, m), GELU=silu,
                      SHRINK_PROGRAMS=slots * parts if fused else 0, SLOTS=slots,
                      PREFETCH_B=fused, EXPAND_LAST=False, EVEN_K=k % sl.BLOCK_K == 0)
        return compiled_shared(sl._kernel(), types, consts, tile.warps, tile.stages)

    def shrink(m, dtype, r_block=64):
        types = dict(x_ptr="*" + TYPES[dtype], a0_ptr="*fp32", a1_ptr="*fp32", a2_ptr="*fp32",
                     out_ptr="*fp32", s0="fp32", s1="fp32", s2="fp32")
        consts = dict(BLOCK_M=sl.row_block(m), BLOCK_K=lk.BLOCK_K, R=r_block,
                      IEEE=dtype == torch.float32, PDL=True)
        return compiled_shared(lk._kernel(), types, consts, 4, 2)

    def expand(m, dtype, r_block=64):
        t = "*" + TYPES[dtype]
        types = dict(base_ptr=t, la_ptr="*fp32", b_ptr="*fp32", out_ptr=t)
        consts = dict(BLOCK_M=sl.row_block(m), BLOCK_N=128, R=r_block, LA_SPLIT=lk.split_of(9728, m),
                      IEEE=dtype == torch.float32, PDL=True)
        return compiled_shared(lk._expand_kernel(), types, consts, 4, 1)

    bf16, fp32 = torch.bfloat16, torch.float32
    shared = {
        "gate/up bf16 32 rows": gemv(32, 9728, 2560, True, bf16),
        "gate/up bf16 32 rows r16": gemv(32, 9728, 2560, True, bf16, 16),
        "down bf16 32 rows": gemv(32, 2560, 9728, False, bf16),
        "down bf16 64 rows": gemv(64, 2560, 9728, False, bf16),
        "qkv bf16 64 rows": gemv(64, 6144, 2560, False, bf16),
        "gate/up fp32 32 rows": gemv(32, 3072, 1024, True, fp32),
        "qkv fp32 1 row": gemv(1, 6144, 2560, False, fp32),
        "gate/up bf16 32 rows fused": gemv(32, 9728, 2560, True, bf16, fused=True),
        "qkv bf16 32 rows fused": gemv(32, 6144, 2560, False, bf16, fused=True),
        "down bf16 1 row fused": gemv(1, 2560, 9728, False, bf16, fused=True),
        "gate/up fp32 32 rows fused": gemv(32, 3072, 1024, True, fp32, fused=True),
        # lora_gemv_max_rows up to 64: one 64-row tile.
        "gate/up bf16 64 rows fused": gemv(64, 9728, 2560, True, bf16, fused=True),
        "qkv bf16 64 rows fused": gemv(64, 6144, 2560, False, bf16, fused=True),
        "down bf16 64 rows fused": gemv(64, 2560, 9728, False, bf16, fused=True),
        "gate/up fp32 64 rows fused": gemv(64, 3072, 1024, True, fp32, fused=True),
        # Widths off the K step (masked K tails): 26B-A4B's dense down, gpt-oss-sized gate/up.
        "down bf16 8 rows K 2112": gemv(8, 2816, 2112, False, bf16, lora=False),
        "down bf16 8 rows K 2112 fused": gemv(8, 2816, 2112, False, bf16, fused=True),
        "qkv bf16 32 rows K 2880 fused": gemv(32, 5120, 2880, False, bf16, fused=True),
        "gate/up bf16 32 rows K 2880": gemv(32, 2880, 2880, True, bf16, lora=False),
        "shrink bf16 64 rows": shrink(64, bf16),
        "shrink fp32 32 rows": shrink(32, fp32),
        "expand bf16 64 rows": expand(64, bf16),
        "expand fp32 64 rows": expand(64, fp32),
        # The adapter table's stacked term (`Kernels.lora_rows`): up to MAX_MASKED_RANK wide.
        "gate/up bf16 32 rows R": gemv(32, 9728, 2560, True, bf16, lk.MAX_MASKED_RANK),
        "qkv bf16 32 rows R": gemv(32, 6144, 2560, False, bf16, lk.MAX_MASKED_RANK),
        "shrink bf16 64 rows R": shrink(64, bf16, lk.MAX_MASKED_RANK),
        "expand bf16 64 rows R": expand(64, bf16, lk.MAX_MASKED_RANK),
    }
    print(shared)
    over = {name: fit for name, fit in shared.items() if fit[1] > LIMIT}
    assert not over, over
    # The shrink and expand run 2 and 1 stages; the GEMV's variants keep a pipeline.
    shallow = {name: fit for name, fit in shared.items() if fit[0] < 2 and not name.startswith(("shrink", "expand"))}
    assert not shallow, shallow
""")


def test_lora_kernels_compile_for_hopper_within_shared_memory():
    triton = pytest.importorskip("triton")
    if not hasattr(triton, "compile"):
        pytest.skip("this Triton cannot compile ahead of time")
    run_fresh_python(_HOPPER_CHECK, triton_interpret=False)


# -- the layer functions: live adapters routed to the GEMV, LoRARequest rows kept off it -------

def _projection(n: int, k: int, rank: int, scale: float, dtype=torch.float32) -> Linear:
    lora = () if rank == 0 else ((torch.randn(rank, k) / k ** 0.5, torch.randn(n, rank), scale),)
    return Linear(torch.randn(n, k).to(dtype), None, lora)


def _reference(x: torch.Tensor, p: Linear, rows: torch.Tensor | None = None) -> torch.Tensor:
    """PEFT's math in float64: W x + s B (A x) (on `rows` only, when given)."""
    x64 = x.double()
    out = x64 @ p.weight.double().T
    for a, b, s in p.lora:
        delta = s * (x64 @ a.double().T) @ b.double().T
        out = out + (delta if rows is None else delta * rows.double())
    return out


GEMV = [Kernels(small=True), Kernels(lora_small=True), Kernels(lora_small=True, fused_shrink=False)]


@pytest.mark.parametrize("kernels", GEMV, ids=["small", "lora_small", "separate_shrink"])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_qkv_group_with_live_adapters_runs_as_one_gemv(kernels, rows, monkeypatch):
    torch.manual_seed(rows)
    q, k, v = _projection(96, 256, 16, 2.0), _projection(32, 256, 0, 1.0), _projection(32, 256, 64, 0.5)
    x = torch.randn(rows, 256)
    calls = []
    shrink = lk.lora_shrink
    monkeypatch.setattr(lk, "lora_shrink", lambda *a, **kw: calls.append(1) or shrink(*a, **kw))
    outputs = project_group(x, [q, k, v], kernels)
    assert all(o.dim() == 3 for o in outputs), "expected the GEMV's partials (one launch)"
    # The GEMV computes s A x itself (fused shrink), or one shrink launch serves the group.
    assert len(calls) == (0 if kernels.fused_shrink else 1)
    for out, p in zip(outputs, (q, k, v)):
        torch.testing.assert_close(out.sum(0).double(), _reference(x, p), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernels", GEMV, ids=["small", "lora_small", "separate_shrink"])
def test_gated_act_and_linear_with_live_adapters(kernels):
    torch.manual_seed(0)
    gate, up, down = _projection(64, 128, 8, 2.0), _projection(64, 128, 8, 2.0), _projection(128, 64 * 2, 16, 0.5)
    x = torch.randn(5, 128)
    act = gated_act(x, gate, up, F.silu, kernels)
    want = F.silu(_reference(x, gate)) * _reference(x, up)
    torch.testing.assert_close(act.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, down, kernels).double(), _reference(x, down), rtol=1e-5, atol=1e-4)
    # Gemma's tanh-GELU: one GEMV for gate and up too, the activation after it.
    gelu = functools.partial(F.gelu, approximate="tanh")
    act = gated_act(x, gate, up, gelu, kernels)
    torch.testing.assert_close(act.double(), gelu(_reference(x, gate)) * _reference(x, up), rtol=1e-5, atol=1e-4)


def test_lora_small_needs_an_adapter_and_the_row_limit():
    """Plain projections keep the cuBLAS path outside `small`; live-LoRA batches run the GEMV
    up to its one row tile (64 rows, `lora_gemv_max_rows`' ceiling) and cuBLAS + shrink +
    expand past it (full outputs, not partials)."""
    torch.manual_seed(1)
    plain, adapted = _projection(64, 128, 0, 1.0), _projection(64, 128, 8, 1.0)
    x = torch.randn(4, 128)
    assert project_group(x, [plain], Kernels(lora_small=True))[0].dim() == 2
    assert project_group(x, [adapted], Kernels(lora_small=True))[0].dim() == 3
    for rows, partials in ((sl.LAUNCH_MAX_ROWS, True), (sl.LAUNCH_MAX_ROWS + 1, False)):
        big = torch.randn(rows, 128)
        out = project_group(big, [adapted], Kernels(lora_small=True))[0]
        assert (out.dim() == 3) == partials
        got = out.sum(0) if partials else out
        torch.testing.assert_close(got.double(), _reference(big, adapted), rtol=1e-5, atol=1e-4)


def test_batches_past_the_gemv_run_one_shrink_per_group_and_expand_per_adapter(monkeypatch):
    """Past the GEMV's rows (`lora_expand`): W x from cuBLAS, one shrink launch per group, one
    expand launch per adapted projection, nothing for an unadapted one (off CUDA the ops' torch
    paths, the kernels' contract)."""
    torch.manual_seed(5)
    calls = {"shrink": 0, "expand": 0}
    for name in calls:
        op = getattr(lk, f"lora_{name}")
        monkeypatch.setattr(lk, f"lora_{name}",
                            lambda *a, _op=op, _name=name, **kw: calls.__setitem__(_name, calls[_name] + 1) or _op(*a, **kw))
    kernels = Kernels(lora_expand=True)
    x = torch.randn(lk.MAX_ROWS + 9, 256)
    q, k, v = _projection(96, 256, 16, 2.0), _projection(32, 256, 0, 1.0), _projection(32, 256, 64, 0.5)
    outputs = project_group(x, [q, k, v], kernels)
    assert calls == {"shrink": 1, "expand": 2}
    for out, p in zip(outputs, (q, k, v)):
        assert out.shape == (x.shape[0], p.weight.shape[0])
        torch.testing.assert_close(out.double(), _reference(x, p), rtol=1e-5, atol=1e-4)
    gate, up, down = _projection(64, 256, 8, 2.0), _projection(64, 256, 8, 2.0), _projection(256, 64, 16, 0.5)
    for act in (F.silu, functools.partial(F.gelu, approximate="tanh")):
        got = gated_act(x, gate, up, act, kernels)
        # A product of two fp32 projections (~16 each here): fp32 rounding reaches ~3e-4 in it; a
        # lost or doubled adapter term would be off by O(1).
        torch.testing.assert_close(got.double(), act(_reference(x, gate)) * _reference(x, up), rtol=1e-4, atol=1e-3)
    hidden = torch.randn(x.shape[0], 64)
    torch.testing.assert_close(linear(hidden, down, kernels).double(), _reference(hidden, down), rtol=1e-5, atol=1e-4)
    assert calls == {"shrink": 4, "expand": 7}
    # Not this path: plain groups, two live adapters, ranks past the kernels' limit.
    two = Linear(torch.randn(64, 256), None, gate.lora + up.lora)
    for group in ([_projection(64, 256, 0, 1.0)], [two], [_projection(64, 256, lk.MAX_RANK * 2, 0.25)]):
        out = project_group(x, group, kernels)[0]
        torch.testing.assert_close(out.double(), _reference(x, group[0]), rtol=1e-5, atol=1e-4)
    assert calls == {"shrink": 4, "expand": 7}


@pytest.mark.parametrize("kernels", [Kernels(), *GEMV, Kernels(lora_expand=True)],
                         ids=["cublas", "small", "lora_small", "separate_shrink", "lora_expand"])
def test_lora_request_rows_take_their_adapter_instead_of_the_live_one(kernels):
    """Rows with a LoRARequest use their adapter instead of the live one (vLLM's rule), whatever
    path the step's size picks: such projections leave the GEMV for the masked path."""
    torch.manual_seed(2)
    live = _projection(64, 128, 8, 2.0)
    request = (torch.randn(4, 128) / 128 ** 0.5, torch.randn(64, 4), 1.5)
    live_mask = torch.tensor([[True], [False], [True], [False], [True]])
    p = live.with_rows(((*request, ~live_mask),), live_mask)
    x = torch.randn(5, 128)
    got = project_group(x, [p, p], kernels)
    want = _reference(x, live, live_mask) + _reference(x, Linear(torch.zeros(64, 128), None, (request,)), ~live_mask)
    for out in got:
        assert out.dim() == 2
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)


def test_in_lora_request_steps_projections_no_adapter_touches_stay_on_the_gemv():
    """A step with LoRARequest rows marks every projection with the rows' live mask; those that
    neither a live nor a requested adapter adapts still run the GEMV (3-D partials for the q/k/v
    epilogue), while a merged projection leaves it (its request rows read the unmerged weight)."""
    torch.manual_seed(6)
    x = torch.randn(5, 128)
    live_mask = torch.tensor([[True], [False], [True], [False], [True]])
    untouched = _projection(64, 128, 0, 1.0).with_rows((), live_mask)
    (out,) = project_group(x, [untouched], Kernels(small=True))
    assert out.dim() == 3
    torch.testing.assert_close(out.sum(0).double(), _reference(x, untouched), rtol=1e-5, atol=1e-4)
    unmerged = torch.randn(64, 128)
    merged = Linear(unmerged + 0.1, None, unmerged=unmerged).with_rows((), live_mask)
    (out,) = project_group(x, [merged], Kernels(small=True))
    assert out.dim() == 2
    want = torch.where(live_mask, x.double() @ (unmerged + 0.1).double().T, x.double() @ unmerged.double().T)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)


def _table_step(rows: int, fan_in: int = 128):
    """An adapter table holding two LoRARequest adapters (ranks 8 and 16, on q and v only) and
    one step's rows cycling over live (0), adapter 1, adapter 2 and the base model."""
    from flexrollout.lora.adapters import BASE_MODEL, Adapter
    from flexrollout.lora.table import AdapterTable, TableBatch

    adapters = []
    for lora_id, rank in ((1, 8), (2, 16)):
        weights = {(0, name): (torch.randn(rank, fan_in) / fan_in ** 0.5, torch.randn(width, rank), 0.5 * lora_id)
                   for name, width in (("q_proj", 96), ("v_proj", 32))}
        adapters.append(Adapter(lora_id, f"a{lora_id}", weights))
    table = AdapterTable(4, torch.device("cpu"), torch.float32)
    mix = [None, *adapters, BASE_MODEL]
    row_adapters = [mix[i % len(mix)] for i in range(rows)]
    return TableBatch(table, torch.tensor(table.row_slots(row_adapters))), row_adapters


@pytest.mark.parametrize("rows, kernels", [
    (6, Kernels(small=True, lora_small=True, lora_rows=True)),
    (lk.MAX_ROWS + 9, Kernels(lora_expand=True, lora_rows=True))], ids=["gemv", "expand"])
def test_lora_request_rows_fold_into_the_lora_kernels(monkeypatch, rows, kernels):
    """`lora_rows`: the adapter table's stacked term (q, v) and a live adapter off the request
    rows (k, which no request adapts) fold into one shrink per group and the GEMV / expand
    kernels, the rows' masks on the shrink's partials; each row gets exactly its own adapter
    (PEFT's math per row), the same as the unfused path gives with the flag off."""
    from flexrollout.lora.adapters import BASE_MODEL

    torch.manual_seed(7)
    calls = {"shrink": 0}
    op = lk.lora_shrink
    monkeypatch.setattr(lk, "lora_shrink", lambda *a, **kw: calls.__setitem__("shrink", calls["shrink"] + 1) or op(*a, **kw))
    batch, row_adapters = _table_step(rows)
    live = _projection(32, 128, 8, 2.0)
    q, k, v = (Linear(torch.randn(width, 128)).with_rows(batch.terms(0, name), batch.live_mask)
               for name, width in (("q_proj", 96), ("k_proj", 32), ("v_proj", 32)))
    k = live.with_rows(batch.terms(0, "k_proj"), batch.live_mask)
    x = torch.randn(rows, 128)

    def want(p, name):
        out = x.double() @ p.weight.double().T
        for i, adapter in enumerate(row_adapters):
            if adapter is None and p.lora:
                a, b, scaling = p.lora[0]
                out[i] += scaling * (b.double() @ (a.double() @ x[i].double()))
            elif adapter is not None and adapter is not BASE_MODEL and (0, name) in adapter.weights:
                a, b, scaling = adapter.weights[(0, name)]
                out[i] += scaling * (b.double() @ (a.double() @ x[i].double()))
        return out

    for flag in (True, False):
        got = project_group(x, [q, k, v], Kernels(**{**kernels.__dict__, "lora_rows": flag}))
        assert calls["shrink"] == 1                         # one launch with the flag, none without
        for out, p, name in zip(got, (q, k, v), ("q_proj", "k_proj", "v_proj")):
            if flag and kernels.small:
                assert out.dim() == 3                       # GEMV partials
                out = out.sum(0)
            torch.testing.assert_close(out.double(), want(p, name), rtol=1e-5, atol=1e-4)


def test_two_live_adapters_and_large_ranks_run_the_unfused_path():
    torch.manual_seed(3)
    x = torch.randn(3, 128)
    two = Linear(torch.randn(64, 128), None, _projection(64, 128, 8, 1.0).lora + _projection(64, 128, 4, 0.5).lora)
    wide = _projection(64, 128, lk.MAX_RANK * 2, 0.25)
    for p in (two, wide):
        out = project_group(x, [p], Kernels(small=True))[0]
        assert out.dim() == 2
        torch.testing.assert_close(out.double(), _reference(x, p), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 32, 64, 65, 1024, 8192])
def test_shrink_slices_shrink_as_row_blocks_grow(rows):
    """Decode batches split K up to MAX_SPLIT ways; prefill's row blocks already give the
    programs, so its partials (which every expand program re-reads) stay about one x in fp32."""
    k = 9728
    split = lk.split_of(k, rows)
    row_blocks = -(-rows // lk.row_block(rows))
    assert 1 <= split <= max(1, lk.MAX_SPLIT // row_blocks)
    assert split * lk.k_slice(k, rows) >= k > (split - 1) * lk.k_slice(k, rows)
    if rows >= lk.MAX_SPLIT * 64:
        assert split == 1


def test_shrink_partials_off_cuda_match_a_plain_matmul():
    torch.manual_seed(4)
    x, a0, a2 = torch.randn(6, 640), torch.randn(8, 640), torch.randn(16, 640)
    parts = lk.lora_shrink(x, a0, None, a2, 2.0, 0.0, 0.5)
    r_block = lk.rank_block([8, 0, 16])
    assert parts.shape == (lk.split_of(640, 6), 6, 3 * r_block)
    torch.testing.assert_close(lk.low_rank_sum(parts, 0, 8, r_block), 2.0 * x @ a0.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lk.low_rank_sum(parts, 2, 16, r_block), 0.5 * x @ a2.T, rtol=1e-5, atol=1e-4)
    assert parts.sum(0)[:, r_block:2 * r_block].abs().max() == 0


class _ShallowOnly:
    """A stand-in Triton kernel that refuses pipelines deeper than `fits` stages, as Triton
    refuses a variant past the GPU's shared memory, and records the depths it was asked for."""

    def __init__(self, fits: int):
        self.fits, self.asked = fits, []

    def __getitem__(self, grid):
        def run(*args, num_stages, **kwargs):
            from triton.runtime.errors import OutOfResources

            self.asked.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(1000 * num_stages, 1000 * self.fits, "shared memory")
        return run


def test_launches_past_shared_memory_retry_shallower_and_remember():
    pytest.importorskip("triton")
    kernel = _ShallowOnly(fits=2)
    consts = {"BLOCK_M": 16, "SILU_MUL": True}
    for _ in range(2):
        sl.launch_fitting(kernel, (4, 1), (), consts, 8, 3, torch.device("cpu"))
    assert kernel.asked == [3, 2, 2]            # the depth that fit is kept for the variant
    sl.launch_fitting(kernel, (4, 1), (), consts, 8, 1, torch.device("cpu"))
    assert kernel.asked[-1] == 1                # never deeper than a launch asks
    with pytest.raises(Exception, match="shared memory"):
        sl.launch_fitting(_ShallowOnly(fits=0), (4, 1), (), {"BLOCK_M": 32}, 8, 3, torch.device("cpu"))
