"""The small-batch projection kernel against float64 torch, run by Triton's interpreter on CPU
(and natively on CUDA when present)."""
from __future__ import annotations

import textwrap

import pytest
import torch

from conftest import run_fresh_python
from flexrollout.kernels import registered
from flexrollout.kernels import small_linear as sl

triton = pytest.importorskip("triton")

# Runs in a fresh interpreter: TRITON_INTERPRET must be set before the kernel is built.
_CHECK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from flexrollout.kernels import small_linear as sl
    torch.manual_seed({seed})
    dtype = getattr(torch, "{dtype}")
    K = {k}
    widths = {widths}
    ws = [torch.randn(n, K).to(dtype) for n in widths]
    x = torch.randn({m}, K).to(dtype)
    tile = {tile}
    out = sl.launch(x, *(ws + [None] * (3 - len(ws))), {silu}, tile, act="{act}")
    x64 = x.double()
    act = F.silu if "{act}" == "silu" else (lambda g: F.gelu(g, approximate="tanh"))
    if {silu}:
        ref = act(x64 @ ws[0].double().T) * (x64 @ ws[1].double().T)
    else:
        ref = torch.cat([x64 @ w.double().T for w in ws], dim=1)
    got = out.double().sum(0)
    assert out.shape == (tile.split, {m}, ref.shape[1]), out.shape
    assert torch.isfinite(got).all()
    err = ((got - ref).norm() / ref.norm()).item()
    print("relerr", err)
    assert err < {tol}, err
""")

CASES = [
    # (m, k, widths, silu_mul, split, dtype, tol)
    (1, 256, [96], False, 1, "float32", 1e-6),
    (5, 256, [64, 32, 40], False, 2, "float32", 1e-6),     # q/k/v-like, ragged last block
    # (bf16 is checked on CUDA only: Triton 3.6's interpreter mis-reads bf16 tensors, error ~1e10)
    (16, 384, [70, 16], False, 1, "float16", 1e-2),
    (3, 256, [72, 72], True, 1, "float32", 1e-6),         # gate/up with SiLU-mul epilogue
    (9, 512, [130], False, 4, "float16", 1e-2),
    (24, 256, [80, 48], False, 2, "float32", 1e-6),       # 17..32 rows: the 32-row tile
    (32, 256, [64, 64], True, 1, "float16", 1e-2),
    # The down projection's long-K tilings (block_k=256, split=2 at M = 1; block_n=128,
    # split=4 at M = 8), and the narrow-output one tiling() picks at these widths.
    (1, 1024, [64], False, {"block_k": 256, "split": 2}, "float16", 1e-2),
    (8, 1024, [136], False, {"block_n": 128, "split": 4}, "float16", 1e-2),
    (1, 1024, [64], False, "auto", "float16", 1e-2),
    # Input widths off the 128-wide K step (26B-A4B's 2,112, gpt-oss's 2,880): masked K tails,
    # unsplit, split in two, in three uneven slices, and under the gated epilogue.
    (3, 320, [64, 40], False, "auto", "float32", 1e-6),
    (2, 704, [96], False, "auto", "float16", 1e-2),
    (5, 704, [70, 16], False, {"split": 3}, "float32", 1e-6),
    (3, 320, [72, 72], True, "auto", "float32", 1e-6),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}-k{c[1]}-{len(c[2])}w-silu{c[3]}-s{str(c[4]).replace(' ', '').replace(':', '=')}-{c[5]}")
def test_kernel_matches_float64_in_triton_interpreter(case):
    m, k, widths, silu, tile, dtype, tol = case
    if tile == "auto":
        tile = f"sl.tiling({m}, {sum(widths)}, {k}, {silu}, dtype)"
    elif isinstance(tile, dict):
        tile = f"sl.Tiling(**{tile})"
    else:
        tile = f"sl.Tiling(split={tile})"
    code = _CHECK.format(seed=m, dtype=dtype, k=k, widths=widths, m=m, silu=silu, tile=tile, tol=tol, act="silu")
    run_fresh_python(code, triton_interpret=True)


@pytest.mark.parametrize("m, dtype, tol", [(1, "float32", 1e-6), (7, "float16", 1e-2), (32, "float16", 1e-2)])
def test_gelu_tanh_gated_epilogue_matches_float64_in_triton_interpreter(m, dtype, tol):
    """Gemma's gate/up launch: GELU-tanh(x gate^T) * (x up^T), rounded once."""
    tile = f"sl.tiling({m}, 72, 256, True, dtype)"
    code = _CHECK.format(seed=m, dtype=dtype, k=256, widths=[72, 72], m=m, silu=True, tile=tile, tol=tol,
                         act="gelu_tanh")
    run_fresh_python(code, triton_interpret=True)


