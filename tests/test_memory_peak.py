"""benchmarks/memory_peak.py: replaying an allocation history finds the peak and who holds it."""
from __future__ import annotations

import importlib.util
import os

spec = importlib.util.spec_from_file_location(
    "memory_peak", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "memory_peak.py"))
memory_peak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory_peak)


def _frames(path, line, name="f"):
    return [{"filename": "/usr/lib/python3/site-packages/torch/functional.py", "line": 9, "name": "op"},
            {"filename": path, "line": line, "name": name}]


def _event(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def test_peak_is_the_largest_live_total_and_groups_by_flexrollout_line():
    mlp = _frames("/src/flexrollout/models/llama.py", 60, "out_mlp")
    sampler = _frames("/src/flexrollout/engine/sampler.py", 120, "sample")
    trace = [
        _event("alloc", 1, 100, mlp),
        _event("alloc", 2, 300, sampler),        # live 400
        _event("free_requested", 2, 300),
        _event("free_completed", 2, 300),        # live 100
        _event("alloc", 3, 250, mlp),
        _event("alloc", 4, 120, mlp),            # live 470: the peak
        _event("free_completed", 1, 100),
        _event("alloc", 5, 50, sampler),         # live 420
    ]
    peak, at, blocks = memory_peak.peak_blocks(trace)
    assert (peak, at) == (470, 5)
    assert sorted(blocks) == [1, 3, 4]
    assert memory_peak.by_site(blocks) == [("models/llama.py:60 out_mlp", 470, 3)]


def test_free_requested_counts_when_a_trace_has_no_completions():
    a = _frames("/x/flexrollout/a.py", 1)
    trace = [_event("alloc", 1, 10, a), _event("free_requested", 1, 10), _event("alloc", 2, 7, a)]
    peak, _, blocks = memory_peak.peak_blocks(trace)
    assert peak == 10 and list(blocks) == [1]
    assert memory_peak.site([{"filename": "/opt/lib/site-packages/torch/x.py", "line": 3, "name": "g"}]) \
        == "torch/x.py:3 g"


def test_stack_names_the_flexrollout_frames_and_reserved_counts_segments():
    frames = [{"filename": "/t/site-packages/torch/nn/functional.py", "line": 5, "name": "silu"},
              {"filename": "/s/flexrollout/models/base.py", "line": 80, "name": "mlp"},
              {"filename": "/s/flexrollout/engine/runner.py", "line": 30, "name": "prefill"}]
    assert memory_peak.stack(frames) == "models/base.py:80 mlp < engine/runner.py:30 prefill"
    trace = [_event("segment_alloc", 0, 20), _event("segment_alloc", 20, 30),
             _event("segment_free", 0, 20), _event("segment_alloc", 0, 10)]
    assert memory_peak.reserved_peak(trace) == 50
