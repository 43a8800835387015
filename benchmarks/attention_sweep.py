"""flex decode attention over the paged cache: block-mask layout and kernel options.

Qwen3-4B's attention (32 query heads, 8 KV heads, head_dim 128, 128-token pages; `--shape` and
`--window` set others, e.g. Gemma-4-E2B's 8,1,256 sliding over 512 and 8,1,512 full) at batch 1,
8 and 64 with every row at the same context, run through the engine's own `paged_attention` and
mask builder, from CUDA-graph replays over 8 layers' caches. Prints microseconds per layer and
the KV read rate, for the mask with earlier pages as full blocks against every page partial
(mask_mod evaluated everywhere: the engine's, `attention.masks.decode_block_mask` says why), and
for several flex kernel options. `--cache-pages` sizes the caches like the engine's: flex splits
full blocks by the cache's whole length. (`{}` is flex's default: on an H200, BLOCK_N 64, one
stage, two warps; the engine's own choice is `decode_kernel_options`. The full-block mask at
head_dim 512 needs `{"num_stages": 1}`: at three it asks 280 KB of shared memory.)

    python benchmarks/attention_sweep.py [--context 256] [--batches 1,8] [--options JSON]
        [--shape HEADS,KV_HEADS,HEAD_DIM] [--window W] [--cache-pages N] [OUT.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from flexrollout.attention.flex import AttentionMetadata, paged_attention
from flexrollout.attention.masks import decode_block_mask
from flexrollout.spec import LayerSpec
from gemv_sweep import graph_seconds   # benchmarks/ is on sys.path when run as a script

PAGE, LAYERS, MAX_PAGES = 128, 8, 16
OPTIONS = [{}, {"num_stages": 2}, {"num_stages": 3}, {"num_stages": 3, "num_warps": 4},
           {"BLOCK_N": 128, "num_stages": 3, "num_warps": 4}]


def paged_cache(num_pages: int, kv_heads: int, head_dim: int, used: torch.Tensor) -> torch.Tensor:
    """(1, kv_heads, num_pages * PAGE, head_dim), random on the `used` pages (the only ones read)."""
    cache = torch.zeros(1, kv_heads, num_pages, PAGE, head_dim, device="cuda", dtype=torch.bfloat16)
    cache[:, :, used] = torch.randn(1, kv_heads, used.numel(), PAGE, head_dim, device="cuda",
                                    dtype=torch.bfloat16)
    return cache.view(1, kv_heads, num_pages * PAGE, head_dim)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--options", default=None,
                        help='JSON list of option dicts to try instead of OPTIONS, e.g. \'[{"SPLIT_KV": 2}]\'')
    parser.add_argument("--no-partial", action="store_true", help="skip the all-partial mask variants")
    parser.add_argument("--shape", default="32,8,128", help="query heads, KV heads, head_dim")
    parser.add_argument("--window", type=int, default=None, help="sliding window in tokens")
    parser.add_argument("--cache-pages", type=int, default=0,
                        help="pages in each layer's cache (default: just the batch's); the engine's "
                             "cache holds far more, and flex sizes its KV splits by the cache's length")
    parser.add_argument("out", nargs="?", default="/tmp/attention.json")
    args = parser.parse_args()
    options = json.loads(args.options) if args.options else OPTIONS
    heads, kv_heads, head_dim = (int(n) for n in args.shape.split(","))
    spec = LayerSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, window=args.window)
    torch.manual_seed(0)
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        pages_per_row = -(-args.context // PAGE)
        num_pages = max(args.cache_pages, batch * pages_per_row + 1)
        order = torch.randperm(num_pages - 1, device="cuda").int() + 1      # page 0: padding
        rows = torch.zeros(batch, max(MAX_PAGES, pages_per_row), dtype=torch.int32, device="cuda")
        rows[:, :pages_per_row] = order[:batch * pages_per_row].view(batch, pages_per_row)
        used = rows[:, :pages_per_row].flatten().long()
        caches = [(paged_cache(num_pages, kv_heads, head_dim, used),
                   paged_cache(num_pages, kv_heads, head_dim, used)) for _ in range(LAYERS)]
        page_logical = torch.zeros(num_pages, dtype=torch.long, device="cuda")
        page_logical[rows[:, :pages_per_row].flatten().long()] = torch.arange(
            pages_per_row, device="cuda").repeat(batch)
        positions = torch.full((batch,), args.context - 1, device="cuda")
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        full = decode_block_mask(rows, positions // PAGE + 1, positions, page_logical, PAGE,
                                 spec.group, num_pages * PAGE, args.window, full_blocks=True)
        kv_gb = batch * min(args.context, args.window or args.context) * kv_heads * head_dim * 4 / 1e9
        variants = [("full+partial", full, o) for o in options]
        if not args.no_partial and args.window is None:    # windowed pages are all partial
            partial = decode_block_mask(rows, positions // PAGE + 1, positions, page_logical, PAGE,
                                        spec.group, num_pages * PAGE)
            variants += [("all partial", partial, o) for o in ({}, {"num_stages": 3})]
        for layout, block_mask, opts in variants:
            meta = AttentionMetadata(positions, positions, decode=True, block_masks={spec.mask_key: block_mask},
                                     kernel_options=dict(opts))

            def layers():
                for k, v in caches:
                    paged_attention(q, k, v, meta, spec)
            try:
                seconds = graph_seconds(layers) / LAYERS
            except Exception as exc:   # an option set flex rejects is reported, not fatal
                print("skip", batch, layout, opts, type(exc).__name__, str(exc)[:160], flush=True)
                continue
            key = f"bs{batch} {layout} {json.dumps(opts)}"
            results[key] = {"us_per_layer": round(seconds * 1e6, 2),
                            "kv_GBs": round(kv_gb / seconds)}
            print(key, results[key], flush=True)
        engine_mask = decode_block_mask(rows, positions // PAGE + 1, positions, page_logical, PAGE,
                                        spec.group, num_pages * PAGE, args.window)
        check(q, caches[0], rows, pages_per_row, args.context, engine_mask, spec)
        del caches
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


def check(q, cache, rows, pages_per_row, context, mask, spec: LayerSpec) -> None:
    """The engine mask's output against dense attention over each row's own pages (those in
    the window, with one)."""
    k_cache, v_cache = cache
    positions = torch.full((q.shape[0],), context - 1, device="cuda")
    meta = AttentionMetadata(positions, positions, decode=True, block_masks={spec.mask_key: mask})
    got = paged_attention(q, k_cache, v_cache, meta, spec).float()
    slots = (rows[:, :pages_per_row, None].long() * PAGE + torch.arange(PAGE, device="cuda")).flatten(1)
    slots = slots[:, max(0, context - (spec.window or context)):context]
    k = k_cache[0][:, slots].float()                          # (Hkv, B, L, D)
    v = v_cache[0][:, slots].float()
    q5 = q.float().view(q.shape[0], spec.num_kv_heads, spec.group, spec.head_dim)
    scores = torch.einsum("bhgd,hbld->bhgl", q5, k) * spec.attention_scale
    ref = torch.einsum("bhgl,hbld->bhgd", scores.softmax(-1), v).reshape(q.shape[0], -1)
    err = ((got - ref).norm() / ref.norm()).item()
    print(f"check bs{q.shape[0]}: relative error {err:.2e}", flush=True)
    assert err < 2e-2, err


if __name__ == "__main__":
    main()