def test_reference_partials_sum_to_linear():
    """The CPU path of the op (what torch.compile sees off CUDA) has the kernel's contract."""
    torch.manual_seed(0)
    x, w0, w1 = torch.randn(4, 256), torch.randn(48, 256), torch.randn(16, 256)
    parts = sl.small_linear(x, w0, w1)
    assert parts.shape == (sl.split_k(64, 256, False), 4, 64)
    torch.testing.assert_close(parts.sum(0), torch.cat([x @ w0.T, x @ w1.T], dim=1), rtol=1e-5, atol=1e-5)
    act = sl.small_linear(x, w0, w0 * 0.5, silu_mul=True)
    torch.testing.assert_close(act[0], torch.nn.functional.silu(x @ w0.T) * (x @ (0.5 * w0).T),
                               rtol=1e-5, atol=1e-5)
    act = sl.small_linear(x, w0, w0 * 0.5, silu_mul=True, act="gelu_tanh")
    torch.testing.assert_close(act[0], torch.nn.functional.gelu(x @ w0.T, approximate="tanh") * (x @ (0.5 * w0).T),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="act must be one of"):
        sl.small_linear(x, w0, w0, silu_mul=True, act="relu")


# Qwen3-4B's decode projections (N, K) and Qwen3's LM head, plus the tiny models' widths.
_SHAPES = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151936, 2560), (64, 1024),
           (96, 256), (4096, 4096), (1024, 384), (130, 512), (2560, 9600)]


