"""Decode block masks built from a page table: which KV slots each row sees, and which pages
flex may read without evaluating mask_mod (full blocks); flex decode's kernel options."""
from __future__ import annotations

import pytest
import torch

from flexrollout.attention.masks import decode_block_mask
from flexrollout.attention.reference import dense_view

PAGE = 4


def _table(positions: list[int], max_pages: int, seed: int):
    """Random distinct physical pages (page 0 reserved) for rows decoding at `positions`."""
    gen = torch.Generator().manual_seed(seed)
    counts = [p // PAGE + 1 for p in positions]
    physical = (torch.randperm(sum(counts) + 3, generator=gen)[:sum(counts)] + 1).tolist()
    rows = torch.zeros(len(positions), max_pages, dtype=torch.int32)
    page_logical = torch.zeros(sum(counts) + 4, dtype=torch.long)
    for r, count in enumerate(counts):
        pages, physical = physical[:count], physical[count:]
        rows[r, :count] = torch.tensor(pages, dtype=torch.int32)
        page_logical[pages] = torch.arange(count)
    return rows, page_logical


def _expected_slots(rows, position: int, row: int, window: int | None) -> set[int]:
    first = 0 if window is None else max(0, position - window + 1)
    return {int(rows[row, t // PAGE]) * PAGE + t % PAGE for t in range(first, position + 1)}


@pytest.mark.parametrize(("window", "full_blocks"), [(None, True), (None, False), (6, True)])
def test_decode_mask_sees_exactly_each_rows_own_positions(window, full_blocks):
    positions = [0, 3, 4, 9, 15, 17]            # page starts, page ends, a row on its first page
    rows, page_logical = _table(positions, max_pages=6, seed=len(positions))
    pos = torch.tensor(positions)
    kv_len = page_logical.numel() * PAGE
    mask = decode_block_mask(rows, pos // PAGE + 1, pos, page_logical, PAGE, 1, kv_len, window,
                             full_blocks=full_blocks)
    slots, visible = dense_view(mask, decode=True)
    for r, p in enumerate(positions):
        seen = slots[r][visible[r]].tolist()
        assert len(seen) == len(set(seen)), f"row {r} lists a slot twice"
        assert set(seen) == _expected_slots(rows, p, r, window), r


def test_full_blocks_list_pages_before_the_last():
    positions = [0, 5, 11, 12]
    rows, page_logical = _table(positions, max_pages=5, seed=1)
    pos = torch.tensor(positions)
    mask = decode_block_mask(rows, pos // PAGE + 1, pos, page_logical, PAGE, 1,
                             page_logical.numel() * PAGE, full_blocks=True)
    assert mask.full_kv_num_blocks[:, 0, 0].tolist() == [p // PAGE for p in positions]
    assert mask.kv_num_blocks[:, 0, 0].tolist() == [1] * len(positions)
    for r, p in enumerate(positions):
        assert int(mask.kv_indices[r, 0, 0, 0]) == int(rows[r, p // PAGE])      # the partial page
        assert mask.full_kv_indices[r, 0, 0, :p // PAGE].tolist() == rows[r, :p // PAGE].tolist()


def test_decode_masks_list_every_page_as_partial():
    """The engine's decode mask: no full blocks (flex would split those by the whole cache's
    length), every page of the row partial, in logical order, for flex's even KV split."""
    positions = [0, 5, 11, 12]
    rows, page_logical = _table(positions, max_pages=5, seed=1)
    pos = torch.tensor(positions)
    mask = decode_block_mask(rows, pos // PAGE + 1, pos, page_logical, PAGE, 1,
                             page_logical.numel() * PAGE)
    assert mask.full_kv_num_blocks is None
    assert mask.kv_num_blocks[:, 0, 0].tolist() == [p // PAGE + 1 for p in positions]
    for r, p in enumerate(positions):
        assert mask.kv_indices[r, 0, 0, :p // PAGE + 1].tolist() == rows[r, :p // PAGE + 1].tolist()


def test_sliding_decode_mask_lists_only_pages_inside_the_window():
    """A sliding layer's decode reads O(window) pages, not the whole context: the listed pages
    are exactly those holding a position inside the window."""
    positions, window = [0, 5, 13, 22, 23], 6
    rows, page_logical = _table(positions, max_pages=6, seed=2)
    pos = torch.tensor(positions)
    mask = decode_block_mask(rows, pos // PAGE + 1, pos, page_logical, PAGE, 1,
                             page_logical.numel() * PAGE, window)
    assert mask.kv_indices.shape[-1] <= -(-window // PAGE) + 1
    for r, p in enumerate(positions):
        count = int(mask.kv_num_blocks[r, 0, 0])
        listed = mask.kv_indices[r, 0, 0, :count].tolist()
        inside = sorted({int(rows[r, t // PAGE]) for t in range(max(0, p - window + 1), p + 1)})
        assert sorted(listed) == inside, r


def test_decode_kernel_options_split_and_stages(monkeypatch):
    """flex decode's options on a 132-SM card: the KV split fills the SMs up to the pages a row
    can hold; three stages, except two past 2 x SMs programs and one for fp32 heads wider than
    128 (three overflow shared memory there); 16-bit heads of 512 take three (no full blocks in
    decode masks); options the caller sets are kept."""
    from types import SimpleNamespace

    from flexrollout.attention import flex

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=132))
    dev = torch.device("cuda", 0)
    assert flex.decode_split(1, 1, 32, dev) == 32
    assert flex.decode_split(1, 8, 4, dev) == 4
    assert flex.decode_split(8, 8, 32, dev) == 4
    assert flex.decode_split(64, 8, 32, dev) == 1
    assert flex.decode_kernel_options(None, 1, 1, 32, dev, 512, 2) == {"SPLIT_KV": 32, "num_stages": 3}
    assert flex.decode_kernel_options(None, 1, 4, 32, dev, 256, 4)["num_stages"] == 1
    assert flex.decode_kernel_options(None, 8, 8, 32, dev, 128, 4)["num_stages"] == 3
    assert flex.decode_kernel_options(None, 64, 8, 32, dev, 128, 2) == {"SPLIT_KV": 1, "num_stages": 2}
    mine = {"SPLIT_KV": 3, "num_stages": 2}
    assert flex.decode_kernel_options(mine, 1, 1, 32, dev, 512, 2) == mine


def test_decode_compiles_shallower_where_inductor_runs_out_of_shared_memory(monkeypatch):
    """A decode kernel Inductor cannot fit at the stages asked compiles with one fewer until it
    fits, and later calls of that shape start from the depth that fit; other errors propagate."""
    from torch._inductor.exc import InductorError

    from flexrollout.attention import flex

    monkeypatch.setattr(flex, "_FITTED_STAGES", {})
    asked = []

    def fake_flex(q, k, v, block_mask, scale, kernel_options, return_lse):
        asked.append(kernel_options["num_stages"])
        if kernel_options["num_stages"] > 1:
            raise InductorError(RuntimeError("No valid triton configs. OutOfMemoryError: out of "
                                             "resource: Required: 280576 Hardware limit:232448"), None)
        return q

    q = torch.randn(1, 1, 8, 512, dtype=torch.bfloat16)
    opts = {"SPLIT_KV": 4, "num_stages": 3}
    assert flex._decode_fitting(fake_flex, q, None, None, None, 1.0, opts, False) is q
    assert asked == [3, 2, 1]
    assert flex._decode_fitting(fake_flex, q, None, None, None, 1.0, opts, False) is q
    assert asked == [3, 2, 1, 1]
    assert opts == {"SPLIT_KV": 4, "num_stages": 3}       # the caller's options untouched

    def broken(*args, **kwargs):
        raise InductorError(RuntimeError("some other compile error"), None)

    with pytest.raises(InductorError, match="some other"):
        flex._decode_fitting(broken, q.float(), None, None, None, 1.0, opts, False)
