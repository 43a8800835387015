"""bitsandbytes 4-bit base weights (NF4 / FP4, with and without double quantisation), CPU.

The model's decoder projections are bitsandbytes `Linear4bit` layers quantised from a tiny random
llama. The reference dequantises the same packed weights to fp32 (`dequantized_reference`, a test
copy): HF generate on it for greedy tokens, its teacher-forced logits for logprobs. bitsandbytes'
own forward is held to the same reference, and the engine's error must be no larger. With its
AVX512-BF16 CPU kernel switched off, bitsandbytes' forward is the same dequantise-and-multiply:
PEFT's forward over it is then an exact QLoRA reference.
"""
from __future__ import annotations

import ast
import os
import textwrap

import pytest
import torch
from conftest import (
    make_tiny_model,
    make_tiny_moe,
    run_fresh_python,
    saved_adapter_models,
)

from flexrollout import LLM, SamplingParams
from flexrollout.bench import quantize_4bit
from flexrollout.models.base import text_model

bnb = pytest.importorskip("bitsandbytes")

PROMPTS = [[5, 17, 33, 2, 9, 100, 4], [300, 7, 8, 121], [41, 42, 43, 44, 45, 46, 47, 48, 49]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
FORMATS = [("nf4", True), ("nf4", False), ("fp4", False)]


def _children_of_type(model, kind):
    """(parent, name, child) for every child of type `kind` inside the decoder layers (a
    multimodal wrapper's are its language model's)."""
    return [(parent, name, child) for layer in text_model(model).layers for parent in layer.modules()
            for name, child in list(parent.named_children()) if type(child) is kind]


def _quantize_projections(model, quant_type: str, double_quant: bool):
    """Every nn.Linear inside the decoder layers (attention, MLP, linear attention, routers,
    per-layer-input gates) as a bitsandbytes Linear4bit: the bench's own QLoRA-like load."""
    model = quantize_4bit(model, quant_type, double_quant)
    assert _children_of_type(model, bnb.nn.Linear4bit)
    return model.eval()


def _model(quant_type="nf4", double_quant=True):
    model, tok = make_tiny_model("llama", seed=4)
    return _quantize_projections(model, quant_type, double_quant), tok


def with_lora(model):
    """`model` in PEFT LoRA (r=8) on all seven projections, B drawn so that the adapters matter."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets)).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return pm


def dequantized_reference(model):
    """A plain fp32 copy of `model` with each Linear4bit's weight dequantised (test-side only)."""
    import copy

    ref = copy.deepcopy(model)
    for parent, name, q in _children_of_type(ref, bnb.nn.Linear4bit):
        lin = torch.nn.Linear(q.in_features, q.out_features, bias=q.bias is not None)
        lin.weight.data = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).float()
        if q.bias is not None:
            lin.bias.data = q.bias.data.float()
        setattr(parent, name, lin)
    return ref.eval()