@pytest.mark.parametrize("n, k", _SHAPES)
def test_split_rule(n, k):
    """The split's contract: every split gets whole 128-wide K steps (the kernel loops over
    K / split in BLOCK_K steps and `launch` refuses anything else), at most MAX_SPLIT partials, and
    K is split no further than needed: either 256 programs stream, or the next split would break
    the first two rules. SiLU-mul needs whole sums: never split."""
    split = sl.split_k(n, k, False)
    blocks = -(-n // 64)
    assert split >= 1 and split & (split - 1) == 0 and split <= 8
    assert k % (split * 128) == 0
    if split > 1:
        assert blocks * (split // 2) < 256           # the previous split had too few programs
    assert blocks * split >= 256 or split == 8 or k % (2 * split * 128) != 0
    assert sl.split_k(n, k, True) == 1


def test_long_k_tiling_rule():
    """Down projections of 16-bit weights take the tilings the H200 search found fastest for
    Qwen3-4B's down (2560 x 9728), BENCHMARKS.md "Decode kernels, fourth run": M = 1, 256-wide K
    steps and split 2 (3,509 GB/s); M = 8, 128-row blocks and split 4 (3,457 GB/s), 5 stages.
    fp32 (stages of that size overflow shared memory) and K < 3 N keep the split rule."""
    bf16 = torch.bfloat16
    assert sl.tiling(1, 2560, 9728, False, bf16) == sl.Tiling(block_k=256, split=2, stages=5)
    assert sl.tiling(8, 2560, 9728, False, bf16) == sl.Tiling(block_n=128, split=4, stages=5)
    assert sl.tiling(1, 2560, 9728, False, torch.float32).split == sl.split_k(2560, 9728, False)
    assert sl.tiling(1, 2560, 4096, False, bf16).block_k == 128                      # o_proj: K < 3 N


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n, k", [(1536, 6144), (1536, 12288), (256, 1536)])
def test_narrow_long_k_tiling_rule(m, n, k):
    """Gemma-4-E2B's down projections and per-layer-input gate: the long-K tiles would run 48 /
    24 programs or fewer; 64-row blocks and split 4 (96) measured fastest on an H100
    (gemv_sweep.py --shapes e2b: down 2,193 against 2,024 GB/s at M = 1, 2,230 against 2,021 at
    M = 8; the gate 325 against 228)."""
    assert sl.tiling(m, n, k, False, torch.bfloat16) == sl.Tiling(split=4, stages=5)


# Widths off the 128-wide K step: 26B-A4B's dense down_proj, gpt-oss's q/k/v, router, LM head.
_RAGGED_SHAPES = [(2816, 2112), (5120, 2880), (32, 2880), (201088, 2880), (104, 320), (96, 704)]


@pytest.mark.parametrize("n, k", _RAGGED_SHAPES)
def test_split_rule_off_the_k_step(n, k):
    """A width off the K step splits into slices of whole 128-wide steps that cover K, none
    empty (the kernel would store zeros for it), each of two steps or more when split, at most
    MAX_SPLIT, as many as the 256-program rule asks."""
    split = sl.split_k(n, k, False)
    k_per = sl.k_per_split(k, sl.Tiling(split=split))
    assert 1 <= split <= 8 and k_per % 128 == 0
    assert k_per * split >= k > k_per * (split - 1)
    assert split == 1 or k_per >= 256
    assert -(-n // 64) * split >= 256 or split > 4 or -(-k // 128) < 4 * split
    assert sl.split_k(n, k, True) == 1


@pytest.mark.parametrize("n, k", _SHAPES + _RAGGED_SHAPES)
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_tiling_is_launchable(n, k, m, silu, dtype):
    """Whatever tiling() picks, `launch` accepts: whole K steps per split, known block sizes, no
    split of SiLU-mul's whole sums. (The interpreter cases marked "auto" run such picks.)"""
    tile = sl.tiling(m, n, k, silu, dtype)
    k_per = sl.k_per_split(k, tile)
    assert k_per % tile.block_k == 0 and k_per * tile.split >= k > k_per * (tile.split - 1), tile
    assert k % (tile.split * tile.block_k) == 0 or k % 128 != 0, tile     # ragged only off the step
    assert tile.block_n in (64, 128) and tile.block_k in (128, 256)
    if silu:
        assert tile.split == 1
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8, 16, 24, 32])
def test_kernel_on_cuda(m):
    torch.manual_seed(m)
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        ws = [torch.randn(n, 2560, device="cuda", dtype=dtype) for n in (4096, 1024, 1024)]
        x = torch.randn(m, 2560, device="cuda", dtype=dtype)
        got = sl.small_linear(x, *ws).sum(0).double()
        ref = torch.cat([x.double() @ w.double().T for w in ws], dim=1)
        assert ((got - ref).norm() / ref.norm()).item() < tol
        gate, up = (torch.randn(9728, 2560, device="cuda", dtype=dtype) for _ in range(2))
        act = sl.small_linear(x, gate, up, silu_mul=True)[0].double()
        ref = torch.nn.functional.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
        assert ((act - ref).norm() / ref.norm()).item() < tol
        act = sl.small_linear(x, gate, up, silu_mul=True, act="gelu_tanh")[0].double()
        ref = torch.nn.functional.gelu(x.double() @ gate.double().T, approximate="tanh") * (x.double() @ up.double().T)
        assert ((act - ref).norm() / ref.norm()).item() < tol
        # Widths off the K step, masked K tails: 26B-A4B's down (2,112), gpt-oss's q/k/v (2,880).
        for widths, k in (((2816,), 2112), ((4096, 512, 512), 2880)):
            ws = [torch.randn(n, k, device="cuda", dtype=dtype) for n in widths]
            xk = torch.randn(m, k, device="cuda", dtype=dtype)
            got = sl.small_linear(xk, *ws).sum(0).double()
            ref = torch.cat([xk.double() @ w.double().T for w in ws], dim=1)
            assert ((got - ref).norm() / ref.norm()).item() < tol, (widths, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enabled", [True, False])
def test_small_batch_kernels_flag_reaches_every_projection(enabled):
    """With the flag off no projection (layers, LM head) launches the GEMV; with it on, every one
    of a decode step's 4 per-layer launches and the LM head's does (so the count can fail both ways)."""
    from flexrollout import LLM, SamplingParams
    from flexrollout.bench import random_model

    model = random_model("qwen3-0.6b", torch.bfloat16, "cuda", 1024)
    llm = LLM(model, max_model_len=512, max_num_seqs=4, num_kv_pages=32, enforce_eager=True,
              small_batch_kernels=enabled)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)             # compile first
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate([[8, 9, 10, 11]], params, use_tqdm=False)
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if "small_linear_kernel" in e.key)
    decode_steps, layers = 3, model.config.num_hidden_layers
    if enabled:
        assert launches >= decode_steps * (4 * layers + 1), launches
    else:
        assert launches == 0, launches


