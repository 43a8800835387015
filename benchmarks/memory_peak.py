"""What is live at the peak of a CUDA allocation history, grouped by the flexrollout line that
allocated it.

    flexrollout bench --preset qwen3-4b --workload grpo --lora-rank 32 --memory-snapshot snap.pickle
    python benchmarks/memory_peak.py snap.pickle [--top 15]

The snapshot is torch's `torch.cuda.memory._dump_snapshot` pickle: `device_traces` holds one list
of events per device ("alloc", "free_requested", "free_completed", ...), each with an address, a
size and the Python frames of the allocation (innermost first). Replaying the allocs and frees
gives the live bytes over time; at the maximum, the live blocks are grouped by their innermost
frame inside flexrollout (or the innermost frame at all when none is), so the largest groups say
which tensors make the engine's peak. Only what the trace saw counts: the weights, allocated
before recording started, are not in it.
"""
from __future__ import annotations

import argparse
import pickle
from collections import defaultdict


def site(frames: list[dict]) -> str:
    """The innermost flexrollout frame of an allocation, else its innermost frame."""
    candidates = [frame for frame in frames if _ours(frame)] or frames
    return _label(candidates[0]) if candidates else "<no frames>"


def _ours(frame: dict) -> bool:
    return "flexrollout" in frame.get("filename", "")


def _label(frame: dict) -> str:
    return f"{_short(frame['filename'])}:{frame['line']} {frame['name']}"


def _short(path: str) -> str:
    for marker in ("/flexrollout/", "/site-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def peak_blocks(trace: list[dict]) -> tuple[int, int, dict[int, tuple[int, str]]]:
    """Replay one device's events: (peak live bytes, index of the peak event, live blocks there
    as addr -> (size, site)). A block counts as freed at "free_completed" (the allocator's own
    accounting), or at "free_requested" in traces that have no completions."""
    free_action = ("free_completed" if any(e["action"] == "free_completed" for e in trace)
                   else "free_requested")
    live: dict[int, tuple[int, str]] = {}
    total = peak = peak_at = 0
    peak_live: dict[int, tuple[int, str]] = {}
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], site(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, peak_at, peak_live = total, index, dict(live)
        elif event["action"] == free_action and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return peak, peak_at, peak_live


def stack(frames: list[dict]) -> str:
    """The flexrollout frames of an allocation, innermost first: which phase of a step made it."""
    return " < ".join(_label(frame) for frame in frames if _ours(frame)) or site(frames)


def reserved_peak(trace: list[dict]) -> int:
    """The most bytes the allocator held from the driver while recording (segment allocs minus
    segment frees): what graph pools and cached blocks cost beyond the live tensors."""
    total = peak = 0
    for event in trace:
        if event["action"] == "segment_alloc":
            total += event["size"]
            peak = max(peak, total)
        elif event["action"] == "segment_free":
            total -= event["size"]
    return peak


def by_site(blocks: dict[int, tuple[int, str]]) -> list[tuple[str, int, int]]:
    """(site, bytes, count), largest first."""
    sizes: dict[str, list[int]] = defaultdict(list)
    for size, where in blocks.values():
        sizes[where].append(size)
    return sorted(((w, sum(s), len(s)) for w, s in sizes.items()), key=lambda r: -r[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=15)
    opts = parser.parse_args()
    with open(opts.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    for device, trace in enumerate(snapshot["device_traces"]):
        if not trace:
            continue
        peak, at, blocks = peak_blocks(trace)
        print(f"device {device}: {len(trace)} events, peak {peak / 1e9:.3f} GB live "
              f"(allocated while recording) at event {at}; segments reserved while recording "
              f"peak at {reserved_peak(trace) / 1e9:.3f} GB")
        print(f"  the peak's allocation: {stack(trace[at].get('frames', []))}")
        for where, size, count in by_site(blocks)[:opts.top]:
            print(f"  {size / 1e6:10.1f} MB  {count:5d} blocks  {where}")


if __name__ == "__main__":
    main()
