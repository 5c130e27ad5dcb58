"""HostBlockTable: a step's block tables from the persistent rows equal the lists' own."""

from __future__ import annotations

import random

import torch

from wattserve.daemon.engine.block_table import HostBlockTable, TableRows
from wattserve.daemon.engine.kv_cache import KVCacheManager


def from_lists(tables: list[list[int]], blocks: list[int]) -> list[list[int]]:
    """What layout() built before: each table cut to the blocks read, zero-padded."""
    width = max(blocks, default=0)
    return [t[:b] + [0] * (width - len(t[:b])) for t, b in zip(tables, blocks, strict=True)]


def test_gathered_rows_equal_the_lists_as_sequences_grow_end_and_return():
    rng = random.Random(7)
    kv = KVCacheManager(num_blocks=400, block_size_tokens=4, enable_prefix_caching=False)
    host = HostBlockTable(rows=2, cols=2)  # small: rows and columns must grow
    tokens: dict[str, int] = {}
    next_id = 0
    for _ in range(300):
        if len(tokens) < 12 and rng.random() < 0.3:  # admit
            sid = f"s{next_id % 20}"  # ids come back after their sequence ended
            next_id += 1
            if sid not in tokens and kv.allocate(sid, n := rng.randrange(1, 40)):
                tokens[sid] = n
        if tokens and rng.random() < 0.1:  # end (or preempt) one
            sid = rng.choice(sorted(tokens))
            kv.free(sid)
            del tokens[sid]
        step = rng.sample(sorted(tokens), k=min(len(tokens), rng.randrange(0, 9)))
        for sid in step:  # a decode, now and then a longer chunk
            want = tokens[sid] + rng.choice((1, 1, 1, 6))
            if kv.allocate(sid, want):
                tokens[sid] = want
        tables = [kv.table(sid) for sid in step]
        # a chunk reads up to its end; now and then fewer blocks than its table holds
        blocks = [max(0, len(t) - (rng.random() < 0.2)) for t in tables]
        got = host.gather(step, tables, blocks)
        assert got.dtype == torch.long and got.shape == (len(step), max(blocks, default=0))
        assert got.tolist() == from_lists(tables, blocks)
    assert host.num_rows <= 32  # rows of ended sequences were taken back


def test_a_table_read_as_rows_gives_lists():
    rows = TableRows(torch.tensor([[3, 4], [5, 0]], dtype=torch.long, device="cpu"))
    assert len(rows) == 2 and list(rows) == [[3, 4], [5, 0]] and rows[1] == [5, 0]
    assert max(len(r) for r in rows) == 2
