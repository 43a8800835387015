"""Live LoRA on the GEMV path on a GPU (skipped without CUDA): the shrink + folded GEMV in bf16 at
Qwen3-4B's shapes against float64 PEFT math, and whole models with CUDA graphs against PEFT's
own forward (fp32: greedy tokens equal; bf16: logprobs within bf16 noise, far below the
adapter's own effect)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexrollout import LLM, SamplingParams
from flexrollout.bench import random_model
from flexrollout.kernels import lora as lora_kernels
from flexrollout.layers.linear import Kernels, Linear, gated_act, linear, project_group

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _projection(n: int, k: int, rank: int, g: torch.Generator) -> Linear:
    """A bf16 weight with a PEFT-like fp32 adapter (rank 0: none)."""
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to("cuda", torch.bfloat16)
    if rank == 0:
        return Linear(weight)
    a = (torch.randn(rank, k, generator=g) / k ** 0.5).cuda()
    b = (0.5 * torch.randn(n, rank, generator=g) / rank ** 0.5).cuda()
    return Linear(weight, None, ((a, b, 2.0),))


def _exact(x: torch.Tensor, p: Linear) -> torch.Tensor:
    x64 = x.double()
    out = x64 @ p.weight.double().T
    for a, b, s in p.lora:
        out = out + s * (x64 @ a.double().T) @ b.double().T
    return out


def _peft_way(x: torch.Tensor, p: Linear) -> torch.Tensor:
    """PEFT's own rounding: the bf16 base output plus the fp32 delta, rounded once more."""
    out = F.linear(x, p.weight).float()
    for a, b, s in p.lora:
        out = out + s * (x.float() @ a.T) @ b.T
    return out.to(x.dtype)


def _relerr(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("gemv_rows", [lora_kernels.MAX_ROWS, 64], ids=["gemv32", "gemv64"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_shrink", "shrink_launch"])
@pytest.mark.parametrize("rank", [16, 32, 64])
@pytest.mark.parametrize("rows", [1, 8, 32, 33, 64, 65, 300])
def test_folded_gemv_bf16_at_qwen3_4b_shapes(rank, rows, fused, gemv_rows):
    """q/k/v (v unadapted), gate/up with SiLU-mul, o and down as the engine calls them: within
    PEFT's own bf16 error of float64 (one rounding instead of PEFT's two). Up to the GEMV's LoRA
    rows (`lora_gemv_max_rows`: 64 by default, 32 the other case here) the GEMV with the adapter folded in
    (s A x from its own first programs, or from a shrink launch); past them cuBLAS, the shrink
    and the expand kernel (`Kernels.lora_expand`)."""
    if rows > gemv_rows and not fused:
        pytest.skip("past the GEMV's rows there is no fused shrink to turn off")
    if gemv_rows > lora_kernels.MAX_ROWS and not lora_kernels.MAX_ROWS < rows <= gemv_rows:
        pytest.skip("routed as with 32 rows")
    g = torch.Generator().manual_seed(rank * 100 + rows)
    q, k, v = _projection(4096, 2560, rank, g), _projection(1024, 2560, rank, g), _projection(1024, 2560, 0, g)
    gate, up = _projection(9728, 2560, rank, g), _projection(9728, 2560, rank, g)
    o, down = _projection(2560, 4096, rank, g), _projection(2560, 9728, rank, g)
    gemv = rows <= gemv_rows
    kernels = Kernels(small=gemv, lora_small=gemv, lora_expand=not gemv, fused_shrink=fused)
    x = torch.randn(rows, 2560, generator=g).to("cuda", torch.bfloat16)
    with torch.no_grad():
        outs = project_group(x, [q, k, v], kernels)
        assert all(out.dim() == (3 if gemv else 2) for out in outs), "q/k/v: one GEMV launch"
        for out, p in zip(outs, (q, k, v)):
            got = out.sum(0).to(torch.bfloat16) if gemv else out
            assert _relerr(got, _exact(x, p)) <= 1.2 * _relerr(_peft_way(x, p), _exact(x, p)) + 1e-4
        act = gated_act(x, gate, up, F.silu, kernels)
        want = F.silu(_exact(x, gate)) * _exact(x, up)
        peft = F.silu(_peft_way(x, gate).float()) * _peft_way(x, up).float()
        assert _relerr(act, want) <= 1.2 * _relerr(peft.to(torch.bfloat16), want) + 1e-4
        for p, width in ((o, 4096), (down, 9728)):
            xi = torch.randn(rows, width, generator=g).to("cuda", torch.bfloat16)
            got = linear(xi, p, kernels)
            assert _relerr(got, _exact(xi, p)) <= 1.2 * _relerr(_peft_way(xi, p), _exact(xi, p)) + 1e-4


def _peft(dtype: torch.dtype, rank: int, seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = random_model("qwen3-0.6b", dtype, "cuda", 2048)
    pm = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL)).eval()
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    assert next(p for n, p in pm.named_parameters() if "lora_A" in n).dtype == torch.float32
    return pm


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 60, (count,), generator=g)]


