"""The Triton kernels Inductor would launch per compiled layer function, counted on a CPU.

    python benchmarks/kernel_count.py --preset gemma-4-e2b --layers 4
    python benchmarks/kernel_count.py --preset qwen3.5-4b --layers 4 --detail

A batch-1 decode step on the GPU is mostly launches: Gemma-4-E2B's was 22 kernels a layer (H100
profile, 2026-12-06). This counts, without a GPU, what Inductor makes of each compiled region:
the CPU graph is scheduled with Inductor's Triton backend (`cpu_backend = "triton"`), whose fusion
rules are the GPU's, the scheduler's nodes after fusion are recorded, and the compile is then
abandoned (the region runs eagerly; only the count is wanted). Matrix products are counted apart
("extern"): on CUDA the engine runs small batches through its own GEMV kernel, where q/k/v share
a launch and gate/up take their activation in the epilogue, so an extern is not one launch each.
The count predicted E2B's 22 a layer before it was measured. It is a proxy: on the GPU a norm
whose output RoPE reads rotated still takes its own kernel, which the CPU count fuses.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging

import torch._dynamo.utils as dynamo_utils
import torch._inductor.config as inductor_config
from compile_count import build_llm, force_compile, generate
from torch._inductor import scheduler
from torch._inductor.compile_fx import compile_fx

from flexrollout.bench import PRESETS
from flexrollout.kernels import small_linear as gemv
from flexrollout.models import base


class _Counted(Exception):
    """Raised once the scheduler's fused nodes are recorded: nothing is compiled."""


def _record_nodes(regions: list):
    def codegen(self) -> None:
        nodes = []
        for node in self.nodes:
            # No-ops, and MultiOutput (a view of one of a multi-output op's results): no launch.
            if isinstance(node, scheduler.NopKernelSchedulerNode) or (
                    type(node.node).__name__ == "MultiOutput"):
                continue
            if isinstance(node, scheduler.ExternKernelSchedulerNode):
                nodes.append(("extern", getattr(node.node, "python_kernel_name", None)
                              or str(getattr(node.node, "op_overload", None) or type(node.node).__name__)))
                continue
            ops = sorted({getattr(o.target, "__name__", str(o.target))
                          for n in node.get_nodes() if n.node is not None
                          for o in n.node.origins if o.op == "call_function"})
            nodes.append(("kernel", f"{tuple(node.group[1])} " + ",".join(ops)))
        regions.append(nodes)
        raise _Counted
    return codegen


def counting_backend(regions: list):
    """A torch.compile backend that records each region's fused nodes and runs it eagerly."""
    def backend(gm, example_inputs):
        try:
            return compile_fx(gm, example_inputs)
        except Exception as err:    # Inductor wraps what codegen raises
            if not isinstance(err, _Counted) and not isinstance(err.__cause__, _Counted) \
                    and "_Counted" not in repr(err):
                raise
        return gm.forward
    return backend


def route_small_batches_through_the_gemv(llm) -> None:
    """Decode as CUDA traces it: small batches project through the GEMV op (fp32 partials, q/k/v
    in one call, gate/up with the activation in its epilogue), which on CPU runs its reference
    implementation. The engine takes that path only for CUDA weights; this lets CPU ones in."""
    gemv.weight_supported, gemv.supported = gemv.weight_fits, gemv.fits
    step = base.DecoderForward._step

    def small_step(self, input_ids, meta, cache):
        made = step(self, input_ids, meta, cache)
        small = input_ids.shape[0] <= self.options.small_rows
        return dataclasses.replace(made, kernels=dataclasses.replace(made.kernels, small=small))

    base.DecoderForward._step = small_step
    forward = llm.llm_engine.forward
    forward.prepare(dataclasses.replace(forward.options, small_rows=gemv.MAX_ROWS))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gemma-4-e2b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=4, help="fewer layers than the preset (same widths)")
    p.add_argument("--batch-sizes", default="1", help="comma-separated decode batch sizes")
    p.add_argument("--detail", action="store_true", help="list each region's kernels and their ops")
    p.add_argument("--gemv", action="store_true",
                   help="small batches through the GEMV op, as on CUDA (its CPU reference runs)")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.prompt_len, args.max_tokens, args.max_len = 11, 3, 256
    args.dtype, args.weight_shapes = "bfloat16", "decode"
    logging.basicConfig(level=logging.WARNING)

    inductor_config.cpu_backend = "triton"
    regions: list = []
    scheduler.Scheduler.codegen = _record_nodes(regions)
    llm = build_llm(args, "cpu")
    if args.gemv:
        route_small_batches_through_the_gemv(llm)
    force_compile(llm, counting_backend(regions))
    dynamo_utils.clear_compilation_metrics()
    for batch in args.batch_sizes:
        generate(llm, batch, args.prompt_len, args.max_tokens)
    names = [m.co_name for m in dynamo_utils.get_compilation_metrics()
             if m.co_filename and "flexrollout" in m.co_filename]
    print(f"{args.preset}, {args.layers} layers, decode batch {args.batch_sizes} "
          "(the *_symbolic functions are prefill's)")
    print(f"{'compiled function':32} {'kernels':>7} {'extern':>6}")
    for name, nodes in zip(names, regions):
        kernels = sum(kind == "kernel" for kind, _ in nodes)
        print(f"{name:32} {kernels:>7} {len(nodes) - kernels:>6}")
        if args.detail:
            for kind, what in nodes:
                print(f"    {kind:6} {what[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
