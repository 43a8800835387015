"""Data-parallel rollouts: N processes (torchrun), one engine per rank over its own model replica,
each generating its own shard of the prompts, as TRL's colocate mode runs them under accelerate.

CPU only here: two processes on a gloo process group (a FileStore rendezvous, as torchrun would
set up with a TCP store; the file needs no port and no store thread). Each rank's greedy and
seeded-sampling outputs, gathered over the group, must equal a single-process engine over the
same prompts, and HF's greedy tokens.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import make_tiny_model

from flexrollout import LLM, SamplingParams

TESTS = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [[5, 17, 33, 2, 9], [300, 7, 8], [41, 42, 43, 44, 45, 46], [9, 8], [100, 101, 102], [7]]
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
SAMPLED = dict(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11)

_RANK = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from conftest import make_tiny_model
    from flexrollout import LLM, SamplingParams

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=rank, world_size=world)
    model, tok = make_tiny_model("llama", seed=3)           # every rank: the same replica
    llm = LLM(model, tokenizer=tok, max_model_len=64, max_num_seqs=4)
    prompts = {prompts!r}
    mine = list(range(rank, len(prompts), world))            # this rank's shard
    result = {{}}
    for name, params in (("greedy", {greedy!r}), ("sampled", {sampled!r})):
        outs = llm.generate([{{"prompt_token_ids": prompts[i]}} for i in mine],
                            SamplingParams(**params), use_tqdm=False)
        result[name] = {{i: o.outputs[0].token_ids for i, o in zip(mine, outs)}}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        merged = {{name: {{}} for name in result}}
        for part in gathered:
            for name, by_index in part.items():
                merged[name].update(by_index)
        with open({out!r}, "w") as f:
            json.dump(merged, f)
    dist.barrier()                        # both ranks are done before either leaves
    # Leave without the interpreter's teardown: gloo's teardown at exit aborted rank 0 now and then in
    # CI runs ('terminate called without an active exception', after the results were written),
    # with a TCP store and with this FileStore alike. The engine holds no threads of its own; the
    # results are already on disk, so the process ends here, as torchrun's workers may.
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
""")


def _single_process(params: dict) -> list[list[int]]:
    model, tok = make_tiny_model("llama", seed=3)
    llm = LLM(model, tokenizer=tok, max_model_len=64, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**params),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_two_gloo_ranks_generate_their_shards_like_one_process(tmp_path, hf_greedy):
    out = tmp_path / "gathered.json"
    script = tmp_path / "rank.py"
    script.write_text(_RANK.format(tests=TESTS, prompts=PROMPTS, greedy=GREEDY, sampled=SAMPLED, out=str(out),
                                   store=str(tmp_path / "store")))
    ranks = [subprocess.Popen([sys.executable, str(script)],
                              env=dict(os.environ, RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        for rank, proc in enumerate(ranks):
            _, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"rank {rank}: {stderr[-3000:]}"
    finally:
        for proc in ranks:                # a rank left waiting on a dead peer
            proc.kill()
    gathered = json.loads(out.read_text())
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        by_index = {int(i): tokens for i, tokens in gathered[name].items()}
        assert sorted(by_index) == list(range(len(PROMPTS)))
        assert [by_index[i] for i in range(len(PROMPTS))] == _single_process(params), name
    model, _ = make_tiny_model("llama", seed=3)
    reference = [hf_greedy(model, p, GREEDY["max_tokens"]).tokens for p in PROMPTS]
    assert [gathered["greedy"][str(i)] for i in range(len(PROMPTS))] == reference


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_engine_lives_on_the_models_gpu_not_the_current_one(hf_greedy):
    """A rank's model on cuda:1 while cuda:0 is current: the cache, the decode graphs and every
    kernel run on cuda:1, and the tokens are HF's."""
    model, tok = make_tiny_model("llama", seed=3)
    model = model.to("cuda:1")
    torch.cuda.set_device(0)
    llm = LLM(model, tokenizer=tok, max_model_len=256, max_num_seqs=4)
    assert llm.llm_engine.device == torch.device("cuda:1")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**GREEDY), use_tqdm=False)
    assert llm.llm_engine.runner.graphs.graphs, "decode should have replayed a captured graph"
    assert torch.cuda.current_device() == 0
    cpu_model, _ = make_tiny_model("llama", seed=3)
    assert [o.outputs[0].token_ids for o in outs] == \
        [hf_greedy(cpu_model, p, GREEDY["max_tokens"]).tokens for p in PROMPTS]