def _logprob_errors(logprobs_of, reference, prompts) -> float:
    """Largest |logprob - reference| over every prompt token after the first."""
    worst = 0.0
    for prompt in prompts:
        with torch.no_grad():
            ref = reference(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
        got = logprobs_of(prompt)
        worst = max(worst, max(abs(got[i - 1] - ref[i - 1, prompt[i]].item()) for i in range(1, len(prompt))))
    return worst


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _tiny(arch: str):
    """A tiny fp32 model of `arch` (the other test files' factories), not yet quantised."""
    if arch == "llama":
        return make_tiny_model("llama", seed=4)
    if arch in ("qwen3_moe", "gpt_oss"):
        return make_tiny_moe(arch)
    if arch.startswith("gemma4"):
        from test_gemma4 import make_tiny_gemma4
        return make_tiny_gemma4(arch.split("-")[1])
    from test_qwen35 import make_tiny_qwen35
    return make_tiny_qwen35(arch.split("-")[1])


ARCH_CASES = [("llama", *f) for f in FORMATS] + [
    (arch, "nf4", True) for arch in ("qwen3_moe", "gpt_oss", "gemma4-e2b", "gemma4-moe", "gemma4-wrapper", "qwen35-dense",
                                     "qwen35-moe")]


@pytest.mark.parametrize("arch, quant_type, double_quant", ARCH_CASES)
def test_4bit_greedy_and_logprobs_match_the_dequantized_reference(arch, quant_type, double_quant, hf_greedy):
    """Every nn.Linear of the decoder layers in 4-bit (Gemma-4's router and per-layer-input gates,
    Qwen3.5's GatedDeltaNet projections and shared-expert gate included; stacked experts stay
    16-bit, as bitsandbytes leaves them)."""
    model, tok = _tiny(arch)
    model = _quantize_projections(model, quant_type, double_quant)
    reference = dequantized_reference(model)
    packed = {n: p.data_ptr() for n, p in model.named_parameters() if p.dtype == torch.uint8}
    llm = LLM(model, tokenizer=tok, max_model_len=64, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(reference, p, 10).tokens for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def engine_logprobs(prompt):
        entries = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].prompt_logprobs
        return [entries[i][prompt[i]].logprob for i in range(1, len(prompt))]

    def bnb_logprobs(prompt):
        with torch.no_grad():
            lp = model(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
        return [lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]

    ours, theirs = _logprob_errors(engine_logprobs, reference, PROMPTS), _logprob_errors(bnb_logprobs, reference, PROMPTS)
    assert ours < 1e-4 and ours <= max(theirs, 1e-5), (ours, theirs)
    # the packed weights are where they were, and still packed: no dequantised copy replaced them
    assert packed and packed == {n: p.data_ptr() for n, p in model.named_parameters() if p.dtype == torch.uint8}


def test_qlora_live_adapter_matches_peft_and_follows_updates():
    from peft import LoraConfig, get_peft_model

    model, tok = _model()
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    llm = LLM(pm, tokenizer=tok, max_model_len=64, max_num_seqs=4)
    for _ in range(2):
        expected = [_hf_greedy(pm, p, 10) for p in PROMPTS]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        with torch.no_grad():                          # an optimizer step, in place
            for name, p in pm.named_parameters():
                if "lora_A" in name:
                    p.add_(torch.randn_like(p) * 0.5)
    with pm.disable_adapter():
        assert expected != [_hf_greedy(pm, p, 10) for p in PROMPTS], "the adapter should matter"


def test_sleep_and_wake_leave_a_trainers_4bit_weights_in_place(hf_greedy):
    """A trainer's 4-bit model (in memory, not the engine's): sleep frees the cache, the packed
    weights never move, and after wake the engine still gives the dequantised reference's tokens."""
    model, tok = _model()
    reference = dequantized_reference(model)
    packed = {n: (p.data_ptr(), p.device) for n, p in model.named_parameters() if p.dtype == torch.uint8}
    llm = LLM(model, tokenizer=tok, max_model_len=64, max_num_seqs=4, enable_sleep_mode=True)
    llm.sleep(1)
    assert not llm.llm_engine.kv_cache_awake
    assert packed == {n: (p.data_ptr(), p.device) for n, p in model.named_parameters() if p.dtype == torch.uint8}
    llm.wake_up()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(reference, p, 10).tokens for p in PROMPTS]


def test_lora_request_over_a_4bit_base_matches_peft(tmp_path):
    """A saved adapter by LoRARequest over a 4-bit base equals PEFT loading it onto the same
    bitsandbytes model; rows without the request run the 4-bit base alone."""
    from peft import LoraConfig, get_peft_model

    from flexrollout import LoRARequest

    trained, tok = _model()
    trained = get_peft_model(trained, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                 init_lora_weights=False))
    base, reference = saved_adapter_models(trained, lambda: _model()[0], tmp_path / "adapter")
    llm = LLM(base, tokenizer=tok, max_model_len=64, max_num_seqs=4)
    request = LoRARequest("saved", 1, str(tmp_path / "adapter"))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                        lora_request=[request, None, request])
    expected = [_hf_greedy(reference, PROMPTS[0], 10), _hf_greedy(base, PROMPTS[1], 10),
                _hf_greedy(reference, PROMPTS[2], 10)]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert expected[0] != _hf_greedy(base, PROMPTS[0], 10), "the adapter should matter"


def test_merged_lora_mode_refuses_a_4bit_base():
    from peft import LoraConfig, get_peft_model

    model, tok = _model()
    pm = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).eval()
    with pytest.raises(ValueError, match="lora_mode='live'"):
        LLM(pm, tokenizer=tok, max_model_len=64, lora_mode="merged")
    llm = LLM(pm, tokenizer=tok, max_model_len=64, max_num_seqs=2)      # live mode runs
    assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids



def test_vllm_quantization_bitsandbytes_argument():
    """TRL passes quantization='bitsandbytes' for a 4-bit model: accepted there, refused (naming
    it) over 16-bit weights, which flexrollout never quantises."""
    model, tok = _model()
    llm = LLM(model, tokenizer=tok, max_model_len=64, max_num_seqs=2, quantization="bitsandbytes")
    assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    plain, tok = make_tiny_model("llama", seed=4)
    with pytest.raises(ValueError, match="quantization='bitsandbytes'"):
        LLM(plain, tokenizer=tok, max_model_len=64, quantization="bitsandbytes")
    assert LLM(plain, tokenizer=tok, max_model_len=64, max_num_seqs=2).generate(
        [{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

# -- the small-batch 4-bit kernel (kernels/gemv_4bit.py) -------------------------------------
# Run by Triton's interpreter on CPU in a fresh process (TRITON_INTERPRET must be set before the
# kernel is built); on CUDA by the gpu-marked test below. Always against bitsandbytes' own
# dequantize_4bit.
_KERNEL_CHECK = textwrap.dedent("""
    import torch, bitsandbytes as bnb
    from flexrollout.kernels import gemv_4bit
    torch.manual_seed({seed})
    n, k, m = {n}, {k}, {m}
    x_dtype, w_dtype = torch.{x_dtype}, torch.{w_dtype}
    packed, state = bnb.functional.quantize_4bit(torch.randn(n, k).to(w_dtype), blocksize={blocksize},
                                                 quant_type="{quant_type}", compress_statistics={nested})
    assert state.nested == {nested} and state.dtype == w_dtype
    weight = bnb.functional.dequantize_4bit(packed, state).to(x_dtype)     # bitsandbytes' weight
    x = torch.randn(m, k).to(x_dtype)
    parts = gemv_4bit.launch(x, packed, state, split={split})
    got, ref = parts.double().sum(0), x.double() @ weight.double().T
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 1e-6, err                          # fp32 sums of exact products
    # One-hot rows pick weight columns: every dequantised value, bit for bit (tail included).
    cols = torch.linspace(0, k - 1, 16).long()
    picked = gemv_4bit.launch(torch.eye(k)[cols].to(x_dtype), packed, state).sum(0)
    torch.testing.assert_close(picked, weight.float().T[cols], rtol=0, atol=0)
    out = gemv_4bit.project(x, packed, state)
    assert out.dtype == x_dtype and out.shape == (m, n)
""")

KERNEL_CASES = [
    # (quant_type, nested, m, n, k, x dtype, weight (quant state) dtype, blocksize, split)
    ("nf4", True, 1, 96, 256, "bfloat16", "bfloat16", 64, "None"),
    ("nf4", False, 5, 70, 320, "float32", "float32", 64, 2),         # K not a multiple of the slice
    ("fp4", True, 7, 64, 576, "bfloat16", "bfloat16", 64, 2),        # 9 blocks a row
    ("fp4", False, 16, 130, 384, "float32", "bfloat16", 64, 3),      # bf16 weights, fp32 rows
    ("nf4", True, 3, 40, 512, "float16", "float16", 128, 4),
    ("nf4", False, 2, 33, 128, "float16", "bfloat16", 32, 1),        # two roundings, as bnb + .to()
    ("nf4", True, 20, 72, 256, "bfloat16", "bfloat16", 64, 2),       # a 32-row tile
    ("fp4", True, 64, 40, 192, "bfloat16", "bfloat16", 64, "None"),  # a full 64-row tile
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_4bit_kernel_matches_bitsandbytes_in_triton_interpreter(case):
    pytest.importorskip("triton")
    quant_type, nested, m, n, k, x_dtype, w_dtype, blocksize, split = case
    run_fresh_python(_KERNEL_CHECK.format(seed=m, quant_type=quant_type, nested=nested, m=m, n=n, k=k,
                                          x_dtype=x_dtype, w_dtype=w_dtype, blocksize=blocksize,
                                          split=split), triton_interpret=True)


# The CUDA path (dots in x's dtype, native rounding casts) is what the interpreter does not run:
# compiled here for Hopper (sm_90, Triton's own ptxas, no GPU) at Qwen3-4B's down shape.
_HOPPER_CHECK = textwrap.dedent("""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from flexrollout.kernels import gemv_4bit

    fn = gemv_4bit._kernel()
    for x_type, w_type, nested, blocksize, block_m in (("bf16", "bf16", True, 64, 16), ("fp16", "bf16", False, 128, 16),
                                                       ("fp32", "fp32", True, 64, 16), ("bf16", "bf16", True, 64, 64),
                                                       ("bf16", "bf16", True, 256, 64), ("fp32", "fp32", False, 256, 64),
                                                       ("fp32", "fp32", True, 128, 64), ("fp32", "fp32", True, 64, 64),
                                                       ("bf16", "bf16", False, 32, 64)):
        per_step = gemv_4bit.blocks_per_step(9728, blocksize)
        types = dict(x_ptr="*" + x_type, out_ptr="*fp32", la_ptr="*fp32", b_0="*fp32", b_1="*fp32",
                     b_2="*fp32")
        for i in range(3):                  # q / k / v's tensors
            types.update({f"packed_{i}": "*u8", f"absmax_{i}": "*u8" if nested else "*fp32",
                          f"code_{i}": "*fp32", f"absmax2_{i}": "*fp32", f"code2_{i}": "*fp32",
                          f"offset_{i}": "*fp32"})
        consts = dict(BLOCKSIZE=blocksize, BLOCKSIZE2=256, NESTED=nested,
                      W_DTYPE=tl.bfloat16 if w_type == "bf16" else tl.float32,
                      X_DTYPE={"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[x_type],
                      EMULATE=False, BLOCK_M=block_m, BLOCK_N=gemv_4bit.BLOCK_N,
                      LORA=block_m == 64, R=128, LA_SPLIT=4,     # QLoRA folded in at 64-row tiles
                      BLOCKS_PER_STEP=per_step)
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        # Specialised as a real launch is (pointers and sizes divisible by 16), without which
        # Triton does not pipeline with async copies and shared memory reads low.
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n].startswith("*") or sig[n] == "i32"}
        src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4,
                                         "num_stages": gemv_4bit.pipeline_stages(blocksize * per_step)})
        assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
        print(x_type, w_type, nested, blocksize, per_step, block_m, kernel.metadata.shared)
""")


def test_4bit_kernel_compiles_for_hopper():
    triton = pytest.importorskip("triton")
    if not hasattr(triton, "compile"):
        pytest.skip("this Triton cannot compile ahead of time")
    run_fresh_python(_HOPPER_CHECK, triton_interpret=False)


def test_4bit_kernel_takes_only_rows_of_whole_blocks(monkeypatch):
    """Blocks that straddle two rows (K not a multiple of the block size) and block sizes past
    the kernel's tile are left to bitsandbytes' ops: `supported` says no and `launch` refuses,
    naming the shapes."""
    from flexrollout.kernels import gemv_4bit

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for k, blocksize, ok in ((256, 64, True), (330, 64, False), (1024, 512, False)):
        packed, state = bnb.functional.quantize_4bit(torch.randn(8, k), blocksize=blocksize,
                                                     quant_type="nf4")
        x = torch.randn(2, k)
        assert gemv_4bit.supported(x, state) is ok
        if not ok:
            with pytest.raises(ValueError, match="whole blocks"):
                gemv_4bit.launch(x, packed, state)


# The engine's projections route to the kernel with `Kernels(quant_small=True)` (what
# `LLM(quant_kernels=True)` sets for CUDA batches of <= 64 rows) and leave larger batches to
# bitsandbytes' ops; run through `layers.linear.linear` as the models call it.
_ROUTE_CHECK = textwrap.dedent("""
    import torch, bitsandbytes as bnb
    from flexrollout.kernels import gemv_4bit
    from flexrollout.layers.linear import Kernels, Linear, linear

    launches = []
    launch = gemv_4bit._launch
    gemv_4bit._launch = lambda *args, **kw: launches.append(args[0].shape[0]) or launch(*args, **kw)
    torch.manual_seed(0)
    packed, state = bnb.functional.quantize_4bit(torch.randn(48, 192), quant_type="nf4",
                                                 compress_statistics=True)
    p = Linear(packed, torch.randn(48), quant=gemv_4bit.Packed4bit.of(state))
    weight = bnb.functional.dequantize_4bit(packed, state).double()
    for rows, routed in ((1, True), (20, True), (64, True), (65, False)):
        x = torch.randn(rows, 192)
        ref = x.double() @ weight.T + p.bias.double()
        for kernels, expect in ((Kernels(quant_small=True), routed), (Kernels(), False)):
            before = len(launches)
            got = linear(x, p, kernels)
            assert got.dtype == x.dtype and got.shape == (rows, 48)
            assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-6
            assert (len(launches) > before) == expect, (rows, kernels, launches)
    print(launches)
""")

# Projections of one input share a launch: q / k / v (ragged widths: 96, 40, 40 rows of 64-row
# blocks) as fp32 partials for the q/k/v epilogue or `finish_group`, gate / up for the gated
# activation; a group quantised differently (another block size) is refused by name, and its
# projections run one launch each.
_GROUP_CHECK = textwrap.dedent("""
    import functools
    import torch, torch.nn.functional as F, bitsandbytes as bnb
    from flexrollout.kernels import gemv_4bit
    from flexrollout.layers.linear import Kernels, Linear, finish_group, gated_act, project_group

    launches = []
    launch = gemv_4bit._launch
    gemv_4bit._launch = lambda *args, **kw: launches.append(len(args[1])) or launch(*args, **kw)
    torch.manual_seed(1)
    dtype = torch.{dtype}

    def projection(n, k, blocksize=64):
        packed, state = bnb.functional.quantize_4bit(torch.randn(n, k).to(dtype), blocksize=blocksize,
                                                     quant_type="nf4", compress_statistics=True)
        weight = bnb.functional.dequantize_4bit(packed, state).double()
        return Linear(packed, torch.randn(n).to(dtype) if n == 40 else None, quant=gemv_4bit.Packed4bit.of(state)), weight

    def close(got, ref):
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < {tol}, err

    kernels = Kernels(quant_small=True)
    x = torch.randn(5, 256).to(dtype)
    qkv = [projection(n, 256) for n in (96, 40, 40)]
    outputs = project_group(x, [p for p, _ in qkv], kernels)
    assert launches == [3] and all(o.dim() == 3 for o in outputs), launches
    for out, (p, weight) in zip(finish_group(outputs, [p for p, _ in qkv], dtype), qkv):
        close(out, x.double() @ weight.T + (0 if p.bias is None else p.bias.double()))
    (gate, gate_w), (up, up_w) = projection(72, 256), projection(72, 256)
    act = functools.partial(F.gelu, approximate="tanh")
    close(gated_act(x, gate, up, act, kernels), act(x.double() @ gate_w.T) * (x.double() @ up_w.T))
    assert launches == [3, 2], launches
    mixed = [qkv[0][0], projection(40, 256, blocksize=128)[0]]
    assert not gemv_4bit.groupable([p.quant for p in mixed])
    try:
        gemv_4bit.launch_group(x, [(p.weight, p.quant) for p in mixed])
        raise AssertionError("a mixed group should be refused")
    except ValueError as error:
        assert "quantised alike" in str(error)
    project_group(x, mixed, kernels)
    assert launches == [3, 2, 1, 1], launches
""")


def test_engine_projections_route_small_batches_to_the_4bit_kernel():
    pytest.importorskip("triton")
    assert run_fresh_python(_ROUTE_CHECK, triton_interpret=True).strip() == "[1, 20, 64]"


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("float16", 1e-2)])
def test_projections_of_one_input_share_a_4bit_launch(dtype, tol):
    pytest.importorskip("triton")
    run_fresh_python(_GROUP_CHECK.format(dtype=dtype, tol=tol), triton_interpret=True)


# A 4-bit model's steps compile their layers, through bitsandbytes' `gemm_4bit` op (it has a fake
# implementation) or, with quant_kernels, our kernel up to 64 rows: forced on CPU here, as on
# CUDA, through dynamo's eager backend (recording the traced ops) or Inductor, and Triton's
# interpreter.
_COMPILE_CHECK = textwrap.dedent("""
    import sys
    from dataclasses import replace
    import torch, torch._dynamo.utils as dynamo_utils
    sys.path.insert(0, {tests!r})
    from conftest import make_tiny_model
    from test_quant4bit import GREEDY, PROMPTS, _hf_greedy, _quantize_projections, dequantized_reference, with_lora
    from flexrollout import LLM
    from flexrollout.kernels import gemv_4bit, registered

    model, tok = make_tiny_model("llama", seed=4, layers=4)
    model = _quantize_projections(model, "nf4", True)
    if {qlora}:          # live adapters on every projection: the LoRA kernels around the 4-bit one
        model = reference = with_lora(model)           # PEFT's own forward over bitsandbytes'
    else:
        reference = dequantized_reference(model)
    llm = LLM(model, tokenizer=tok, max_model_len=64, max_num_seqs=4, quant_kernels={quant_kernels})
    forward = llm.llm_engine.forward
    options = forward.options                          # CUDA only: quant_rows, LoRA kernels, compile
    assert options.quant_rows == 0 and not options.lora_kernels and not options.compile_layers
    assert options.compile_4bit                        # on by default (used where layers compile)
    traced = set()                                     # the ops dynamo put in the compiled graphs

    def backend(graph, example_inputs):
        traced.update(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    # Inductor (CPU C++ here) also generates the wrapper that calls the op with its arguments
    forward.prepare(replace(options, compile_layers=True,
                            compile_backend="inductor" if {inductor} else backend,
                            quant_rows=gemv_4bit.MAX_ROWS if {quant_kernels} else 0,
                            compile_4bit=not {quant_kernels}, lora_kernels=True))
    assert forward.options.compile_layers
    launches = []                                      # (inside the op: not traced)
    launch = gemv_4bit._launch
    gemv_4bit._launch = lambda *args, **kw: launches.append(args[0].shape[0]) or launch(*args, **kw)
    dynamo_utils.clear_compilation_metrics()
    expected = [_hf_greedy(reference, p, 10) for p in PROMPTS]
    for _ in range(2):           # the second call re-reads every projection: no new compile
        outs = llm.generate([{{"prompt_token_ids": p}} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    if not {inductor}:
        assert (str(registered("gemv_4bit").default) in traced) == {quant_kernels}, traced
        assert ("bitsandbytes.gemm_4bit.default" in traced) != {quant_kernels}, traced
        assert (str(registered("lora_shrink").default) in traced) == {qlora}, traced
        # QLoRA: with our kernel the adapters fold into its launch; with bitsandbytes' op an
        # expand adds each adapter's B (s A x) to its output
        assert (str(registered("lora_expand").default) in traced) == ({qlora} and not {quant_kernels}), traced
    # with our kernel: the packed prefill (20 rows) and the decode steps (3 rows)
    assert set(launches) == ({{sum(map(len, PROMPTS)), len(PROMPTS)}} if {quant_kernels} else set()), launches
    counts = {{}}
    for m in dynamo_utils.get_compilation_metrics():
        if m.co_filename and "flexrollout" in m.co_filename:
            counts[m.co_name] = counts.get(m.co_name, 0) + 1
    print(sorted(counts.items()))
""")


@pytest.mark.parametrize("quant_kernels, qlora, inductor", [
    (True, False, False), (True, True, False), (True, False, True),
    (False, False, False), (False, True, False), (False, False, True)],
    ids=["kernel", "kernel-qlora", "kernel-inductor", "bnb", "bnb-qlora", "bnb-inductor"])
def test_4bit_steps_compile_their_layers(quant_kernels, qlora, inductor):
    """The layer functions trace the 4-bit projection (fullgraph: a graph break would raise):
    bitsandbytes' gemm_4bit op, or our kernel with quant_kernels; with live adapters the shrink
    (and, over bitsandbytes' op, the expand). They give HF's tokens on the dequantised reference
    (PEFT's with adapters), and compile once per function and batch specialisation, not once
    per layer: the three fused layer boundaries of 4 layers share their compile. Through
    Inductor too, whose generated wrapper once called our op with unbound symbols."""
    pytest.importorskip("triton")
    tests = os.path.dirname(os.path.abspath(__file__))
    code = _COMPILE_CHECK.format(tests=tests, qlora=qlora, inductor=inductor, quant_kernels=quant_kernels)
    counts = dict(ast.literal_eval(run_fresh_python(code, triton_interpret=True)))
    assert counts.get("post_then_pre", 0) >= 1 and max(counts.values()) <= 2, counts


@pytest.mark.gpu
@pytest.mark.parametrize("quant_type, nested", [("nf4", True), ("fp4", False)])
@pytest.mark.parametrize("m", [1, 8, 16, 40, 64])
def test_4bit_kernel_on_cuda_matches_bitsandbytes(quant_type, nested, m):
    """Qwen3-4B's q and down projection shapes, bf16, against bitsandbytes' dequantised weight."""
    from flexrollout.kernels import gemv_4bit

    torch.manual_seed(m)
    for n, k in ((4096, 2560), (2560, 9728)):
        packed, state = bnb.functional.quantize_4bit(torch.randn(n, k, device="cuda", dtype=torch.bfloat16),
                                                     quant_type=quant_type, compress_statistics=nested)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert gemv_4bit.supported(x, state)
        ref = x.double() @ bnb.functional.dequantize_4bit(packed, state).double().T
        got = gemv_4bit.launch(x, packed, state).double().sum(0)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    # q / k / v in one launch
    weights = [bnb.functional.quantize_4bit(torch.randn(n, 2560, device="cuda", dtype=torch.bfloat16),
                                            quant_type=quant_type, compress_statistics=nested) for n in (4096, 1024, 1024)]
    x = torch.randn(m, 2560, device="cuda", dtype=torch.bfloat16)
    got = gemv_4bit.launch_group(x, [(p, gemv_4bit.Packed4bit.of(s)) for p, s in weights]).double().sum(0)
    ref = torch.cat([x.double() @ bnb.functional.dequantize_4bit(p, s).double().T for p, s in weights], dim=1)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_kernels_decode_like_bitsandbytes_ops_on_cuda(dtype, monkeypatch):
    """`LLM(quant_kernels=True)`: decode's 4-bit projections run our Triton GEMV (captured in
    the graphs) and give bitsandbytes' ops' tokens; in fp32 both equal HF generate on the
    dequantised reference, and logprobs agree to fp32 (bf16: to its rounding)."""
    from flexrollout.kernels import gemv_4bit

    launches = []
    launch = gemv_4bit._launch
    monkeypatch.setattr(gemv_4bit, "_launch", lambda *a, **kw: launches.append(a[0].shape[0]) or launch(*a, **kw))
    model, tok = _tiny("llama")
    model = _quantize_projections(model.to("cuda", dtype), "nf4", True)
    runs = {}
    for on in (True, False):
        llm = LLM(model, tokenizer=tok, max_model_len=64, max_num_seqs=4, quant_kernels=on)
        runs[on] = _greedy_decode(llm)
        del llm
    assert launches and max(launches) <= gemv_4bit.MAX_ROWS
    _assert_same_decode(runs[True], runs[False], model, dtype)


def _greedy_decode(llm) -> list[tuple[list[int], list[float], list[float]]]:
    """Each prompt's 10 greedy tokens, their logprobs and each step's gap between its top two logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    runs = []
    for o in outs:
        steps = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in o.outputs[0].logprobs]
        runs.append((o.outputs[0].token_ids, [s[0] for s in steps], [s[0] - s[1] for s in steps]))
    return runs


def _assert_same_decode(run, other, model, dtype, fused=False):
    """Two engines' greedy decodes agree: tokens equal, logprobs to the dtype's rounding; in fp32
    both are HF generate's tokens on the dequantised reference. `fused`: one engine compiled its
    layers and the other did not, so in 16 bits their roundings differ (Inductor keeps fused
    intermediates in fp32) and a sequence may leave the other at a near-tie (top two within 0.1),
    and only there; up to it the two agree."""
    if fused and dtype != torch.float32:
        for (ta, la, gap_a), (tb, lb, gap_b) in zip(run, other):
            same = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
            assert same == len(ta) or max(gap_a[same], gap_b[same]) < 0.1, (same, gap_a[same], gap_b[same])
            assert all(abs(a - b) < 5e-2 for a, b in zip(la[:same], lb[:same])), (la, lb)
        return
    assert [t for t, *_ in run] == [t for t, *_ in other]
    worst = max(abs(a - b) for (_, la, _), (_, lb, _) in zip(run, other) for a, b in zip(la, lb))
    assert worst < (1e-4 if dtype == torch.float32 else 5e-2), worst
    if dtype == torch.float32:
        reference = dequantized_reference(model)
        assert [t for t, *_ in run] == [_hf_greedy(reference, p, 10) for p in PROMPTS]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen35-dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compile_4bit", [False, True], ids=["uncompiled", "compile_4bit"])
def test_4bit_decode_graphs_match_eager_on_cuda(arch, dtype, compile_4bit):
    """A 4-bit model decodes from CUDA graphs (bitsandbytes' gemm_4bit captured; with
    compile_4bit, inside compiled layers), with the same tokens and logprobs as the engine
    without graphs (uncompiled); in fp32 both equal HF generate on the dequantised reference."""
    model, tok = _tiny(arch)
    model = _quantize_projections(model.to("cuda", dtype), "nf4", True)
    runs = {}
    for eager in (False, True):
        llm = LLM(model, tokenizer=tok, max_model_len=64, max_num_seqs=4, enforce_eager=eager,
                  compile_4bit=compile_4bit and not eager)
        runs[eager] = _greedy_decode(llm)
        graphs = llm.llm_engine.runner.graphs
        assert (graphs is None) == eager and (eager or len(graphs.graphs) > 0)
        del llm
    _assert_same_decode(runs[False], runs[True], model, dtype, fused=compile_4bit)


def _qlora_projection(out: int, k: int, rank: int, scaling: float):
    """A 4-bit (nf4, nested) projection with a live fp32 adapter of `rank` (0: none), and its
    float64 reference W x + s B (A x) over bitsandbytes' dequantised weight."""
    from flexrollout.kernels.gemv_4bit import Packed4bit
    from flexrollout.layers.linear import Linear

    packed, state = bnb.functional.quantize_4bit(torch.randn(out, k), quant_type="nf4", compress_statistics=True)
    adapter = (torch.randn(rank, k) / k ** 0.5, torch.randn(out, rank), scaling) if rank else None
    weight = bnb.functional.dequantize_4bit(packed, state).double()

    def reference(x):
        y = x.double() @ weight.T
        if adapter is not None:
            y = y + scaling * (x.double() @ adapter[0].double().T) @ adapter[1].double().T
        return y

    return Linear(packed, None, (adapter,) if adapter else (), quant=Packed4bit.of(state)), reference


@pytest.mark.parametrize("rows, kernels", [(3, "lora_small"), (40, "lora_expand"), (3, None)])
def test_qlora_projections_take_one_shrink_per_group_and_an_expand_per_adapter(rows, kernels, monkeypatch):
    """QLoRA: 4-bit projections with live adapters take the LoRA kernels at every batch size the
    engine runs them (off CUDA, their ops' torch paths: the kernels' contract): one shrink per
    group of projections of one input, the 4-bit projection, one expand per adapted projection;
    without the LoRA kernels, the unfused path. Each against float64 over the dequantised weight."""
    import functools

    import torch.nn.functional as F

    from flexrollout.kernels import lora as lk
    from flexrollout.layers.linear import Kernels, gated_act, linear, project_group

    torch.manual_seed(rows)
    calls = {"shrink": 0, "expand": 0}
    for name in calls:
        op = getattr(lk, f"lora_{name}")
        monkeypatch.setattr(lk, f"lora_{name}", lambda *a, _op=op, _n=name, **kw: calls.__setitem__(_n, calls[_n] + 1) or _op(*a, **kw))
    step = Kernels(**{kernels: True}) if kernels else Kernels()
    x = torch.randn(rows, 256)
    qkv = [_qlora_projection(96, 256, 16, 2.0), _qlora_projection(32, 256, 0, 1.0), _qlora_projection(32, 256, 8, 0.5)]
    for out, (_, reference) in zip(project_group(x, [p for p, _ in qkv], step), qkv):
        assert out.dim() == 2
        torch.testing.assert_close(out.double(), reference(x), rtol=1e-5, atol=1e-4)
    (gate, gate_ref), (up, up_ref) = _qlora_projection(64, 256, 8, 2.0), _qlora_projection(64, 256, 8, 2.0)
    act = functools.partial(F.gelu, approximate="tanh")
    # A product of two fp32 projections (~16 each): fp32 rounding reaches ~3e-4 in it; a lost or
    # doubled adapter term would be off by O(1).
    torch.testing.assert_close(gated_act(x, gate, up, act, step).double(), act(gate_ref(x)) * up_ref(x),
                               rtol=1e-4, atol=1e-3)
    down, down_ref = _qlora_projection(256, 64, 16, 0.5)
    hidden = torch.randn(rows, 64)
    torch.testing.assert_close(linear(hidden, down, step).double(), down_ref(hidden), rtol=1e-5, atol=1e-4)
    assert calls == ({"shrink": 3, "expand": 5} if kernels else {"shrink": 0, "expand": 0})


@pytest.mark.gpu
@pytest.mark.parametrize("quant_kernels, compile_4bit", [(False, False), (False, True), (True, False)],
                         ids=["bnb_ops", "bnb_ops_compiled", "quant_kernels"])
def test_qlora_decode_on_cuda_matches_peft_and_follows_updates(quant_kernels, compile_4bit):
    """fp32 QLoRA on the GPU (adapters on all seven projections): decode from graphs with the
    LoRA kernels around bitsandbytes' ops or our 4-bit kernel gives PEFT's greedy tokens, before
    and after an in-place update of the adapters."""
    model, tok = _tiny("llama")
    pm = with_lora(_quantize_projections(model.to("cuda"), "nf4", True))
    llm = LLM(pm, tokenizer=tok, max_model_len=64, max_num_seqs=4, quant_kernels=quant_kernels,
              compile_4bit=compile_4bit)

    def peft_greedy(prompt):
        ids = torch.tensor([prompt], device="cuda")
        out = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                          min_new_tokens=10, do_sample=False, eos_token_id=[], pad_token_id=0)
        return out[0, len(prompt):].tolist()

    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [peft_greedy(p) for p in PROMPTS]
        with torch.no_grad():                          # an optimizer step, in place
            for name, p in pm.named_parameters():
                if "lora_A" in name:
                    p.add_(torch.randn_like(p) * 0.5)
    assert llm.llm_engine.runner.graphs.graphs, "decode should have replayed a captured graph"