@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "silu"])
def test_gated_act_compiled_takes_the_one_gate_up_launch(name):
    """The same where the engine runs it, under torch.compile: one GEMV call for gate and up.
    Dynamo once compared a functools.partial argument as unequal to that very partial, so
    Gemma's compiled decode ran gate and up as two launches and a third for the product
    (H100 profile, 2026-12-07)."""
    from flexrollout.layers.linear import Kernels, Linear, gated_act
    from flexrollout.layers.mlp import activation

    calls = []

    def backend(gm, example_inputs):
        calls.extend(n for n in gm.graph.nodes if n.target is registered("small_linear").default)
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    x, gate, up = torch.randn(3, 256), Linear(torch.randn(64, 256)), Linear(torch.randn(64, 256))
    act = activation(name)
    fn = torch.compile(lambda x, gate, up, act: gated_act(x, gate, up, act, Kernels(small=True)),
                       backend=backend, fullgraph=True)
    got = fn(x, gate, up, act)
    torch.testing.assert_close(got, act(x @ gate.weight.T) * (x @ up.weight.T), rtol=1e-5, atol=1e-4)
    assert len(calls) == 1, calls


def test_gated_act_runs_gemmas_gelu_tanh_in_the_gate_up_launch(monkeypatch):
    """Gemma's MLP activation (the very GELU-tanh function `layers.mlp` maps
    `gelu_pytorch_tanh` to) takes the one gate/up launch, as SiLU does; exact GELU does not."""
    from flexrollout.layers.linear import Kernels, Linear, gated_act
    from flexrollout.layers.mlp import activation

    calls = []
    op = sl.small_linear
    monkeypatch.setattr(sl, "small_linear", lambda *a, **kw: calls.append(kw.get("act")) or op(*a, **kw))
    torch.manual_seed(0)
    x, gate, up = torch.randn(3, 256), Linear(torch.randn(64, 256)), Linear(torch.randn(64, 256))
    for name, fused in (("gelu_pytorch_tanh", "gelu_tanh"), ("silu", "silu"), ("gelu", None)):
        act = activation(name)
        got = gated_act(x, gate, up, act, Kernels(small=True))
        torch.testing.assert_close(got, act(x @ gate.weight.T) * (x @ up.weight.T), rtol=1e-5, atol=1e-4)
        assert calls == ([fused] if fused else []), (name, calls)      # one launch, or none (CPU)
        calls.clear()