def test_fp32_live_lora_with_graphs_matches_peft_greedy():
    """fp32, batches of 1 and 12 (the GEMV with the adapter folded in) and 40 (past its rows) on
    one engine: tokens equal HF generate on the PEFT model."""
    pm = _peft(torch.float32, 16, seed=1)
    llm = LLM(pm, max_model_len=512, max_num_seqs=48, num_kv_pages=256)
    for batch in (1, 12, 40):
        prompts = _prompts(batch, pm.config.vocab_size, seed=batch)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt], device="cuda")
            want = pm.generate(input_ids=ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
            assert out.outputs[0].token_ids == want[0, len(prompt):].tolist(), batch
    assert llm.llm_engine.runner.graphs.graphs, "decode should have replayed a captured graph"


def _teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token) of each generated token under `model`'s own forward, in fp32."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]


@pytest.mark.parametrize("rank", [64])
def test_bf16_live_lora_with_graphs_tracks_peft_forward(rank):
    """bf16 with fp32 adapters, decode from captured graphs at batch 1 / 8 (the GEMV with the
    adapter folded in) and 40 (past its rows): each sampled token's logprob against PEFT's forward over the same tokens. The adapter moves those logprobs far more than the engine differs from PEFT."""
    pm = _peft(torch.bfloat16, rank, seed=rank)
    llm = LLM(pm, max_model_len=512, max_num_seqs=64, num_kv_pages=256)
    for batch in (1, 8, 40):
        prompts = _prompts(batch, pm.config.vocab_size, seed=batch)
        outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                                    ignore_eos=True, logprobs=0), use_tqdm=False)
        ours, peft, base = [], [], []
        for prompt, out in zip(prompts, outs):
            tokens = out.outputs[0].token_ids
            ours.append(torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]))
            peft.append(_teacher_forced(pm, prompt, tokens).cpu())
            with pm.disable_adapter():
                base.append(_teacher_forced(pm, prompt, tokens).cpu())
        ours, peft, base = torch.cat(ours), torch.cat(peft), torch.cat(base)
        err, effect = (ours - peft).abs(), (peft - base).abs()
        assert err.mean() < 0.25 * effect.mean(), (batch, err.mean(), effect.mean())
        assert err.mean() < 0.05 and err.max() < 0.5, (batch, err.mean(), err.max())
    assert llm.llm_engine.runner.graphs.graphs, "decode should have replayed a captured graph"


def _lora_tensors(pm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pm.named_parameters() if "lora_" in n}


def _set_lora_tensors(pm, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if n in tensors:
                p.copy_(tensors[n])


def test_lora_requests_decode_from_graphs_and_match_peft(tmp_path):
    """fp32, one call mixing rows of the live adapter, of two saved adapters (LoRARequest by
    path) and of the base model: decode replays graphs keyed on the adapter table, and each
    row's tokens equal PEFT's generate with that row's adapter in the live adapter's place
    (or with adapters disabled)."""
    from flexrollout import LoRARequest
    from flexrollout.lora import BaseModelRequest, save_lora

    pm = _peft(torch.float32, 16, seed=1)
    saved = {}
    for name, seed in (("A", 2), ("B", 3)):
        g = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g, device="cuda") * (0.02 if "lora_B" in n else 0.05))
        save_lora(pm, str(tmp_path / name))
        saved[name] = _lora_tensors(pm)
    _set_lora_tensors(pm, saved["A"])
    live = {n: t.flip(0) for n, t in saved["A"].items()}            # a third adapter, live
    a, b = LoRARequest("A", 1, str(tmp_path / "A")), LoRARequest("B", 2, str(tmp_path / "B"))
    base = BaseModelRequest()
    requests = [None, a, b, base, a, None, b, a, base, None, b, a]
    prompts = _prompts(len(requests), pm.config.vocab_size, seed=7)

    def peft_greedy(prompt, request):
        ids = torch.tensor([prompt], device="cuda")
        _set_lora_tensors(pm, live if request is None else saved.get(getattr(request, "lora_name", None), live))
        if request is base:
            with pm.disable_adapter():
                out = pm.generate(input_ids=ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        else:
            out = pm.generate(input_ids=ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        return out[0, len(prompt):].tolist()

    want = [peft_greedy(p, r) for p, r in zip(prompts, requests)]
    assert len({tuple(peft_greedy(prompts[0], r)) for r in (None, a, b, base)}) == 4   # they differ
    _set_lora_tensors(pm, live)
    llm = LLM(pm, max_model_len=512, max_num_seqs=16, num_kv_pages=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False, lora_request=requests)
    assert [o.outputs[0].token_ids for o in outs] == want
    graphs = llm.llm_engine.runner.graphs.graphs
    assert any(key[2] is not None for key in graphs), "LoRARequest steps should replay a graph"


@pytest.mark.parametrize("kernels_on", [True, False], ids=["lora_request_kernels", "unfused"])
def test_lora_requests_over_a_plain_model_match_peft(tmp_path, kernels_on):
    """fp32, a model without live adapters serving three saved adapters and base rows, batches of
    12 (GEMV) and 40 (past its rows): with `lora_request_kernels` each projection's table term
    folds into the shrink + GEMV / expand kernels, its column mask picking each row's adapter.
    Every row's tokens equal PEFT's generate with that row's adapter, either way."""
    from flexrollout import LoRARequest
    from flexrollout.lora import save_lora

    pm = _peft(torch.float32, 16, seed=4)
    requests, saved = [None], {}
    for lora_id in (1, 2, 3):
        g = torch.Generator(device="cuda").manual_seed(lora_id)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g, device="cuda") * (0.02 if "lora_B" in n else 0.05))
        save_lora(pm, str(tmp_path / str(lora_id)))
        requests.append(LoRARequest(str(lora_id), lora_id, str(tmp_path / str(lora_id))))
        saved[str(lora_id)] = _lora_tensors(pm)
    batches = {batch: _prompts(batch, pm.config.vocab_size, seed=batch) for batch in (12, 40)}

    def peft_greedy(prompt, request):
        ids = torch.tensor([prompt], device="cuda")
        if request is None:
            with pm.disable_adapter():
                out = pm.generate(input_ids=ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        else:
            _set_lora_tensors(pm, saved[request.lora_name])
            out = pm.generate(input_ids=ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        return out[0, len(prompt):].tolist()

    rows = {batch: [requests[i % len(requests)] for i in range(batch)] for batch in batches}
    want = {batch: [peft_greedy(p, r) for p, r in zip(prompts, rows[batch])]
            for batch, prompts in batches.items()}
    plain = pm.unload()                   # the base model, PEFT's layers removed
    llm = LLM(plain, max_model_len=512, max_num_seqs=48, num_kv_pages=256,
              lora_request_kernels=kernels_on)
    for batch, prompts in batches.items():
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False, lora_request=rows[batch])
        assert [o.outputs[0].token_ids for o in outs] == want[batch], batch
    assert any(key[2] is not None for key in llm.llm_engine.runner.graphs.graphs)