def test_weights_off_the_k_step_run_cublas_without_keeping_the_group_off(monkeypatch):
    """Routing is per projection: a group whose input width the GEMV cannot stream (not a
    multiple of 64) runs F.linear, and one it can still comes back as the GEMV's partials; both
    compute the projection."""
    from flexrollout.layers.linear import Kernels, Linear, gated_act, linear, project_group

    monkeypatch.setattr(sl, "supported", sl.fits)       # `linear`'s path on CPU tensors too
    shapes = []
    op = sl.small_linear
    monkeypatch.setattr(sl, "small_linear", lambda x, *w, **kw: shapes.append(x.shape[1]) or op(x, *w, **kw))
    torch.manual_seed(0)
    for fan_in, on_gemv in ((200, False), (256, True)):
        x = torch.randn(3, fan_in)
        q, k = Linear(torch.randn(32, fan_in)), Linear(torch.randn(16, fan_in))
        outs = project_group(x, [q, k], Kernels(small=True))
        assert [o.dim() for o in outs] == [3 if on_gemv else 2] * 2
        for out, p in zip(outs, (q, k)):
            torch.testing.assert_close(out.sum(0) if on_gemv else out, x @ p.weight.T, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(linear(x, q, Kernels(small=True)), x @ q.weight.T, rtol=1e-5, atol=1e-4)
        got = gated_act(x, q, q, torch.nn.functional.silu, Kernels(small=True))
        torch.testing.assert_close(got, torch.nn.functional.silu(x @ q.weight.T) * (x @ q.weight.T),
                                   rtol=1e-5, atol=1e-4)
        assert shapes == [fan_in] * (3 if on_gemv else 0), (fan_in, shapes)
        shapes.clear()


def test_widths_off_the_k_step_take_the_gemv(monkeypatch):
    """A width that is a multiple of 64 but not of the 128-wide K step (26B-A4B's 2,112-wide
    down_proj, gpt-oss's 2,880-wide inputs; 320 here) streams through the GEMV with masked K
    tails where the step lets it (`Kernels.ragged`), with or without a live adapter folded in;
    without it, or at a width off 64 (200), it runs F.linear (+ expand). All compute PEFT's
    W x + s B A x."""
    from flexrollout.layers.linear import Kernels, Linear, linear

    monkeypatch.setattr(sl, "supported", sl.fits)       # `linear`'s path on CPU tensors too
    widths = []
    op = sl.small_linear
    monkeypatch.setattr(sl, "small_linear", lambda x, *w, **kw: widths.append(x.shape[1]) or op(x, *w, **kw))
    torch.manual_seed(0)
    ragged = Kernels(small=True, lora_small=True, ragged=True)
    cases = [(320, False, ragged, True), (320, True, ragged, True), (200, True, ragged, False),
             (320, False, Kernels(small=True, lora_small=True), False),
             (320, True, Kernels(small=True, lora_small=True), False)]
    for fan_in, adapted, kernels, on_gemv in cases:
        x, weight = torch.randn(3, fan_in), torch.randn(40, fan_in)
        lora_a, lora_b = torch.randn(4, fan_in), torch.randn(40, 4)
        p = Linear(weight, lora=((lora_a, lora_b, 0.5),) if adapted else ())
        want = x @ weight.T + (0.5 * (x @ lora_a.T) @ lora_b.T if adapted else 0)
        torch.testing.assert_close(linear(x, p, kernels), want, rtol=1e-5, atol=1e-4)
        assert widths == ([fan_in] if on_gemv else []), (fan_in, adapted, widths)
        widths.clear()
    assert sl.split_k(2816, 2112, False) == 6            # 26B-A4B's down: 6 slices of 3 K steps


@pytest.mark.parametrize("mlp_width, ragged_gemv", [(200, False), (200, True), (320, False), (320, True)])
def test_a_model_with_one_projection_off_the_k_step_decodes_the_rest_through_the_gemv(
        monkeypatch, mlp_width, ragged_gemv):
    """A Llama whose MLP width is off the 128-wide K step: small batches still take the GEMV for
    q/k/v, o and gate/up (its CPU reference, let in as CUDA would be), and greedy decode matches
    HF's. down_proj runs F.linear, except that a width that is a multiple of 64 (320) takes the
    GEMV with `EngineConfig.ragged_gemv` (masked K tails); 200 never does. Before, one such
    width turned the GEMV off model-wide."""
    from transformers import LlamaConfig

    from conftest import _from_config, _hf_greedy, make_tiny_tokenizer, small_kernels_on_cpu
    from flexrollout import LLM, SamplingParams

    seen = small_kernels_on_cpu(monkeypatch)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=mlp_width, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, eos_token_id=511,
                         bos_token_id=1, pad_token_id=0, max_position_embeddings=256)
    model, gen = _from_config(config, seed=3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
    prompts = [[5, 17, 300, 42, 9], [7, 8]]
    refs = [_hf_greedy(model, p, 6).tokens for p in prompts]
    llm = LLM(model, tokenizer=make_tiny_tokenizer(), max_model_len=128, max_num_seqs=2, num_kv_pages=16,
              ragged_gemv=ragged_gemv)
    assert llm.llm_engine.forward.options.small_rows > 0
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    widths = [w.shape[1] for w in seen["gemv"]]
    down_on_gemv = ragged_gemv and mlp_width % 64 == 0
    assert widths and set(widths) == ({128, mlp_width} if down_on_gemv else {128}), set(widths)
    assert widths.count(128) >= 5 * 3 * 2                   # q/k/v, o, gate/up in each layer's decode steps


def test_op_namespace_follows_the_op_sources(tmp_path):
    """The custom ops' namespace hashes the sources that define them (kernels/ and layers/), so
    a changed op is a new name, which Inductor's FX graph cache cannot confuse with the old one
    (its key holds the op's name, not its fake's shape rule); other files leave it alone."""
    import shutil
    from pathlib import Path

    import flexrollout
    from flexrollout.kernels import NAMESPACE, sources_hash

    package = Path(flexrollout.__file__).parent
    assert NAMESPACE == f"flexrollout_{sources_hash(package)}"
    assert registered("small_linear") is getattr(torch.ops, NAMESPACE).small_linear
    copy = tmp_path / "flexrollout"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert sources_hash(copy) == sources_hash(package)
    (copy / "cli.py").write_text("# not an op's source\n")
    assert sources_hash(copy) == sources_hash(package)
    kernel = copy / "kernels" / "gemv_4bit.py"
    kernel.write_text(kernel.read_text().replace("STEP_COLUMNS = 128", "STEP_COLUMNS = 256"))
    assert sources_hash(copy) != sources_hash(package)
